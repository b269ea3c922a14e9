"""WAL checkpoints of the journal in a worker thread, never on the trio thread.

SQLite checkpoints a WAL database by itself every 1,000 pages, inside whichever commit
crosses the mark; with ``synchronous = NORMAL`` a checkpoint fsyncs the WAL and the database.
On the daemon that commit is a FUSE request on the trio thread: every few dozen creates, one
of them waited for two fsyncs while every other request waited behind it (1,500 creates/s
of the core without them, 400/s with them). So the daemon turns the automatic
checkpoint off (``PRAGMA wal_autocheckpoint = 0`` on the loop's connection) and this task
runs PASSIVE checkpoints from a connection of its own, in a worker thread, once a second
while the journal changes.

Invariants:
- The loop's connection stays the only writer; this connection only checkpoints (it never
  reads or writes a row and holds no transaction), from one thread at a time.
- A PASSIVE checkpoint never waits for the writer or a reader and never blocks them (SQLite:
  the writer appends to the WAL meanwhile; a reader's snapshot only stops it short). What it
  copies into the database is fsynced before the WAL is reused (``synchronous = NORMAL``),
  so durability is unchanged: a commit survives a process crash at once, and a power loss
  once ``Journal.make_durable`` ran (docs/SEMANTICS.md) or a checkpoint covered it.
- If this task stops (the mount is ending), SQLite's checkpoint at the last close of the
  loop's connection still empties the WAL.
- The WAL grows by at most what one second of commits writes, plus whatever a long reader
  (an offline ``ckptfs retention --plan``) holds back; ``wal_bytes`` says how much.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

import trio

log = logging.getLogger(__name__)

INTERVAL = 1.0  # seconds between checkpoints while the journal changes


class WalCheckpointer:
    """Checkpoints ``path``'s WAL in a worker thread while ``changes()`` moves."""

    def __init__(self, path: Path, interval: float = INTERVAL) -> None:
        self.path = path
        self.interval = interval
        self.checkpoints = 0  # completed, for tests and status
        self._db: sqlite3.Connection | None = None
        self._limiter = trio.CapacityLimiter(1)

    def wal_bytes(self) -> int:
        try:
            return os.stat(f"{self.path}-wal").st_size
        except FileNotFoundError:
            return 0

    def _connect(self) -> sqlite3.Connection:
        # Used only from the worker thread that ``_limiter`` admits (one at a time).
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA synchronous = NORMAL")
        return db

    def checkpoint_now(self) -> tuple[int, int, int]:
        """One PASSIVE checkpoint (in the calling thread): (busy, wal frames, copied)."""
        if self._db is None:
            self._db = self._connect()
        row = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        self.checkpoints += 1
        return int(row[0]), int(row[1]), int(row[2])

    async def run(self, changes: Callable[[], int],
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Checkpoint every ``interval`` seconds in which ``changes()`` (the loop
        connection's ``total_changes``) moved."""
        task_status.started()
        seen = changes()
        try:
            while True:
                await trio.sleep(self.interval)
                now = changes()
                if now == seen:
                    continue
                seen = now
                try:
                    await trio.to_thread.run_sync(self.checkpoint_now, limiter=self._limiter)
                except sqlite3.Error as exc:  # e.g. a full disk: the next round tries again
                    log.warning("journal checkpoint failed (tried again in %.0fs): %s",
                                self.interval, exc)
        finally:
            self.close()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
