"""What the kernel says is mounted where (/proc/self/mountinfo), and mountpoint checks.

Invariants: read-only; never touches a path below a mountpoint that might hang (a dead FUSE
mount answers ENOTCONN, a hung one blocks), except ``check_mountpoint`` which lists the
directory only after the mount table says nothing is mounted there.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ckptfs.errors import UserError

FSTYPE = "fuse.ckptfs"


@dataclass(frozen=True, slots=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    options: str


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
                MountEntry(_unescape(fields[4]), after[0], _unescape(after[1]), fields[5])
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


def check_mountpoint(path: Path) -> Path:
    """The mountpoint as an absolute path, or a UserError saying why it cannot be used."""
    entry = find(path)
    if entry is not None:
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
    return Path(normalize(path))
