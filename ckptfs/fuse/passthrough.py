"""FUSE passthrough: whether a mount may use it, and which opens go through it.

With passthrough the kernel serves read/write/mmap of an open straight from a backing file (the
staging file), without a request to the daemon. Kernel rules this module encodes (Linux 6.9+,
checked on 6.18, see docs/DESIGN.md, "Passthrough"):

- An inode is in one io mode at a time. While it has a passthrough open, a daemon-served open
  of it (page-cached or direct_io) fails with EIO, and the other way round. So the choice is
  per inode, with open counts: ``BackingTable.acquire`` never asks the kernel for a mix.
- All passthrough opens of an inode must name the same backing file: one backing id per inode,
  registered at its first passthrough open and closed at its last release.
- A passthrough open's flags may only add direct_io/parallel-writes/noflush: keep_cache (on in
  pyfuse3's ``FileInfo`` by default) makes the open fail with EIO. ``file_info_fields`` gives
  the fields to answer with.
- Registering a backing file needs CAP_SYS_ADMIN (EPERM otherwise), a pyfuse3 built against
  libfuse 3.17 with scripts/pyfuse3-passthrough.patch, and no writeback cache.

Who calls: the CLI's foreground mount (``use_patched_pyfuse3`` before anything imports
pyfuse3), the mount (``decide`` before ``pyfuse3.init``) and the FUSE adapter
(``PassthroughFiles``: at FUSE_INIT, every open/create/flush/fsync/release, and before it
reports attributes). ``BackingTable`` knows nothing of the namespace or staging: its caller
says which files are wholly local (``eligible``); ``PassthroughFiles`` is that caller, and the
only part that reads the core's rows and staging files.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import platform
import signal
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import trio

from ckptfs.errors import UserError
from ckptfs.state.journal import State

if TYPE_CHECKING:
    from ckptfs.engine.fs import Filesystem

log = logging.getLogger(__name__)

Mode = Literal["auto", "on", "off"]
MIN_KERNEL = (6, 9)
_CAP_SYS_ADMIN = 21


# -- which pyfuse3

def patched_pyfuse3_dir() -> Path:
    """Where scripts/build_passthrough_fuse.sh installs the patched pyfuse3 (its PREFIX)."""
    return Path(os.environ.get("CKPTFS_FUSE_PREFIX", "/opt/ckptfs-fuse")) / "python"


def use_patched_pyfuse3(mode: Mode) -> bool:
    """Put the patched pyfuse3 first on ``sys.path`` unless ``mode`` is off; True if it was.

    Must run before anything imports pyfuse3 (the CLI calls it just before it imports
    ckptfs.ops.mount). The stock pyfuse3 stays installed: with ``off``, or without the build, the
    daemon imports that one, and ``decide`` says why passthrough is not used.
    """
    if mode == "off":
        return False
    where = patched_pyfuse3_dir()
    if not (where / "pyfuse3").is_dir():
        return False
    if "pyfuse3" in sys.modules:
        log.warning("pyfuse3 was imported before the passthrough build could be chosen")
        return False
    sys.path.insert(0, str(where))
    return True


# -- may this mount use passthrough?

@dataclass(frozen=True, slots=True)
class Facts:
    """What the decision depends on, read off the machine by ``facts()`` (tests inject them)."""

    kernel: tuple[int, int]
    cap_sys_admin: bool
    pyfuse3_has_passthrough: bool
    # Why the staging filesystem cannot tell whether a file is open for writing ("" if it
    # can): ``writers_left`` asks it with a read lease (see ``PassthroughFiles``).
    leases: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    request: bool       # ask for FUSE_CAP_PASSTHROUGH at init
    reason: str         # why not, when not ("" when requested)


def facts(pyfuse3_module: Any, staging_root: Path) -> Facts:
    return Facts(
        kernel=_kernel_release(platform.release()),
        cap_sys_admin=_has_cap_sys_admin(),
        pyfuse3_has_passthrough=hasattr(pyfuse3_module, "passthrough_open"),
        leases=_leases_unusable(staging_root),
    )


def decide(mode: Mode, f: Facts) -> Decision:
    """``off``: never. ``auto``: when everything is there, else one log line and the stock path.
    ``on``: when everything is there, else a ``UserError`` naming the one missing piece."""
    if mode == "off":
        return Decision(False, "passthrough = off")
    reason = ""
    if not f.pyfuse3_has_passthrough:
        reason = (f"the pyfuse3 found has no passthrough support (none built in "
                  f"{patched_pyfuse3_dir()}: run scripts/build_passthrough_fuse.sh)")
    elif f.kernel < MIN_KERNEL:
        reason = f"kernel {f.kernel[0]}.{f.kernel[1]} has no FUSE passthrough (6.9+)"
    elif not f.cap_sys_admin:
        reason = "registering backing files needs CAP_SYS_ADMIN"
    elif f.leases:
        reason = (f"the staging filesystem refuses file leases ({f.leases}), which the "
                  f"daemon needs to see a mapping outlive its descriptor")
    if not reason:
        return Decision(True, "")
    if mode == "on":
        raise UserError(f"passthrough = on, but {reason}")
    log.info("passthrough off: %s", reason)
    return Decision(False, reason)


def fallback_note(mode: Mode, decision: Decision) -> str:
    """What ``ckptfs mount`` says beside its success line when ``auto`` could not use
    passthrough ("" otherwise: it is in use, or the user turned it off)."""
    if mode != "auto" or decision.request:
        return ""
    return f"the daemon serves reads and writes (no FUSE passthrough: {decision.reason})"


def _kernel_release(release: str) -> tuple[int, int]:
    parts = release.split("-", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def _has_cap_sys_admin(status: str = "/proc/self/status") -> bool:
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return False


def writers_left(path: Path) -> bool:
    """Whether anything holds the file at ``path`` open for writing, as the kernel counts:
    it refuses a read lease (EAGAIN) while any open file description of the inode has write
    access, mapped or not. The caller must hold none itself. A missing file has none.

    The lease is dropped at once; should a writer open the file meanwhile, the lease break
    is signalled with SIGURG (ignored by default) rather than SIGIO, which would kill us."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except BlockingIOError:
            return True
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


