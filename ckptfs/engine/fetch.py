"""Read path: fault in byte ranges of files whose data is not (wholly) local.

A file known from the store but not local (state REMOTE) has a sparse staging file
``data/<ino>`` of its full size; the blocks fetched so far are recorded in the journal
(``ranges``), so nothing is downloaded twice, also across a remount.

Invariants:
- Data is fetched in aligned blocks of ``fetch_block_size``, or of the object's integrity
  block (integrity.py) when that is larger; both are powers of two, so a fetch block holds
  whole integrity blocks, each verified on its own.
- A block is served only once verified (when the object has block CRCs). A mismatch is
  fetched once more, then the read fails with ChecksumMismatch (EIO) and is logged and
  counted: never wrong bytes from a verified object. The verified integrity blocks of a bad
  fetch block are kept. A file assembled whole is checked against its whole-file CRC32C
  when it has no block CRCs.
- A block is recorded in the journal only after its bytes are on disk: with a nursery (a
  mount), a flusher task fdatasyncs the files fetched into, then journals their ranges, once
  no fetch has landed for a flush interval (about a second), or after ``MAX_UNSYNCED_S``,
  so fetching never waits for the disk and a restore does not write to disk while it
  downloads; a crash before that only loses the record (the blocks
  are fetched again). A file becomes a whole local copy only after an fdatasync.
- Concurrent readers of one block share one fetch (and its outcome); at most
  ``concurrency`` range GETs are in flight for the whole mount.
- Every fetched byte is reserved in the space budget first and given back when dropped.
- ``drop``/``reset`` bump the inode's generation. A fetch checks it (and that the file is
  still REMOTE) before it writes and before it records: one from an older generation (the
  file was truncated, evicted or replaced meanwhile) records nothing, and readers waiting on
  it look again instead of taking it for success. Fetches in flight are registered in
  ``_inflight`` from the moment they are scheduled, so ``settle`` waits for every one.
- A cancelled fetch never hands its ``Cancelled`` to another task: waiters retry.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from ckptfs.errors import ChecksumMismatch, ObjectGone
from ckptfs.state.journal import Journal, Row, State
from ckptfs.state.staging import Staging
from ckptfs.store.integrity import BlockSums, fd_checksum, range_crc
from ckptfs.store.tiers.base import LocalWriteFailed, ObjectMissing, Tier

log = logging.getLogger(__name__)

# The flusher syncs a file still being fetched into at least this often (seconds): the kernel
# writes dirty pages back after 30 s anyway (vm.dirty_expire_centisecs).
MAX_UNSYNCED_S = 30.0


class RangeSet:
    """Disjoint, sorted, coalesced [start, stop) intervals."""

    def __init__(self, spans: list[tuple[int, int]] | None = None) -> None:
        self.starts: list[int] = []
        self.stops: list[int] = []
        for a, b in spans or []:
            self.add(a, b)

    def add(self, start: int, stop: int) -> None:
        if stop <= start:
            return
        i = bisect.bisect_left(self.stops, start)  # first interval that ends at/after start
        j = bisect.bisect_right(self.starts, stop)  # intervals before j start at/before stop
        if i < j:
            start = min(start, self.starts[i])
            stop = max(stop, self.stops[j - 1])
        self.starts[i:j] = [start]
        self.stops[i:j] = [stop]

    def covers(self, start: int, stop: int) -> bool:
        if stop <= start:
            return True
        i = bisect.bisect_right(self.starts, start) - 1
        return i >= 0 and self.stops[i] >= stop

    def covered_within(self, start: int, stop: int) -> int:
        """How many bytes of [start, stop) are covered."""
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        total = 0
        while i < len(self.starts) and self.starts[i] < stop:
            total += max(0, min(stop, self.stops[i]) - max(start, self.starts[i]))
            i += 1
        return total

    def total(self) -> int:
        return sum(b - a for a, b in zip(self.starts, self.stops, strict=True))

    def spans(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.stops, strict=True))


@dataclass
class _Inflight:
    done: trio.Event = field(default_factory=trio.Event)
    error: Exception | None = None
    generation: int = -1


@dataclass
class FetchStats:
    gets: int = 0
    fetched_bytes: int = 0
    integrity_failures: int = 0
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=512))
    errors: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=32))


Reserve = Callable[[int], Awaitable[None]]


class Fetcher:
    def __init__(
        self, tier: Tier, staging: Staging, journal: Journal, *, block_size: int = 8 << 20,
        concurrency: int = 8, readahead: int = 64 << 20, reserve: Reserve | None = None,
        give_back: Callable[[int], None] | None = None, make_room: Reserve | None = None,
        other_copies: Callable[[Row], list[str]] | None = None,
    ) -> None:
        self.tier = tier
        # Other keys holding a file's bytes (the objects of its other names, hard links): read
        # from them when its own object is gone (another node deleted that name).
        self._other_copies = other_copies
        self.staging = staging
        self.journal = journal
        self.block_size = block_size
        self.readahead_bytes = readahead
        self._limiter = trio.CapacityLimiter(concurrency)
        self._reserve = reserve
        self._give_back = give_back
        self._make_room = make_room  # a local write hit a full disk despite the reservation
        self._ranges: dict[int, RangeSet] = {}
        self._inflight: dict[tuple[int, int], _Inflight] = {}
        self._generation: dict[int, int] = {}
        self._unsynced: set[int] = set()  # inodes with ranges fetched but not journaled yet
        # Since when each inode has fetched ranges not journaled.
        self._unsynced_since: dict[int, float] = {}
        self._last_landed = 0.0  # when a fetch last landed in any inode
        self.stats = FetchStats()
        # Readahead runs here (the mount's nursery); without one there is no readahead.
        self.nursery: trio.Nursery | None = None

    # -- what is local ----------------------------------------------------------------------

    def unit(self, row: Row) -> int:
        sums = self.sums(row)
        return max(self.block_size, sums.block_size) if sums else self.block_size

    @staticmethod
    def sums(row: Row) -> BlockSums | None:
        sums = BlockSums.decode(row.blocks)
        return sums if sums and sums.matches_size(row.size) else None

    def ranges(self, ino: int) -> RangeSet:
        found = self._ranges.get(ino)
        if found is None:
            found = self._ranges[ino] = RangeSet(self.journal.ranges(ino))
        return found

    def local_bytes(self, ino: int) -> int:
        return self.ranges(ino).total()

    def is_complete(self, row: Row) -> bool:
        return self.ranges(row.ino).covers(0, row.size)

    def partial_inos(self) -> list[int]:
        """Inodes with fetched ranges (journaled, or fetched since the last flush)."""
        found = set(self.journal.inos_with_ranges())
        found.update(ino for ino, have in self._ranges.items() if have.total())
        return sorted(found)

    def prepare(self, row: Row) -> None:
        """Make the sparse staging file exist at the file's size (before the first read)."""
        if not self.staging.exists(row.ino):
            fd = os.open(self.staging.path(row.ino),
                         os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, row.size)
            finally:
                os.close(fd)

    def drop(self, ino: int) -> int:
        """Forget every fetched range of ``ino`` and delete its data; returns bytes freed."""
        freed = self.reset(ino)
        self.staging.unlink(ino)
        return freed

    def forget(self, ino: int) -> None:
        """A new version of the file begins here: fetches of the old one record nothing."""
        self._generation[ino] = self._generation.get(ino, 0) + 1
        if self._ranges.get(ino) or self.journal.ranges(ino):
            self.reset(ino)

    def reset(self, ino: int) -> int:
        """Forget the fetched ranges of ``ino`` but keep its data file (a handle has it open):
        it is fetched again over the old bytes. Returns the bytes given back."""
        self._generation[ino] = self._generation.get(ino, 0) + 1
        freed = self.ranges(ino).total()
        self._ranges.pop(ino, None)
        self._synced(ino)
        self.journal.set_ranges(ino, [])
        if freed and self._give_back:
            self._give_back(freed)
        return freed

    async def settle(self, ino: int) -> None:
        """Wait until no fetch of ``ino`` is in flight."""
        while True:
            pending = [f for (i, _), f in self._inflight.items() if i == ino]
            if not pending:
                return
            await pending[0].done.wait()

    def completed(self, ino: int) -> None:
        """The file is wholly local and verified: its ranges are no longer needed."""
        self._ranges.pop(ino, None)
        self._synced(ino)
        self.journal.set_ranges(ino, [])

    async def sync_file(self, ino: int) -> None:
        """fdatasync the data file of ``ino`` (before it counts as a whole local copy)."""
        fd = self.staging.acquire(ino)
        try:
            await trio.to_thread.run_sync(os.fdatasync, fd)
        finally:
            self.staging.release(ino, fd)

    async def flush(self, quiet: float = 0.0) -> None:
        """Journal the ranges fetched since the last flush, once their bytes are on disk.

        With ``quiet``, while fetches landed (in any file) during the last ``quiet`` seconds,
        files wait (unless unsynced for ``MAX_UNSYNCED_S``): an fdatasync in a download
        makes the disk write what the reader is about to read, while it waits (measured: a
        restore of 4 x 256 MiB from SeaweedFS ran at 0.6-0.9x boto3's ``download_file``,
        which leaves its pages to the kernel; 1.0-1.3x with the sync after the burst)."""
        now = trio.current_time()
        busy = quiet and now - self._last_landed < quiet  # a download is under way
        for ino in list(self._unsynced):
            if busy and now - self._unsynced_since.get(ino, now) < MAX_UNSYNCED_S:
                continue
            self._synced(ino)
            generation = self.generation(ino)
            if not self.staging.exists(ino):
                continue
            await self.sync_file(ino)
            have = self._ranges.get(ino)
            if have is not None and self.generation(ino) == generation:
                self.journal.set_ranges(ino, have.spans())

    def flush_now(self) -> None:
        """The same, blocking (at unmount)."""
        for ino in list(self._unsynced):
            self._synced(ino)
            have = self._ranges.get(ino)
            if have is None or not self.staging.exists(ino):
                continue
            fd = self.staging.acquire(ino)
            try:
                os.fdatasync(fd)
            finally:
                self.staging.release(ino, fd)
            self.journal.set_ranges(ino, have.spans())

    async def wait_quiet(self, interval: float = 1.0) -> None:
        """Return once no fetch has landed anywhere for ``interval`` seconds (or
        ``MAX_UNSYNCED_S`` passed): the disk is free to write what the fetches left."""
        deadline = trio.current_time() + MAX_UNSYNCED_S
        while (left := min(self._last_landed + interval, deadline) - trio.current_time()) > 0:
            await trio.sleep(left)

    async def run_flusher(self, interval: float = 1.0) -> None:
        while True:
            await trio.sleep(interval)
            await self.flush(quiet=interval)

    # -- fetching ---------------------------------------------------------------------------

    def generation(self, ino: int) -> int:
        return self._generation.get(ino, 0)

    def covers(self, row: Row, offset: int, length: int) -> bool:
        return self.ranges(row.ino).covers(offset, min(offset + length, row.size))

    async def ensure(self, row: Row, offset: int, length: int) -> None:
        """Fetch the blocks of ``[offset, offset + length)`` of ``row`` that are not local
        (ChecksumMismatch, ObjectGone, StoreUnavailable); blocks are fetched concurrently.

        Returns early, without error, if the file changes meanwhile (a new generation: it
        was truncated, evicted or replaced); the caller checks ``covers`` and decides."""
        stop = min(offset + length, row.size)
        if stop <= offset:
            return
        generation = self.generation(row.ino)
        unit = self.unit(row)
        missing = [i for i in range(offset // unit, (stop - 1) // unit + 1)
                   if not self._has_block(row, i, unit)]
        if not missing:
            return
        try:
            if len(missing) == 1:
                await self._block(row, missing[0], generation)
                return
            try:
                async with trio.open_nursery() as nursery:
                    for index in missing:
                        nursery.start_soon(self._block, row, index, generation)
            except BaseExceptionGroup as group:
                # One clear error for the caller (the others are logged where they happened).
                raise _first(group) from None
        except ChecksumMismatch:
            # A bad integrity block inside a fetch block spoils only itself: the verified
            # blocks around it were kept, and a read of those alone succeeds.
            if not self.covers(row, offset, stop - offset):
                raise

    def _has_block(self, row: Row, index: int, unit: int) -> bool:
        return self.ranges(row.ino).covers(index * unit, min((index + 1) * unit, row.size))

    def readahead(self, row: Row, offset: int, nbytes: int) -> None:
        """Start fetching ``[offset, offset + nbytes)`` in the background (best effort).

        The fetches are registered before this returns, so ``settle`` (before a truncation)
        and readers of the same blocks see them at once."""
        if self.nursery is None or nbytes <= 0 or offset >= row.size:
            return
        generation = self.generation(row.ino)
        unit = self.unit(row)
        stop = min(offset + nbytes, row.size)
        for index in range(offset // unit, (stop - 1) // unit + 1):
            key = (row.ino, index)
            if key in self._inflight or self._has_block(row, index, unit):
                continue
            shared = self._inflight[key] = _Inflight()
            self.nursery.start_soon(self._readahead_block, row, index, generation, shared)

    async def _readahead_block(self, row: Row, index: int, generation: int,
                               shared: _Inflight) -> None:
        try:
            await self._own(row, index, generation, shared)
        except Exception as exc:  # noqa: BLE001 (a reader that needs it fetches it again)
            log.debug("readahead of block %d of inode %d failed: %s", index, row.ino, exc)

    async def _block(self, row: Row, index: int, generation: int) -> None:
        """Make block ``index`` local: fetch it, or wait for the fetch already in flight.

        A waiter gets the owner's error only if it is an ordinary error of the same
        generation; if the owner was cancelled, or fetched for an older generation, the
        waiter looks again (and fetches itself if still needed)."""
        key = (row.ino, index)
        unit = self.unit(row)
        while self.generation(row.ino) == generation and not self._has_block(row, index, unit):
            shared = self._inflight.get(key)
            if shared is None:
                shared = self._inflight[key] = _Inflight()
                await self._own(row, index, generation, shared)
                return
            await shared.done.wait()
            if shared.error is not None and shared.generation == generation:
                raise shared.error

    async def _own(self, row: Row, index: int, generation: int, shared: _Inflight) -> None:
        shared.generation = generation
        key = (row.ino, index)
        try:
            await self._fetch_block(row, index, generation)
        except Exception as exc:  # not Cancelled: a waiter must not inherit that
            shared.error = exc
            raise
        finally:
            if self._inflight.get(key) is shared:
                del self._inflight[key]
            shared.done.set()

    def _current(self, row: Row, generation: int) -> bool:
        """Whether fetched bytes are still wanted: same generation, still not local."""
        return self.generation(row.ino) == generation and row.state is State.REMOTE

    async def _fetch_block(self, row: Row, index: int, generation: int) -> None:
        assert row.remote_key is not None
        key = row.remote_key
        unit = self.unit(row)
        sums = self.sums(row)
        start = index * unit
        length = min(unit, row.size - start)
        if not self._current(row, generation) or self._has_block(row, index, unit):
            return
        # Only what is not local yet takes room (a block may be half there, e.g. after the
        # fetch block size changed between two mounts).
        need = length - self.ranges(row.ino).covered_within(start, start + length)
        if self._reserve:
            await self._reserve(need)
        recorded = False
        try:
            if not self._current(row, generation):
                return  # truncated, evicted or replaced while we waited for room
            self.prepare(row)
            fd = self.staging.acquire(row.ino)
            try:
                for attempt in (1, 2):
                    key, got = await self._read_any(row, key, start, length, fd)
                    self.stats.gets += 1
                    self.stats.fetched_bytes += got
                    self.stats.recent.append((time.monotonic(), got))
                    actual = await trio.to_thread.run_sync(
                        _settle, fd, start, got, sums.block_size if sums else None,
                        self.nursery is None)
                    bad = None
                    if sums:
                        first = start // sums.block_size
                        bad = next((first + i for i, crc in enumerate(actual)
                                    if crc != sums.crcs[first + i]), None)
                    if got == length and bad is None:
                        break
                    self.stats.integrity_failures += 1
                    if got != length:
                        what = f"{key}: short read at {start} ({got} of {length} bytes)"
                    else:
                        assert sums is not None and bad is not None
                        what = (f"{key}: block {bad} has crc32c "
                                f"{actual[bad - start // sums.block_size]:08x}, expected "
                                f"{sums.crcs[bad]:08x}")
                    if attempt == 1:
                        log.warning("%s; fetching it again", what)
                        continue
                    await self._check_replaced(row)
                    self._error(f"{what} (twice): refusing to serve it")
                    if sums and got == length and self._current(row, generation):
                        # The verified blocks stay (and keep their room); the rest is given
                        # back below.
                        need -= min(self._keep_verified(row, start, sums, actual), need)
                    raise ChecksumMismatch(what)
            finally:
                self.staging.release(row.ino, fd)
            if not self._current(row, generation):
                return  # evicted, replaced or deleted meanwhile: the bytes are not its data
            have = self.ranges(row.ino)
            have.add(start, start + length)
            if self.nursery is None:
                self.journal.set_ranges(row.ino, have.spans())  # synced in _settle
            else:
                self._mark_unsynced(row.ino)  # the flusher syncs, then journals
            recorded = True
        finally:
            if not recorded and self._give_back:
                self._give_back(need)

    def _synced(self, ino: int) -> None:
        self._unsynced.discard(ino)
        self._unsynced_since.pop(ino, None)

    def _mark_unsynced(self, ino: int) -> None:
        now = self._last_landed = trio.current_time()  # trio's clock: tests jump it
        self._unsynced_since.setdefault(ino, now)
        self._unsynced.add(ino)

    def _keep_verified(self, row: Row, start: int, sums: BlockSums, crcs: list[int]) -> int:
        """Record the integrity blocks of a failed fetch that did verify; bytes recorded.
        (Their reservation is the caller's to settle.)"""
        first = start // sums.block_size
        have = self.ranges(row.ino)
        kept = 0
        for i, crc in enumerate(crcs):
            if crc != sums.crcs[first + i]:
                continue
            a = (first + i) * sums.block_size
            b = min(a + sums.block_size, row.size)
            kept += b - a - have.covered_within(a, b)
            have.add(a, b)
        if kept:
            self._mark_unsynced(row.ino)
            if self.nursery is None:
                self.flush_now()
        return kept

    async def _read_any(self, row: Row, key: str, start: int, length: int,
                        fd: int) -> tuple[str, int]:
        """``_read`` from ``key``, or, if that object is gone, from where the file moved
        meanwhile or another key holding the same bytes (``other_copies``); the key read and
        the bytes read."""
        while True:
            try:
                return key, await self._read(key, start, length, fd, quiet=True)
            except ObjectGone as exc:
                if row.remote_key is None or row.remote_key == key:
                    gone = exc
                    break
                # This node carried the file to its new key while the read waited (a
                # directory rename's sweep: copy, the row takes the new key, then the old
                # one goes): the same version is there.
                key = row.remote_key
        for other in self._other_copies(row) if self._other_copies else []:
            if other == key:
                continue
            try:
                got = await self._read(other, start, length, fd, quiet=True)
            except ObjectGone:
                continue
            log.info("%s is gone from %s: read from %s, another name of it", key,
                     self.tier.url, other)
            return other, got
        self._error(f"{key}: deleted from {self.tier.url} behind ckptfs")
        raise gone

    async def _read(self, key: str, start: int, length: int, fd: int,
                    quiet: bool = False) -> int:
        for attempt in (1, 2):
            try:
                async with self._limiter:
                    return await self.tier.read_into(key, start, length, fd, start)
            except ObjectMissing:
                if not quiet:
                    self._error(f"{key}: deleted from {self.tier.url} behind ckptfs")
                raise ObjectGone(f"{key} was deleted from {self.tier.url}") from None
            except LocalWriteFailed as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or attempt == 2 \
                        or self._make_room is None:
                    raise OSError(exc.errno, str(exc)) from None
                await self._make_room(length)
        raise AssertionError("unreachable")

    async def _check_replaced(self, row: Row) -> None:
        """After two bad reads: a new version written by another node is not corruption."""
        assert row.remote_key is not None
        try:
            info = await self.tier.head(row.remote_key)
        except ObjectMissing:
            raise ObjectGone(f"{row.remote_key} was deleted from {self.tier.url}") from None
        if info.meta.checksum != row.checksum or info.size != row.size:
            raise ObjectGone(f"{row.remote_key} was replaced in {self.tier.url} since it was "
                             "listed; open it again")

    async def verify_whole(self, row: Row) -> None:
        """A file assembled whole with no block CRCs: check its whole-file CRC32C."""
        if self.sums(row) is not None or not row.checksum:
            return
        fd = self.staging.acquire(row.ino)
        try:
            actual = await trio.to_thread.run_sync(fd_checksum, fd, row.size)
        finally:
            self.staging.release(row.ino, fd)
        if actual != row.checksum:
            self.stats.integrity_failures += 1
            raise ChecksumMismatch(
                f"{row.remote_key}: assembled file has {actual}, the store says {row.checksum}")

    def _error(self, message: str) -> None:
        log.error("%s", message)
        self.stats.errors.append((time.time(), message))

    def rate(self, window: float = 60.0) -> float:
        now = time.monotonic()
        return sum(n for t, n in self.stats.recent if now - t < window) / window


def _settle(fd: int, offset: int, length: int, block: int | None, sync: bool) -> list[int]:
    """The CRC32C of each ``block`` bytes just fetched (none if ``block`` is None); with
    ``sync``, the bytes are made durable first (no flusher will)."""
    crcs = [range_crc(fd, at, min(block, offset + length - at))
            for at in range(offset, offset + length, block)] if block else []
    if sync:
        os.fdatasync(fd)
    return crcs


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first(exc)
        if not isinstance(exc, trio.Cancelled):
            return exc
    return group.exceptions[0]
