"""What the kernel says is mounted where (/proc/self/mountinfo), and mountpoint checks.

Invariants: read-only; never touches a path below a mountpoint that might hang (a dead FUSE
mount answers ENOTCONN, a hung one blocks) from the calling thread: ``check_mountpoint`` lists
the directory only after the mount table says nothing is mounted there, and ``probe`` asks a
mountpoint from a thread it abandons if the call hangs.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from ckptfs.errors import UserError

FSTYPE = "fuse.ckptfs"
# What a FUSE mount whose daemon died answers (ECONNABORTED: requests caught in the abort).
_DEAD = (errno.ENOTCONN, errno.ECONNABORTED)


@dataclass(frozen=True, slots=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    options: str
    device: str = ""  # "major:minor" (st_dev)


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def mounts() -> list[MountEntry]:
    entries = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            after = right.split()
            if len(fields) < 6 or len(after) < 2:
                continue
            entries.append(
                MountEntry(_unescape(fields[4]), after[0], _unescape(after[1]), fields[5],
                           fields[2])
            )
    return entries


def normalize(path: str | Path) -> str:
    """An absolute path with symlinks of the parent resolved, without touching the leaf."""
    path = os.path.abspath(path)
    parent, leaf = os.path.split(path)
    return os.path.join(os.path.realpath(parent), leaf)


def find(path: str | Path) -> MountEntry | None:
    """The top-most mount at exactly ``path``, if any."""
    target = normalize(path)
    found = None
    for entry in mounts():
        if entry.mountpoint == target:
            found = entry
    return found


def probe(path: str | Path, timeout: float = 2.0) -> int:
    """0 if ``statvfs(path)`` works, else its errno; ETIMEDOUT if it hangs (a hung FUSE daemon).

    statvfs, not stat: the kernel answers stat from cached attributes even when the daemon
    is gone, while statfs always asks the daemon.
    """
    result: list[int] = []

    def run() -> None:
        try:
            os.statvfs(path)
            result.append(0)
        except OSError as exc:
            result.append(exc.errno or errno.EIO)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    return result[0] if result else errno.ETIMEDOUT


def holder(path: str | Path, entries: list[MountEntry] | None = None) -> MountEntry | None:
    """The mount whose tree holds ``path`` (the top-most of the longest mountpoint that is
    ``path`` or one of its ancestors), by the path's text: nothing is touched."""
    target = os.path.abspath(path)
    found: MountEntry | None = None
    for entry in mounts() if entries is None else entries:
        # The later of two at one mountpoint is the top one (the table lists in mount order).
        if _inside(target, entry.mountpoint) and (
                found is None or len(entry.mountpoint.rstrip("/")) >=
                len(found.mountpoint.rstrip("/"))):
            found = entry
    return found


def _resolved(path: str | Path) -> str:
    """``path`` with the symlinks of its existing ancestors resolved (it need not exist)."""
    path = os.path.abspath(path)
    head, tail = path, ""
    while not os.path.lexists(head) and head != os.path.dirname(head):
        head, name = os.path.split(head)
        tail = os.path.join(name, tail) if tail else name
    return os.path.join(os.path.realpath(head), tail) if tail else os.path.realpath(head)


def _inside(path: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_staging_place(staging: Path, mountpoint: Path) -> None:
    """UserError if the staging directory cannot hold a mount's files where it is: inside
    the mount itself (the daemon would reach its own files through itself), or inside any
    FUSE mount (another ckptfs mount would upload this one's journal, node token and
    control socket to its store; any FUSE daemon would sit under every write of this one).
    The text of the path first (a hung FUSE mount is never touched), then with symlinks of
    its existing ancestors resolved."""
    entries = mounts()
    mountpoint_text = os.path.abspath(mountpoint)
    for where in dict.fromkeys((os.path.abspath(staging), _resolved(staging))):
        if _inside(where, mountpoint_text):
            raise UserError(f"staging directory {staging} is inside the mountpoint "
                            f"{mountpoint}: it would be hidden by the mount it serves; put "
                            "it on the local NVMe, outside the mount")
        entry = holder(where, entries)
        if entry is not None and entry.fstype.split(".")[0] in ("fuse", "fuseblk"):
            kind = "ckptfs mount" if entry.fstype == FSTYPE else f"FUSE mount ({entry.fstype})"
            raise UserError(f"staging directory {staging} is inside the {kind} "
                            f"{entry.mountpoint}: staging must be on a local disk (the NVMe), "
                            "not on a FUSE filesystem")


def check_mountpoint(path: Path) -> Path:
    """The mountpoint as an absolute path, or a UserError saying why it cannot be used."""
    outer = holder(path)
    if outer is not None and outer.fstype == FSTYPE and \
            os.path.abspath(path).rstrip("/") != outer.mountpoint.rstrip("/"):
        raise UserError(f"mountpoint {path} is inside the ckptfs mount {outer.mountpoint}: "
                        "mount ckptfs on a directory of a local filesystem")
    entry = find(path)
    if entry is not None:
        if entry.fstype == FSTYPE and probe(entry.mountpoint) in _DEAD:
            raise UserError(
                f"mountpoint {path} is a stale ckptfs mount (its daemon is gone); "
                f"run 'ckptfs umount {path}' first"
            )
        kind = "a ckptfs mount" if entry.fstype == FSTYPE else f"a {entry.fstype} mount"
        raise UserError(f"mountpoint {path} is already mounted ({kind})")
    if not os.path.lexists(path):
        raise UserError(f"mountpoint {path} does not exist")
    if not os.path.isdir(path):
        raise UserError(f"mountpoint {path} is not a directory")
    try:
        if os.listdir(path):
            raise UserError(f"mountpoint {path} is not empty")
    except PermissionError:
        raise UserError(f"mountpoint {path} is not readable") from None
    real = normalize(path)
    outer = holder(real)
    if outer is not None and outer.fstype == FSTYPE:  # reached through a symlink
        raise UserError(f"mountpoint {path} is inside the ckptfs mount {outer.mountpoint}: "
                        "mount ckptfs on a directory of a local filesystem")
    return Path(real)