def _leases_unusable(directory: Path) -> str:
    """Why ``writers_left`` cannot work for files in ``directory`` ("" if it can)."""
    probe = directory / ".lease-probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
        writers_left(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return ""


# -- which opens go through it

class Backend(Protocol):
    """Registers backing files with the kernel: pyfuse3's ``passthrough_open/close``."""

    def open(self, fd: int) -> int: ...
    def close(self, backing_id: int) -> None: ...


class Pyfuse3Backend:
    def __init__(self, pyfuse3_module: Any) -> None:
        self._pyfuse3 = pyfuse3_module

    def open(self, fd: int) -> int:
        return int(self._pyfuse3.passthrough_open(fd))

    def close(self, backing_id: int) -> None:
        self._pyfuse3.passthrough_close(backing_id)


def negotiated_backend(pyfuse3_module: Any) -> Backend | None:
    """After FUSE_INIT: pyfuse3's backing-file calls if the kernel agreed to passthrough."""
    enabled = getattr(pyfuse3_module, "passthrough_enabled", None)
    return Pyfuse3Backend(pyfuse3_module) if enabled is not None and enabled() else None


@dataclass(slots=True)
class _Inode:
    backing_id: int     # 0: the inode's opens are served by the daemon
    opens: int


class BackingTable:
    """Per-inode io mode and open counts; one backing id per inode in passthrough.

    ``acquire`` at every open/create that succeeded, ``release`` at every RELEASE, with the id
    ``acquire`` returned. Not thread-safe: called from the trio thread only.
    """

    def __init__(self, backend: Backend | None) -> None:
        # None: passthrough not negotiated (or given up), every open is daemon-served.
        self._backend = backend
        self._inodes: dict[int, _Inode] = {}
        self.gave_up = ""  # why the mount stopped using passthrough, if it did

    @property
    def active(self) -> bool:
        return self._backend is not None

    def acquire(self, ino: int, fd: int, eligible: bool) -> int:
        """The backing id to answer this open with, or 0 to serve it in the daemon.

        ``eligible``: every byte of the file is in the staging file ``fd`` (the caller's rule).
        An inode with daemon-served opens stays daemon-served until they are all released
        (a fault-in read may be under way); an inode with passthrough opens gives every new
        open the same backing id (the kernel would fail a daemon-served one with EIO).
        """
        entry = self._inodes.get(ino)
        if entry is None:
            entry = self._inodes[ino] = _Inode(self._register(fd) if eligible else 0, 0)
        entry.opens += 1
        return entry.backing_id

    def release(self, ino: int, backing_id: int) -> None:
        entry = self._inodes[ino]
        assert entry.backing_id == backing_id, (ino, entry, backing_id)
        entry.opens -= 1
        if entry.opens:
            return
        del self._inodes[ino]
        if backing_id and self._backend is not None:
            try:
                self._backend.close(backing_id)
            except OSError as e:  # the id is gone with the connection, or never was
                log.warning("passthrough_close(%d) for inode %d: %s", backing_id, ino, e)

    def mode(self, ino: int) -> Literal["passthrough", "daemon", "closed"]:
        entry = self._inodes.get(ino)
        if entry is None:
            return "closed"
        return "passthrough" if entry.backing_id else "daemon"

    def _register(self, fd: int) -> int:
        if self._backend is None:
            return 0
        try:
            return self._backend.open(fd)
        except OSError as e:
            if e.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTTY):
                # The mount cannot do it at all (no CAP_SYS_ADMIN after all, not negotiated):
                # give up once, with one line, rather than at every open.
                log.warning("passthrough off for this mount: backing open: %s", e)
                self._backend = None
                self.gave_up = f"registering a backing file failed: {e}"
            else:
                log.warning("passthrough backing open: %s; serving this file in the daemon", e)
            return 0


