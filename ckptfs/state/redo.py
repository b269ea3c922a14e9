"""The journal's redo log: what a group commit has not committed yet, so a SIGKILL loses none.

With group commit (journal.py ``defer_commits``, the mounted daemon) the journal runs its
changes inside one SQLite transaction and commits it every few milliseconds, not once per
FUSE request: a create then costs no commit of its own (no locks taken and released, no WAL
pages written for it alone). A request is still acknowledged only once its change is safe from
a SIGKILL: each *unit* (one ``transaction()``, or one statement outside any) is appended here,
as the statements it ran and their parameters, before the request returns. The append is one
``pwrite(2)`` into the page cache, which survives the process.

Format: records ``<length u32><crc32 u32><payload>``, the payload ``marshal`` of
``(seq, [(sql, params), ...])``. ``seq`` numbers units from the last one the database holds
(its ``redo_seq`` in ``meta``, written in the same transaction as the units it covers).

Invariants:
- A unit is in this log before the request that made it returns, or it is rolled back in the
  database (a failed append: the request fails, nothing is half done).
- The log is emptied (its next unit written at its start) only after the transaction
  holding its units committed. Its file keeps its blocks: what lies behind the last unit
  written are older units, all committed. A journal that opens empties the file first
  (after replaying it), so no unit of a history the database does not have stays in it.
- Replay (at open) applies the units numbered ``redo_seq + 1, + 2, ...`` in order and stops at
  the first gap, short record or checksum mismatch: the journal is then at a *prefix* of what
  happened, as after a power loss, never at a state with a unit missing in the middle. A power
  loss may leave any part of this log (``make_durable`` commits first, and the database carries
  durability; the log is fsynced only when that commit fails on a full disk, ``sync``), older
  units the new ones had overwritten included; their numbers say which are the next ones.
- One writer: the process that appends holds the log's lock (``lock``); a process that finds
  it taken (a tool opening the journal beside the live daemon) neither replays nor empties it.
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
PREALLOCATE = 1 << 20  # bytes of the log's file taken when it opens (``RedoLog``)

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
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            lock(self._fd, path)
        except BaseException:
            os.close(self._fd)
            raise
        self._offset = 0  # where the next unit goes
        # Blocks taken now, and reused from the start after every commit (never truncated,
        # as SQLite reuses its WAL): when the writers fill the disk to the last byte, the
        # units of the uploads and evictions that free it still have room.
        try:
            os.posix_fallocate(self._fd, 0, PREALLOCATE)
        except OSError:
            pass  # a full disk now: the log grows as it must

    def append(self, seq: int, statements: list[Statement]) -> None:
        """One unit, after those since the last ``clear``; OSError (a full disk): not in the
        log (the next unit goes to the same place, over whatever part of it was written)."""
        payload = marshal.dumps((seq, statements))
        record = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        written = os.pwrite(self._fd, record, self._offset)
        if written != len(record):
            raise OSError(f"short write to {self.path} ({written} of {len(record)} bytes)")
        self._offset += len(record)

    def clear(self) -> None:
        """Every unit in the log is committed in the database: the next goes at the start.
        What is left behind it are units numbered at or below the database's ``redo_seq``,
        which ``read_units`` skips."""
        self._offset = 0

    def sync(self) -> None:
        """Make the units appended so far survive a power loss (a batch that cannot commit
        on a full disk: the journal's ``make_durable``)."""
        os.fsync(self._fd)

    @property
    def size(self) -> int:
        """Bytes of units not committed yet."""
        return self._offset

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
        if length == 0:
            break  # the zeros of the preallocated space: the end
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
