"""The filesystem core: what every operation means (docs/SEMANTICS.md), with no pyfuse3 in sight.

``Filesystem`` is a plain object driven by the FUSE adapter and, directly, by the unit tests.
It owns the file handles and decides state transitions; the namespace keeps the tree, the
staging directory keeps the bytes, the journal keeps the truth.

Invariants:
- write() and close() do no network I/O: bytes go to the staging file, state to the journal.
- A file open for writing is in state OPEN; it becomes STAGED (ready for upload) only when its
  last writable handle is released. Opening for write again starts a new ``version``.
- Metadata a caller could observe after an operation returns is committed to the journal
  before it returns; size/mtime from write() are persisted at flush/fsync/release.
- fsync() makes data and journal durable on local disk (a real fsync of both).
- A COMMITTED row has its whole data file while the daemon runs; only a power loss in the
  middle of an eviction can break that (``_mark_evicted``), and ``start`` repairs it (the
  row becomes REMOTE: its committed copy is in the store).
- Nothing on the trio thread waits for an unlink of data or a journal fsync for eviction:
  they run in worker threads (``evict_async``, big removed files in ``_drop_data``), and
  their space counts as used until they returned.
- Raises domain exceptions (errors.py) or OSError from the staging filesystem, never an errno.
- Hard links (namespace.py, docs/DESIGN.md "Hard links"): handles, writers and the staging
  file are the head's (the kernel row). Every change of the bytes or the metadata is made to
  every name row of the file at once (``_names``): each name's object is uploaded again,
  never one name with bytes of a version another is still writing. The bytes leave NVMe only
  when every name's object holds them (``evictable``), so an alias to upload always finds
  them here.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from ckptfs.cluster.noderun import boot_id, page_cache_lost
from ckptfs.cluster.peers import Peers
from ckptfs.engine.fetch import Fetcher
from ckptfs.engine.keys import KeyClaims
from ckptfs.engine.listing import Lister
from ckptfs.engine.yieldgate import YieldGate
from ckptfs.errors import (
    AlreadyExists,
    BadHandle,
    ChecksumMismatch,
    FileTooLarge,
    InvalidArgument,
    IsADirectory,
    NeedsRestore,
    NoSuchAttribute,
    NotADirectory,
    NotFound,
    NotPermitted,
    ObjectGone,
    StagingFull,
    StoreRefused,
    StoreUnavailable,
    Unsupported,
)
from ckptfs.state.journal import ROOT_INODE, Journal, Row, State
from ckptfs.state.namespace import Namespace
from ckptfs.state.staging import SpaceBudget, Staging
from ckptfs.store.integrity import file_sums
from ckptfs.store.tiers.base import ARCHIVE_CLASSES, ObjectArchived
from ckptfs.store.trust import is_special

if TYPE_CHECKING:
    from ckptfs.store.tiers.base import Tier

log = logging.getLogger(__name__)

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
XATTR_CREATE = 1
XATTR_REPLACE = 2
# Virtual, read-only attributes. Not listed by listxattr so that `cp -a` and rsync -X between
# two ckptfs paths do not try (and fail) to copy them.
XATTR_STATE = b"user.ckptfs.state"
XATTR_TIERS = b"user.ckptfs.tiers"
XATTR_DAEMON = b"user.ckptfs.daemon"
_VIRTUAL_XATTRS = (XATTR_STATE, XATTR_TIERS, XATTR_DAEMON)
_MAX_XATTR_VALUE = 64 * 1024


@dataclass(slots=True)
class Handle:
    ino: int
    fd: int | None
    writable: bool
    # Opened write-only with write_direct_io: the kernel sends writes straight to us.
    direct_io: bool = False
    # Opened for writing by a caller without CAP_FSETID (not root): its writes clear
    # setuid and setgid (_drop_set_id). None: opened by root, or read-only.
    unprivileged_writer: Caller | None = None
    # Sequential-read detection for readahead: where the next read would start, and how far
    # ahead of it blocks are being fetched (doubles while the reader stays sequential).
    next_offset: int = 0
    window: int = 0


@dataclass(slots=True, frozen=True)
class ReadSettings:
    """How the read path talks to the warm tier (Config keys of the same names)."""

    metadata_ttl: float = 10.0
    fetch_block_size: int = 16 * 1024 * 1024
    fetch_concurrency: int = 8
    readahead_bytes: int = 64 * 1024 * 1024
    restore_days: int = 1


@dataclass(slots=True, frozen=True)
class Caller:
    """Who asks: from the FUSE request context (the kernel already checked permissions)."""

    uid: int
    gid: int
    umask: int = 0o022


ROOT_CALLER = Caller(0, 0)


@dataclass(slots=True, frozen=True)
class FsStats:
    block_size: int
    blocks: int
    blocks_free: int
    blocks_avail: int
    files: int
    files_free: int
    name_max: int


class ChangeListener(Protocol):
    """What stage 2 (upload.py) needs to hear from the core. Calls must not block."""

    def inode_changed(self, ino: int) -> None: ...
    def closed(self, inos: list[int]) -> None: ...
    def tree_moved(self, inos: list[int]) -> None: ...
    def sweep_added(self, sweep_id: int) -> None: ...
    def tombstone_added(self, tomb_id: int, key: str) -> None: ...
    def cancel(self, ino: int) -> None: ...
    def last_seq(self) -> int: ...
    async def wait_until_done(self, upto_seq: int) -> None: ...
    async def wait_progress(self) -> None: ...
    def hurry(self) -> None: ...


class _NoListener:
    def inode_changed(self, ino: int) -> None:
        return None

    def closed(self, inos: list[int]) -> None:
        return None

    def sweep_added(self, sweep_id: int) -> None:
        return None

    def tree_moved(self, inos: list[int]) -> None:
        return None

    def tombstone_added(self, tomb_id: int, key: str) -> None:
        return None

    def cancel(self, ino: int) -> None:
        return None

    def last_seq(self) -> int:
        return 0

    async def wait_until_done(self, upto_seq: int) -> None:
        return None

    async def wait_progress(self) -> None:
        await trio.sleep_forever()  # nothing will ever be uploaded, so nothing frees up

    def hurry(self) -> None:
        return None


def state_label(row: Row) -> str:
    """What ``user.ckptfs.state`` says of a file."""
    if row.incomplete:
        return "incomplete"
    if row.state is State.REMOTE and row.storage_class in ARCHIVE_CLASSES:
        return "archived"
    if stat.S_ISDIR(row.mode):
        return "directory"
    if stat.S_ISLNK(row.mode):
        return "symlink"
    if not stat.S_ISREG(row.mode):
        return "special"
    return row.state.value


# A removed file at least this big is unlinked in a worker thread (with a nursery): the
# unlink of a multi-GB file waits on the disk; a small one is quicker than the hand-off.
UNLINK_IN_BACKGROUND = 16 * 1024 * 1024
# At most one "writers wait for space" log line per this many seconds.
STALL_LOG_EVERY = 30.0
# How often a writer waiting for space asks the uploader to retry failed items at once.
HURRY_EVERY = 1.0


class Filesystem:
    """The core. All methods run on the trio thread; none of them blocks on the network."""

    def __init__(
        self, journal: Journal, staging: Staging, *, unlink_remote: bool = True,
        fsync_remote: bool = False, space: SpaceBudget | None = None,
        tier: Tier | None = None, read: ReadSettings = ReadSettings(),
        write_stall_timeout: float = 300.0, write_direct_io: bool = False,
    ) -> None:
        self.journal = journal
        self.listener: ChangeListener = _NoListener()
        self.space = space or SpaceBudget(staging, None, 0.0)
        self.read_settings = read
        self.mountpoint = ""  # for messages that name a path the user can type
        self.write_stall_timeout = write_stall_timeout
        self.write_direct_io = write_direct_io
        self.stall_seconds = 0.0
        self._stall_logged_at = -math.inf
        # Unlinks of data files under way in worker threads (evict_async, big removed
        # files); writers short of space wait for them before they wait for uploads.
        self._frees_in_flight = 0
        # Unparked when a free returns or a file's last handle closes (it may be evicted).
        self._space_freed = trio.lowlevel.ParkingLot()
        # Where big removed files are unlinked in the background (the mount's nursery).
        self.nursery: trio.Nursery | None = None
        self.bytes_written = 0  # through write() since the mount (metrics)
        # unlink = "local-only" leaves remote copies to retention; fsync = "remote" waits for
        # the store (docs/SEMANTICS.md).
        self.unlink_remote = unlink_remote
        self.fsync_remote = fsync_remote
        self.staging = staging
        self.ns = Namespace(journal, on_drop=self._drop_data)
        self._handles: dict[int, Handle] = {}
        self.gate = YieldGate.disabled()  # told of every handle: uploads yield to the job
        self._next_fh = 1
        self._writers: dict[int, int] = {}
        # The read path: without a tier (unit tests of the write path) every file is local.
        # Every claim on a store key (the uploader's, a listing's question) goes through it.
        self.keys = KeyClaims(journal, self.ns)
        self.fetcher: Fetcher | None = None
        self._completing: set[int] = set()  # inodes whose _completed runs in the background
        self.lister: Lister | None = None
        # Versions and records across nodes (peers.py): the composition root names the node.
        self.peers: Peers | None = None
        if tier is not None:
            self.fetcher = Fetcher(
                tier, staging, journal, block_size=read.fetch_block_size,
                concurrency=read.fetch_concurrency, readahead=read.readahead_bytes,
                reserve=self._reserve, give_back=self.space.give_back,
                make_room=self._make_room, other_copies=self._other_copies,
            )
            self.peers = Peers(tier)
            self.lister = Lister(journal, self.ns, tier, ttl=read.metadata_ttl,
                                 is_busy=self._busy, on_drop=self._drop_data,
                                 on_lost=self._upload_again, keys=self.keys,
                                 peers=self.peers,
                                 on_relocated=lambda ino: self.listener.inode_changed(ino))
        self.daemon_info: dict[str, object] = {}

    # -- start ----------------------------------------------------------------------------

    def start(self) -> None:
        """Replay the journal: purge orphans, mark files left open as incomplete, report strays."""
        self.journal.ensure_root(os.getuid(), os.getgid(), stat.S_IFDIR | 0o755)
        self.ns.replay_fixups()
        # Reads every committed local copy: only when the page cache may have been lost.
        rebooted = page_cache_lost(self.staging.root, boot_id())
        with self.journal.transaction():
            for row in self.journal.rows_in_states(State.OPEN):
                if row.closed_at is not None and not row.incomplete:
                    # Closed (flushed by its last writer) just before the crash: staged, unless
                    # its data is not what the close recorded (a power loss took pages).
                    if self.staging.file_size(self._data_ino(row)) == row.size:
                        row.state = State.STAGED
                        self.journal.update(row)
                    else:
                        self._mark_incomplete(row, "its data is not the size its close recorded")
                    continue
                if not row.incomplete:
                    self._mark_incomplete(row, "its writer never closed it")
            for row in self.journal.rows_in_states(State.UPLOADING, State.STAGED):
                actual = self.staging.file_size(self._data_ino(row))
                if actual is None or actual < row.size:
                    # A power loss took its tail: an upload would fail at every attempt.
                    self._mark_incomplete(row, "its data is shorter than its close recorded")
                elif actual > row.size:
                    # Written after its close (a descriptor dup'ed before it, its journal
                    # record not made yet), or a power loss kept a later write and lost the
                    # journal's record of it: not the file that was closed.
                    self._mark_incomplete(row, "its data is longer than its close recorded")
                elif row.state is State.UPLOADING:
                    row.state = State.STAGED
                    self.journal.update(row)
            self._repair_committed(verify=rebooted)
        self.journal.make_durable()  # before _remove_remote_leftovers unlinks anything
        for ino in self.journal.inos_with_ranges():
            ranged = self.journal.get(ino)
            if ranged is None or ranged.state is not State.REMOTE:
                self.journal.set_ranges(ino, [])  # whole and local (or gone): not needed
            elif not self.staging.exists(ino):
                self.journal.set_ranges(ino, [])  # the data file was lost: fetch again
        self._remove_remote_leftovers()
        if trashed := self.staging.empty_trash():
            log.info("removed %d data files an interrupted eviction or removal left in %s",
                     trashed, self.staging.trash_dir)
        for stray in self.staging.stray_files(self.journal.all_inos()):
            log.warning("staging file with no journal entry (kept, not deleted): %s", stray)
        self.space.used = self.journal.local_bytes()

    def _mark_incomplete(self, row: Row, why: str) -> None:
        """Replay found a file that must never be published as it is: incomplete, OPEN (as a
        file whose writer died is), listed by ``status``, kept at what is left of it, until
        it is written again or removed. Caller holds a transaction."""
        actual = self.staging.file_size(self._data_ino(row))
        row.state = State.OPEN
        row.incomplete = True
        row.size = actual if actual is not None else 0
        self.journal.update(row)
        log.warning("incomplete file (%s): %s", why,
                    (self.journal.path_of(row.ino) or b"?").decode(errors="replace"))

    def _repair_committed(self, verify: bool) -> None:
        """A COMMITTED file whose local data is not what was committed is REMOTE.

        An eviction cut short by a crash (a power loss that kept the unlink but not the
        journal's REMOTE, or a journal written by an older ckptfs that unlinked first) leaves
        such a row with a missing or short data file; a power loss can also take pages of a
        file and keep its size (a rewrite whose OPEN row was lost; data a ckptfs older than
        the uploader's fdatasync never synced). Served as it is, it would read as zeros or
        wrong bytes, and be pushed over the good store copy by the next metadata change. Its
        committed copy is in the store, so reads fetch it from there instead.

        ``verify`` (the last run stopped uncleanly and the machine booted since: noderun.py):
        every local copy is checked against its recorded checksum, which reads all of them;
        otherwise only sizes are (the page cache kept every byte, or a clean stop synced it).
        Caller holds a transaction.
        """
        for row in self.journal.rows_in_states(State.COMMITTED):
            if row.link_of is not None:
                continue  # its bytes are the head's, checked as the head's row
            actual = self.staging.file_size(row.ino)
            if actual is not None and actual >= row.size:
                if not verify or not (row.checksum or "").startswith("crc32c:") \
                        or self._holds(row):
                    continue
                what = "its bytes do not match the committed checksum"
            else:
                what = f"{actual} of {row.size} bytes left"
            path = os.fsdecode(self.journal.path_of(row.ino) or b"?")
            if row.remote_key is None:  # nothing to fetch from: never publish it as it is
                log.error("committed file %s lost its local data (%s) and has no store copy",
                          path, what)
                self._mark_incomplete(row, "lost its local data, no store copy")
                continue
            log.warning("committed file %s lost its local data (%s): it will be read from the "
                        "store", path, what)
            row.state = State.REMOTE
            self.journal.update(row)
            # Its data file is no fetched range: _remove_remote_leftovers removes it.
            self.journal.set_ranges(row.ino, [])

    def _holds(self, row: Row) -> bool:
        """Whether the local data file of ``row`` has the bytes of its recorded checksum."""
        try:
            return file_sums(self.staging.path(row.ino), row.size)[0] == row.checksum
        except OSError:
            return False

    def _remove_remote_leftovers(self) -> None:
        """A REMOTE file's data file holds only its journaled fetched ranges. One without any
        is garbage (an eviction that crashed after journaling REMOTE, before the unlink; or
        ranges fetched but never journaled): removed, so it takes no space unaccounted for."""
        ranged = set(self.journal.inos_with_ranges())
        for row in self.journal.rows_in_states(State.REMOTE):
            if row.ino not in ranged and self.staging.exists(row.ino):
                self.staging.unlink(row.ino)

    def _drop_data(self, row: Row) -> None:
        if not stat.S_ISREG(row.mode):
            return
        if row.state is State.REMOTE:
            if self.fetcher is not None:
                self.fetcher.drop(row.ino)  # fetched ranges, if any
            else:
                self.staging.unlink(row.ino)
        elif self.nursery is not None and row.size >= UNLINK_IN_BACKGROUND:
            # A checkpoint rotated away (rmtree of GBs): the unlink waits on the disk for
            # tens of milliseconds a file, in a worker thread; the space comes back after.
            trashed = self.staging.discard(row.ino)
            if trashed is not None:
                self._frees_in_flight += 1
                self.nursery.start_soon(
                    self._freeing, partial(trio.to_thread.run_sync,
                                           self.staging.remove_trashed, [trashed]), row.size)
        elif self.staging.unlink(row.ino):
            # Only if the data was still there: a removed inode is dropped again when its last
            # reference goes (a handle closed, then the kernel's forget), and its space must
            # be given back once (else the staging usage drifts below what the disk holds).
            self.space.give_back(row.size)

    def _upload_again(self, row: Row) -> None:
        """The store lost the committed copy of an entry written here: upload it again."""
        row.remote_key = None
        row.tiers = ""
        if stat.S_ISREG(row.mode):
            self._stage(row)  # this name's object: the others are where they were
        else:
            row.state = State.STAGED
            self.listener.inode_changed(row.ino)
        self.ns.persist(row)

    def _other_copies(self, row: Row) -> list[str]:
        """The keys of the other names of the file ``row`` (a kernel row) whose objects hold
        its bytes (same checksum): where a read goes when its own object is gone."""
        return [name.remote_key for name in self._names(row)
                if name.ino != row.ino and name.remote_key and name.checksum == row.checksum
                and name.state in (State.COMMITTED, State.REMOTE)]

    def _busy(self, ino: int) -> bool:
        ino = self.ns.kernel_ino(ino)
        return bool(self.ns.open_count(ino) or self._writers.get(ino))

    @staticmethod
    def _data_ino(row: Row) -> int:
        """Whose staging file holds the bytes of the name row ``row`` (an alias: its head's)."""
        return row.ino if row.link_of is None else row.link_of

    def _names(self, row: Row) -> list[Row]:
        """Every name row of the kernel row ``row``: itself and its aliases (hard links)."""
        return [row, *self.ns.aliases(row.ino)]

    def is_open(self, ino: int) -> bool:
        """Whether a handle (reading or writing) is open on the file now (retention checks
        it just before a checkpoint leaves NVMe)."""
        return self._busy(ino)

    # -- attributes -----------------------------------------------------------------------

    async def lookup(self, parent: int, name: bytes) -> Row:
        try:
            row = self.ns.lookup(parent, name)
        except NotFound:
            if self.lister is None or name in (b".", b".."):
                raise
            # A miss asks the store (at most once per metadata_ttl: the listing is cached,
            # and so is the absence). Looked up again only if something changed meanwhile
            # (the listing found entries): a create's lookup of its new name asks once.
            changes = self.journal.total_changes
            await self.lister.refresh(self.ns.get(parent))
            if self.journal.total_changes == changes:
                raise
            row = self.ns.lookup(parent, name)
        else:
            if self.lister is not None and row.remote_key is not None and \
                    row.state in (State.REMOTE, State.COMMITTED) and name not in (b".", b".."):
                # A view of a remote object: another node may have replaced or removed it.
                await self.lister.check_entry(self.ns.get(parent), row)
                row = self.ns.lookup(parent, name)
        self.ns.remember(row.ino)
        return row

    def remember(self, ino: int) -> None:
        """The kernel got one more reference to ``ino`` (a readdirplus entry)."""
        self.ns.remember(ino)

    def forget(self, ino: int, count: int) -> None:
        self.ns.forget(ino, count)

    def getattr(self, ino: int) -> Row:
        return self.ns.get(ino)

    async def setattr(
        self, ino: int, *, fh: int | None = None, size: int | None = None,
        mode: int | None = None, uid: int | None = None, gid: int | None = None,
        atime_ns: int | None = None, mtime_ns: int | None = None,
        caller: Caller = ROOT_CALLER,
    ) -> Row:
        row = self.ns.get(ino)
        now = time.time_ns()
        if size is not None and size > row.size and \
                not self.space.could_ever_take(size - row.size):
            # A hole is counted at its apparent size like written bytes (a write into it
            # takes no more room): one larger than the staging disk would only stall for
            # write_stall_timeout and end in ENOSPC.
            raise FileTooLarge(f"{size} bytes: more than the staging directory holds")
        if row.state is State.REMOTE and size == 0:
            await self._discard_remote(row)  # nothing of the old bytes is needed
        elif row.state is State.REMOTE and (size is not None or mode is not None
                                            or uid is not None or gid is not None
                                            or mtime_ns is not None):
            await self._ensure_local(row)  # the new version is built from the old bytes
        if size is not None:
            if stat.S_ISDIR(row.mode):
                raise IsADirectory("cannot truncate a directory")
            if not stat.S_ISREG(row.mode):
                raise InvalidArgument("can only truncate a regular file")
            if size < 0:
                raise InvalidArgument("negative size")
            charged = size - row.size
            await self._reserve(charged)
            row = self.ns.get(ino)  # a write may have moved the size while we waited
            self._modify_data(row)
            self.staging.truncate(ino, size)
            self.space.settle(charged, size - row.size)
            row.size = size
            row.mtime_ns = now
            if not self._writers.get(ino):
                self._mark_staged(row)
        if mode is not None:
            row.mode = stat.S_IFMT(row.mode) | stat.S_IMODE(mode)
        if size is not None:
            self._drop_set_id(row, caller, persist=False)
        if uid is not None or gid is not None:
            self._drop_set_id(row, caller, chown=True, persist=False)
        if uid is not None:
            row.uid = uid
        if gid is not None:
            row.gid = gid
        if atime_ns is not None:
            row.atime_ns = atime_ns
        if mtime_ns is not None:
            row.mtime_ns = mtime_ns
        row.ctime_ns = now
        if (mode, uid, gid, mtime_ns) != (None, None, None, None) and size is None:
            self._metadata_changed(row)
        self.ns.persist(row)
        return row

    def _metadata_changed(self, row: Row) -> None:
        """Mode, owner or mtime changed: the remote copy's metadata must follow."""
        if self._writers.get(row.ino) or row.incomplete or row.state is State.OPEN:
            return  # the close to come uploads it all
        for name in self._names(row):  # each name's object carries the metadata
            if name.state not in (State.COMMITTED, State.UPLOADING):
                continue
            if stat.S_ISREG(name.mode):
                self.listener.cancel(name.ino)
                self._stage(name)
            else:
                name.state = State.STAGED
                self.listener.inode_changed(name.ino)

    def readlink(self, ino: int) -> bytes:
        row = self.ns.get(ino)
        if not stat.S_ISLNK(row.mode) or row.target is None:
            raise InvalidArgument("not a symbolic link")
        return row.target

    # -- namespace ------------------------------------------------------------------------

    def _unhide(self, parent: int, name: bytes) -> None:
        """A new entry at a path hidden by unlink = "local-only": the store may show it again."""
        if not self.unlink_remote:
            base = self.journal.path_of(parent)
            if base is not None:
                key = os.fsdecode(base + b"/" + name if base else name)
                self.journal.unhide(key)
                self.journal.unhide(key + "/")

    def mkdir(self, parent: int, name: bytes, mode: int, caller: Caller) -> Row:
        self._unhide(parent, name)
        row = self.ns.create(
            parent, name, stat.S_IFDIR | stat.S_IMODE(mode), caller.uid, caller.gid,
            state=State.STAGED,
        )
        self.ns.remember(row.ino)
        if self.lister is not None:
            self.lister.created(row.ino)
        self.listener.inode_changed(row.ino)
        return row

    def mknod(self, parent: int, name: bytes, mode: int, caller: Caller, rdev: int = 0) -> Row:
        """A regular file, or a special file: FIFO, UNIX socket, character or block device.

        A special file is its journal row alone (mode, rdev, owner, times), put in the store
        like a symlink (upload.py ``_put_entry``). It has no staged data and never reaches
        the read or write path: for these types the kernel serves open() itself (a FIFO's
        pipe lives in this node's kernel; a device node is refused, the mount is nodev), so
        the daemon sees only metadata operations on it.
        """
        kind = stat.S_IFMT(mode)
        if kind not in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            raise InvalidArgument("mknod makes files, FIFOs, sockets and device nodes only")
        self._unhide(parent, name)
        if kind != stat.S_IFREG:
            # rdev means something only for devices (mknod(2) ignores it otherwise).
            row = self.ns.create(parent, name, mode, caller.uid, caller.gid,
                                 state=State.STAGED,
                                 rdev=rdev if kind in (stat.S_IFCHR, stat.S_IFBLK) else 0)
            self.ns.remember(row.ino)
            self.listener.inode_changed(row.ino)
            return row
        row = self.ns.create(parent, name, mode, caller.uid, caller.gid, state=State.STAGED)
        self.staging.create_empty(row.ino)
        self.ns.remember(row.ino)
        self.listener.inode_changed(row.ino)
        return row

    def symlink(self, parent: int, name: bytes, target: bytes, caller: Caller) -> Row:
        self._unhide(parent, name)
        row = self.ns.create(
            parent, name, stat.S_IFLNK | 0o777, caller.uid, caller.gid, state=State.STAGED,
            target=target,
        )
        self.ns.remember(row.ino)
        self.listener.inode_changed(row.ino)
        return row

    async def link(self, ino: int, parent: int, name: bytes) -> Row:
        """A new name for a regular or special file (docs/HARD_LINKS.md): an alias row, put
        in the store as an entry of its own. A regular file known only from the store is
        fetched first: the new name's object is put from the local bytes, as every upload
        is; a special file has no bytes (its entry is put again at each name, as a rename
        of it does: upload.py ``_put_entry``)."""
        row = self.ns.get(ino)
        if not stat.S_ISREG(row.mode) and not is_special(row.mode):
            raise NotPermitted("hard links of directories and symlinks")
        if row.parent is None:
            raise NotFound(f"inode {ino} has no name left")
        if stat.S_ISREG(row.mode):
            await self._ensure_local(row)
            row = self.ns.get(ino)
            if row.state is State.REMOTE:
                raise StoreUnavailable(f"inode {ino}: its bytes could not be made local")
        self._unhide(parent, name)
        alias = self.ns.link(row, parent, name)
        if alias.state is State.STAGED:
            self.listener.inode_changed(alias.ino)
        self.ns.remember(row.ino)
        return row

    async def unlink(self, parent: int, name: bytes) -> None:
        await self._remove(parent, name, directory=False)

    async def rmdir(self, parent: int, name: bytes, *, sweep: bool = True) -> None:
        """``sweep``: files other nodes closed into the directory before now but had not
        committed when it was listed go too, once every node has committed them (a rank-0
        ``rm -r`` of a checkpoint: upload.py ``_sweep``). Retention, which deletes only the
        versions it planned on, passes False."""
        await self._remove(parent, name, directory=True, sweep=sweep)

    async def _remove(self, parent: int, name: bytes, *, directory: bool,
                      sweep: bool = False) -> None:
        row = self.ns.lookup(parent, name)
        if directory and self.lister is not None and stat.S_ISDIR(row.mode):
            # ENOTEMPTY if the store has entries in it: wait for the listing, however long;
            # a directory the store knows cannot be judged empty while the store is down.
            if not await self.lister.refresh(row, wait=math.inf, current=True) \
                    and row.remote_key:
                raise StoreUnavailable(f"cannot list {row.remote_key} to see that it is empty")
            row = self.ns.lookup(parent, name)
        name_row = self.ns.entry(parent, name)
        if self.ns.is_linked(name_row):
            if directory:
                raise NotADirectory(name.decode(errors="replace"))
            with self.journal.transaction():
                notify = self._drop_name(name_row)
            notify()
            return
        keys = self._remote_keys(row)
        path = self.journal.path_of(row.ino) if directory and sweep and self.unlink_remote \
            and self.lister is not None else None
        sweep_id = None
        with self.journal.transaction():
            self.ns.unlink(parent, name, directory=directory)
            tombs = [(self._tombstone(k, row), k) for k in keys]
            if path:
                sweep_id = self.journal.add_sweep(os.fsdecode(path) + "/", None)
            if not self.unlink_remote:
                # Kept remotely for retention, not shown: the committed copy, and the one an
                # upload or move on its way (it cannot be called back) is writing.
                for key in {row.remote_key, row.uploading_key} - {None}:
                    assert key is not None
                    self.journal.hide(key)
        self._forget_remote(row, tombs)
        if sweep_id is not None:
            self.listener.sweep_added(sweep_id)

    def _tombstone(self, key: str, row: Row) -> int:
        """A tombstone of ``key``, pinned to ``row``'s committed version if that is what the
        key holds (peers.py: a deletion applies to the version this node knew)."""
        if key == row.remote_key and stat.S_ISREG(row.mode):
            return self.journal.add_tombstone(key, row.stamp, row.remote_etag)
        return self.journal.add_tombstone(key)

    def _remote_keys(self, row: Row) -> list[str]:
        """Keys on the warm tier that hold (or may soon hold) ``row``: deleted with it."""
        if not self.unlink_remote:
            return []
        keys = {row.remote_key} if row.remote_key else set()
        if row.uploading_key:  # an upload or a move on its way
            keys.add(row.uploading_key)
        path = self.journal.path_of(row.ino)
        if path:
            # Whatever the store holds at this path goes too, even if this entry never got
            # there: a file it replaced by rename, whose object it was to overwrite, or its
            # own directory marker or symlink being put right now (the deletion waits for
            # work on the same key, and skips a key a live entry has committed to since).
            keys.add(os.fsdecode(path) + ("/" if stat.S_ISDIR(row.mode) else ""))
        return sorted(keys)

    def _drop_name(self, name: Row, keep: str | None = None) -> Callable[[], None]:
        """Remove the name row ``name`` of a file with several names, in the caller's
        transaction; returns what to tell the uploader once it is committed.

        An alias: its keys are tombstoned (but ``keep``, the key a rename over it is about
        to write). The head's own name: the head takes the name of its first alias
        (namespace.py ``succession``). If it adopts that alias's object, the head's old keys
        are tombstoned and nothing is copied; otherwise the head is carried to the alias's
        key as a renamed file is (a move, or an upload of the local copy: a remote head has
        every alias committed, so it adopts unless the alias's own move is still to come),
        the alias's key is not tombstoned: the head's copy overwrites it.
        """
        succession = self.ns.succession(name)
        keys = set(self._remote_keys(name))
        if succession is not None and not succession[1]:
            # Tombstones of keys the head still holds are harmless: a deletion skips a key
            # with an owner (keys.py), and the head's move retires its old key itself.
            heir_path = self.journal.path_of(succession[0].ino)
            keys |= set(self._remote_keys(succession[0]))
            keys.discard(os.fsdecode(heir_path or b""))
        hidden = set() if self.unlink_remote else {name.remote_key, name.uploading_key} - {None}
        self.ns.remove_name(name)
        tombs = [(self._tombstone(k, name), k) for k in sorted(keys) if k != keep]
        for key in hidden:
            assert key is not None
            self.journal.hide(key)

        def notify() -> None:
            if succession is None:
                self.listener.cancel(name.ino)
            else:
                self.listener.cancel(succession[0].ino)
                if not succession[1]:
                    self.listener.inode_changed(name.ino)  # to its new key
            for tomb_id, key in tombs:
                self.listener.tombstone_added(tomb_id, key)
        return notify

    def _forget_remote(self, row: Row, tombs: list[tuple[int, str]]) -> None:
        self.listener.cancel(row.ino)
        for tomb_id, key in tombs:
            self.listener.tombstone_added(tomb_id, key)

    async def rename(
        self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int = 0
    ) -> None:
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == (
            RENAME_NOREPLACE | RENAME_EXCHANGE
        ):
            raise InvalidArgument(f"rename flags {flags:#x}")
        src = self.ns.lookup(old_parent, old_name)  # ENOENT before anything changes
        try:
            dst: Row | None = self.ns.lookup(new_parent, new_name)
        except NotFound:
            dst = None
        if self.lister is not None:
            # A directory moves with every descendant, other nodes' files in it included
            # (a tmp-dir commit: every node wrote its shard into step_1.tmp): the journal
            # must know them all first, as the store holds them now, not as a listing
            # within the ttl saw them (nor only if this node's marker of it is in the store
            # already). A directory about to be replaced must really be empty.
            if stat.S_ISDIR(src.mode) and not await self.lister.refresh_tree(
                    src, current=True) and src.remote_key is not None:
                raise StoreUnavailable(f"cannot list {src.remote_key} to move all of it")
            if dst is not None and stat.S_ISDIR(dst.mode) and not await (
                    self.lister.refresh_tree(dst, current=True) if flags & RENAME_EXCHANGE
                    else self.lister.refresh(dst, wait=math.inf, current=True)) \
                    and dst.remote_key:
                raise StoreUnavailable(f"cannot list {dst.remote_key} to see that it is empty")
            if flags & RENAME_EXCHANGE:
                # Two remote copies cannot trade places one move after the other: both are
                # made local first and uploaded again (below).
                for each in (src, dst):
                    if each is not None and each.state is State.REMOTE:
                        await self._ensure_local(each)
            self.ns.lookup(old_parent, old_name)
            try:
                dst = self.ns.lookup(new_parent, new_name)
            except NotFound:
                dst = None
        self._unhide(new_parent, new_name)
        exchange = bool(flags & RENAME_EXCHANGE)
        dst_name = self._entry_or_none(new_parent, new_name)
        src_name = self.ns.entry(old_parent, old_name)
        linked_dst = dst_name is not None and not exchange and self.ns.is_linked(dst_name) \
            and self.ns.kernel(dst_name).ino != self.ns.kernel(src_name).ino
        if linked_dst:
            # Only a name goes (_drop_name), before the move: check first what would refuse
            # the move, so that nothing is removed for a rename that fails.
            if flags & RENAME_NOREPLACE:
                raise AlreadyExists(new_name.decode(errors="replace"))
            if stat.S_ISDIR(src.mode):
                raise NotADirectory(new_name.decode(errors="replace"))
            dst = None
        replaced_keys = self._remote_keys(dst) if dst is not None and not exchange else []
        overwritten = None
        if dst is not None and not exchange:
            # The moved file goes to exactly that key and overwrites it there: deleting it
            # first would leave the store without it in between (`latest.tmp` -> `latest`).
            dst_path = self.journal.path_of(dst.ino)
            replaced_keys = [k for k in replaced_keys
                             if not dst_path or k.rstrip("/") != os.fsdecode(dst_path)]
            overwritten = os.fsdecode(dst_path) if dst_path else None
        old_path = self.journal.path_of(src.ino) if stat.S_ISDIR(src.mode) else None
        # Directories that move: their old keys may have to go (keys.py, rule 6).
        dirs_before = self.keys.directory_keys(
            r for r in (src, dst if exchange else None)
            if r is not None and stat.S_ISDIR(r.mode))
        sweep = None
        dropped: Callable[[], None] | None = None
        with self.journal.transaction():
            if linked_dst:
                assert dst_name is not None
                target = self.journal.path_of(dst_name.ino)
                dropped = self._drop_name(dst_name, keep=os.fsdecode(target or b""))
            moved, replaced = self.ns.rename(
                old_parent, old_name, new_parent, new_name,
                noreplace=bool(flags & RENAME_NOREPLACE), exchange=exchange,
            )
            tombs = [(self._tombstone(k, replaced), k) for k in replaced_keys] if replaced \
                else []
            if replaced is not None and overwritten is not None and self.peers is not None \
                    and replaced.remote_key == overwritten and self.peers.foreign(replaced.stamp):
                # The moved file overwrites the replaced one's object at its key: another
                # node that wrote that version is told it is gone (a tombstone that deletes
                # nothing, peers.py), else it would find it missing and upload it again.
                tombs.append((self.journal.add_tombstone(
                    overwritten, replaced.stamp, replaced.remote_etag, keep=True), overwritten))
            left = [(self.journal.add_tombstone(k), k) for k in self.keys.left_behind(dirs_before)]
            new_path = self.journal.path_of(moved.ino)
            if old_path and new_path and not exchange:
                # Other nodes may still be uploading files they closed into the directory
                # before this rename (a tmp-dir commit right after the job's barrier): they
                # are moved after every node has committed them (upload.py ``_sweep``).
                sweep = self.journal.add_sweep(os.fsdecode(old_path) + "/",
                                               os.fsdecode(new_path) + "/")
        if dropped is not None:
            dropped()
        for tomb_id, key in left:
            self.listener.tombstone_added(tomb_id, key)
        if sweep is not None:
            self.listener.sweep_added(sweep)  # numbered before the tree's markers
        if replaced is not None and not exchange:
            self._forget_remote(replaced, tombs)
        for row in (moved, replaced) if exchange else (moved,):
            if row is None:
                continue
            if exchange and stat.S_ISREG(row.mode) and row.state is State.COMMITTED:
                # Two remote copies trading places cannot be moved one after the other:
                # upload both again from their local copies.
                self._mark_staged(row)
                self.ns.persist(row)
            elif stat.S_ISDIR(row.mode):
                self.listener.tree_moved(self.journal.descendants(row.ino) + [row.ino])
            else:
                self.listener.inode_changed(row.ino)

    def _entry_or_none(self, parent: int, name: bytes) -> Row | None:
        try:
            return self.ns.entry(parent, name)
        except NotFound:
            return None

    async def readdir(self, ino: int, after: int) -> Iterator[Row]:
        """Entries after the cursor ``after`` (0 = start); each row's ino is the next cursor."""
        row = self.ns.get(ino)
        if after == 0 and self.lister is not None:
            await self.lister.refresh(row)
        return self.ns.children(ino, after)

    # -- files ----------------------------------------------------------------------------

    async def open(self, ino: int, flags: int, caller: Caller = ROOT_CALLER) -> int:
        row = self.ns.get(ino)
        if stat.S_ISDIR(row.mode):
            raise IsADirectory("cannot open a directory as a file")
        if not stat.S_ISREG(row.mode):
            raise InvalidArgument("not a regular file")
        writable = (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
        # Linux truncates on O_TRUNC even for O_RDONLY (the kernel checked write permission),
        # and with atomic_o_trunc the kernel leaves that truncation to us.
        truncate = bool(flags & os.O_TRUNC)
        if row.state is State.REMOTE:
            if truncate:
                await self._discard_remote(row)
            elif writable:
                await self._ensure_local(row)  # the new version is built from the old bytes
            else:
                await self._check_archived(row)
                assert self.fetcher is not None
                self.fetcher.prepare(row)  # sparse: ranges are fetched as they are read
            row = self.ns.get(ino)
        if truncate:
            self.space.give_back(row.size)
        if writable:
            self._begin_write(row)
        elif truncate:
            self._modify_data(row)
        fd = self.staging.acquire(ino)
        if truncate:
            self._drop_set_id(row, caller, persist=False)
            os.ftruncate(fd, 0)
            row.size = 0
            row.mtime_ns = row.ctime_ns = time.time_ns()
            if not self._writers.get(ino):
                self._mark_staged(row)
            self.ns.persist(row)
        return self._new_handle(row, fd, writable, flags, caller)

    def create(
        self, parent: int, name: bytes, mode: int, flags: int, caller: Caller
    ) -> tuple[int, Row]:
        writable = (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
        self._unhide(parent, name)
        row = self.ns.create(
            parent, name, stat.S_IFREG | stat.S_IMODE(mode), caller.uid, caller.gid,
            state=State.OPEN if writable else State.STAGED,
        )
        fd = self.staging.acquire_new(row.ino)
        self.ns.remember(row.ino)
        if writable:
            self._writers[row.ino] = 1
        else:
            self.listener.inode_changed(row.ino)  # created empty and closed: upload it
        return self._new_handle(row, fd, writable, flags, caller), row

    def _new_handle(self, row: Row, fd: int, writable: bool, flags: int,
                    caller: Caller) -> int:
        fh = self._next_fh
        self._next_fh += 1
        # Only write-only opens: such a descriptor cannot be mmapped (which direct I/O would
        # refuse) and is not read through, so the cache gives it nothing. The kernel drops
        # cached pages that a direct write overwrites, so readers on other descriptors stay
        # coherent (tests/test_write_direct_io.py).
        direct = self.write_direct_io and (flags & os.O_ACCMODE) == os.O_WRONLY
        self._handles[fh] = Handle(row.ino, fd, writable, direct,
                                   caller if writable and caller.uid != 0 else None)
        self.ns.pin(row.ino)
        self.gate.opened()
        return fh

    def direct_io(self, fh: int) -> bool:
        """Whether the kernel should bypass its page cache for this handle."""
        return self._handle(fh).direct_io

    def _handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise BadHandle(f"file handle {fh}") from None

    def _begin_write(self, row: Row) -> None:
        """A writable open: a new version begins (the file is OPEN until its last writer closes)."""
        count = self._writers.get(row.ino, 0)
        self._writers[row.ino] = count + 1
        if count == 0:
            self._modify_data(row)
            for name in self._names(row):
                name.state = State.OPEN
                name.incomplete = False
                name.closed_at = None
            self.ns.persist(row)

    def _end_write(self, row: Row) -> None:
        left = self._writers[row.ino] - 1
        if left:
            self._writers[row.ino] = left
            return
        del self._writers[row.ino]
        # Closed when its last writer's close(2) returned (``flush``: the journal holds it
        # staged since), unless a write came after that close.
        self._mark_staged(row, closed_at=row.closed_at)
        self.ns.persist(row)

    def _modify_data(self, row: Row) -> None:
        """The bytes are about to change: a new version, no longer committed anywhere (under
        any of its names)."""
        if self.fetcher is not None:
            self.fetcher.forget(row.ino)  # no fetch of the old version may land in it
        version = self.journal.next_version()
        for name in self._names(row):
            self.listener.cancel(name.ino)
            name.version = version
            name.checksum = None
            name.tiers = ""
            name.committed_at = None

    def _mark_staged(self, row: Row, closed_at: float | None = None) -> None:
        """Closed (at ``closed_at``, else now): every name ready for upload (the caller
        persists the row before its next await)."""
        for name in self._names(row):
            self._stage(name, closed_at)

    def _stage(self, row: Row, closed_at: float | None = None) -> None:
        """One name row ready for upload."""
        row.state = State.STAGED
        row.incomplete = False
        row.closed_at = closed_at if closed_at is not None else time.time()
        self.listener.inode_changed(row.ino)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._handle(fh)
        assert handle.fd is not None
        for _ in range(4):
            row = self.ns.get(handle.ino)
            wanted = max(0, min(size, row.size - offset))  # the journal's size is the file's
            if row.state is not State.REMOTE or self.fetcher is None:
                break
            try:
                await self.fetcher.ensure(row, offset, wanted)
            except ObjectArchived:
                try:
                    await self._archived_since(row)
                except NeedsRestore as exc:
                    # EIO, not EAGAIN: from read(2), EAGAIN reads as "no data yet" (Python's
                    # read() returns None, and torch.load fails far from the cause). The
                    # next open fails with EAGAIN, as for any archived file.
                    raise StoreRefused(str(exc)) from None
                raise
            if row.state is not State.REMOTE:
                continue  # truncated or completed meanwhile: look at it again
            if self.fetcher.covers(row, offset, wanted):
                self._read_ahead(handle, row, offset, wanted)
                if self.fetcher.is_complete(row):
                    await self._complete(row)
                break
            # The file changed under the fetch (evicted and fetched again, refetched after
            # a bad checksum): try again; never serve a hole as data.
        else:
            raise ObjectGone(f"inode {handle.ino} kept changing while being read")
        return self.staging.pread(handle.fd, wanted, offset)

    def _read_ahead(self, handle: Handle, row: Row, offset: int, size: int) -> None:
        """Sequential readers get blocks fetched ahead of them, a window that doubles up to
        ``readahead_bytes``; a jump elsewhere starts over."""
        assert self.fetcher is not None
        limit = self.fetcher.readahead_bytes
        end = offset + size
        if limit <= 0:
            return
        if offset == handle.next_offset or (handle.window and
                                            handle.next_offset <= offset < handle.next_offset
                                            + handle.window):
            unit = self.fetcher.unit(row)
            handle.window = min(max(2 * handle.window, 2 * unit), max(limit, unit))
            self.fetcher.readahead(row, end, handle.window)
        else:
            handle.window = 0
        handle.next_offset = end

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self._handle(fh)
        if not handle.writable or handle.fd is None:
            raise BadHandle("file not open for writing")
        row = self.ns.get(handle.ino)
        if handle.unprivileged_writer is not None:
            self._drop_set_id(row, handle.unprivileged_writer)
        if row.closed_at is not None and row.state is State.OPEN:
            row.closed_at = None  # written after a close(2) of another descriptor: still open
            self.ns.persist(row)
            self.listener.cancel(row.ino)  # its place in the upload order is given up
        # A guess: the size may move while this write waits for space (an earlier write to
        # the file ends, a truncate); what the file really grew by is settled below.
        reserved = max(offset + len(data) - row.size, 0)
        if reserved and not self.space.try_take(reserved):
            await self._reserve(reserved)
        try:
            try:
                written = self.staging.pwrite(handle.fd, data, offset)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # The disk filled up behind our accounting (other users of the disk): make
                # room the same way, then try once more.
                self.space.give_back(reserved)
                reserved = 0
                self.space.remeasure()
                await self._reserve(len(data), force_evict=True)
                reserved = len(data)
                written = self.staging.pwrite(handle.fd, data, offset)
        except BaseException:
            self.space.give_back(reserved)
            raise
        row = self.ns.get(handle.ino)
        before = row.size
        self.ns.note_write(row, offset + written)
        self.space.settle(reserved, row.size - before)
        self.bytes_written += written
        return written

    def _drop_set_id(self, row: Row, caller: Caller, *, chown: bool = False,
                     persist: bool = True) -> None:
        """The kernel's rules on a local filesystem (setattr_should_drop_suidgid,
        chown_common): a write or truncate by a caller other than root clears setuid, and
        setgid when the file is group-executable or the caller is not in its group; a
        ``chown`` by anyone (root too) clears setuid of what is not a directory, and setgid
        of a regular file by the same rule, root counting as a member of every group.

        The daemon applies it itself on every write of a handle opened for writing by a
        caller other than root (the one holding CAP_FSETID, near enough: capabilities are
        not in the request), on a truncate and an open(O_TRUNC) by one, and on every chown:
        with FUSE_CAP_HANDLE_KILLPRIV_V2 (mount.py) the kernel leaves it to us and only says
        so in flags the FUSE binding does not pass on; without it, the kernel also sends the
        cleared mode, and applying the rule twice changes nothing. Only the writer's primary
        group is known: a member through a supplementary group loses a setgid bit that ext4
        would keep.
        """
        root = caller.uid == 0
        if stat.S_ISDIR(row.mode) or (root and not chown):
            return
        drop = row.mode & stat.S_ISUID
        if stat.S_ISREG(row.mode) and row.mode & stat.S_ISGID and (
                row.mode & stat.S_IXGRP or (not root and caller.gid != row.gid)):
            drop |= stat.S_ISGID
        if drop:
            row.mode &= ~drop
            row.ctime_ns = time.time_ns()
            if persist:
                self.ns.persist(row)

    # -- space ----------------------------------------------------------------------------

    async def _reserve(self, nbytes: int, force_evict: bool = False) -> None:
        """Make room for ``nbytes`` more local bytes: evict committed copies, else wait for
        uploads to commit more, else StagingFull after ``write_stall_timeout``."""
        if nbytes <= 0:
            self.space.try_take(nbytes)
            return
        if not force_evict and self.space.try_take(nbytes):
            return
        started = trio.current_time()
        deadline = started + self.write_stall_timeout
        try:
            hurried = -math.inf
            while True:
                await self._evict(nbytes)
                if self.space.try_take(nbytes):
                    return
                self._log_stall(nbytes)
                if self._frees_in_flight:
                    # An eviction or a removal is unlinking: its space comes back when it
                    # returns, which is no upload progress. No deadline on this wait: it is
                    # bounded by the unlink, and ENOSPC while room is being made would be
                    # wrong (and under a test's autojump clock, the idle loop would leap to
                    # the deadline while the unlink runs in its thread).
                    await self._space_freed.park()
                    continue
                if trio.current_time() >= deadline:
                    break
                # hurry() wakes every waiter: two writers waiting here, each hurrying at
                # each wake-up, would wake each other forever without a pause.
                if trio.current_time() - hurried >= HURRY_EVERY:
                    hurried = trio.current_time()
                    self.listener.hurry()
                # Back within HURRY_EVERY to hurry again: a hurry also opens the uploads' yield
                # gate for a while only, and this writer's open file would close it again.
                with trio.move_on_at(min(deadline, hurried + HURRY_EVERY)):
                    await self._room_may_come()
        finally:
            self.stall_seconds += trio.current_time() - started
        log.error("ENOSPC to a writer: no room for %d bytes in %s after %.0fs of waiting for "
                  "uploads (%d bytes of local data; see 'ckptfs status')", nbytes,
                  self.staging.root, self.write_stall_timeout, self.space.used)
        raise StagingFull(f"no room for {nbytes} bytes in {self.staging.root} after "
                          f"{self.write_stall_timeout:.0f}s")

    async def _room_may_come(self) -> None:
        """Return at the next upload that finishes (its file may be evicted now), or when a
        file is closed for the last time or a free returns (``_space_freed``): a committed
        copy that was open when a writer looked for victims is one once it is closed. A
        reader of evicted files closes one and faults in the next; waiting for uploads alone,
        with none left to do, it waited until ``write_stall_timeout``."""
        async with trio.open_nursery() as nursery:
            async def first(wait: Callable[[], Awaitable[object]]) -> None:
                await wait()
                nursery.cancel_scope.cancel()
            nursery.start_soon(first, self.listener.wait_progress)
            nursery.start_soon(first, self._space_freed.park)

    def _log_stall(self, nbytes: int) -> None:
        """Say that writers wait for space, at most every ``STALL_LOG_EVERY`` seconds (many
        writers stall at once, and each wakes up many times)."""
        now = trio.current_time()
        if now - self._stall_logged_at < STALL_LOG_EVERY:
            return
        self._stall_logged_at = now
        log.warning("staging full: a writer waits for uploads to make room for %d bytes "
                    "(%d bytes of local data, limit %s; ENOSPC after write_stall_timeout %.0fs)",
                    nbytes, self.space.used, self.space.max_bytes or "the disk",
                    self.write_stall_timeout)

    async def _make_room(self, nbytes: int) -> None:
        """A write of ``nbytes`` already accounted for hit a full disk: measure again and
        evict at least that much (or wait, then StagingFull, as any writer would)."""
        self.space.remeasure()
        await self._reserve(nbytes, force_evict=True)
        self.space.give_back(nbytes)

    def _victims(self, nbytes: int) -> tuple[int, list[Row]]:
        """Committed local copies to drop, oldest first, until ``nbytes`` would be freed
        (fetched ranges of files not wholly local are dropped at once, first)."""
        freed = 0
        if self.fetcher is not None:
            for ino in self.fetcher.partial_inos():
                if freed >= nbytes:
                    return freed, []
                if not self._busy(ino) and self.ns.get(ino).state is State.REMOTE:
                    freed += self.fetcher.drop(ino)
        victims: list[Row] = []
        for row in self.journal.rows_in_states(State.COMMITTED):
            if freed >= nbytes:
                break
            cached = self.ns.get(row.ino)
            if cached.state is not State.COMMITTED or self.ns.open_count(row.ino) \
                    or self._writers.get(row.ino) or cached.remote_key is None \
                    or not self.evictable(cached):
                continue
            victims.append(cached)
            freed += cached.size
        return freed, victims

    async def _evict(self, nbytes: int) -> int:
        """Drop local copies of committed files until ``nbytes`` are freed; returns once the
        disk has the space back."""
        freed, victims = self._victims(nbytes)
        await self.evict_async(*victims)  # one durable journal commit for the lot
        return freed

    def evict_for_space(self, nbytes: int) -> int:
        """Make room for a writer the daemon cannot stall (a passthrough open): evict at once,
        without waiting; returns the bytes freed."""
        freed, victims = self._victims(nbytes)
        self.evict(*victims)
        return freed

    def evict(self, *rows: Row) -> None:
        """Drop the local copies of committed files; they stay readable from the warm tier.
        Blocking on the disk (the journal's fsync, the unlinks): for callers that cannot
        wait (a passthrough writer's reservation, ``ckptfs evict --staging``); the daemon's
        other callers use ``evict_async``."""
        rows, trashed = self._mark_evicted(rows)
        if not rows:
            return
        self.journal.make_durable()
        self.staging.remove_trashed(trashed)
        for row in rows:
            self.space.give_back(row.size)
            log.info("evicted local copy of %s (%d bytes)", row.remote_key, row.size)

    async def evict_async(self, *rows: Row) -> None:
        """``evict`` with the disk waits in worker threads: the loop answers other requests
        meanwhile (the unlink of a multi-GB file takes tens of milliseconds on ext4). The
        space is given back only once the unlinks returned, when the disk has it: a writer
        woken earlier would meet a real ENOSPC."""
        rows, trashed = self._mark_evicted(rows)
        if not rows:
            return

        async def durable_then_unlinked() -> None:
            await self.journal.make_durable_async()
            await trio.to_thread.run_sync(self.staging.remove_trashed, trashed)

        self._frees_in_flight += 1
        await self._freeing(durable_then_unlinked, sum(row.size for row in rows))
        for row in rows:
            log.info("evicted local copy of %s (%d bytes)", row.remote_key, row.size)

    async def _freeing(self, unlink: Callable[[], Awaitable[None]], nbytes: int) -> None:
        """Run ``unlink`` (disk waits in worker threads), then give ``nbytes`` back and wake
        the writers waiting for space. Not on an error: the space stays taken (the files are
        in the trash, which the next start empties, and it measures the space again).

        The caller counts it in ``_frees_in_flight`` before it starts (synchronously: a
        writer short of space decides by that count whether to wait for it)."""
        try:
            with trio.CancelScope(shield=True):  # bounded; the accounting must follow the disk
                await unlink()
            self.space.give_back(nbytes)
        finally:
            self._frees_in_flight -= 1
            self._space_freed.unpark_all()

    def _mark_evicted(self, rows: tuple[Row, ...]) -> tuple[tuple[Row, ...], list[Path]]:
        """The first, synchronous half of an eviction: the rows that may go (``evictable``)
        become REMOTE in one journal transaction and their data files move into the staging's
        trash at once (a rename), so a read that faults the file in meanwhile writes to a new
        data file. Returns those rows and where their data files went.

        Order and crashes: the REMOTE rows are committed before the renames and made durable
        before the unlinks. A power loss can still keep a rename and lose the REMOTE (the
        journal is synced after the renames, so that the loop does not wait for it): the row
        is then COMMITTED without its data file, which ``_repair_committed`` turns REMOTE at
        the next start (its committed copy is in the store: eviction takes only rows with a
        store key); the trash is emptied then. A crash after the journal sync leaves only
        files in the trash. The journal goes first so that a crash of the process alone (the
        kernel keeps both the commit and the renames) never needs that repair.
        """
        rows = tuple(row for row in rows if self.evictable(row))
        if not rows:
            return rows, []
        with self.journal.transaction():
            for row in rows:
                if self.fetcher is not None:
                    self.fetcher.reset(row.ino)  # a new generation: no late fetch lands in it
                row.state = State.REMOTE
                self.ns.persist(row)
        return rows, [path for row in rows
                      if (path := self.staging.discard(row.ino)) is not None]

    def evictable(self, row: Row) -> bool:
        """Whether the local bytes of ``row`` may go as far as its names are concerned: an
        alias has none of its own; a head's go only when every alias's object holds them
        (else an alias still to upload would find nothing to upload); and only once its
        committed copy is at its path (a rename not carried to the store yet would move a
        copy that another node may delete or overwrite meanwhile: the local one is then the
        only one left to upload)."""
        if row.link_of is not None or row.uploading_key is not None \
                or row.remote_key is None or row.remote_key != self.keys.key_of(row):
            return False
        return all(alias.state is State.COMMITTED and alias.version == row.version
                   and alias.checksum == row.checksum for alias in self.ns.aliases(row.ino))

    async def evict_tree(self, ino: int) -> tuple[int, int, list[str]]:
        """``ckptfs evict PATH``: drop local copies of committed files at or under ``ino``.

        Returns (files evicted, bytes freed, files kept with the reason). Files not committed
        yet, or open, keep their local copy: evicting them would lose data or pull data from
        under a reader."""
        evicted, freed, kept = 0, 0, []
        victims: list[Row] = []
        for each in [ino, *self.journal.descendants(ino)]:
            row = self.ns.get(each)
            if not stat.S_ISREG(row.mode) or row.link_of is not None:
                continue  # an alias's bytes are its head's, decided with the head
            path = os.fsdecode(self.journal.path_of(each) or b"?")
            if self._busy(each):
                kept.append(f"{path}: open")
            elif row.state is State.COMMITTED and row.remote_key is not None \
                    and not self.evictable(row):
                moving = row.uploading_key is not None or \
                    row.remote_key != self.keys.key_of(row)
                kept.append(f"{path}: its rename is not carried to the store yet" if moving
                            else f"{path}: another name of it is not committed to the store yet")
            elif row.state is State.COMMITTED and row.remote_key is not None:
                victims.append(row)
                evicted, freed = evicted + 1, freed + row.size
            elif row.state is State.REMOTE and self.fetcher is not None:
                dropped = self.fetcher.drop(each)
                if dropped:
                    evicted, freed = evicted + 1, freed + dropped
            else:
                kept.append(f"{path}: {state_label(row)}, not committed to the store yet")
        await self.evict_async(*victims)  # one durable journal commit for the lot
        return evicted, freed, kept

    async def ensure_local(self, row: Row) -> None:
        """``ckptfs restore --local`` and friends: the whole file on NVMe."""
        await self._ensure_local(row)

    async def resolve(self, rel: str) -> Row:
        """The entry at ``rel`` (relative to the mount root), asking the store on a miss."""
        row = self.ns.get(ROOT_INODE)
        for part in (p for p in rel.split("/") if p and p != "."):
            name = os.fsencode(part)
            try:
                row = self.ns.lookup(row.ino, name)
            except NotFound:
                if self.lister is None:
                    raise
                await self.lister.refresh(row)
                row = self.ns.lookup(row.ino, name)
        return row

    async def _ensure_local(self, row: Row) -> None:
        """Make a file known from the store wholly local (verified), e.g. before a write."""
        if row.state is not State.REMOTE:
            return
        if self.fetcher is None or row.remote_key is None:
            raise StoreUnavailable(f"inode {row.ino} has no local copy and no store to read")
        await self._check_archived(row)
        self.ns.pin(row.ino)  # not evicted while it is being assembled
        try:
            self.fetcher.prepare(row)
            await self.fetcher.ensure(row, 0, row.size)
            if row.state is State.REMOTE:
                await self._completed(row)
        finally:
            self.ns.unpin(row.ino)

    async def _complete(self, row: Row) -> None:
        """The last block of a file arrived: ``_completed``, in the background when every
        block was verified as it came (block CRCs), once the fetches have paused: its
        fdatasync of the whole file need not hold up the reader, nor the other fetches
        (measured: it cost a third of a restore's throughput)."""
        assert self.fetcher is not None
        nursery = self.fetcher.nursery
        if nursery is None or self.fetcher.sums(row) is None:
            await self._completed(row)  # a whole-file CRC is checked before this read returns
        elif row.ino not in self._completing:
            self._completing.add(row.ino)
            nursery.start_soon(self._complete_later, row)

    async def _complete_later(self, row: Row) -> None:
        assert self.fetcher is not None
        try:
            # After the download burst, as the flusher does: writing the file to disk now
            # would compete with the fetches still running (of this restore's other files).
            await self.fetcher.wait_quiet()
            await self._completed(row)
        except Exception as exc:  # noqa: BLE001 (the file stays remote: a later read retries)
            log.warning("inode %d: could not make it a local copy: %s", row.ino, exc)
        finally:
            self._completing.discard(row.ino)

    async def _completed(self, row: Row) -> None:
        """Every block is local: verify the whole file if it has no block CRCs, then it is
        a committed local copy (evictable again)."""
        assert self.fetcher is not None
        version = row.version
        for attempt in (1, 2):
            try:
                await self.fetcher.verify_whole(row)
                break
            except ChecksumMismatch as exc:
                if attempt == 2 or row.version != version:
                    self.fetcher.stats.errors.append((time.time(), str(exc)))
                    log.error("%s (twice): refusing to serve it", exc)
                    raise
                log.warning("%s; fetching it again", exc)
                self.fetcher.reset(row.ino)
                await self.fetcher.ensure(row, 0, row.size)
        if row.state is State.REMOTE and row.version == version \
                and self.fetcher.is_complete(row):
            await self.fetcher.sync_file(row.ino)  # a whole local copy is a durable one
        if row.state is State.REMOTE and row.version == version \
                and self.fetcher.is_complete(row):
            with self.journal.transaction():  # never COMMITTED with ranges left behind
                row.state = State.COMMITTED
                self.ns.persist(row)
                self.fetcher.completed(row.ino)

    async def _discard_remote(self, row: Row) -> None:
        """The old bytes of a file known from the store are not needed (O_TRUNC, truncate
        to 0): it becomes an empty local file, without a download."""
        assert self.fetcher is not None
        await self.fetcher.settle(row.ino)  # no fetch may write old bytes into the new file
        if self.ns.open_count(row.ino):
            self.fetcher.reset(row.ino)
            self.staging.truncate(row.ino, 0)
        else:
            self.fetcher.drop(row.ino)
            self.staging.create_empty(row.ino)
        row.size = 0
        row.state = State.COMMITTED  # local and empty; the caller starts the new version
        self.ns.persist(row)

    async def _archived_since(self, row: Row) -> None:
        """A read found the object in an archive class the journal did not know of (moved
        after this node last listed it: a bucket lifecycle rule, another node's retention).
        The journal learns the class, a restore is requested and the log names
        `ckptfs restore` (``NeedsRestore``, as at the open of an archived file); returns
        only if the object is readable again (the caller re-raises)."""
        assert self.fetcher is not None and row.remote_key is not None
        info = await self.fetcher.tier.head(row.remote_key)
        if info.storage_class in ARCHIVE_CLASSES and row.storage_class != info.storage_class \
                and row.state is State.REMOTE:
            row.storage_class = info.storage_class
            self.ns.persist(row)
        await self._check_archived(row)

    async def _check_archived(self, row: Row) -> None:
        """A file only in an archive storage class cannot be read until it is restored:
        start the restore and fail fast with the command that waits for it."""
        if row.storage_class not in ARCHIVE_CLASSES or self.fetcher is None:
            return
        assert row.remote_key is not None
        info = await self.fetcher.tier.head(row.remote_key)
        if not info.archived:
            return  # restored (a temporary copy is readable), or moved to a readable class
        if info.restore_state is None:
            await self.fetcher.tier.restore(row.remote_key, self.read_settings.restore_days)
            log.info("%s: restore from %s requested", row.remote_key, info.storage_class)
        path = os.path.join(self.mountpoint, os.fsdecode(self.journal.path_of(row.ino) or b"?"))
        message = (f"{path} is in {info.storage_class} (restore "
                   f"{'in progress' if info.restore_state else 'requested'}); run "
                   f"`ckptfs restore {path}` to wait for it")
        log.warning("%s", message)
        raise NeedsRestore(message)

    def flush(self, fh: int) -> None:
        """close() of one file descriptor: make size/mtime visible in the journal.

        The kernel sends FLUSH inside close(2) but RELEASE only after close(2) returned; a
        crash in between must not turn a closed file into an incomplete one. So the last
        writer's flush records ``closed_at`` (the file stays OPEN for the uploader until
        release); a write after it clears it again; replay treats OPEN + closed_at as closed.
        """
        handle = self._handle(fh)
        row = self.ns.get(handle.ino)
        if handle.writable and self._writers.get(handle.ino) == 1 and row.state is State.OPEN:
            names = self._names(row)
            now = time.time()
            for name in names:
                name.closed_at = now
            self.ns.persist_closed(row)  # staged in the journal: RELEASE writes nothing
            # close(2) returns now; RELEASE (which stages the file) may come later. The file
            # takes its place in the upload order here, so that a marker closed after this
            # returns, on any node, waits for it.
            self.listener.closed([name.ino for name in names])
        elif self.ns.is_dirty(handle.ino):
            self.ns.persist(row)

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._handle(fh)
        assert handle.fd is not None
        # Disk waits off the loop (a multi-GB fsync takes seconds; every other request of the
        # node would wait that long). The handle's descriptor stays open meanwhile: the kernel
        # sends no RELEASE for a file while an FSYNC of it is in flight.
        await trio.to_thread.run_sync(self.staging.sync, handle.fd, datasync)
        if self.ns.is_dirty(handle.ino):
            self.ns.persist(self.ns.get(handle.ino))
        await self.journal.make_durable_async()
        if self.fsync_remote:
            # Everything closed so far reaches the warm tier (this file too once closed: a
            # file open for writing is never uploaded).
            await self.listener.wait_until_done(self.listener.last_seq())

    def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is None:
            raise BadHandle(f"file handle {fh}")
        self.gate.closed()
        row = self.ns.get(handle.ino)
        if handle.writable:
            self._end_write(row)
        elif self.ns.is_dirty(row.ino):
            self.ns.persist(row)
        if handle.fd is not None:
            self.staging.release(handle.ino, handle.fd)
        self.ns.unpin(handle.ino)
        if not self.ns.open_count(handle.ino):
            self._space_freed.unpark_all()  # it may be evicted now: a writer short of room

    def detach(self, fh: int) -> None:
        """Give back ``fh``'s staging descriptor; the handle stays open (a writer's file stays
        OPEN) until ``release``, and no request may use it meanwhile. For a release that
        must wait while a passthrough mapping may still write the file (passthrough.py): the
        daemon must then hold no descriptor of it open for writing."""
        handle = self._handle(fh)
        if handle.fd is not None:
            self.staging.release(handle.ino, handle.fd)
            handle.fd = None

    async def fsyncdir(self) -> None:
        await self.journal.make_durable_async()

    # -- xattrs ---------------------------------------------------------------------------

    def getxattr(self, ino: int, name: bytes) -> bytes:
        row = self.ns.get(ino)
        if name == XATTR_STATE:
            return state_label(row).encode()
        if name == XATTR_TIERS:
            return row.tiers.encode()
        if name == XATTR_DAEMON and ino == ROOT_INODE and self.daemon_info:
            return json.dumps(self.daemon_info).encode()
        if not name.startswith(b"user."):
            # security.capability is asked for on writes; answer without touching SQLite.
            raise NoSuchAttribute(name.decode(errors="replace"))
        value = self.journal.xattr_get(ino, name)
        if value is None:
            raise NoSuchAttribute(name.decode(errors="replace"))
        return value

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        row = self.ns.get(ino)
        if name in _VIRTUAL_XATTRS:
            raise NotPermitted(f"{name.decode()} is read-only")
        if not name.startswith(b"user."):
            raise Unsupported("only user.* extended attributes are supported")
        if len(name) > 255:
            raise OSError(errno.ERANGE, "xattr name too long")
        if len(value) > _MAX_XATTR_VALUE:
            raise OSError(errno.E2BIG, "xattr value too large")
        exists = self.journal.xattr_get(ino, name) is not None
        if flags & XATTR_CREATE and exists:
            raise OSError(errno.EEXIST, "xattr exists")
        if flags & XATTR_REPLACE and not exists:
            raise NoSuchAttribute(name.decode(errors="replace"))
        with self.journal.transaction():
            self.journal.xattr_set(ino, name, value)
            row.ctime_ns = time.time_ns()
            self.ns.persist(row)

    def listxattr(self, ino: int) -> list[bytes]:
        self.ns.get(ino)
        return self.journal.xattr_list(ino)

    def removexattr(self, ino: int, name: bytes) -> None:
        row = self.ns.get(ino)
        if name in _VIRTUAL_XATTRS:
            raise NotPermitted(f"{name.decode()} is read-only")
        with self.journal.transaction():
            if not self.journal.xattr_remove(ino, name):
                raise NoSuchAttribute(name.decode(errors="replace"))
            row.ctime_ns = time.time_ns()
            self.ns.persist(row)

    # -- whole filesystem -----------------------------------------------------------------

    def statfs(self) -> FsStats:
        st = self.staging.statvfs()
        return FsStats(
            block_size=st.f_frsize, blocks=st.f_blocks, blocks_free=st.f_bfree,
            blocks_avail=st.f_bavail, files=st.f_files, files_free=st.f_ffree, name_max=255,
        )

    def close(self) -> None:
        """Persist what is dirty. Open handles are kept in the journal as OPEN (incomplete)."""
        if self.fetcher is not None:
            self.fetcher.flush_now()
        for fh in list(self._handles):
            handle = self._handles[fh]
            if self.ns.is_dirty(handle.ino):
                self.ns.persist(self.ns.get(handle.ino))
        self.journal.make_durable()