def file_info_fields(backing_id: int, direct_io: bool) -> dict[str, Any]:
    """``pyfuse3.FileInfo`` keyword arguments for an open that ``acquire`` answered."""
    if backing_id:
        # keep_cache is outside FOPEN_PASSTHROUGH_MASK: the kernel would fail the open (EIO).
        # direct_io is allowed but means nothing there: the backing file decides.
        return {"backing_id": backing_id, "keep_cache": False, "direct_io": False}
    return {"direct_io": direct_io}



# -- the mount's passthrough opens

# What a passthrough writer holds of the staging budget ahead of its writes (configurable:
# ``passthrough_write_reserve``). The daemon cannot stall a write it never sees, so a writable
# open goes passthrough only if this much can be reserved (evicting committed copies if need
# be); otherwise it is served by the daemon, which waits for uploads (``write_stall_timeout``).
WRITE_HEADROOM = 1 << 30
# How often ``watch`` looks at the staging files of passthrough writers: their growth is
# charged to the budget and their reserve topped up (evicting committed copies) between
# requests, since a writer may write gigabytes without sending the daemon any.
WATCH_INTERVAL = 0.2


@dataclass(slots=True)
class Counters:
    passthrough_opens: int = 0
    daemon_opens: int = 0
    read_requests: int = 0     # READ/WRITE requests that reached the daemon
    write_requests: int = 0


