"""A fault-injecting wrapper around any tier: errors, latency, bandwidth limit, hangs, corruption.

Unit tests drive the knobs directly. Real-mount tests (the daemon is another process) use the
tier config table ``faults`` (see ``FaultConfig``), whose ``down_file`` lets a test take the
store down and bring it back by creating and removing a file.

Invariant: the wrapper never changes what a successful call does, except ``corrupt_reads``,
which flips one byte of what ``read_into`` wrote (to prove checksums are checked).
"""

from __future__ import annotations

import builtins
import os
import random
import signal
from collections import Counter
from pathlib import Path

import trio

from ckptfs.errors import StoreUnavailable
from ckptfs.store.tiers.base import Finish, ObjectInfo, ObjectMeta, Progress, Tier


class FaultyTier(Tier):
    def __init__(
        self, inner: Tier, *, latency: float = 0.0, bandwidth: float | None = None,
        fail_ratio: float = 0.0, down_file: Path | None = None, seed: int = 0,
        kill_after_puts: int | None = None,
    ) -> None:
        super().__init__(inner.name, inner.url)
        self.inner = inner
        self.latency = latency
        self.bandwidth = bandwidth  # bytes per second for put_file/read_into, None = unlimited
        self.fail_ratio = fail_ratio
        self.down_file = down_file
        self.down = False
        self.fail_next = 0
        self.hang = False
        self.corrupt_reads = False
        self.calls: Counter[str] = Counter()
        self.bytes_read = 0
        self.kill_after_puts = kill_after_puts
        self.puts_done = 0
        self._random = random.Random(seed)

    def is_down(self) -> bool:
        return self.down or (self.down_file is not None and self.down_file.exists())

    async def _gate(self, op: str) -> None:
        self.calls[op] += 1
        if self.latency:
            await trio.sleep(self.latency)
        if self.hang:
            await trio.sleep_forever()
        if self.is_down():
            raise StoreUnavailable(f"injected outage ({op})")
        if self.fail_next > 0:
            self.fail_next -= 1
            raise StoreUnavailable(f"injected failure ({op})")
        if self.fail_ratio and self._random.random() < self.fail_ratio:
            raise StoreUnavailable(f"injected random failure ({op})")

    async def _throttle(self, size: int) -> None:
        if self.bandwidth:
            await trio.sleep(size / self.bandwidth)

    async def _send(self, size: int, progress: Progress | None) -> None:
        """``size / bandwidth`` seconds, in up to 16 steps, each reported to ``progress``."""
        assert self.bandwidth
        steps = max(1, min(16, size // 65536))
        sent = 0
        for step in range(1, steps + 1):
            n = size * step // steps - sent
            await trio.sleep(n / self.bandwidth)
            sent += n
            if progress:
                progress(n)

    async def check(self) -> None:
        await self._gate("check")
        await self.inner.check()

    async def cleanup(self, keys_of_ours: set[str]) -> int:
        await self._gate("cleanup")
        return await self.inner.cleanup(keys_of_ours)

    @property
    def late_meta(self) -> bool:
        return self.inner.late_meta

    async def put_file(
        self, key: str, source: Path, size: int, meta: ObjectMeta,
        progress: Progress | None = None, *, finish: Finish | None = None,
    ) -> str | None:
        await self._gate("put_file")
        if self.bandwidth:
            # A slow link: the bytes go out over the transfer time, as a progress display
            # sees them on a real one (then the inner tier stores them at once).
            await self._send(size, progress)
            progress = None
        etag = await self.inner.put_file(key, source, size, meta, progress, finish=finish)
        self.puts_done += 1
        if self.kill_after_puts is not None and self.puts_done >= self.kill_after_puts:
            os.kill(os.getpid(), signal.SIGKILL)  # the object is stored, the journal not told
        return etag

    async def put_entry(self, key: str, meta: ObjectMeta) -> None:
        await self._gate("put_entry")
        await self.inner.put_entry(key, meta)

    async def read_into(self, key: str, offset: int, length: int, fd: int, fd_offset: int) -> int:
        await self._gate("read_into")
        await self._throttle(length)
        n = await self.inner.read_into(key, offset, length, fd, fd_offset)
        self.bytes_read += n
        if self.corrupt_reads and n:
            at = fd_offset + self._random.randrange(n)
            byte = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at)
        return n

    async def head(self, key: str) -> ObjectInfo:
        await self._gate("head")
        return await self.inner.head(key)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        await self._gate("list")
        return await self.inner.list(prefix)

    async def list_dir(self, prefix: str) -> builtins.list[ObjectInfo]:
        await self._gate("list")
        return await self.inner.list_dir(prefix)

    async def restore(self, key: str, days: int) -> None:
        await self._gate("restore")
        await self.inner.restore(key, days)

    async def promote(self, key: str) -> None:
        await self._gate("promote")
        await self.inner.promote(key)

    async def put_small(self, key: str, data: bytes, *, if_absent: bool = False,
                        if_tag: str | None = None) -> str:
        await self._gate("put_small")
        return await self.inner.put_small(key, data, if_absent=if_absent, if_tag=if_tag)

    async def get_small(self, key: str) -> tuple[bytes, str]:
        await self._gate("get_small")
        return await self.inner.get_small(key)

    async def copy(self, src: str, dst: str, *, if_etag: str | None = None) -> str | None:
        await self._gate("copy")
        return await self.inner.copy(src, dst, if_etag=if_etag)

    async def delete(self, key: str, *, if_etag: str | None = None) -> None:
        await self._gate("delete")
        await self.inner.delete(key, if_etag=if_etag)

    def is_transient(self, exc: BaseException) -> bool:
        return self.inner.is_transient(exc)

    async def aclose(self) -> None:
        await self.inner.aclose()
