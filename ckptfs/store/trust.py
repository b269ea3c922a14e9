"""What a node takes from the store's word: the mode bits, owners and symlink targets of the
entries it maps from object metadata (listing.py). Anyone who can write the store prefix
writes that metadata, so it is mapped as an untrusted tar archive is extracted by a user
(docs/SEMANTICS.md, "What the store may decide"):

- Mode: the permission bits only; setuid and setgid are dropped from every entry, the sticky
  bit is kept on directories only. (The mount is also ``nosuid,nodev`` by default: mount.py.)
- Owner: a uid or gid outside ``0 .. 2**32 - 2`` (negative, ``(uid_t) -1``, too large, or
  unreadable) becomes ``NOBODY`` (65534). A valid one is kept: the permission checks of a
  shared mount depend on the writer's owners (``default_permissions``).
- Symlink target: kept verbatim, absolute or relative, even pointing outside the mount (the
  kernel resolves it in the reader's namespace, with the reader's rights, as for a symlink
  on any disk), but refused when empty, containing NUL or longer than ``MAX_TARGET`` bytes
  (what ``symlink(2)`` itself refuses): the entry is then not mapped at all.
- Special file: its type must be a FIFO, socket, character or block device (anything else in
  a ``kind = special`` object is refused: not mapped); the permission bits as for a file; a
  device's number is kept (the mount is ``nodev``: a device node never opens a device), a
  number outside ``0 .. 2**64 - 1`` refuses the entry, and any other type's number is 0.

Pure functions; no I/O. The writing node's own entries keep what was set locally: only
entries mapped from the store pass through here.
"""

from __future__ import annotations

import os
import stat

NOBODY = 65534
MAX_ID = 2**32 - 2  # (uid_t) -1 means "no change" to chown(2): not an owner
MAX_TARGET = 4095  # PATH_MAX - 1: symlink(2) refuses longer targets (ENAMETOOLONG)
DEFAULT_DIR_MODE = 0o755


def file_mode(mode: int) -> int:
    """``st_mode`` of a regular file from a store-supplied mode."""
    return stat.S_IFREG | (mode & 0o777)


def dir_mode(mode: int) -> int:
    """``st_mode`` of a directory from a store-supplied mode (0755 when it has none)."""
    return stat.S_IFDIR | ((mode & 0o1777) or DEFAULT_DIR_MODE)


SPECIAL_TYPES = (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK)
MAX_RDEV = 2**64 - 1  # dev_t


def is_special(mode: int) -> bool:
    """A FIFO, socket or device node."""
    return stat.S_IFMT(mode) in SPECIAL_TYPES


def special_mode(mode: int, rdev: int) -> tuple[int, int] | None:
    """``st_mode`` and ``st_rdev`` of a special file from store-supplied values, or None if
    they describe no special file (then the entry is refused)."""
    kind = stat.S_IFMT(mode)
    if kind not in SPECIAL_TYPES or not 0 <= rdev <= MAX_RDEV:
        return None
    return kind | (mode & 0o777), rdev if kind in (stat.S_IFCHR, stat.S_IFBLK) else 0


def owner(value: int) -> int:
    """A uid or gid from the store, or ``NOBODY`` if it is not one."""
    return value if 0 <= value <= MAX_ID else NOBODY


def symlink_target(target: str | None) -> tuple[bytes | None, str | None]:
    """The target of a symlink from the store as bytes, or None and why it is refused."""
    try:
        raw = os.fsencode(target or "")
    except UnicodeEncodeError:
        return None, "symlink target is not a byte string"
    if not raw:
        return None, "empty symlink target"
    if b"\0" in raw:
        return None, "symlink target contains NUL"
    if len(raw) > MAX_TARGET:
        return None, f"symlink target longer than {MAX_TARGET} bytes"
    return raw, None