@dataclass(slots=True)
class PassthroughFiles:
    """Which opens of one mount the kernel serves from their staging file, and what the core
    must learn about the writes it no longer sees.

    - An open is *eligible* when every byte of the file is in its staging file: any state but
      REMOTE (a REMOTE file is fetched range by range on demand: daemon-served, so its reads
      fault in; once wholly fetched it is COMMITTED, and later opens may go passthrough once
      every daemon-served open of it is released, ``BackingTable``). A writable first open
      is also eligible only if ``write_reserve`` bytes of the space budget can be reserved
      for it (after evicting committed copies if need be).
    - Writes through passthrough never reach the daemon: ``refresh`` copies the staging
      file's size and mtime into the row (marked dirty, persisted by the core at flush, fsync
      and release as for a daemon write) and charges the growth to the space budget, from
      the inode's reserve first. The adapter calls it before it answers with attributes and
      before flush/fsync/release, so the journal and the upload see every byte written
      before close(2); ``watch`` calls it for inodes with passthrough writers every
      ``WATCH_INTERVAL`` and tops their reserve up, evicting committed copies, so the budget
      follows a long write and room is made ahead of it. The reserve left is given back at
      the last writable release.
    - Invariant: ``fs.space.used`` counts every byte of a passthrough file that ``refresh``
      has seen plus the reserves held; a writer that outruns its reserve while nothing can be
      evicted is charged anyway (the bytes are on disk), and it meets ENOSPC from the staging
      filesystem itself if the disk fills: the one place where a passthrough writer does not
      wait as a daemon-served writer does (docs/PASSTHROUGH.md, "Space").
    - Pages the kernel cached for a daemon-served open may be stale once the file was written
      in passthrough: the next daemon-served open of it drops them (keep_cache off).
    - No write the daemon cannot see: every write of a passthrough open goes through its FUSE
      file, whose RELEASE comes after the last descriptor, dup, fork, splice or in-flight I/O
      of it is gone -- except a shared mapping. The kernel maps the *backing* file, so the
      mapping outlives the FUSE file: after RELEASE it can still write the staging file.
      Only an ``O_RDWR`` open can map a file writable (``mmap`` needs read access, and write
      access for ``PROT_WRITE``; ``O_WRONLY`` cannot map at all). So once an ``O_RDWR``
      open of an inode went passthrough (*mappable*), the core's release of its writable
      handles waits (``_parked``, their staging descriptors given back at once) until (1)
      no open of the inode is left and (2) ``writers_left`` says nothing holds its staging
      file open for writing: a mapping holds the backing file, opened read-write, until
      munmap. Until then the file stays OPEN, as on the daemon path, where RELEASE itself
      waits for munmap; ``watch`` (and ``poll``, which ``ckptfs sync`` calls) asks again.
      Write-only opens (``torch.save``, DCP, safetensors) never wait for this.

    Runs on the trio thread only.
    """

    fs: Filesystem
    requested: bool = False
    reason: str = "passthrough = off"
    table: BackingTable = field(default_factory=lambda: BackingTable(None))
    counters: Counters = field(default_factory=Counters)
    write_reserve: int = WRITE_HEADROOM
    # fh -> (ino, backing id, writable and passthrough)
    _handles: dict[int, tuple[int, int, bool]] = field(default_factory=dict)
    # Inodes with an O_RDWR passthrough open since their opens last all went away (a shared
    # writable mapping of them may outlive every open), and the core handles whose release
    # waits until no mapping can write them.
    _mappable: set[int] = field(default_factory=set)
    _parked: dict[int, list[int]] = field(default_factory=dict)
    _unsure: set[int] = field(default_factory=set)            # parked, lease probe failing
    _seen: dict[int, tuple[int, int]] = field(default_factory=dict)      # ino -> size, mtime
    _written: set[int] = field(default_factory=set)
    _writers: dict[int, int] = field(default_factory=dict)    # ino -> writable pt opens
    _reserved: dict[int, int] = field(default_factory=dict)   # ino -> budget held ahead
    _short: set[int] = field(default_factory=set)             # inos warned of a full budget

    def negotiated(self, backend: Backend | None) -> None:
        """FUSE_INIT is answered: ``backend`` if the kernel agreed to passthrough."""
        if not self.requested:
            return
        if backend is None:
            self.reason = "the kernel did not negotiate FUSE passthrough at FUSE_INIT"
            log.warning("passthrough off: %s", self.reason)
            return
        self.table = BackingTable(backend)
        self.reason = ""
        log.info("passthrough on: opens of local files are served by the kernel")

    @property
    def active(self) -> bool:
        return self.table.active

    def status(self) -> dict[str, Any]:
        c = self.counters
        return {"active": self.active, "reason": self.table.gave_up or self.reason,
                "opens": {"passthrough": c.passthrough_opens, "daemon": c.daemon_opens},
                "requests": {"read": c.read_requests, "write": c.write_requests},
                "writers": sum(self._writers.values()),
                "reserved_bytes": sum(self._reserved.values()),
                "mapped_files": len(self._parked)}

    def opened(self, fh: int, ino: int, flags: int, direct_io: bool) -> dict[str, Any]:
        """The core opened ``fh`` on ``ino``: ``pyfuse3.FileInfo`` fields to answer with."""
        first = self.table.mode(ino) == "closed"
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if first and ino in self._parked:
            self.refresh(ino)  # before the baseline moves: what a mapping wrote meanwhile
        eligible = first and self.table.active and self._eligible(ino)
        reserved = eligible and writable and self._reserve(ino)
        eligible = eligible and (reserved or not writable)
        # The inode's shared staging descriptor (the core's handle holds it already): the
        # kernel keeps its own reference to the file it registers.
        fd = self.fs.staging.acquire(ino) if eligible else -1
        try:
            backing = self.table.acquire(ino, fd, eligible)
        finally:
            if eligible:
                self.fs.staging.release(ino, fd)
        if backing and first:
            self._seen[ino] = self._stat(ino)
        self._handles[fh] = (ino, backing, writable and bool(backing))
        if backing:
            self.counters.passthrough_opens += 1
            if flags & os.O_ACCMODE == os.O_RDWR:
                self._mappable.add(ino)
            if writable:
                self._writers[ino] = self._writers.get(ino, 0) + 1
                if ino not in self._reserved:  # a writer joining a reader's passthrough
                    self._top_up(ino)
            return file_info_fields(backing, direct_io)
        if reserved:  # the kernel would not take the file after all
            self.fs.space.give_back(self._reserved.pop(ino))
        self.counters.daemon_opens += 1
        fields = file_info_fields(0, direct_io)
        if ino in self._written:
            self._written.discard(ino)
            fields["keep_cache"] = False
        return fields

    def _eligible(self, ino: int) -> bool:
        row = self.fs.getattr(ino)
        # A set-id file is served by the daemon, which clears the bits on an unprivileged
        # write by the kernel's rule (fs.py ``_drop_set_id``); a passthrough write keeps
        # setgid on a file that is not group-executable, written by a non-member
        # (tests/test_posix_conformance.py). Checkpoints are never set-id: nothing is lost.
        return row.state is not State.REMOTE and not row.mode & (stat.S_ISUID | stat.S_ISGID)

    def _reserve(self, ino: int) -> bool:
        """Hold ``write_reserve`` of the budget for a passthrough writer of ``ino``, evicting
        committed copies if that is what it takes; False if it cannot be had."""
        if not self._take(self.write_reserve):
            return False
        self._reserved[ino] = self._reserved.get(ino, 0) + self.write_reserve
        return True

    def _take(self, nbytes: int) -> bool:
        """``nbytes`` of the budget, evicting committed copies (oldest first) until they fit;
        False once nothing is left to evict."""
        while not self.fs.space.try_take(nbytes):
            if not self.fs.evict_for_space(nbytes):
                return False
        return True

    def _top_up(self, ino: int) -> None:
        """Bring a passthrough writer's reserve back to ``write_reserve``, or say once that
        it writes past the budget (it meets ENOSPC only if the disk itself fills)."""
        need = self.write_reserve - self._reserved.get(ino, 0)
        if need <= 0:
            return
        if not self._take(need):
            if ino not in self._short:
                self._short.add(ino)
                log.warning("staging budget full while inode %d is written in passthrough, "
                            "no committed copy left to evict: its writes are not held back "
                            "and get ENOSPC if the disk fills", ino)
                self.fs.listener.hurry()  # failed uploads retried now: room to evict later
            return
        self._short.discard(ino)
        self._reserved[ino] = self._reserved.get(ino, 0) + need

    def refresh(self, ino: int) -> None:
        """Size and mtime of an inode open in passthrough (or still mapped by one), from its
        staging file."""
        mode = self.table.mode(ino)
        if mode != "passthrough" and not (mode == "closed" and ino in self._parked):
            return  # daemon-served writes reach the row themselves
        seen = self._stat(ino)
        if seen == self._seen.get(ino) or seen == (-1, -1):
            return
        self._seen[ino] = seen
        size, mtime_ns = seen
        row = self.fs.getattr(ino)
        growth = size - row.size
        if growth > 0:
            self._charge(ino, growth)
            self.fs.bytes_written += growth
        self.fs.ns.note_write(row, size)  # marks the row dirty; then the staging file's values
        row.size = size
        row.mtime_ns = row.ctime_ns = mtime_ns
        self._written.add(ino)
        if row.state is State.OPEN and row.closed_at is not None:
            # Written after the last writer's close(2) (a dup'ed descriptor, a shared
            # mapping): still open, as Filesystem.write says for a daemon-served write.
            row.closed_at = None
            self.fs.ns.persist(row)
            self.fs.listener.cancel(ino)
        if self._writers.get(ino) and self._reserved.get(ino, 0) < self.write_reserve // 2:
            self._top_up(ino)

    def _charge(self, ino: int, growth: int) -> None:
        """``growth`` bytes more of ``ino`` are on disk: from its reserve, then the budget."""
        held = self._reserved.get(ino, 0)
        used = min(held, growth)
        if ino in self._reserved:
            self._reserved[ino] = held - used
        rest = growth - used
        if rest and not self.fs.space.try_take(rest):
            # Already on disk: counted anyway (the budget is over; daemon-served writers evict
            # and wait, and new writable opens are daemon-served until it recovers).
            self.fs.space.give_back(-rest)

    async def watch(self, interval: float = WATCH_INTERVAL) -> None:
        """Follow passthrough writers between their requests, and release what waited for
        a mapping once it is gone (runs for the mount's life)."""
        while True:
            await trio.sleep(interval)
            self.poll()

    def poll(self) -> None:
        """What ``watch`` does every ``WATCH_INTERVAL``; ``ckptfs sync`` calls it first, so
        a file unmapped just before is staged before sync looks at the upload queue."""
        for ino in list(self._writers):
            self.refresh(ino)
        for ino in list(self._parked):
            if self.table.mode(ino) == "closed":
                self.refresh(ino)
                self._unpark(ino)

    def observe(self, ino: int) -> None:
        """The core changed the staging file itself (a truncate): not a passthrough write."""
        if self.table.mode(ino) == "passthrough":
            self._seen[ino] = self._stat(ino)

    def handle_ino(self, fh: int) -> int | None:
        entry = self._handles.get(fh)
        return None if entry is None else entry[0]

    def release(self, fh: int) -> None:
        """RELEASE of ``fh`` (the adapter refreshed first): the core's release, now, or for a
        writer of a mappable inode once no mapping can write it (the class docstring)."""
        entry = self._handles.pop(fh, None)
        if entry is None:
            self.fs.release(fh)
            return
        ino, _, writer = entry
        try:
            if writer and ino in self._mappable:
                # The staging descriptor goes now: ``writers_left`` must not count ours.
                self.fs.detach(fh)
                self._parked.setdefault(ino, []).append(fh)
            else:
                self.fs.release(fh)
        finally:
            self._released(fh, entry)
        if self.table.mode(ino) == "closed":
            if ino in self._parked:
                self._unpark(ino)
            else:
                self._mappable.discard(ino)

    def _unpark(self, ino: int) -> None:
        """Release the parked handles of ``ino`` (no open of it is left) unless something
        still holds its staging file open for writing: a mapping of a closed O_RDWR open."""
        try:
            mapped = writers_left(self.fs.staging.path(ino))
        except OSError as exc:  # cannot tell (checked at mount: should not happen): wait
            if ino not in self._unsure:
                self._unsure.add(ino)
                log.warning("inode %d: cannot tell whether a mapping still writes it (%s): "
                            "its upload waits", ino, exc)
            return
        self._unsure.discard(ino)
        if mapped:
            return
        handles = self._parked.pop(ino)
        self._mappable.discard(ino)
        self._seen.pop(ino, None)
        for fh in handles:
            self.fs.release(fh)

    def close(self) -> None:
        """The daemon stops (SIGTERM; an unmount is refused while the kernel's backing file
        of a mapping keeps the mount's path): files still mapped are released with the bytes
        they hold now (staged, uploaded at the next mount), rather than left OPEN as if
        their writer had crashed."""
        for ino, handles in self._parked.items():
            log.warning("inode %d is still mapped at unmount: writes through the mapping from "
                        "now on are not uploaded", ino)
            for fh in handles:
                self.fs.release(fh)
        self._parked.clear()

    def _released(self, fh: int, entry: tuple[int, int, bool]) -> None:
        ino, backing, writer = entry
        self.table.release(ino, backing)
        if writer:
            left = self._writers[ino] - 1
            if left:
                self._writers[ino] = left
            else:
                # The adapter refreshed before this release: what is left was never written.
                del self._writers[ino]
                self.fs.space.give_back(self._reserved.pop(ino, 0))
                self._short.discard(ino)
        if self.table.mode(ino) == "closed" and ino not in self._parked:
            self._seen.pop(ino, None)

    def _stat(self, ino: int) -> tuple[int, int]:
        try:
            st = self.fs.staging.stat(ino)
        except FileNotFoundError:
            return (-1, -1)
        return (st.st_size, st.st_mtime_ns)
