"""The journal's redo log: what a group commit has not committed yet, so a SIGKILL loses none.

With group commit (journal.py ``defer_commits``, the mounted daemon) the journal runs its
changes inside one SQLite transaction and commits it every few milliseconds, not once per
FUSE request: a create then costs no commit of its own (no locks taken and released, no WAL
pages written for it alone). A request is still acknowledged only once its change is safe from
a SIGKILL: each *unit* (one ``transaction()``, or one statement outside any) is appended here,
as the statements it ran and their parameters, before the request returns. The append is one
``write(2)`` into the page cache, which survives the process.

Format: records ``<length u32><crc32 u32><payload>``, the payload ``marshal`` of
``(seq, [(sql, params), ...])``. ``seq`` numbers units from the last one the database holds
(its ``redo_seq`` in ``meta``, written in the same transaction as the units it covers).

Invariants:
- A unit is in this log before the request that made it returns, or it is rolled back in the
  database (a failed append: the request fails, nothing is half done).
- The log is emptied only after the transaction holding its units committed.
- Replay (at open) applies the units numbered ``redo_seq + 1, + 2, ...`` in order and stops at
  the first gap, short record or checksum mismatch: the journal is then at a *prefix* of what
  happened, as after a power loss, never at a state with a unit missing in the middle. A power
  loss may leave any tail of this log (it is never fsynced: ``make_durable`` commits first, and
  the database carries durability) or old records a truncation had dropped; their numbers say
  which are the next ones.
- The statements are deterministic given the database they run on (every value is a
  parameter; ``INTEGER PRIMARY KEY AUTOINCREMENT`` numbers from the database's own state), so
  replaying a unit on the state it ran on gives what it gave.
"""

from __future__ import annotations

import fcntl
import marshal
import os
import struct
import zlib
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("<II")

Statement = tuple[str, tuple[Any, ...]]


class RedoLogBusy(Exception):
    """Another process writes this redo log (a live daemon on the same staging directory)."""


def lock(fd: int, path: Path) -> None:
    """Take the log's lock (``flock``, released when the process dies, a SIGKILL too): its
    writer holds it while it may append; a process opening the journal beside a live daemon
    (an offline ``ckptfs retention --plan``) finds it taken and neither replays nor empties
    the log, whose units are the daemon's, not committed yet."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RedoLogBusy(f"{path} is in use by another process") from None


class RedoLog:
    """Appends units to ``path`` and reads them back (one writer: the journal's thread, which
    holds the log's lock while the log is open)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            lock(self._fd, path)
        except BaseException:
            os.close(self._fd)
            raise
        self._size = os.fstat(self._fd).st_size

    def append(self, seq: int, statements: list[Statement]) -> None:
        """One unit; OSError (a full disk) leaves the log as it was."""
        payload = marshal.dumps((seq, statements))
        record = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        try:
            written = os.write(self._fd, record)
            if written != len(record):
                raise OSError(f"short write to {self.path} ({written} of {len(record)} bytes)")
        except BaseException:
            os.ftruncate(self._fd, self._size)  # no torn record in front of the next one
            raise
        self._size += len(record)

    def clear(self) -> None:
        """Every unit in the log is committed in the database."""
        if self._size:
            os.ftruncate(self._fd, 0)
            self._size = 0

    @property
    def size(self) -> int:
        return self._size

    def close(self) -> None:
        os.close(self._fd)


def read_units(path: Path, after: int) -> list[list[Statement]]:
    """The units numbered ``after + 1, after + 2, ...`` found in ``path``, in order, up to the
    first one missing or damaged (module docstring)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    units: list[list[Statement]] = []
    expected = after + 1
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, offset)
        payload = data[offset + _HEADER.size:offset + _HEADER.size + length]
        if len(payload) != length or zlib.crc32(payload) != crc:
            break  # a torn or damaged tail (a power loss): the prefix before it stands
        try:
            seq, statements = marshal.loads(payload)
        except (EOFError, ValueError, TypeError):
            break
        offset += _HEADER.size + length
        if seq <= after:
            continue  # already in the database (a truncation the disk did not keep)
        if seq != expected:
            break  # a gap: what follows would not be a prefix
        units.append([(str(sql), tuple(params)) for sql, params in statements])
        expected += 1
    return units
