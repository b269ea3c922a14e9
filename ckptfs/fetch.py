"""Read path: bring a file whose local copy was evicted back from the warm tier.

Invariants:
- Bytes read back from a tier are checked against the checksum recorded at upload before the
  file is served; a mismatch is refetched once, then the open fails (EIO) and is logged:
  never wrong bytes.
- Concurrent opens of the same file share one fetch.
- The data is written to ``data/<ino>.fetch`` and renamed into place only once verified, so a
  crash mid-fetch leaves no half file that looks whole.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import trio

from ckptfs.errors import ChecksumMismatch, StoreUnavailable
from ckptfs.journal import Row
from ckptfs.staging import Staging
from ckptfs.tiers.base import ObjectMissing, Tier

log = logging.getLogger(__name__)

BLOCK = 64 * 1024 * 1024


class Fetcher:
    def __init__(self, tier: Tier, staging: Staging, concurrency: int = 4) -> None:
        self.tier = tier
        self.staging = staging
        self.concurrency = concurrency
        self._inflight: dict[int, trio.Event] = {}
        self.fetched_bytes = 0
        self.failures = 0

    async def fetch_whole(self, row: Row) -> None:
        """Make ``row``'s local data file whole again (ChecksumMismatch/StoreUnavailable)."""
        waiting = self._inflight.get(row.ino)
        if waiting is not None:
            await waiting.wait()
            if not self.staging.exists(row.ino):
                raise StoreUnavailable(f"fetching inode {row.ino} failed")
            return
        done = self._inflight[row.ino] = trio.Event()
        try:
            for attempt in (1, 2):
                try:
                    await self._fetch_once(row)
                    return
                except ChecksumMismatch:
                    self.failures += 1
                    if attempt == 2:
                        log.error("%s: checksum mismatch twice; refusing to serve it",
                                  row.remote_key)
                        raise
                    log.warning("%s: checksum mismatch, fetching again", row.remote_key)
        finally:
            del self._inflight[row.ino]
            done.set()

    async def _fetch_once(self, row: Row) -> None:
        from ckptfs.upload import file_checksum

        assert row.remote_key is not None
        part = self.staging.data_dir / f"{row.ino}.fetch"
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, row.size)
            limiter = trio.Semaphore(self.concurrency)

            async def block(offset: int) -> None:
                async with limiter:
                    length = min(BLOCK, row.size - offset)
                    got = await self.tier.read_into(row.remote_key or "", offset, length, fd,
                                                    offset)
                    if got != length:
                        raise ChecksumMismatch(
                            f"{row.remote_key}: short read at {offset} ({got} of {length})")

            try:
                async with trio.open_nursery() as nursery:
                    for offset in range(0, row.size, BLOCK):
                        nursery.start_soon(block, offset)
            except* ObjectMissing as group:
                raise group.exceptions[0] from None
            except* ChecksumMismatch as group:
                raise group.exceptions[0] from None
            except* StoreUnavailable as group:
                raise group.exceptions[0] from None
            await trio.to_thread.run_sync(os.fsync, fd)
        finally:
            os.close(fd)
        if row.checksum:
            actual = await trio.to_thread.run_sync(file_checksum, Path(part), row.size)
            if actual != row.checksum:
                os.unlink(part)
                raise ChecksumMismatch(
                    f"{row.remote_key}: store has {actual}, journal says {row.checksum}")
        os.replace(part, self.staging.path(row.ino))
        self.fetched_bytes += row.size
