"""Stage 2: bring the warm tier in line with the journal, in the background.

Every inode whose remote copy is out of date (a file closed, a directory made, anything
renamed) and every *tombstone* (a remote key whose inode was removed) is a work item. A fixed
number of workers (``upload_concurrency``), started in the mount's nursery, pull items in
sequence order and reconcile them:

- a STAGED file is uploaded (state UPLOADING, then COMMITTED with its checksum and key);
- a COMMITTED file whose key is not its path any more is moved (server-side copy + delete);
- a directory, symlink or special file (FIFO, socket, device node) is represented on the
  tier (``put_entry``: an empty object whose meta carries the type and rdev, tiers/base.py).
- a tombstone deletes its key.

Ordering rules (docs/SEMANTICS.md, "Stage 2: the warm tier"; docs/DESIGN.md, "Upload order"):
- Items are numbered when queued. A commit marker (``.metadata``, ``latest``, ...) starts only
  when every item with a smaller number has finished, so a reader of the store that sees a
  marker finds everything closed before it. A marker queued again is numbered again. Moves
  obey the same rule (a marker's new key is its target): when a directory moves, and when
  the journal is replayed after a restart, markers are queued after every other item, so
  they reach their new keys after the files they stand for, at any depth.
- Nothing else waits for anything queued: an old directory whose children are not deleted
  yet, or a file whose key is still a directory on a file tier, fails with ``NotEmptyYet``
  and is retried (waiting would deadlock: the directory's deletion could be waiting for that
  very file). That failure is an ordering wait, not an outage: the store answered, so it
  never counts towards OUTAGE_AFTER (counting it would let only one item at a time reach
  the store, on a growing backoff, while the deletions it waits for sit behind the gate),
  and the item is tried again as soon as a deletion succeeds (``_deleted_one``), besides
  its own backoff. Only items in flight are waited for: the deletion of a directory key
  waits for every item in flight beneath it, and nothing starts beneath a directory being
  deleted (keys.py, rule 5), since on a file tier a put beneath a deleted directory would
  make it again, after its tombstone is gone.
- A directory renamed or removed is carried by a *sweep* (``_sweep``), ordered as a marker
  and after a barrier that also counts the other nodes' markers: nothing moves out of its
  old prefix, nor goes under it, before the sweep ran; the sweep moves (or deletes)
  everything there, with a record for each other node's version (peers.py).
- Who may touch a key, and when, is keys.py's (``KeyClaims``): two items never work on the
  same remote key at once (a move claims its source and its target), a copy to a key waits
  for the file that still has to move away from it, a ring of such moves is broken by
  parking one copy, and a pending deletion of a key is dropped when a newer upload to that
  key starts (it would overwrite it anyway).

Invariants:
- The journal is written before the store is touched (state UPLOADING, tombstone rows), and
  every store operation is idempotent, so replaying the journal after a crash is safe.
- A file open for writing is never uploaded; opening it for writing cancels its upload.
- Failures are retried with exponential backoff and jitter, never in a busy loop; the last
  error of every item is kept for ``status``.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import functools
import itertools
import logging
import math
import os
import random
import re
import stat
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import crc32c
import trio

from ckptfs.cluster.peers import Peers, Verdict, version_of
from ckptfs.engine.keys import KeyClaims
from ckptfs.engine.workqueue import WorkQueue
from ckptfs.engine.yieldgate import YieldGate
from ckptfs.errors import CkptfsError, NotFound
from ckptfs.state.journal import Journal, Row, State
from ckptfs.state.namespace import Namespace
from ckptfs.state.staging import Staging
from ckptfs.store.integrity import MIN_BLOCK, BlockSums, file_sums, format_crc
from ckptfs.store.tiers.base import (
    Kind,
    NotEmptyYet,
    ObjectInfo,
    ObjectMeta,
    ObjectMissing,
    PreconditionFailed,
    Tier,
)

if TYPE_CHECKING:
    from ckptfs.cluster.coordination import Coordinator
    from ckptfs.engine.listing import Lister

log = logging.getLogger(__name__)

BACKOFF_BASE = 0.5
INLINE_SUMS = 256 * 1024  # files this small are summed on the trio thread
BACKOFF_MAX = 60.0
HURRY_DELAY = 1.0  # the longest a failed item waits while a writer waits for space
# This many transient failures in a row, no success between, and the store is taken as down:
# one item at a time probes it (with backoff) until one succeeds. Without this every queued
# item is tried, fails and is retried on its own backoff: with n files closed during an outage
# that is n attempts (a sync, a checksum and two journal writes each) per backoff period, a
# load on the daemon and on the struggling store that grows with the queue.
OUTAGE_AFTER = 3
UPLOADED_KEYS = 4096  # keys of the last uploads kept for ``uploaded_since`` (retention)
_HASH_CHUNK = 8 * 1024 * 1024

WorkKey = tuple[str, int]  # ("ino", inode), ("tomb", tombstone id) or ("sweep", sweep id)


def _same_version(row: Row, info: ObjectInfo) -> bool:
    """Whether the object ``info`` is the version ``row`` committed (same bytes, and the
    same writer's version where both carry a stamp)."""
    return info.meta.checksum == row.checksum and (
        row.stamp is None or info.meta.stamp is None or info.meta.stamp == row.stamp)


def _changed_here(row: Row, mark: int) -> bool:
    """Whether ``row`` changed on this node since the version counter stood at ``mark``: a
    version on its way, or one written here since (a view of the store a listing brought in
    since is no change of this node's)."""
    return row.state not in (State.COMMITTED, State.REMOTE) or row.incomplete or (
        row.version > mark and row.closed_at is not None)


class NotLocal(CkptfsError):
    """An alias's upload found its head's bytes not on this node (retried with backoff)."""


@dataclass
class Work:
    key: WorkKey
    seq: int
    not_before: float = 0.0
    attempts: int = 0
    error: str | None = None
    target: str | None = None  # the remote key it writes (or deletes), while in flight
    source: str | None = None  # the key a move copies from, while in flight
    park: bool = False  # a move to a parking key (keys.py rule 2), while in flight
    cancel: trio.CancelScope | None = None
    done_bytes: int = 0


@dataclass
class UploadStats:
    uploaded_files: int = 0
    uploaded_bytes: int = 0
    moved: int = 0
    deleted: int = 0
    retries: int = 0
    failures: int = 0
    recent: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes) for rates
    # Called with (seconds, bytes) after each upload (metrics.py's latency histogram).
    observers: list[Callable[[float, int], None]] = field(default_factory=list)


def _with_sums(meta: ObjectMeta, checksum: str, sums: BlockSums) -> ObjectMeta:
    return dataclasses.replace(meta, checksum=checksum, blocks=sums.encode())


def file_checksum(path: Path, size: int) -> str:
    """CRC32C of the first ``size`` bytes of ``path`` (hardware-accelerated), as text."""
    value = 0
    with open(path, "rb", buffering=0) as f:
        left = size
        while left > 0:
            chunk = f.read(min(_HASH_CHUNK, left))
            if not chunk:
                break
            value = crc32c.crc32c(chunk, value)
            left -= len(chunk)
    return format_crc(value)


def _signature(info: ObjectInfo) -> str:
    """What tells a version of a key from one written there later (``_sweep_plan``): the
    writer's stamp with the tag and size. A directory marker is only its key (a file
    tier's directory changes its tag and times as entries come and go); one made again
    is told by what was written under it since."""
    if info.key.endswith("/"):
        return "dir"
    return f"{info.meta.stamp} {info.etag} {info.size}"


def is_marker(name: str, patterns: Iterable[str]) -> bool:
    """Whether the file name ``name`` matches one of the glob ``patterns`` (fnmatchcase)."""
    matcher = _markers_matcher(tuple(patterns))
    return matcher is not None and matcher(name) is not None


@functools.lru_cache(maxsize=16)
def _markers_matcher(patterns: tuple[str, ...]) -> Callable[[str], object] | None:
    """One compiled expression for all of ``patterns``: every close asks for its names, and
    a loop of ``fnmatchcase`` over the patterns cost more than the rest of the question."""
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match


