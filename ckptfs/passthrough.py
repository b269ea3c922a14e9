"""FUSE passthrough (issue 16): whether a mount may use it, and which opens go through it.

With passthrough the kernel serves read/write/mmap of an open straight from a backing file (the
staging file), without a request to the daemon. Kernel rules this module encodes (Linux 6.9+,
checked on 6.18, see docs/PASSTHROUGH.md):

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

Who calls: the mount (``decide`` before ``pyfuse3.init``, ``Negotiated`` after FUSE_INIT) and
the filesystem core at open/create/release (``BackingTable``). Nothing here touches the
namespace or staging: the caller decides which files are wholly local (``eligible``).
"""

from __future__ import annotations

import errno
import logging
import platform
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ckptfs.errors import UserError

log = logging.getLogger(__name__)

Mode = Literal["auto", "on", "off"]
MIN_KERNEL = (6, 9)
_CAP_SYS_ADMIN = 21


# -- may this mount use passthrough?

@dataclass(frozen=True, slots=True)
class Facts:
    """What the decision depends on, read off the machine by ``facts()`` (tests inject them)."""

    kernel: tuple[int, int]
    cap_sys_admin: bool
    pyfuse3_has_passthrough: bool


@dataclass(frozen=True, slots=True)
class Decision:
    request: bool       # ask for FUSE_CAP_PASSTHROUGH at init
    reason: str         # why not, when not ("" when requested)


def facts(pyfuse3_module: Any) -> Facts:
    return Facts(
        kernel=_kernel_release(platform.release()),
        cap_sys_admin=_has_cap_sys_admin(),
        pyfuse3_has_passthrough=hasattr(pyfuse3_module, "passthrough_open"),
    )


def decide(mode: Mode, f: Facts) -> Decision:
    """``off``: never. ``auto``: when everything is there, else one log line and the stock path.
    ``on``: when everything is there, else a ``UserError`` naming the one missing piece."""
    if mode == "off":
        return Decision(False, "passthrough = off")
    reason = ""
    if not f.pyfuse3_has_passthrough:
        reason = ("the installed pyfuse3 has no passthrough support "
                  "(scripts/build_passthrough_fuse.sh, PYTHONPATH=/opt/ckptfs-fuse/python)")
    elif f.kernel < MIN_KERNEL:
        reason = f"kernel {f.kernel[0]}.{f.kernel[1]} has no FUSE passthrough (6.9+)"
    elif not f.cap_sys_admin:
        reason = "registering backing files needs CAP_SYS_ADMIN"
    if not reason:
        return Decision(True, "")
    if mode == "on":
        raise UserError(f"passthrough = on, but {reason}")
    log.info("passthrough off: %s", reason)
    return Decision(False, reason)


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

