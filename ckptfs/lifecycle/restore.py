"""``ckptfs restore PATH``: bring files held only in an archive storage class back to the warm
tier, with progress.

Steps for every archived file at or under PATH: request a restore (S3 RestoreObject; a
request already in progress is fine), poll until the temporary copy is readable, then copy
the object onto itself in the warm tier's storage class (a server-side copy that keeps its
metadata and checksums), so it stays readable after the temporary copy expires. With
``local``, the file is also fetched whole to NVMe.

The restored checkpoints are then *pinned* (pins.py) for ``days``: retention keeps them in
the warm tier (and, with ``local``, on this node's NVMe) instead of moving them back to the
archive at its next run.

Invariants: the journal learns the new storage class only after the store has it; the pin
is written before the first object leaves the archive class (a retention run that sees a
restored object sees its pin); a file that is not archived is left alone (restoring twice is
harmless, and extends the pin); errors name the file.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from ckptfs.engine.fs import Filesystem
from ckptfs.errors import InvalidArgument, NotFound
from ckptfs.lifecycle.pins import pin_here, pin_in_store
from ckptfs.state.journal import Row, State
from ckptfs.store.tiers.base import ARCHIVE_CLASSES

log = logging.getLogger(__name__)

Report = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class RestoreProgress:
    files: int = 0
    bytes: int = 0
    restored_files: int = 0
    restored_bytes: int = 0
    waiting: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"files": self.files, "total_bytes": self.bytes,
                "restored_files": self.restored_files, "restored_bytes": self.restored_bytes,
                "waiting": self.waiting[:3]}


async def archived_files(fs: Filesystem, row: Row) -> list[Row]:
    """The files at or under ``row`` whose only copy is in an archive storage class."""
    # The classes as the store has them now: another node's retention (or a lifecycle rule)
    # may have moved objects since the last listing.
    if fs.lister is not None and stat.S_ISDIR(row.mode):
        await fs.lister.refresh_tree(row, current=True)
    elif fs.lister is not None and row.parent is not None:
        await fs.lister.refresh(fs.ns.get(row.parent), wait=math.inf, current=True)
        row = fs.ns.get(row.ino)
    inos = [row.ino, *fs.journal.descendants(row.ino)] if stat.S_ISDIR(row.mode) else [row.ino]
    found = []
    for ino in inos:
        each = fs.ns.get(ino)
        if stat.S_ISREG(each.mode) and each.storage_class in ARCHIVE_CLASSES \
                and each.remote_key is not None:
            found.append(each)
    return found


async def restore(
    fs: Filesystem, row: Row, *, days: int, local: bool, report: Report,
    poll_interval: float = 5.0, node: str | None = None,
) -> RestoreProgress:
    """Restore the archived files at or under ``row`` and pin them (``node``: who pinned,
    in the pin's record)."""
    if fs.fetcher is None:
        raise InvalidArgument("this mount has no warm tier to restore from")
    tier = fs.fetcher.tier
    files = await archived_files(fs, row)
    progress = RestoreProgress(files=len(files), bytes=sum(f.size for f in files))
    pending: dict[int, Row] = {f.ino: f for f in files}
    path = os.fsdecode(fs.journal.path_of(row.ino) or b"")
    pinned = False
    for each in files:
        assert each.remote_key is not None
        info = await tier.head(each.remote_key)
        if info.archived and info.restore_state is None:
            await tier.restore(each.remote_key, days)
            log.info("%s: restore from %s requested", each.remote_key, info.storage_class)
    while pending:
        progress.waiting = [os.fsdecode(fs.journal.path_of(i) or b"?") for i in pending]
        await report(progress.as_dict())
        for ino, each in list(pending.items()):
            key = each.remote_key
            assert key is not None
            info = await tier.head(key)
            if info.archived:
                continue  # the store is still thawing it
            if not pinned:
                # Before the first promote: retention must not move it back meanwhile.
                until = time.time() + days * 86400
                await pin_in_store(tier, path, until, node)
                if local:
                    pin_here(fs.journal, path, until)
                pinned = True
            if info.storage_class in ARCHIVE_CLASSES:
                await tier.promote(key)  # keep it readable after the restore expires
            del pending[ino]
            progress.restored_files += 1
            progress.restored_bytes += each.size
            log.info("%s: restored to %s", key, tier.url)
            # Hours may have passed: take the row as it is now, and change only its class
            # (it may have been renamed, replaced or removed meanwhile).
            try:
                current = fs.ns.get(ino)
            except NotFound:
                continue
            if current.remote_key != key:
                continue
            current.storage_class = None
            fs.ns.persist(current)
            if local and current.state is State.REMOTE:
                await fs.ensure_local(current)
        if pending:
            await trio.sleep(poll_interval)
    progress.waiting = []
    await report(progress.as_dict())
    return progress
