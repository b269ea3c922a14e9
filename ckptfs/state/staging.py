"""Files on local NVMe: one sparse data file per regular-file inode, under ``<staging>/data``.

Layout of a staging directory (mode 0711: others may reach the control socket in it, whose
server checks who connects (control.py), but cannot list it; every file in it is 0600 and
``data`` is 0700)::

    <staging>/journal.db   the journal (journal.py)
    <staging>/journal.db-redo  its changes not committed yet (redo.py; group commit)
    <staging>/data/<ino>   the bytes of inode <ino>, sparse where nothing was written
    <staging>/trash/<ino>.<n>  data files taken out of the way, waiting for their unlink
    <staging>/lock         flock()ed by the one daemon that owns this directory
    <staging>/daemon.log   log of a daemon started in the background
    <staging>/store-id     the store (normalized warm-tier URL) this directory's files belong to

Invariants:
- A data file is named by its inode number only; names and tree live in the journal, so a
  rename never touches a data file.
- One file descriptor per inode, shared by every handle (refcounted in ``acquire``/``release``),
  so a write through one handle is seen by a read through another at once.
- Data files are never deleted here on our own initiative: the caller decides (after unlink,
  or, later, after a tier holds a committed copy).
- A file in ``trash`` is garbage whatever the journal says: it was renamed there only when its
  inode no longer needed it (evicted, or removed), so a crash before its unlink leaves nothing
  but space to reclaim (``empty_trash`` at start). The rename frees the data file's name at once
  (a fetch may create a new file there meanwhile); the unlink of a multi-GB file, which waits
  on the disk, runs in a worker thread.
- A data file's bytes are durable only once ``datasync`` (or an fsync(2) of the user's) returned:
  the uploader calls it before the journal says COMMITTED.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from ckptfs.errors import UserError

# Traversable (the control socket is in it), not listable or writable, by others.
STAGING_MODE = 0o711
# Below this much free space a mount is refused: the journal alone needs room to start.
MIN_FREE_BYTES_TO_MOUNT = 16 * 1024 * 1024
STORE_ID_NAME = "store-id"


class StagingLocked(UserError):
    """Another process holds ``<staging>/lock``: a daemon (or an offline command) owns the
    directory. Its own type so that an offline command can say what to do instead."""


@dataclass(slots=True)
class _OpenData:
    fd: int
    refs: int


class Staging:
    """The data files of one staging directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_dir = root / "data"
        self._data_str = os.fspath(self.data_dir)
        self._open: dict[int, _OpenData] = {}
        # Descriptors of data files unlinked while still held (a fetch in flight when a file
        # was evicted): closed at their last release, never handed out again.
        self._detached: dict[int, _OpenData] = {}
        self._lock_fd: int | None = None
        self.trash_dir = root / "trash"
        self._trashed = 0  # names in trash: <ino>.<n>, n counting up in this process

    # -- lifecycle ------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the layout, lock it and check it is usable; UserError if not.

        The lock is taken before anything is written inside, so a second daemon pointed at a
        staging directory in use learns so without touching the owner's files.
        """
        if os.path.lexists(self.root) and not self.root.is_dir():
            raise UserError(f"staging directory {self.root} is not a directory")
        try:
            self.root.mkdir(mode=STAGING_MODE, parents=True, exist_ok=True)
        except OSError as exc:
            raise self._unusable(exc, "cannot be created") from None
        self._lock()
        try:
            self._check_usable()
        except BaseException:
            self.close()
            raise

    def recorded_store(self) -> str | None:
        """The store this directory's files belong to (``store-id``), or None if it has no
        record yet (a first mount, or a directory made before the record existed)."""
        record = self.root / STORE_ID_NAME
        try:
            return record.read_text().strip() or None
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"staging directory {self.root}: cannot read {record}: "
                            f"{getattr(exc, 'strerror', None) or exc}") from None

    def record_store(self, identity: str) -> None:
        """Record (durably) that this directory's files belong to the store ``identity``.
        The caller decides when: only once a mount with that store is ready (mount.py)."""
        record = self.root / STORE_ID_NAME
        tmp = self.root / f".{STORE_ID_NAME}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, (identity + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, record)
            dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise self._unusable(exc, "cannot record its store") from None

    def _unusable(self, exc: OSError, what: str) -> UserError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return self._full()
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            what = "is not writable"
        return UserError(f"staging directory {self.root} {what}: {exc.strerror}")

    def _check_usable(self) -> None:
        try:
            self.data_dir.mkdir(mode=0o700, exist_ok=True)
            if os.stat(self.root).st_mode & 0o777 != STAGING_MODE:
                os.chmod(self.root, STAGING_MODE)
        except OSError as exc:
            raise self._unusable(exc, "cannot be set up") from None
        if not self.data_dir.is_dir():
            raise UserError(f"staging directory {self.root}: {self.data_dir} is not a directory")
        probe = self.root / ".write-probe"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"x" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                try:
                    os.unlink(probe)
                except FileNotFoundError:
                    pass
        except OSError as exc:
            raise self._unusable(exc, "is not writable") from None
        if self.free_bytes() < MIN_FREE_BYTES_TO_MOUNT:
            raise self._full()

    def _full(self) -> UserError:
        """A mount refused for want of space: the figures, and the way out (docs/OPERATIONS.md,
        "The staging disk is full")."""
        try:
            free = f"{self.free_bytes() // 1024} KiB free"
        except OSError:
            free = "no free space"
        return UserError(
            f"staging directory {self.root} is on a full disk ({free}, at least "
            f"{MIN_FREE_BYTES_TO_MOUNT // (1024 * 1024)} MiB needed): drop the NVMe copies of "
            f"files already in the store with 'ckptfs evict --staging {self.root}' (try "
            "--dry-run first), or free space elsewhere on that disk")

    def lock(self) -> None:
        """Take the directory's lock only, exactly as ``prepare`` does first, without setting
        anything up or checking free space: ``ckptfs evict --staging`` must get in on a disk
        too full to mount. StagingLocked if another process holds it."""
        if not self.root.is_dir():
            raise UserError(f"staging directory {self.root} is not a directory")
        self._lock()

    def _lock(self) -> None:
        try:
            fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise self._unusable(exc, "cannot be locked") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StagingLocked(
                f"staging directory {self.root} is in use by another ckptfs daemon"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:
            os.close(fd)
            raise self._unusable(exc, "cannot be locked") from None
        self._lock_fd = fd

    def close(self) -> None:
        for data in self._open.values():
            os.close(data.fd)
        self._open.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- data files -----------------------------------------------------------------------

    def path(self, ino: int) -> Path:
        return self.data_dir / str(ino)

    def _file(self, ino: int) -> str:
        """``path`` as a string, for the per-create calls (no ``Path`` object each time)."""
        return os.path.join(self._data_str, str(ino))

    def exists(self, ino: int) -> bool:
        return self.path(ino).exists()

    def stat(self, ino: int) -> os.stat_result:
        """``ino``'s data file's status: through the descriptor held for it if any (no path
        walk: a passthrough file is looked at three times per create), else by its path.
        FileNotFoundError if there is none."""
        data = self._open.get(ino)
        if data is not None:
            return os.fstat(data.fd)
        return os.stat(self._file(ino))

    def acquire(self, ino: int) -> int:
        """A file descriptor for ``ino``'s data, created empty if missing. Pair with release."""
        data = self._open.get(ino)
        if data is None:
            fd = os.open(self.path(ino), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            data = self._open[ino] = _OpenData(fd, 0)
        data.refs += 1
        return data.fd

    def release(self, ino: int, fd: int | None = None) -> None:
        """Give back one reference; ``fd`` (what acquire returned) tells a detached one."""
        if fd is not None and fd in self._detached:
            data = self._detached[fd]
            data.refs -= 1
            if data.refs == 0:
                del self._detached[fd]
                os.close(data.fd)
            return
        data = self._open[ino]
        data.refs -= 1
        if data.refs == 0:
            del self._open[ino]
            os.close(data.fd)

    def acquire_new(self, ino: int) -> int:
        """``create_empty`` and ``acquire`` in one open (a create's: half its opens)."""
        assert ino not in self._open, f"inode {ino} is new: nobody holds its data file"
        fd = os.open(self._file(ino), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._open[ino] = _OpenData(fd, 1)
        return fd

    def create_empty(self, ino: int) -> None:
        """Make ``ino``'s data file exist and be empty (a new file, or a leftover from a crash)."""
        fd = os.open(self.path(ino), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.close(fd)

    @staticmethod
    def pwrite(fd: int, buf: bytes, offset: int) -> int:
        view = memoryview(buf)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
        return done

    @staticmethod
    def pread(fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def truncate(self, ino: int, size: int) -> None:
        fd = self.acquire(ino)
        try:
            os.ftruncate(fd, size)
        finally:
            self.release(ino)

    def datasync(self, ino: int) -> None:
        """Make ``ino``'s bytes durable (blocking: call it in a worker thread).
        FileNotFoundError if the file is gone (unlinked meanwhile)."""
        fd = os.open(self.path(ino), os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def sync(fd: int, datasync: bool) -> None:
        if datasync:
            os.fdatasync(fd)
        else:
            os.fsync(fd)

    def unlink(self, ino: int) -> bool:
        """Remove ``ino``'s data file; True if there was one (callers that account for its
        space give it back only then: removing twice must not free twice)."""
        self._detach(ino)
        try:
            os.unlink(self.path(ino))
        except FileNotFoundError:
            return False
        return True

    def _detach(self, ino: int) -> None:
        held = self._open.pop(ino, None)
        if held is not None:
            # Whoever holds it keeps writing to the old file; the next acquire gets a new one.
            self._detached[held.fd] = held

    def discard(self, ino: int) -> Path | None:
        """Move ``ino``'s data file into ``trash`` (a rename: no wait on the data) and return
        where it went, for ``remove_trashed`` to unlink; None if there was no file. From the
        caller's point of view the data file is gone, as after ``unlink``."""
        self._detach(ino)
        self._trashed += 1
        # A leftover of an earlier process may have this name: renaming over it frees it too.
        target = self.trash_dir / f"{ino}.{self._trashed}"
        for attempt in (1, 2):
            try:
                os.rename(self.path(ino), target)
                return target
            except FileNotFoundError:
                if attempt == 2 or not self.path(ino).exists():
                    return None
                self.trash_dir.mkdir(mode=0o700, exist_ok=True)  # the first discard here
        return None

    @staticmethod
    def remove_trashed(paths: list[Path]) -> None:
        """Unlink files ``discard`` moved away (blocking on the disk: a worker thread's job)."""
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def empty_trash(self) -> int:
        """Unlink what a crash left in ``trash``; returns how many files there were."""
        try:
            names = os.listdir(self.trash_dir)
        except FileNotFoundError:
            return 0
        self.remove_trashed([self.trash_dir / name for name in names])
        return len(names)

    def file_size(self, ino: int) -> int | None:
        try:
            return os.stat(self.path(ino)).st_size
        except FileNotFoundError:
            return None

    def stray_files(self, known_inos: set[int]) -> list[Path]:
        """Data files with no journal row: reported at start, never deleted silently."""
        strays = []
        for entry in os.scandir(self.data_dir):
            if not entry.name.isdigit() or int(entry.name) not in known_inos:
                strays.append(Path(entry.path))
        return strays

    # -- space ----------------------------------------------------------------------------

    def statvfs(self) -> os.statvfs_result:
        return os.statvfs(self.root)

    def free_bytes(self) -> int:
        st = self.statvfs()
        return st.f_bavail * st.f_frsize


class SpaceBudget:
    """How many more bytes the staging directory may take before something must give.

    Two limits: ``max_bytes`` of local data (if set), and a free-space reserve of
    ``min_free_ratio`` of the staging filesystem. ``statvfs`` is asked only when the headroom
    measured last time runs out, so the write path normally pays one subtraction.
    """

    def __init__(self, staging: Staging, max_bytes: int | None, min_free_ratio: float) -> None:
        self.staging = staging
        self.max_bytes = max_bytes
        self.min_free_ratio = min_free_ratio
        self.used = 0  # bytes of local file data (apparent sizes)
        self._headroom = 0

    def _measure(self) -> int:
        st = self.staging.statvfs()
        reserve = int(st.f_blocks * st.f_frsize * self.min_free_ratio)
        self._headroom = st.f_bavail * st.f_frsize - reserve
        return self._headroom

    def try_take(self, nbytes: int) -> bool:
        """Account for ``nbytes`` more of local data if they fit; False if they do not."""
        if nbytes <= 0:
            self.used += nbytes
            return True
        if self.max_bytes is not None and self.used + nbytes > self.max_bytes:
            return False
        if self._headroom < nbytes and self._measure() < nbytes:
            return False
        self._headroom -= nbytes
        self.used += nbytes
        return True

    def could_ever_take(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more could fit at all, were every other byte evicted: if not,
        waiting for uploads and evictions is pointless."""
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return False
        st = self.staging.statvfs()
        return nbytes <= st.f_blocks * st.f_frsize * (1 - self.min_free_ratio)

    def remeasure(self) -> None:
        """The disk filled up behind the accounting (other users of the disk, space an
        unlinked file still held): trust statvfs again."""
        self._measure()

    def give_back(self, nbytes: int) -> None:
        """``nbytes`` of local data were deleted, evicted or truncated away."""
        self.used = max(0, self.used - nbytes)
        self._headroom += nbytes

    def settle(self, reserved: int, grown: int) -> None:
        """A change reserved ``reserved`` bytes and grew local data by ``grown`` (negative: it
        shrank): give back the surplus, or account for the rest. A reservation is a guess made
        before a wait; the size it was computed from may have moved meanwhile (another write
        to the same file, a truncate)."""
        if reserved > grown:
            self.give_back(reserved - grown)
        elif grown > reserved:
            # Written already: accounted for even beyond the limits (the next writer waits).
            self.used += grown - reserved
            self._headroom -= grown - reserved
