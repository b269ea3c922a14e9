"""The filesystem core and its uploader without a mount, over a memory tier behind a fault
wrapper: the rig the unit tests of uploads, store keys, store directories, hard links and the
yield gate share (the ``rig`` fixture in tests/conftest.py opens one per test).

Deterministic with trio's autojump clock: backoff and latency cost nothing.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from ckptfs.config import DEFAULT_COMMIT_MARKERS
from ckptfs.engine.fs import ROOT_CALLER, Filesystem
from ckptfs.engine.upload import Uploader
from ckptfs.engine.yieldgate import YieldGate
from ckptfs.errors import NotFound
from ckptfs.state.journal import ROOT_INODE, Journal
from ckptfs.state.staging import Staging
from ckptfs.store.tiers.base import Finish, Kind, ObjectMeta, Progress
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import MemoryTier

ROOT = ROOT_INODE


class RecordingTier(FaultyTier):
    """Logs when each put starts and ends (in trio time) to check ordering."""

    def __init__(self, inner: MemoryTier, **kw: object) -> None:
        super().__init__(inner, **kw)  # type: ignore[arg-type]
        self.events: list[tuple[str, str, float]] = []

    async def put_file(self, key: str, source: Path, size: int, meta: ObjectMeta,
                       progress: Progress | None = None, *,
                       finish: Finish | None = None) -> str | None:
        self.events.append(("start", key, trio.current_time()))
        etag = await super().put_file(key, source, size, meta, progress, finish=finish)
        self.events.append(("end", key, trio.current_time()))
        return etag


@dataclass
class Rig:
    fs: Filesystem
    uploader: Uploader
    tier: RecordingTier
    objects: dict  # type: ignore[type-arg]
    root: Path

    async def write(self, path: str, data: bytes, mode: int = 0o644) -> int:
        parent = ROOT
        parts = path.split("/")
        for part in parts[:-1]:
            try:
                parent = (await self.fs.lookup(parent, part.encode())).ino
            except NotFound:
                parent = self.fs.mkdir(parent, part.encode(), 0o755, ROOT_CALLER).ino
        try:
            ino = (await self.fs.lookup(parent, parts[-1].encode())).ino
        except NotFound:
            fh, row = self.fs.create(parent, parts[-1].encode(), mode,
                                     os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
            ino = row.ino
        else:
            fh = await self.fs.open(ino, os.O_WRONLY | os.O_TRUNC)
        await self.fs.write(fh, 0, data)
        self.fs.flush(fh)
        self.fs.release(fh)
        return ino

    async def ino(self, path: str) -> int:
        ino = ROOT
        for part in path.split("/"):
            ino = (await self.fs.lookup(ino, part.encode())).ino
        return ino

    async def settle(self) -> None:
        await self.uploader.wait_idle()

    def files(self) -> dict[str, bytes]:
        return {k: o.body for k, o in self.objects.items() if o.meta.kind is Kind.FILE}


@asynccontextmanager
async def open_rig(tmp_path: Path, tier: RecordingTier, inner: MemoryTier, *,
                   unlink_remote: bool = True, concurrency: int = 4,
                   gate: YieldGate | None = None) -> AsyncIterator[Rig]:
    """A filesystem core and its uploader over ``tier`` (which wraps ``inner``)."""
    staging = Staging(tmp_path / "staging")
    staging.prepare()
    journal = Journal(staging.root / "journal.db")
    fs = Filesystem(journal, staging, tier=tier, unlink_remote=unlink_remote)
    fs.start()
    if gate is not None:
        fs.gate = gate
    uploader = Uploader(journal, fs.ns, staging, tier, concurrency=concurrency,
                        markers=DEFAULT_COMMIT_MARKERS, keys=fs.keys, gate=gate)
    fs.listener = uploader
    async with trio.open_nursery() as nursery:
        await nursery.start(uploader.run)
        yield Rig(fs, uploader, tier, inner.objects, tmp_path)
        nursery.cancel_scope.cancel()
    journal.close()
    staging.close()




async def read_path(rig: Rig, path: str) -> bytes:
    fh = await rig.fs.open(await rig.ino(path), os.O_RDONLY)
    try:
        return await rig.fs.read(fh, 0, 1 << 30)
    finally:
        rig.fs.release(fh)
