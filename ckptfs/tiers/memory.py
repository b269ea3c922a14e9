"""``memory://name``: a tier held in this process's memory, for tests.

Tiers with the same name share one store (a module-level registry), so a test can open the
"same bucket" from two filesystems, like two nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trio

from ckptfs.tiers.base import (
    Kind,
    ObjectInfo,
    ObjectMeta,
    ObjectMissing,
    Progress,
    Tier,
    write_local,
)


@dataclass
class _Object:
    body: bytes
    meta: ObjectMeta


_STORES: dict[str, dict[str, _Object]] = {}


def store_named(name: str) -> dict[str, _Object]:
    return _STORES.setdefault(name, {})


class MemoryTier(Tier):
    def __init__(self, name: str, url: str, store: str) -> None:
        super().__init__(name, url)
        self.objects = store_named(store)

    async def put_file(
        self, key: str, source: Path, size: int, meta: ObjectMeta,
        progress: Progress | None = None,
    ) -> str | None:
        def read() -> bytes:
            with open(source, "rb") as f:
                return f.read(size)

        body = await trio.to_thread.run_sync(read)
        await trio.lowlevel.checkpoint()
        obj = self.objects[key] = _Object(body, meta)
        if progress:
            progress(len(body))
        return f"{id(obj):x}"

    async def put_entry(self, key: str, meta: ObjectMeta) -> None:
        await trio.lowlevel.checkpoint()
        body = (meta.target or "").encode() if meta.kind is Kind.SYMLINK else b""
        self.objects[key] = _Object(body, meta)

    async def read_into(self, key: str, offset: int, length: int, fd: int, fd_offset: int) -> int:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(key)
        if obj is None:
            raise ObjectMissing(key)
        chunk = obj.body[offset:offset + length]
        return write_local(fd, chunk, fd_offset)

    async def head(self, key: str) -> ObjectInfo:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(key)
        if obj is None:
            raise ObjectMissing(key)
        return ObjectInfo(key, len(obj.body), obj.meta, etag=f"{id(obj):x}")

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        await trio.lowlevel.checkpoint()
        return [
            ObjectInfo(k, len(o.body), o.meta, etag=f"{id(o):x}")
            for k, o in sorted(self.objects.items()) if k.startswith(prefix)
        ]

    async def copy(self, src: str, dst: str) -> None:
        await trio.lowlevel.checkpoint()
        obj = self.objects.get(src)
        if obj is None:
            raise ObjectMissing(src)
        self.objects[dst] = _Object(obj.body, obj.meta)

    async def delete(self, key: str) -> None:
        await trio.lowlevel.checkpoint()
        self.objects.pop(key, None)