class Uploader:
    """The reconciler of the warm tier. Hooks are called by the filesystem core."""

    def __init__(
        self, journal: Journal, ns: Namespace, staging: Staging, tier: Tier, *,
        concurrency: int, markers: Iterable[str], clock: Callable[[], float] = trio.current_time,
        min_block: int = MIN_BLOCK, keys: KeyClaims | None = None,
        peers: Peers | None = None, lister: Lister | None = None,
        gate: YieldGate | None = None,
    ) -> None:
        self.journal = journal
        self.min_block = min_block  # the smallest integrity block (integrity.py)
        self.ns = ns
        self.staging = staging
        self.tier = tier
        self.concurrency = concurrency
        self.markers = tuple(markers)
        self._clock = clock
        self._seq = itertools.count(1)
        self._last_number = 0
        # Files whose last writer's close(2) returned, not yet released: their number.
        self._closing: dict[int, int] = {}
        # The store-down gate (OUTAGE_AFTER): transient failures in a row, when the outage
        # began, and when the next probe may start.
        self._failures_in_a_row = 0
        self._outage_since: float | None = None
        self._probe_at = 0.0
        # Items that last failed with NotEmptyYet: retried at the next deletion's success.
        self._order_waits: set[WorkKey] = set()
        self._pending: WorkQueue[Work] = WorkQueue()
        self._inflight: dict[WorkKey, Work] = {}
        # Wake-ups: waiters take the current event, check the state, then wait on it; a change
        # sets it and installs a fresh one. No lock needed: trio switches only at awaits.
        self._changed = trio.Event()
        # Set at each file uploaded (``wait_uploaded``): the retention task waits on it, not
        # on ``_changed``, which every close of a create burst sets.
        self._uploaded = trio.Event()
        # The keys of the last uploads, for ``uploaded_since`` (bounded: older ones are not
        # known one by one any more).
        self._uploaded_keys: collections.deque[str] = collections.deque(maxlen=UPLOADED_KEYS)
        self.stats = UploadStats()
        self._random = random.Random()
        self._interrupted_keys: set[str] = set()
        # Back from a power loss: the files whose move to their key the journal holds at
        # start (it may have forgotten that the move was done: ``_move_forgotten``).
        self._forgotten_moves: set[int] = set()
        # Likewise the files whose upload it holds at start (``_upload_forgotten``).
        self._forgotten_uploads: set[int] = set()
        # Directories renamed or removed whose sweep has not run yet: id -> old prefix.
        self._sweeping: dict[int, str] = {}
        # ... and its new prefix (None: a removal).
        self._sweep_to: dict[int, str | None] = {}
        # Tombstones that keep their key (a rename over another node's file: ``_keep_waits``).
        self._keeping: set[int] = set()
        self.keys = keys if keys is not None else KeyClaims(journal, ns)
        # Stamps of uploads, records of what this node does to other nodes' versions.
        self.peers = peers if peers is not None else Peers(tier)
        # Where a row replaced by a sweep takes its new version at once (else at its next
        # listing).
        self.lister = lister
        # Set when other nodes may write to the same store (coordination.py): markers then
        # also wait for every node's files closed before them.
        self.coordinator: Coordinator | None = None
        # Items start only when the job lets them (yieldgate.py); sync and hurry open it.
        self.gate = gate if gate is not None else YieldGate.disabled()

    # -- hooks from the filesystem core (trio thread, never block) -------------------------

    def inode_changed(self, ino: int) -> None:
        """``ino`` (a file closed, a directory made, a file renamed...) needs reconciling."""
        self._queue(("ino", ino))

    def closed(self, inos: list[int]) -> None:
        """The last writer's close(2) of a file returned (FLUSH): ``inos`` are its names (a
        hard-linked file's head and aliases); RELEASE, which queues them, may come later.
        They are numbered now, so that barriers acknowledged meanwhile wait for them, and
        commit markers among them after the other names: a `.metadata` linked as `l1` and
        rewritten waits for `l1`'s new version."""
        rows = []
        for ino in inos:
            try:
                rows.append(self.ns.get(ino))
            except NotFound:
                continue
        for row in self._markers_last(rows):
            if row.ino not in self._closing:
                self._closing[row.ino] = self._number()
        self._wake()

    def tree_moved(self, inos: list[int]) -> None:
        """A directory moved: reconcile it and its descendants (moves, then old-key deletions).

        Commit markers anywhere in the tree are queued after every other entry of it, so they
        carry larger numbers and (by ``_pick``'s rule) move only once everything else of the
        tree, at any depth, is at its new key: a ``.metadata`` at depth 1 after the
        ``model/shard_*`` at depth 2, though ``inos`` lists the shallow entries first."""
        rows: list[Row] = []
        for ino in inos:
            try:
                rows.append(self.ns.get(ino))
            except NotFound:
                continue  # removed meanwhile: its tombstone covers any remote copy
        for row in self._markers_last(rows):
            self._queue(("ino", row.ino))

    def tombstone_added(self, tomb_id: int, key: str) -> None:
        if self.journal.tombstone_pin(tomb_id)[3]:
            self._keeping.add(tomb_id)
        self._queue(("tomb", tomb_id))

    def sweep_added(self, sweep_id: int) -> None:
        """A directory was renamed or removed (journal ``sweeps``): once every node has
        committed what it closed before now, everything under its old key goes to its new
        one (or goes). Ordered as a marker is (``_pick``); the tree's markers, queued after
        it, follow it, and no move out of the old prefix starts before it (``_plan``)."""
        found = self.journal.sweep(sweep_id)
        if found is not None:
            self._sweeping[sweep_id] = found[0]
            self._sweep_to[sweep_id] = found[1]
        self._queue(("sweep", sweep_id))

    def hurry(self, *, for_space: bool = True) -> None:
        """A writer waits for space (``for_space``), or ``ckptfs sync`` waits: retry failed
        items (and probe a store taken as down) soon, whatever their backoff says."""
        limit = self._clock() + HURRY_DELAY
        if for_space:
            # Writers waiting for space hurry every second. A sync opens the gate only while
            # it waits (``wait_until_done``): a gate left open after it returns would let
            # uploads run through the burst a job starts right after its sync.
            self.gate.bypass_for(2 * HURRY_DELAY)
        self._probe_at = min(self._probe_at, limit)
        for work in self._pending.values():
            if work.not_before > limit:
                work.not_before = limit
                self._pending.touch(work)
        self._wake()

    def cancel(self, ino: int) -> None:
        """The file is being rewritten or removed: stop working on its old version."""
        self._closing.pop(ino, None)  # written again or removed: not closed after all
        work = self._inflight.get(("ino", ino))
        if work is not None and work.cancel is not None:
            work.cancel.cancel()

    def _continue(self, ino: int) -> None:
        """Queue ``ino`` again to finish what its item started (a parked copy's move on, a
        file renamed while uploading, a put to redo): the same version, so it keeps its
        number even if it is a marker, and markers closed after it still wait for it."""
        self._queue(("ino", ino), keep=True)

    def _queue(self, key: WorkKey, keep: bool = False) -> None:
        reserved = self._reserved(key)
        work = self._pending.get(key)
        if work is None:
            running = self._inflight.get(key)
            if running is not None and (keep or not self._names_marker(key)):
                # Queued again while in flight (a chmod, a rename, a cancelled upload): it
                # keeps its first number, so markers closed after it, here or on another
                # node (an acknowledged barrier notes numbers), still wait for it.
                work = Work(key, min(running.seq, reserved or running.seq))
            else:
                work = Work(key, reserved or self._number())
            self._pending.add(work)
        else:
            before = (work.seq, work.not_before)
            if self._names_marker(key) and not keep:
                # A marker queued again is re-numbered so that it waits for whatever was
                # queued since: a rewritten `latest` must follow its new checkpoint. Other
                # items keep their first number, so markers queued since still wait for them.
                work.seq = reserved or self._number()
            elif reserved:
                work.seq = min(work.seq, reserved)
            work.not_before = 0.0
            if (work.seq, work.not_before) != before:
                self._pending.touch(work)
        if self.coordinator is not None:
            self.coordinator.activity()
        self._wake()

    def _reserved(self, key: WorkKey) -> int | None:
        """The number a file took at its close(2), once it is really closed (released)."""
        if key[0] != "ino" or key[1] not in self._closing:
            return None
        try:
            if self.ns.get(key[1]).state is State.OPEN:
                return None  # queued for another reason (a rename) before its RELEASE
        except NotFound:
            pass
        return self._closing.pop(key[1])

    def _number(self) -> int:
        self._last_number = next(self._seq)
        return self._last_number

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- for the coordinator (coordination.Queue) ---------------------------------------------

    def current_seq(self) -> int:
        """The number of the last item queued (items queued later have larger numbers)."""
        return self._last_number

    def data_outstanding(self, upto_seq: int, *, markers: bool = False) -> bool:
        """Whether a file or directory item numbered ``upto_seq`` or less is not done yet
        (deletions of old copies aside; markers too, unless ``markers``).

        With ``markers`` (a sweep's barrier), markers count, but not those that wait for a
        sweep of this node still to run (one of a related directory, queued before them):
        that sweep waits for the other nodes' acks, which would wait for them (two nodes
        renaming directories at once). A marker of another directory counts: it would
        otherwise reach its name after the other node's sweep had carried the directory.
        Markers themselves wait only for barriers acked on data (coordination.py), so an
        ack never waits for something that waits for it."""
        if any(seq <= upto_seq for seq in self._closing.values()):
            return True
        if self._floor() > upto_seq:
            return False  # nothing that old is queued or in flight: O(log n), the usual case
        items = (*self._pending.values(), *self._inflight.values())
        # The moves of a renamed directory wait for its sweep, which waits for the other
        # nodes' acks: they carry a rename, not a file closed, so acks never wait for them,
        # nor for the files that wait for them to leave a key.
        if markers:
            sweeps = [w for w in items if w.key[0] == "sweep"]
            return any(
                w.key[0] == "ino" and w.seq <= upto_seq
                and not (self._names_marker(w.key) and self._after_own_sweep(w, sweeps))
                and not self._behind_sweep(w.key[1])
                for w in items)
        return any(
            w.key[0] == "ino" and w.seq <= upto_seq and not self._names_marker(w.key)
            and not self._behind_sweep(w.key[1])
            for w in items)

    def _after_own_sweep(self, work: Work, sweeps: list[Work]) -> bool:
        """Whether the marker item ``work`` waits for a sweep of this node still to run (one
        numbered before it, of a directory related to its own: ``_before``)."""
        earlier = [s for s in sweeps if s.seq < work.seq]
        if not earlier:
            return False  # the usual case: no path to look up
        key = os.fsdecode(self.journal.path_of(work.key[1]) or b"")
        return any(self._related(s.key[1], key) for s in earlier)

    def pending(self) -> tuple[int, int]:
        """Files not uploaded yet (staged or uploading, in the journal) and their bytes: what
        a node leaves behind if it stops now (its registration, ``ckptfs umount``)."""
        rows = self.journal.rows_in_states(State.STAGED, State.UPLOADING)  # files only
        return len(rows), sum(r.size for r in rows)

    def work_left(self) -> bool:
        """Whether anything queued needs the store: a file to upload, an entry to put, a
        move, a deletion or a sweep. After a restart every linked inode is queued and most
        are found done at once; those do not count (a node that only read has none)."""
        if self.journal.rows_in_states(State.STAGED, State.UPLOADING) or \
                self.journal.tombstones() or self.journal.sweeps():
            return True
        for work in (*self._pending.values(), *self._inflight.values()):
            if work.key[0] != "ino":
                return True
            try:
                row = self.ns.get(work.key[1])
            except NotFound:
                continue
            if row.incomplete or row.state is State.OPEN:
                continue  # never uploaded as it is
            key = self.keys.key_of(row)
            if row.uploading_key is not None or row.state in (State.STAGED, State.UPLOADING) \
                    or (key is not None and row.remote_key != key):
                return True
        return False

    def held_markers(self) -> list[str]:
        """Markers waiting for other nodes (``status``)."""
        coordinator = self.coordinator
        if coordinator is None:
            return []
        return sorted(os.fsdecode(self.journal.path_of(w.key[1]) or b"?")
                      for w in self._pending.values()
                      if self._names_marker(w.key) and not coordinator.is_released(w.seq))

    def released(self) -> None:
        """The coordinator let markers through: look at them again."""
        self._wake()

    # -- queries ----------------------------------------------------------------------------

    def last_seq(self) -> int:
        """A number no outstanding item exceeds (items queued later get larger ones)."""
        return self._last_number

    def count(self) -> int:
        """Items queued or in flight."""
        return len(self._pending) + len(self._inflight)

    def busy(self) -> bool:
        """Whether any item is queued or in flight (O(1))."""
        return bool(len(self._pending) or self._inflight)

    def _floor(self) -> float:
        """The smallest number queued or in flight (``inf`` when idle), in O(log n)."""
        return min(self._pending.smallest_seq(),
                   min((w.seq for w in self._inflight.values()), default=math.inf))

    def outstanding(self, upto_seq: int | None = None) -> list[Work]:
        return [w for w in (*self._pending.values(), *self._inflight.values())
                if upto_seq is None or w.seq <= upto_seq]

    def failed(self) -> list[Work]:
        return [w for w in (*self._pending.values(), *self._inflight.values()) if w.error]

    def outage(self) -> dict[str, float] | None:
        """While the store is taken as down (OUTAGE_AFTER): since when (seconds ago, on the
        uploader's clock), the failures in a row and when the next probe starts."""
        if self._outage_since is None:
            return None
        now = self._clock()
        return {"down_for_s": round(now - self._outage_since, 1),
                "failures_in_a_row": self._failures_in_a_row,
                "next_probe_in_s": round(max(0.0, self._probe_at - now), 1)}

    async def wait_until_done(self, upto_seq: int) -> None:
        """Return once every item numbered ``upto_seq`` or less has finished."""
        with self.gate.bypassed():  # someone waits for the store: no yielding to the job
            while self._floor() <= upto_seq:
                await self._changed.wait()

    async def wait_progress(self) -> None:
        """Return after the next item finishes (a writer waiting for space tries again)."""
        await self._changed.wait()

    async def wait_uploaded(self, seen: int) -> None:
        """Return once more than ``seen`` files were uploaded (``stats.uploaded_files``)."""
        while self.stats.uploaded_files <= seen:
            await self._uploaded.wait()

    def uploaded_since(self, seen: int) -> list[str] | None:
        """The keys of the files uploaded after the first ``seen`` (``stats.uploaded_files``),
        oldest first, or None if they are too many to have been kept."""
        count = self.stats.uploaded_files - seen
        if count <= 0:
            return []
        if count > len(self._uploaded_keys):
            return None
        return list(itertools.islice(self._uploaded_keys, len(self._uploaded_keys) - count,
                                     None))

    async def wait_idle(self) -> None:
        """Return once nothing at all is left to do (items queued meanwhile included)."""
        while self.busy():
            await self._changed.wait()

    # -- start ------------------------------------------------------------------------------

    def requeue_from_journal(self) -> None:
        """After a restart: everything the journal says is not reconciled yet goes back in."""
        for row in self.journal.interrupted_uploads():
            # An upload the crash interrupted may have completed (or left parts) at a key the
            # file no longer has: remove whatever is there, unless the file still lives there.
            assert row.uploading_key is not None
            self._interrupted_keys.add(row.uploading_key)
            path = self.journal.path_of(row.ino)
            here = None if path is None else \
                os.fsdecode(path) + ("/" if stat.S_ISDIR(row.mode) else "")
            moved = here != row.uploading_key
            if moved and row.remote_key != row.uploading_key:
                self._retire(row.uploading_key)
            row.uploading_key = None
            self.journal.update(row)
        for _, key in self.journal.tombstones():
            self._interrupted_keys.add(key)  # an unlinked file's upload may have been cut short
        rows = self.journal.unreconciled()
        # Markers last (larger numbers), whatever the journal's order: a marker renamed or
        # closed before the crash must still reach the store after the files it stands for,
        # and after the sweeps of renamed directories.
        plain, markers = self._split_markers(rows)
        # Among the markers: in the order they became markers. One renamed to a marker's name
        # (`a` -> `.metadata`) after another marker was closed stands for that one too (the
        # rename is when the job declared the checkpoint complete); its rename set its ctime.
        markers.sort(key=lambda row: max(row.closed_at or 0.0, row.ctime_ns / 1e9))
        for n, row in enumerate(plain + markers):
            if n == len(plain):
                self._queue_sweeps()
            self._queue(("ino", row.ino))
            # Any of these may have been written (or copied to) when the crash came: leftovers
            # of an interrupted put or copy at its key are ours to clean up.
            path = self.journal.path_of(row.ino)
            if path:
                self._interrupted_keys.add(os.fsdecode(path))
        if not markers:
            self._queue_sweeps()
        for tomb_id, key in self.journal.tombstones():
            self.tombstone_added(tomb_id, key)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.lister is not None and self.coordinator is not None and \
                self.coordinator.hold is not None:
            # Back from a power loss: before anything is uploaded again, what other nodes did
            # meanwhile to versions whose commit the journal forgot (listing.py).
            await self.lister.settle_forgotten()
            self._forgotten_moves = {w.key[1] for w in self._pending.values()
                                     if w.key[0] == "ino" and self._is_move(w.key[1])}
            self._forgotten_uploads = {
                w.key[1] for w in self._pending.values()
                if w.key[0] == "ino" and w.key[1] not in self._forgotten_moves}
        keys = set(self._interrupted_keys)
        try:
            removed = await self.tier.cleanup(keys)
            if removed:
                log.info("removed %d leftover partial uploads from %s", removed, self.tier.url)
        except Exception as exc:  # noqa: BLE001 - the store may be down: uploads wait for it
            log.warning("could not clean up leftover uploads on %s: %s", self.tier.url, exc)
        async with trio.open_nursery() as nursery:
            for _ in range(self.concurrency):
                nursery.start_soon(self._worker)
            task_status.started()

    # -- workers ----------------------------------------------------------------------------

    def _pick(self, now: float) -> tuple[Work | None, float]:
        """The next eligible item (smallest number first; it leaves ``_pending``) and when
        to look again. O(log n) per item looked at (workqueue.py), not a sort per pick."""
        if self._outage_since is not None:
            # The store is down: one probe at a time, none before its backoff is over.
            if self._inflight:
                return None, math.inf  # its end wakes the workers
            if now < self._probe_at:
                return None, self._probe_at
        floor = min(self._floor(), min(self._closing.values(), default=math.inf))
        # The inode each waiting item waits for (keys.py rule 1) -> the smallest number
        # waiting for it: items are looked at in number order, so it is known in time.
        waits: dict[int, int] = {}

        def take(work: Work) -> bool:
            if work.key in self._inflight:
                return False
            plan = self._plan(work, waits)
            if plan is None:
                return False  # waits for a file to move away from its key (keys.py rule 1)
            target, source, park = plan
            marker = work.key[0] == "sweep" or (
                work.key[0] == "ino" and target is not None and not park and is_marker(
                    target.rstrip("/").rsplit("/", 1)[-1], self.markers))
            if marker and floor < work.seq and source is not None and \
                    waits.get(work.key[1], math.inf) < work.seq:
                # A marker moving away from a key that an earlier item waits for: it would
                # wait for that item, which waits for it. Its copy steps aside to a parking
                # key (no publication, so no order to keep); it moves on in its turn.
                target, park, marker = self.keys.parking_key(work.key[1]), True, False
            deletion = work.key[0] == "tomb"
            if self.keys.busy_around((target, source), deletion=deletion):
                return False
            sweep = work.key[0] == "sweep"
            if marker and floor < work.seq and (
                    not (sweep or self._sweeping or self._keeping)
                    or self._before(work.seq, sweep, None if sweep else target)):
                return False
            if marker and self.coordinator is not None and \
                    not self.coordinator.is_released(work.seq, full=sweep):
                # Its barrier wakes us when the nodes agree. A sweep's also waits for their
                # commit markers: one closed into a renamed or removed directory before the
                # rename must be in the store when the sweep lists it.
                self.coordinator.want(work.seq, full=sweep)
                return False
            work.target, work.source, work.park = target, source, park
            self.keys.claim(work.key, (target, source), deletion=deletion)
            return True

        return self._pending.pick(now, take)

    def _plan(self, work: Work, waits: dict[int, int]
              ) -> tuple[str | None, str | None, bool] | None:
        """The keys ``work`` would write and copy from, and whether it parks (keys.py rule
        2); None while it must wait for another file to move away from its key (rule 1),
        which it notes in ``waits``."""
        if work.key[0] == "tomb":
            key = self.journal.tombstone_key(work.key[1])
            if key is not None and (self._carried_later(key, work.seq)
                                    or self._keep_waits(work.key[1], key)):
                return None
            return key, None, False
        if work.key[0] == "sweep":
            return None, None, False
        try:
            row = self.ns.get(work.key[1])
        except NotFound:
            return None, None, False
        key = self.keys.key_of(row)
        if key is None:
            return None, None, False
        if self._swept_later(key):
            return None  # under a directory whose sweep has not run yet (below)
        if not stat.S_ISREG(row.mode):
            # A symlink or special file put at a key a file still has to move away from
            # would overwrite that file's copy (its only one, if evicted): rule 1 holds for
            # every put. An entry never moves, so it only ever waits (no cycle through it).
            blocker, _ = self.keys.blocker(row, key)
            if blocker is not None:
                self._wait_for(blocker, work, waits)
                return None
            return key, None, False
        move = self.keys.is_move(row, key)
        upload = row.state in (State.STAGED, State.UPLOADING) and not row.incomplete
        if not move and not upload:
            return key, None, False
        if self._waits_for_sweep_at(row, key):
            # Into a directory renamed or removed, or out of one renamed, whose sweep has not
            # run yet: the sweep moves it (``_sweep``), and nothing new goes under the old
            # name before the sweep has carried (or deleted) what other nodes closed there.
            return None
        blocker, cycle = self.keys.blocker(row, key)
        if blocker is not None and not cycle:
            self._wait_for(blocker, work, waits)
            return None
        if cycle or (move and self.keys.nested(key, row.remote_key)):
            return self.keys.parking_key(row.ino), row.remote_key, True
        return key, row.remote_key if move else None, False

    def _wait_for(self, blocker: Row, work: Work, waits: dict[int, int]) -> None:
        """``work`` waits for ``blocker`` to move away from the key it wants (rule 1)."""
        waits[blocker.ino] = min(waits.get(blocker.ino, work.seq), work.seq)
        if ("ino", blocker.ino) not in self._pending and \
                ("ino", blocker.ino) not in self._inflight:
            self._queue(("ino", blocker.ino))  # its move is what we wait for

    def _markers_last(self, rows: list[Row]) -> list[Row]:
        """``rows`` in their order, but every commit marker after every other entry."""
        plain, markers = self._split_markers(rows)
        return plain + markers

    def _split_markers(self, rows: list[Row]) -> tuple[list[Row], list[Row]]:
        """``rows`` without the commit markers, and the markers (each in their order)."""
        def marker(row: Row) -> bool:  # by name, as _pick judges (a `latest` symlink too)
            return is_marker(os.fsdecode(row.name or b""), self.markers)
        return [r for r in rows if not marker(r)], [r for r in rows if marker(r)]

    def _before(self, seq: int, sweep: bool, marker: str | None = None) -> bool:
        """Whether an item numbered below ``seq`` is still to finish (a marker or a sweep
        numbered ``seq`` waits for it), the moves that wait for a sweep aside: they carry a
        rename, not a file closed, and the sweep they wait for may be numbered after
        ``seq`` (a file renamed while uploading keeps its first number), while the markers
        of a renamed directory are numbered after its sweep and wait for it. A ``sweep``
        does not wait for deletions of old copies either: a directory's old key on a file
        tier can go only once the sweep has moved what is under it. A marker (its key
        ``marker``) waits only for the sweeps of directories related to its own (above it,
        below it, or it: ``_related``), not for another checkpoint's rename or removal.
        Nor does anything wait for a tombstone that waits for the file renamed over its key
        (``_keep_waits``): that file may be the marker."""
        if any(s < seq for s in self._closing.values()):
            return True
        return any(w.seq < seq and not (sweep and w.key[0] == "tomb")
                   and not (w.key[0] == "ino" and self._waits_for_sweep(w.key[1]))
                   and not (w.key[0] == "tomb" and self._keep_waits(w.key[1]))
                   and not (marker is not None and w.key[0] == "sweep"
                            and not self._related(w.key[1], marker))
                   for w in (*self._pending.values(), *self._inflight.values()))

    def _keep_waits(self, tomb_id: int, key: str | None = None) -> bool:
        """Whether ``tomb_id`` is a tombstone that keeps its key ``key`` (a rename here over
        another node's file: the moved file overwrites that version, whose writer is told)
        and waits for the file renamed over it to get there. Until then the job may rename
        that file on or remove it, and then nothing overwrites the old version: the
        tombstone deletes it instead (``_reconcile``). A file that came back incomplete
        after a power loss is not waited for (it is never uploaded as it is)."""
        if tomb_id not in self._keeping:
            return False
        if key is None:
            key = self.journal.tombstone_key(tomb_id)
        row = None if key is None else self._overwriter(key)
        return row is not None and not row.incomplete and row.remote_key != key and (
            row.state in (State.STAGED, State.UPLOADING) or self.keys.is_move(row, key))

    def _overwriter(self, key: str) -> Row | None:
        """The file of this node whose copy goes to the file key ``key`` (it is named so
        here), if any."""
        row = self.ns.entry_at(key)
        if row is None or not stat.S_ISREG(row.mode) or self.keys.key_of(row) != key:
            return None
        return row

    def _related(self, sweep_id: int, key: str) -> bool:
        """Whether the pending sweep ``sweep_id`` moves or removes anything in the directory
        of ``key`` or around it (either is an ancestor of the other): a marker there waits
        for it."""
        directory = key.rstrip("/").rpartition("/")[0]
        directory = directory + "/" if directory else ""
        prefixes = (self._sweeping.get(sweep_id), self._sweep_to.get(sweep_id))
        return any(p is not None and (p.startswith(directory) or directory.startswith(p))
                   for p in prefixes)

    def _swept_later(self, key: str | None, *, renamed: bool = False) -> bool:
        """Whether ``key`` is under a directory renamed or removed here (``renamed``: renamed)
        whose sweep has not run yet."""
        return key is not None and any(
            key.startswith(old) for sweep_id, old in self._sweeping.items()
            if not renamed or self._sweep_to.get(sweep_id) is not None)

    def _carried_later(self, key: str, seq: int) -> bool:
        """Whether a deletion numbered ``seq`` of ``key`` waits for the sweep of a directory
        renamed here before it (an earlier number) into a directory ``key`` is under: a name
        removed after its directory's rename (rank 0's ``mv step.tmp step; rm step/x``). The
        sweep brings there what other nodes closed under the old name before the rename,
        another node's rewrite of ``x`` still uploading then included; the deletion, after
        it, takes that version too, as the job removed it."""
        for sweep_id, new in self._sweep_to.items():
            if new is None or not key.startswith(new):
                continue
            work = self._pending.get(("sweep", sweep_id)) or self._inflight.get(
                ("sweep", sweep_id))
            if work is not None and work.seq < seq:
                return True
        return False

    def _moves_out_later(self, row: Row, key: str | None) -> bool:
        """Whether ``row``'s move to ``key`` is out of a directory renamed here whose sweep has
        not run yet: the sweep carries what is under it first. Out of a directory *removed*
        the move need not wait: the sweep spares every key a row of this node holds, and a
        commit marker closed before the removal must be able to wait for the move (a linked
        file's last name outside the directory, its copy still inside it)."""
        return self.keys.is_move(row, key) and self._swept_later(row.remote_key, renamed=True)

    def _waits_for_sweep(self, ino: int) -> bool:
        """Whether the item of ``ino`` waits for a sweep (``_plan``)."""
        if not self._sweeping:
            return False
        try:
            row = self.ns.get(ino)
        except NotFound:
            return False
        return self._waits_for_sweep_at(row, self.keys.key_of(row))

    def _waits_for_sweep_at(self, row: Row, key: str | None) -> bool:
        """``_waits_for_sweep`` for ``row``, whose key is ``key``."""
        return self._swept_later(key) or self._moves_out_later(row, key)

    def _behind_sweep(self, ino: int) -> bool:
        """Whether the item of ``ino`` waits for a sweep, itself or through the files it waits
        to move away from its key (rule 1): a file put at the key of one whose move out of a
        renamed directory waits for the sweep (``mv step1 step2``, then an exchange of
        ``step1/a`` and ``step2/a``) reaches the store only after that sweep too. Acks leave
        such items out as they leave out those waiting for the sweep themselves."""
        if not self._sweeping:
            return False
        seen: set[int] = set()
        while ino not in seen:
            seen.add(ino)
            try:
                row = self.ns.get(ino)
            except NotFound:
                return False
            key = self.keys.key_of(row)
            if self._waits_for_sweep_at(row, key):
                return True
            if key is None:
                return False
            blocker, cycle = self.keys.blocker(row, key)
            if blocker is None or cycle:
                return False  # free to go, or parks (rule 2): it waits for nothing
            ino = blocker.ino
        return False

    def _queue_sweeps(self) -> None:
        for sweep_id in self.journal.sweeps():
            self.sweep_added(sweep_id)

    def _names_marker(self, key: WorkKey) -> bool:
        if key[0] != "ino":
            return False
        path = self.journal.path_of(key[1])
        return bool(path) and is_marker(os.fsdecode(path or b"").rsplit("/", 1)[-1], self.markers)

    def is_cleanup(self, work: Work) -> bool:
        """Deletions of old copies: ``sync`` waits for them whatever their number."""
        return work.key[0] == "tomb"

    async def _worker(self) -> None:
        while True:
            work = await self._next()
            try:
                with trio.CancelScope() as work.cancel:
                    await self._reconcile(work)
                    if work.error is not None or self._outage_since is not None:
                        self._store_is_back()
                    self._failures_in_a_row = 0
                    work.error = None
                    if work.key[0] == "tomb":
                        self._deleted_one()
            except Exception as exc:  # noqa: BLE001 - every failure is retried and reported
                self._failed(work, exc)
            finally:
                work.cancel = None
                work.target = work.source = None
                work.park = False
                self.keys.release(work.key)
                del self._inflight[work.key]
                self._wake()

    async def _next(self) -> Work:
        while True:
            changed = self._changed
            now = self._clock()
            opens = self.gate.opens_at(now) if self._pending else now
            if opens > now:
                await self.gate.wait(opens)  # the job is busy (yieldgate.py)
                continue
            work, wake_at = self._pick(now)
            if work is not None:
                # In flight before the next checkpoint: no other worker can take it.
                self._inflight[work.key] = work
                return work
            with trio.move_on_at(wake_at):
                await changed.wait()

    def _store_is_back(self) -> None:
        """A failed item just succeeded: the others need not sit out their backoff."""
        now = self._clock()
        if self._outage_since is not None:
            log.warning("the store answers again after %.1fs down: %d items go up now",
                        now - self._outage_since, len(self._pending))
        self._failures_in_a_row = 0
        self._outage_since = None
        for work in self._pending.values():
            if work.error is not None and work.not_before > now:
                work.not_before = now
                self._pending.touch(work)

    def _deleted_one(self) -> None:
        """A key left the store: items waiting for a directory to empty (NotEmptyYet) may
        go now, whatever their backoff says (each tries again once per deletion at most)."""
        now = self._clock()
        for key in self._order_waits:
            work = self._pending.get(key)
            if work is not None and work.not_before > now:
                work.not_before = now
                self._pending.touch(work)
        self._order_waits.clear()

    def _backoff(self, attempts: int) -> float:
        """Seconds to wait after the ``attempts``-th failure in a row: doubling from
        BACKOFF_BASE to BACKOFF_MAX, with jitter (×0.5 to ×1.5)."""
        delay: float = min(BACKOFF_MAX, BACKOFF_BASE * 2 ** min(attempts - 1, 20))
        return delay * (0.5 + self._random.random())

    def _failed(self, work: Work, exc: Exception) -> None:
        work.attempts += 1
        delay = self._backoff(work.attempts)
        work.error = f"{type(exc).__name__}: {exc}"
        work.not_before = self._clock() + delay
        # A directory of a file tier with entries still in it: the item waits for their
        # deletions (retried when one is done, see _deleted_one), and the store answered, so
        # it is no sign of an outage: counting it as one would throttle every other item.
        waiting = isinstance(exc, NotEmptyYet)
        transient = not waiting and self.tier.is_transient(exc)
        self.stats.retries += 1
        if waiting:
            self._order_waits.add(work.key)
            self._failures_in_a_row = 0
            if self._outage_since is not None:
                self._store_is_back()
        elif not transient:
            self.stats.failures += 1
        else:
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= OUTAGE_AFTER:
                # Probes back off as one item does, counted from the outage's start.
                probes = self._failures_in_a_row - OUTAGE_AFTER + 1
                self._probe_at = self._clock() + self._backoff(probes)
                if self._outage_since is None:
                    self._outage_since = self._clock()
                    log.warning("the store looks down (%d failures in a row, the last: %s): "
                                "one item at a time probes it until it answers; %d items wait",
                                self._failures_in_a_row, work.error, len(self._pending) + 1)
        # While the store is taken as down the item waits for a probe, not for its delay.
        when = (f"retry in {delay:.1f}s" if self._outage_since is None else
                f"the store looks down: next probe in "
                f"{max(0.0, self._probe_at - self._clock()):.1f}s, then the rest")
        log.warning("%s %s failed (attempt %d, %s): %s",
                    {"ino": "upload of", "tomb": "deletion of"}.get(work.key[0], "sweep"),
                    work.target or work.key, work.attempts, when, work.error)
        queued = self._pending.get(work.key)
        if queued is None:
            self._pending.add(work)
        elif not self._names_marker(work.key) and work.seq < queued.seq:
            queued.seq = work.seq  # the first number stands (see _queue)
            self._pending.touch(queued)

    # -- reconciling one item ---------------------------------------------------------------

    async def _reconcile(self, work: Work) -> None:
        kind, ident = work.key
        if kind == "tomb":
            key = self.journal.tombstone_key(ident)
            if key is not None:
                # A live file committed at this key since (a rename over it, an exchange):
                # the object is its data now, not garbage. A key hidden by a local-only
                # unlink is kept for retention.
                stamp, etag, moved_to, keep = self.journal.tombstone_pin(ident)
                if keep and self._overwriter(key) is None:
                    # The file renamed over it was renamed on or removed before its copy got
                    # there (``_keep_waits``): nothing overwrites the version, which goes as
                    # the job removed it.
                    keep = False
                if keep:
                    # Overwritten here, not deleted (a rename over another node's file): its
                    # writer is told that version is gone.
                    await self.peers.record(stamp, key, Verdict.DELETED)
                elif self.keys.may_delete(key, stamp if etag else None):
                    # Only the version this node knew, with a record for its writer if that
                    # is another node (peers.py); exactly that one if a row here holds
                    # another version at the key.
                    exact = self.journal.holder_of(key) is not None
                    if await self.peers.delete(key, stamp=stamp, etag=etag, moved_to=moved_to,
                                               exact=exact):
                        self.stats.deleted += 1
                elif self.journal.holder_of(key) is not None:
                    # A file of this node's is committed there since: the version was
                    # replaced, which its writer must know as if it had been deleted.
                    await self.peers.record(stamp, key, Verdict.MOVED if moved_to
                                            else Verdict.DELETED, to=moved_to)
                self.journal.drop_tombstone(ident)
            self._keeping.discard(ident)
            return
        if kind == "sweep":
            await self._sweep(ident)
            return
        try:
            row = self.ns.get(ident)
        except NotFound:
            return
        path = self.journal.path_of(ident)
        if path is None or not path:
            return  # unlinked (a tombstone covers any remote copy) or the root
        key = os.fsdecode(path)
        if stat.S_ISREG(row.mode):
            if row.state in (State.STAGED, State.UPLOADING) and not row.incomplete:
                await self._upload(work, row, key)
            elif work.park and work.target is not None:
                # A ring of moves (keys.py rule 2): this copy steps aside to a parking key,
                # and from there to its path once the key it wants is free.
                await self._move(row, work.target)
                self._continue(row.ino)
            elif row.state in (State.COMMITTED, State.REMOTE) and row.remote_key != key:
                await self._move(row, key)
        else:
            await self._put_entry(row, key)

    def _is_move(self, ino: int) -> bool:
        try:
            row = self.ns.get(ino)
        except NotFound:
            return False
        key = self.keys.key_of(row)
        return key is not None and self.keys.is_move(row, key)

    async def _move_forgotten(self, row: Row, key: str) -> bool:
        """The version ``row`` moves to ``key`` is gone from its old key, and the node is back
        from a power loss that may have rolled the journal back to before the move was done.
        True if that explains it (the row is settled): the new key holds the version (the
        move was done: taken as committed) or a newer one (the move was done, and the name
        rewritten since: taken as that), or the job removed it since (another node's
        version, whose writer tells nobody of its own deletions: by the job's rules, nothing
        removes the old key before this node's move is in the store; or this node's version,
        that a record says another node deleted or moved). Else False: gone behind ckptfs."""
        try:
            info: ObjectInfo | None = await self.tier.head(key)
        except ObjectMissing:
            info = None
        # Decided once (a store error above retries the move, and this with it).
        self._forgotten_moves.discard(row.ino)
        if info is not None and _same_version(row, info):
            row.remote_key, row.remote_etag = key, info.etag
            if row.state is not State.REMOTE:
                row.state = State.COMMITTED
            self.ns.persist(row)
            log.info("%s: its move was done before the power loss; taken as committed", key)
            return True
        if self.lister is None:
            return False
        if info is not None:
            # Another version at the new key: by the job's rules nothing writes this name
            # before this node's move is in the store, so the move was done and the name
            # rewritten since; the row is a view of that (the listing takes it, as for any
            # file rewritten by another node).
            row.remote_key = key
            self.ns.persist(row)
            self.lister.take(row, info)
            log.info("%s: its move was done before the power loss and the name rewritten "
                     "since; taking the new version", key)
            return True
        record = None
        if not self.peers.foreign(row.stamp):
            record = (await self.peers.replaced({key: row})).get(key)
            if record is None:
                return False
        if not self.lister.drop_removed(row):
            return False
        log.warning("%s: its move was forgotten by the power loss and its version is gone "
                    "from the store: removed since by %s, removed here too", key,
                    f"node {record.by}" if record is not None and record.by
                    else "another node")
        if record is not None:
            await self.lister.drop_records([record])
        return True

    async def _upload_forgotten(self, row: Row, key: str) -> bool:
        """Before the first upload of ``row`` at a start after a power loss (the journal may
        have rolled back to before it was committed), what its key holds decides:

        - this node's own object of this very version (same version number, size and
          checksum): the upload was done; taken as committed, not put again;
        - another node's object: if that node replaced this very version since the start,
          its record says so (a writer records what it replaces before its put:
          ``_upload``), and the file goes here too (``Lister.replaced_since``), as
          ``settle_forgotten`` would have had the record been there then. Put again, it
          would land over that node's newer version.

        True if the row is settled so; False: upload it (nothing there, an older version,
        or another node's version this one replaces)."""
        if not stat.S_ISREG(row.mode) or self.lister is None:
            return False
        version = row.version
        try:
            info = await self.tier.head(key)
        except ObjectMissing:
            return False
        if info.meta.kind is not Kind.FILE or info.meta.stamp is None:
            return False
        if self.peers.foreign(info.meta.stamp):
            return await self.lister.replaced_since(row, key)
        if self.ns.is_linked(row) or version_of(info.meta.stamp) != version or \
                info.size != row.size or info.meta.checksum is None:
            return False  # (a linked file's names are put from the head's bytes: put again)
        checksum, sums = await trio.to_thread.run_sync(
            file_sums, self.staging.path(row.ino), row.size, self.min_block)
        if checksum != info.meta.checksum or row.state is not State.STAGED or \
                row.version != version or self.keys.key_of(row) != key:
            return False  # other bytes, or the file changed or moved meanwhile
        log.info("%s: its upload was done before the power loss; taken as committed", key)
        old_key, old_stamp, old_etag = row.remote_key, row.stamp, row.remote_etag
        row.remote_key = key
        self._committed(row, info.etag, info.meta.stamp, checksum, sums.encode())
        with self.journal.transaction():
            self.ns.persist(row)
            if old_key and old_key != key:
                self._retire(old_key, old_stamp, old_etag)
        return True

    def _committed(self, row: Row, etag: str | None, stamp: str | None, checksum: str,
                   blocks: str) -> None:
        """``row``'s version is the object at its ``remote_key`` (tag ``etag``, writer's
        ``stamp``): COMMITTED (the caller persists it)."""
        row.state = State.COMMITTED
        row.checksum = checksum
        row.blocks = blocks
        row.storage_class = None
        row.remote_etag = etag  # a listing that shows this tag needs no HEAD
        row.stamp = stamp
        row.tiers = self.tier.name
        row.committed_at = time.time()
        self.journal.note_committed(row.ino)

    async def _supersede(self, key: str) -> None:
        """An upload to ``key`` makes pending deletions of ``key`` pointless (and harmful).
        The versions they were to delete are replaced instead: their writers are told first,
        as the deletion would have (peers.py)."""
        for _, stamp in self.journal.tombstones_of(key):
            await self.peers.record(stamp, key, Verdict.DELETED)
        for tomb_id in self.journal.drop_tombstones_for(key):
            self._pending.pop(("tomb", tomb_id), None)
            self._keeping.discard(tomb_id)

    async def _upload(self, work: Work, row: Row, key: str) -> None:
        # A hard link's extra name (an alias) is put from its head's staging file: the same
        # bytes, as many objects as names (journal.py "Hard links").
        data = self.ns.kernel_ino(row.ino)
        if self.ns.get(data).state is State.REMOTE:
            # Not local (fs.py keeps a head's bytes until every alias is committed; a power
            # loss may still have taken them): a sparse file would upload zeros. Retried.
            raise NotLocal(f"{key}: the bytes of its inode {data} are not on this node")
        version = row.version
        if row.ino in self._forgotten_uploads:
            self._forgotten_uploads.discard(row.ino)  # decided once
            if await self._upload_forgotten(row, key):
                return
        row.state = State.UPLOADING
        row.uploading_key = key
        self.ns.persist(row)
        await self._supersede(key)
        if row.remote_key == key:
            # This version replaces the one at its key: if another node wrote that one, it is
            # told (else, should this one be deleted before it lists, it would find its own
            # missing with nothing to say why, and upload it again).
            await self.peers.record(row.stamp, key, Verdict.DELETED)
        source = self.staging.path(data)
        size = row.size
        stamp = self.peers.stamp(version)
        meta = ObjectMeta(Kind.FILE, stat.S_IMODE(row.mode), row.mtime_ns, row.uid, row.gid,
                          stamp=stamp)  # the checksums follow
        summed: list[tuple[str, BlockSums]] = []
        # A big file for a tier that writes the meta last is summed while it is copied (the
        # copy waits on the disk, the sums on the CPU); else before the put.
        late = size > INLINE_SUMS and self.tier.late_meta
        try:
            # Durable before the journal says COMMITTED: a committed local copy may be read,
            # evicted to, or uploaded again after a power loss. A small file is synced and
            # summed inline: a thread hop costs more than summing it, and though its sync
            # blocks for a device flush, a hop for it alone would still let the autojump
            # clock of the node tests leap (tests/test_multinode.py). A big one is flushed
            # while it is sent (``_put``): the store need not wait for the disk.
            if size <= INLINE_SUMS:
                self.staging.datasync(data)
                summed.append(file_sums(source, size, self.min_block))
            elif not late:
                summed.append(await trio.to_thread.run_sync(file_sums, source, size,
                                                            self.min_block))
        except FileNotFoundError:
            if self.journal.path_of(row.ino) is None:
                return  # unlinked since it was queued: nothing to upload
            raise
        summed_now = trio.Event()

        async def sum_up() -> None:
            summed.append(await trio.to_thread.run_sync(file_sums, source, size,
                                                        self.min_block))
            summed_now.set()

        async def finish() -> ObjectMeta:
            await summed_now.wait()
            return _with_sums(meta, *summed[0])

        work.done_bytes = 0  # this attempt's bytes (an earlier one may have sent some)

        def progress(n: int) -> None:
            work.done_bytes += n

        started = time.monotonic()
        try:
            if late:
                etag = await self._put(data, size, lambda: self.tier.put_file(
                    key, source, size, meta, progress, finish=finish), beside=sum_up)
            else:
                etag = await self._put(data, size, lambda: self.tier.put_file(
                    key, source, size, _with_sums(meta, *summed[0]), progress))
        except Exception as exc:
            if row.state is State.UPLOADING and row.version == version:
                row.state = State.STAGED  # waiting for a retry, as user.ckptfs.state says
                self.ns.persist(row)
            if isinstance(exc, FileNotFoundError) and self.journal.path_of(row.ino) is None:
                return  # unlinked while it was summed: nothing to upload
            raise
        checksum, sums = summed[0]
        blocks = sums.encode()
        self.stats.uploaded_files += 1
        self._uploaded_keys.append(key)
        self._uploaded.set()
        self._uploaded = trio.Event()
        self.stats.uploaded_bytes += size
        self.stats.recent.append((time.monotonic(), size))
        del self.stats.recent[:-256]
        for observe in self.stats.observers:
            observe(time.monotonic() - started, size)
        log.debug("uploaded %s (%d bytes) in %.2fs", key, size, time.monotonic() - started)
        old_key, old_stamp, old_etag = row.remote_key, row.stamp, row.remote_etag
        live = await self._still_there(row.ino, key, stamp, etag)
        if live is None:
            return
        row = live
        row.remote_key = key
        row.uploading_key = None
        if row.version == version and row.state is State.UPLOADING:
            self._committed(row, etag, stamp, checksum, blocks)
        else:
            # Rewritten while it uploaded: the object is a version no row holds.
            row.stamp, row.remote_etag = stamp, etag
        with self.journal.transaction():
            self.ns.persist(row)
            if old_key and old_key != key:
                self._retire(old_key, old_stamp, old_etag)
        if os.fsdecode(self.journal.path_of(row.ino) or b"") != key:
            self._continue(row.ino)  # renamed while uploading: move it

    async def _put(self, data: int, size: int, put: Callable[[], Awaitable[str | None]],
                   beside: Callable[[], Awaitable[None]] | None = None) -> str | None:
        """``put()``, and for a file not synced inline (over INLINE_SUMS) the device flush of
        its staging file beside it, and ``beside()`` (the sums a late-meta put waits for);
        returns once all are done (the first failure is raised as itself, as the tiers raise
        theirs, and cancels the others). A file unlinked meanwhile is not flushed:
        ``_still_there`` then finds it gone."""
        if size <= INLINE_SUMS:
            return await put()
        failed: list[Exception] = []
        tags: list[str | None] = []

        async def flush(cancel: trio.CancelScope) -> None:
            try:
                await trio.to_thread.run_sync(self.staging.datasync, data)
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - raised below
                failed.append(exc)
                cancel.cancel()

        async def send(cancel: trio.CancelScope) -> None:
            try:
                tags.append(await put())
            except Exception as exc:  # noqa: BLE001 - raised below
                failed.append(exc)
                cancel.cancel()

        async def other(cancel: trio.CancelScope) -> None:
            assert beside is not None
            try:
                await beside()
            except Exception as exc:  # noqa: BLE001 - raised below
                failed.append(exc)
                cancel.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flush, nursery.cancel_scope)
            nursery.start_soon(send, nursery.cancel_scope)
            if beside is not None:
                nursery.start_soon(other, nursery.cancel_scope)
        if failed:
            raise failed[0]
        return tags[0]

    async def _move(self, row: Row, key: str) -> None:
        old_key = row.remote_key
        assert old_key is not None
        await self._supersede(key)
        # Claimed while the copy is on its way: a listing meanwhile must not take the new key
        # for another node's file (and a crash leaves it to requeue_from_journal).
        row.uploading_key = key
        self.ns.persist(row)
        newer: ObjectInfo | None = None
        try:
            # Only move what is ours: another file may have been written at the old key since
            # (a rename over it, an exchange), or it was deleted behind our back.
            info = await self.tier.head(old_key)
            if not _same_version(row, info):
                if not self._may_follow(row, info):
                    raise ObjectMissing(old_key)
                # A view of another node's file that its writer rewrote before this rename
                # (it closed the new version first, in the job's order, and uploaded it since
                # this node listed it): the path moves, so its newest version does.
                newer = info
            # Pinned to the version just checked (keys.py rule 3): another node writing the
            # old key in between makes the copy fail with PreconditionFailed, and the retry
            # checks again, instead of copying its bytes under our new name.
            tag = await self.tier.copy(old_key, key, if_etag=info.etag)
        except ObjectMissing:
            row.uploading_key = None
            if row.ino in self._forgotten_moves and await self._move_forgotten(row, key):
                return
            if row.state is State.REMOTE:
                # Nothing here to upload again: the file is reported, never retried forever
                # (which would hold every later marker of this node).
                log.error("%s: the only copy of %s is gone from %s; marked incomplete",
                          old_key, key, self.tier.url)
                row.incomplete = True
                self.ns.persist(row)
                return
            row.state = State.STAGED  # upload it again from the local copy
            row.remote_key = None
            self.ns.persist(row)
            self._continue(row.ino)
            return
        live = await self._still_there(row.ino, key)
        if live is None:
            return  # removed meanwhile: its unlink tombstoned the old key
        row = live
        if newer is not None:
            assert self.lister is not None
            if not self.lister.take(row, newer):
                # Opened or changed meanwhile: the copy stays (it is the path's newest
                # version), the row's move is tried again.
                raise NotEmptyYet(f"{old_key}: a newer version to move, the row is busy")
        row.remote_key = key
        row.uploading_key = None
        self.journal.note_committed(row.ino)  # at a key a listing on its way may not show
        if tag is not None:
            row.remote_etag = tag
        with self.journal.transaction():
            self.ns.persist(row)
            self._retire(old_key, info.meta.stamp, info.etag, moved_to=key)
        self.stats.moved += 1

    def _may_follow(self, row: Row, info: ObjectInfo) -> bool:
        """Whether a move of ``row`` may take the other version ``info`` found at its old
        key: ``row`` is a plain view of that key (another node's file, or this node's own
        committed one with nothing of it changed here since: a listing would take another
        node's new version there too, ``Lister._clean``), not a name of a linked file, and
        ``info`` is another node's file, written there after the version the row holds
        (the store took it after that one)."""
        return (self.lister is not None and row.state in (State.REMOTE, State.COMMITTED)
                and not row.incomplete and not self.ns.is_linked(row)
                and info.meta.kind is Kind.FILE and info.meta.stamp is not None
                and self.peers.foreign(info.meta.stamp))

    async def _sweep(self, sweep_id: int) -> None:
        """Carry a directory's rename (or removal) to the store, once every node has committed
        what it closed in it before.

        The sweep waited for a barrier that counts markers too (``_pick``): every node has
        committed everything it closed before the rename, its commit markers included, and
        no move out of the old prefix started before it (``_plan``). So everything under
        ``old`` is what the job had in the directory when it was renamed, in the latest
        version each file reached: this node's files and other nodes', those still
        uploading then and those rewritten since this node listed them. A rename copies each
        to ``new`` (files first, commit markers after them, several at a time: a reader of
        ``new`` never meets a marker before its files), a removal deletes each (markers
        first). The old keys go, pinned to the versions listed, with a record for each
        other node's version (peers.py), which its writer then follows instead of
        uploading it again.

        The rows this node holds at an old key take the new key (and the version found
        there, if another node's is newer than theirs: their local copy goes). A key that a
        row changed here since the rename is left to that row (its upload retires it; another
        node's version there, which none of this node's rows holds, is deleted:
        ``_held_over``), and at the new key a row written or changed here since the rename
        wins over the version the sweep found (its version is above the sweep's mark)."""
        found = self.journal.sweep(sweep_id)
        if found is None:
            return
        old, new, mark = found
        planned, fresh, missing = await self._sweep_plan(sweep_id, old)
        skip = self.keys.claimed() | self.journal.tombstoned_under(old) \
            | self.journal.hidden_under(old)
        left = [info for info in planned if info.key not in skip]
        files = [info for info in left if not info.key.endswith("/")]
        directories = sorted((info for info in left if info.key.endswith("/")),
                             key=lambda i: -i.key.count("/"))
        gone: list[tuple[ObjectInfo, str | None]] = []  # old versions to delete, moved to
        if new is not None:
            for key in missing:
                self._moved_before(key, new + key[len(old):], mark)
            for info in directories:
                await self._sweep_directory(info, new + info.key[len(old):])
            for markers in (False, True):
                batch = [i for i in files if self._is_marker_key(i.key) is markers]
                gone += await self._sweep_files(batch, old, new, mark)
        else:
            gone += [(info, None) for info in files if not self._held(info.key, mark)]
        gone.sort(key=lambda g: not self._is_marker_key(g[0].key))  # markers first
        for version, moved_to in gone:
            if self.journal.holder_of(version.key) is None:  # none of ours holds it now
                await self.peers.delete(version.key, stamp=version.meta.stamp,
                                        etag=version.etag, moved_to=moved_to)
        for info in directories:
            if not any(f.key.startswith(info.key) for f in fresh):  # else written in since
                await self.peers.delete(
                    info.key, stamp=info.meta.stamp if info.meta_known else None,
                    moved_to=None if new is None else new + info.key[len(old):])
        self.journal.drop_sweep(sweep_id)
        self._sweeping.pop(sweep_id, None)
        self._sweep_to.pop(sweep_id, None)
        self._wake()  # the moves that waited for it

    async def _sweep_plan(self, sweep_id: int, old: str
                          ) -> tuple[list[ObjectInfo], list[ObjectInfo], list[str]]:
        """The objects under ``old`` that the sweep acts on, described: those its first
        listing found, in the versions found then; the others there now (a directory
        marker with one of those under it stays); and the files of the first listing that
        are gone (a run of this sweep before a power loss carried them).

        That listing is kept in the journal, durably, before the sweep changes anything in
        the store. Run again (a transient error, or a restart after a power loss that rolled
        the journal back to before the sweep was done), the sweep must not take a version
        written under the old prefix since for one the job had there: after the barrier,
        anything new there was written after the rename or removal (another node writing
        into a directory made again under the old name)."""
        listed = [info for info in await self.tier.list(old) if info.key.startswith(old)]
        limit = trio.CapacityLimiter(self.concurrency)
        described: list[ObjectInfo] = []

        async def one(info: ObjectInfo) -> None:
            async with limit:
                found = await self._described(info)
            if found is not None:
                described.append(found)

        async with trio.open_nursery() as nursery:
            for info in listed:
                nursery.start_soon(one, info)
        described.sort(key=lambda i: i.key)
        plan = self.journal.sweep_plan(sweep_id)
        if plan is None:
            self.journal.set_sweep_plan(sweep_id, {i.key: _signature(i) for i in described})
            await self.journal.make_durable_async()
            return described, [], []
        planned = [i for i in described if plan.get(i.key) == _signature(i)]
        there = {i.key: _signature(i) for i in described}
        # Gone from its key, or another file there now (written after the rename, under the
        # name made again): carried by the earlier run either way.
        return (planned, [i for i in described if plan.get(i.key) != _signature(i)],
                sorted(k for k, sig in plan.items()
                       if there.get(k) != sig and not k.endswith("/")))

    def _moved_before(self, key: str, target: str, mark: int) -> None:
        """A file of the first listing gone from the old prefix (or replaced there by a file
        written since): an earlier run of this sweep copied it to ``target`` and deleted it
        (the journal rolled back past that run). The rows of this node still naming ``key``
        take ``target``, as the first run had them do (``_follow``); the listing of the new
        name takes whatever is there."""
        for row in self._holder_rows(key):
            if _changed_here(row, mark):
                continue  # its own upload carries it
            row.remote_key = target
            self.ns.persist(row)
            self._continue(row.ino)

    async def _sweep_files(self, infos: list[ObjectInfo], old: str, new: str, mark: int
                           ) -> list[tuple[ObjectInfo, str | None]]:
        """Copy ``infos`` (under ``old``) to ``new``, ``concurrency`` at a time; the versions
        to delete, with where each went (None: not copied, a newer one is there)."""
        out: list[tuple[ObjectInfo, str | None]] = []
        limit = trio.CapacityLimiter(self.concurrency)

        async def one(listed: ObjectInfo) -> None:
            async with limit:
                info = await self._described(listed)
                if info is None:
                    return  # gone meanwhile
                if self._held(info.key, mark):
                    # A row changed here since carries the key: its upload retires its own
                    # version there, and only that one (pinned).
                    if self._held_over(info, mark):
                        await self.peers.delete(info.key, stamp=info.meta.stamp,
                                                etag=info.etag)
                    return
                target = new + info.key[len(old):]
                if self._lives_elsewhere(info.key, target):
                    return  # renamed before the directory: its own move carries it
                if self._replaced_here(info.key, target):
                    out.append((info, None))  # not the job's file at that name any more
                    return
                newer = await self._put_there_since(info, target)
                if newer is not None:
                    # The file's version at its new name: the rows holding the old one take
                    # it, and the old one goes, as the job replaced it.
                    self._follow(dataclasses.replace(newer, key=info.key), target)
                    out.append((info, None))
                    return
                copied = await self._sweep_file(info, target, mark)
                if copied:
                    self._follow(info, target)
                out.append((info, target if copied else None))

        async with trio.open_nursery() as nursery:
            for info in infos:
                nursery.start_soon(one, info)
        return out

    async def _put_there_since(self, info: ObjectInfo, target: str) -> ObjectInfo | None:
        """Another node's version of the file at ``target``, the new name of ``info``'s, if
        the store holds one (None if it holds nothing, this node's, or ``info``'s own). After
        the barrier a node writes a file under the new name only after the rename: a file
        written there since, or one it closed under the old name before and uploaded late to
        where the rename took it (its hold forgotten after a power loss, its rewrite of a
        file this node wrote). Either is the job's later version of that name: copied over
        it, the old one would stand there for good. (A HEAD, then the copy: a put landing
        between the two is still overwritten; ``Tier.copy`` has no condition on its target.)"""
        try:
            there = await self.tier.head(target)
        except ObjectMissing:
            return None
        stamp = there.meta.stamp
        if stamp is None or stamp == info.meta.stamp or not self.peers.foreign(stamp) or \
                there.meta.kind is not Kind.FILE:
            return None
        return there

    def _holder_rows(self, key: str) -> list[Row]:
        """The live rows of this node whose committed copy is at ``key``."""
        rows = []
        for ino in self.journal.holders_of(key):
            try:
                rows.append(self.ns.get(ino))
            except NotFound:
                continue
        return rows

    def _held(self, key: str, mark: int) -> bool:
        """Whether a row of this node holds ``key`` and changed here since the sweep's mark
        (a new version on its way, or written here since the rename): the key is its
        business."""
        for row in self._holder_rows(key):
            if _changed_here(row, mark):
                return True
        return False

    def _held_over(self, info: ObjectInfo, mark: int) -> bool:
        """Whether ``info``, at a key rows of this node hold, is another node's version that
        none of them holds, and each of them was written again here after the rename (its
        version above the sweep's ``mark``): a rewrite that node closed before the rename and
        uploaded under the old name. The job replaced it, and the rows' retirement of their
        old copy, pinned to their own version, would leave it there for good. Not if one came
        back incomplete after a power loss: the listing may take that version for it."""
        stamp = info.meta.stamp
        if stamp is None or not self.peers.foreign(stamp):
            return False
        rows = self._holder_rows(info.key)
        return bool(rows) and all(
            not row.incomplete and row.version > mark and not _same_version(row, info)
            for row in rows)

    def _lives_elsewhere(self, key: str, target: str) -> bool:
        """Whether a row of this node holding ``key`` has another path than ``target`` now:
        renamed (within the directory or out of it) before the directory was, its move
        still waiting for this sweep. That move carries the version from ``key`` to where
        the file is (the sweep leaves the key, which the row holds); a copy to ``target``
        would put the file under a name it no longer has, over whatever the job closed there
        since."""
        for row in self._holder_rows(key):
            path = self.journal.path_of(row.ino)
            if path is not None and os.fsdecode(path) != target:
                return True
        return False

    def _replaced_here(self, key: str, target: str) -> bool:
        """Whether the file this node has at ``target`` is another than the version at
        ``key``, on its way there by its own move or upload: a file renamed over that name
        before the directory was (``mv step.tmp/a step.tmp/.metadata; mv step.tmp step``),
        its move still waiting for this sweep, or one written at the new name since. The
        version at ``key`` is then one the job replaced: copied to ``target``, it would
        stand there, a commit marker with bytes never closed under that name, until the
        move overwrote it. A file that came back incomplete after a power loss, or one
        without a copy of its own, is not taken for another: the listing decides it."""
        row = self.ns.entry_at(target)
        if row is None or not stat.S_ISREG(row.mode) or row.incomplete:
            return False
        if key in (row.remote_key, row.uploading_key):
            return False  # the file itself (``_follow`` carries it)
        return row.remote_key is not None or \
            row.state in (State.OPEN, State.STAGED, State.UPLOADING)

    def _follow(self, info: ObjectInfo, target: str) -> None:
        """The rows holding ``info.key`` take ``target``, where it was copied, and its
        version if it is not theirs (another node rewrote the file before the rename)."""
        for row in self._holder_rows(info.key):
            same = _same_version(row, info)
            self.journal.note_committed(row.ino)
            with self.journal.transaction():
                row.remote_key = target
                self.ns.persist(row)
                if not same:
                    there = dataclasses.replace(info, key=target)
                    if self.lister is None or not self.lister.take(row, there):
                        row.remote_key = info.key
                        self.ns.persist(row)
                        raise NotEmptyYet(f"{info.key}: a newer version for a busy row")
            self._continue(row.ino)  # at its path now, or moves on from the new key

    async def _described(self, info: ObjectInfo) -> ObjectInfo | None:
        """``info`` with its metadata (an S3 listing has key, size and tag only)."""
        if info.meta_known:
            return info
        try:
            return await self.tier.head(info.key)
        except ObjectMissing:
            return None

    async def _sweep_directory(self, info: ObjectInfo, target: str) -> None:
        """A directory marker under a renamed directory: one at the new key."""
        try:
            await self.tier.head(target)
        except ObjectMissing:
            try:
                meta = (await self.tier.head(info.key)).meta
            except ObjectMissing:
                return
            await self.tier.put_entry(target, meta)

    async def _sweep_file(self, info: ObjectInfo, target: str, mark: int) -> bool:
        """Copy the version ``info`` under a renamed directory to ``target``, unless this node
        holds something newer there (see ``_sweep``); whether it is there now."""
        holder = self.journal.holder_of(target)
        if holder is not None:
            try:
                row = self.ns.get(holder)
            except NotFound:
                pass
            else:
                if _changed_here(row, mark):
                    return False  # written or changed here after the rename: it wins
                if row.stamp is not None and row.stamp == info.meta.stamp:
                    return True  # this very version is there already
        if self.keys.busy_around((target,)):
            return False  # this node writes the new key right now: its version is newer
        claim = ("sweep", target)
        self.keys.claim(claim, (target,))
        try:
            # Pinned to the version described: rewritten since, the sweep runs again.
            await self.tier.copy(info.key, target, if_etag=info.etag)
        except (ObjectMissing, PreconditionFailed):
            raise NotEmptyYet(f"{info.key} changed while it was swept: again") from None
        finally:
            self.keys.release(claim)
        self.stats.moved += 1
        if holder is not None:
            try:
                row = self.ns.get(holder)
            except NotFound:
                return True
            there = dataclasses.replace(info, key=target)
            if not _same_version(row, info) and (
                    self.lister is None or not self.lister.take(row, there)):
                raise NotEmptyYet(f"{target}: holds an older version here, busy now")
        return True

    def _is_marker_key(self, key: str) -> bool:
        return is_marker(key.rstrip("/").rsplit("/", 1)[-1], self.markers)

    async def _still_there(self, ino: int, key: str, stamp: str | None = None,
                           etag: str | None = None) -> Row | None:
        """After a put to ``key`` (of the version ``stamp``/``etag``, if a file's): the
        entry's row, or None if it was removed meanwhile. Then what we just wrote must go
        (the tombstone of its path may already have run, and a listing would bring the entry
        back), unless a live entry has been committed at ``key`` since (a new file at the
        same path)."""
        try:
            row = self.ns.get(ino)
        except NotFound:
            row = None
        if row is not None and self.journal.path_of(ino) is not None:
            return row
        # Through the journal, so that a failed deletion is retried (and a listing meanwhile
        # skips the key); the tombstone leaves a key a live entry holds by then. A key a
        # local-only unlink hid stays: the store copy is kept for retention.
        if not self.keys.keep_unowned(key):
            self._retire(key, stamp, etag)
        return None

    def _retire(self, key: str, stamp: str | None = None, etag: str | None = None,
                moved_to: str | None = None) -> None:
        """An old copy at ``key`` is no longer needed: a tombstone, in the caller's transaction
        (journal first: a crash before the deletion redoes it), pinned to the version
        ``stamp``/``etag`` when known (and naming where it was moved, for its writer)."""
        tomb_id = self.journal.add_tombstone(key, stamp, etag, moved_to)
        self.tombstone_added(tomb_id, key)

    @staticmethod
    def _entry_meta(row: Row) -> ObjectMeta:
        if stat.S_ISDIR(row.mode):
            return ObjectMeta(Kind.DIRECTORY, stat.S_IMODE(row.mode), row.mtime_ns, row.uid,
                              row.gid)
        if stat.S_ISLNK(row.mode):
            return ObjectMeta(Kind.SYMLINK, stat.S_IMODE(row.mode), row.mtime_ns, row.uid,
                              row.gid, target=os.fsdecode(row.target or b""))
        # A FIFO, socket or device node: the whole st_mode (its type) and the device number.
        # Nothing else: it has no data, and a FIFO's bytes live in the kernel of this node.
        return ObjectMeta(Kind.SPECIAL, row.mode, row.mtime_ns, row.uid, row.gid,
                          rdev=row.rdev)

    @staticmethod
    def _same_entry(a: ObjectMeta, b: ObjectMeta) -> bool:
        # A special file's mtime counts too (a touch of a FIFO must reach the store); not a
        # directory's, which every entry made in it moves (see _put_entry).
        mtime_moved = a.kind is Kind.SPECIAL and a.mtime_ns != b.mtime_ns
        return not mtime_moved and (a.kind, a.mode, a.uid, a.gid, a.target, a.rdev) == \
            (b.kind, b.mode, b.uid, b.gid, b.target, b.rdev)

    async def _put_entry(self, row: Row, key: str) -> None:
        """Represent a directory, symlink or special file at ``key`` (its path).

        A special file (FIFO, socket, device node) takes exactly the symlink's path through
        here and through keys.py (``is_move`` is for regular files only): it has no data, so
        its entry is simply put again at the new key and the old key retired. Interleavings:

        - crash after ``mknod`` committed its row (STAGED), before any put: replay queues
          every STAGED row, so the put happens at the next start; the store lacked the
          entry meanwhile, which is all another node could observe;
        - crash after the put, before COMMITTED was journaled: the row is still STAGED with
          ``uploading_key`` set; the put is repeated (idempotent: the same marker again);
        - rename before the put: the put goes to the new path (the path is read when the
          item runs) and nothing is at the old key;
        - rename while the put is on its way: ``uploading_key`` keeps listings from taking
          the object at the old key for a new entry; afterwards the path differs from ``key``,
          so the entry is queued again, put at the new key, and the old key retired;
        - rename after the put (COMMITTED): ``remote_key`` differs from the new path, the
          entry is put at the new key and the old key retired in one journal transaction;
        - unlink at any point: a tombstone for ``remote_key``, and ``_still_there`` retires
          a key put for an entry removed meanwhile.
        """
        is_dir = stat.S_ISDIR(row.mode)
        target_key = key + "/" if is_dir else key
        if row.state is State.COMMITTED and row.remote_key == target_key:
            return
        if is_dir and row.ino in self._forgotten_uploads and self.lister is not None:
            # After a power loss: another node may have removed or moved the directory since
            # this node put its marker (listing.py ``removed_dir_forgotten``).
            if await self.lister.removed_dir_forgotten(row, target_key):
                self._forgotten_uploads.discard(row.ino)
                return
            self._forgotten_uploads.discard(row.ino)  # decided once
            try:
                row = self.ns.get(row.ino)  # as it is now (its entries were listed)
            except NotFound:
                return
        await self._supersede(target_key)
        meta = self._entry_meta(row)
        if is_dir:
            # Whose marker it is: a node that removes or moves it tells its writer (peers.py).
            meta = dataclasses.replace(meta, stamp=self.peers.stamp(row.version))
        # Claimed while the put is on its way: should the entry be renamed meanwhile, a
        # listing must not take the object for a new entry at the old name.
        row.uploading_key = target_key
        self.ns.persist(row)
        await self.tier.put_entry(target_key, meta)
        live = await self._still_there(row.ino, target_key)
        if live is None:
            return
        row = live
        old_key, old_stamp = row.remote_key, row.stamp
        row.remote_key = target_key
        row.uploading_key = None
        if is_dir:
            row.stamp = meta.stamp
        # A chmod/chown while it was being put leaves it STAGED: it is put once more. Not a
        # directory's mtime, which every entry created in it changes (a directory's mtime in
        # the store is the one of its last put).
        row.state = State.COMMITTED if self._same_entry(self._entry_meta(row), meta) \
            else State.STAGED
        row.tiers = self.tier.name
        row.committed_at = time.time()
        self.journal.note_committed(row.ino)
        with self.journal.transaction():
            self.ns.persist(row)
            if old_key and old_key != target_key:
                # Deleted once its old children are (retried until it is empty); a
                # directory's writer is told where it went.
                self._retire(old_key, old_stamp if is_dir else None,
                             moved_to=target_key if is_dir else None)
        if row.state is State.STAGED or os.fsdecode(self.journal.path_of(row.ino) or b"") != key:
            self._continue(row.ino)  # changed or renamed while being put: put it again
