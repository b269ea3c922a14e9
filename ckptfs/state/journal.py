"""The journal: a SQLite (WAL) record of every inode and its state. The truth about local state.

One row per inode (file, directory, symlink, FIFO, socket, device node). The directory tree
is the ``(parent, name)`` edges; a path is derived from them (``path_of``) rather than
stored, so renaming a directory with 10,000 descendants is one row update. The checkpoint a
file belongs to is found from that path (lifecycle/checkpoints.py, ``checkpoint_pattern``).

File states (their user-facing meaning: docs/SEMANTICS.md)::

    OPEN --close--> STAGED --upload starts--> UPLOADING --success--> COMMITTED --evict--> REMOTE
      ^ open for write (a new version) from any state; the old upload is cancelled

A file whose writer never closed it (the daemon died) keeps ``state = OPEN`` and gets
``incomplete = 1`` at replay: it is never published. *close* is its last writer's close(2)
(the kernel's FLUSH): the row is committed STAGED then, what a crash replays it to, though
the file stays open until the kernel's RELEASE (``mark_open``: the state queries report it
OPEN until then, as the daemon holds it).

Invariants:
- Only the trio thread touches the connection (sqlite3's default same-thread check enforces it).
  A mounted daemon's WAL checkpoints (fsyncs) run from a connection of their own in a worker
  thread (``checkpoint_in_background``, walcheckpoint.py), never inside a commit here.
- Every public mutating method is safe from a SIGKILL before it returns (one *unit*: a
  statement, or one explicit ``transaction()`` for multi-row changes), so a SIGKILL of the
  daemon never loses an acknowledged metadata operation. By default each unit commits
  (``synchronous = NORMAL`` makes commits survive a process crash). With group commit
  (``defer_commits``, the mounted daemon) the units run in one transaction that
  ``commit_batch`` commits every few milliseconds, and each unit is appended to the redo log
  (redo.py) before it returns; opening the journal replays what the log holds beyond the last
  commit. ``make_durable()`` (called by fsync) commits first and makes everything survive a
  power loss too.
- Rows whose ``parent`` is NULL (other than the root) are unlinked inodes that were still open;
  they are purged at the next start.

Hard links (schema 4; docs/DESIGN.md, "Hard links"): every name of a file is a row. The first is the
*head*: the inode the kernel knows, with the staging file ``data/<head>``, fetched ranges,
xattrs and attributes. Each extra name is an *alias* row (``link_of`` = the head): its own
``(parent, name)`` and its own object in the store (state, ``remote_key``, ``uploading_key``,
tag, checksum of what is at its key), so every key still has at most one owner row and the
store-facing modules treat each name as a file. An alias has no staging file, no ranges and
no xattrs; it mirrors the head's mode, owner, size, times and version (namespace.py writes
them in the head's transaction). Aliases point at a head, never at another alias, and only
regular and special files (FIFOs, sockets, device nodes) have them.
"""

from __future__ import annotations

import enum
import json
import logging
import operator
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from itertools import compress
from pathlib import Path
from typing import Any

import trio

from ckptfs.errors import JournalCorrupt
from ckptfs.state.redo import RedoLog, RedoLogBusy, Statement, read_units
from ckptfs.state.redo import lock as redo_lock
from ckptfs.state.walcheckpoint import WalCheckpointer

log = logging.getLogger(__name__)

# Group commit: a batch commits this long after its first unit (redo.py). Short: a reader of
# the database from another connection (an offline ``ckptfs retention --plan``) sees the
# daemon's changes this late at most; long enough that a burst of creates shares commits.
BATCH_INTERVAL = 0.01

ROOT_INODE = 1
SCHEMA_VERSION = 5


class NameTaken(Exception):
    """An insert named an entry its directory already has (the UNIQUE (parent, name) rule)."""


class State(enum.StrEnum):
    OPEN = "open"
    STAGED = "staged"
    UPLOADING = "uploading"
    COMMITTED = "committed"
    REMOTE = "remote"


@dataclass(slots=True)
class Row:
    """One inode as the journal records it. Namespace caches these objects and mutates them."""

    ino: int
    parent: int | None
    name: bytes | None
    mode: int
    uid: int
    gid: int
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    target: bytes | None = None
    state: State = State.STAGED
    incomplete: bool = False
    version: int = 0
    checksum: str | None = None
    tiers: str = ""
    closed_at: float | None = None
    committed_at: float | None = None
    # The key of the committed copy on the warm tier (directories end in "/"); it differs from
    # the path while a rename is being carried to the store.
    remote_key: str | None = None
    # The key an upload in flight writes to (journal first: after a crash, a copy there that
    # the journal never recorded is found and removed if the file moved meanwhile).
    uploading_key: str | None = None
    # Per-block CRC32Cs of the committed copy (integrity.BlockSums encoded), so that range
    # reads are verified; None for objects that carry none (written by other tools).
    blocks: str | None = None
    # The remote copy's storage class when it is not the tier's default (GLACIER...).
    storage_class: str | None = None
    # The object's tag when its metadata was last read: a listing that shows the same tag
    # needs no HEAD to tell whether another node rewrote it.
    remote_etag: str | None = None
    # The device number of a character or block device node (st_rdev); 0 for anything else.
    rdev: int = 0
    # A hard link's extra name (an *alias*): the inode (the *head*) whose bytes and attributes
    # this name shares. None for every other row. See "Hard links" in the module docstring.
    link_of: int | None = None
    # Who wrote the object at ``remote_key`` and which version of theirs it is ("<node>:<n>",
    # peers.py): what another node's record about that object names. None for objects that
    # carry none (written by other tools).
    stamp: str | None = None


_COLUMNS = tuple(f.name for f in fields(Row))
_SELECT = "SELECT " + ", ".join(_COLUMNS) + " FROM inodes"
_INSERT = (f"INSERT INTO inodes ({', '.join(_COLUMNS[1:])}) "
           f"VALUES ({', '.join('?' * len(_COLUMNS[1:]))})")
_UPDATE_ALL = f"UPDATE inodes SET {', '.join(c + ' = ?' for c in _COLUMNS[1:])} WHERE ino = ?"
_WRITTEN_MAX = 100_000  # inodes whose last written values ``Journal.update`` remembers
_POSITIONS = range(len(_COLUMNS) - 1)  # of the columns after ``ino``
_SETS: dict[tuple[int, ...], str] = {}  # the UPDATE statement of each set of columns

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS inodes (
    ino          INTEGER PRIMARY KEY AUTOINCREMENT,
    parent       INTEGER,
    name         BLOB,
    mode         INTEGER NOT NULL,
    uid          INTEGER NOT NULL,
    gid          INTEGER NOT NULL,
    size         INTEGER NOT NULL DEFAULT 0,
    atime_ns     INTEGER NOT NULL DEFAULT 0,
    mtime_ns     INTEGER NOT NULL DEFAULT 0,
    ctime_ns     INTEGER NOT NULL DEFAULT 0,
    target       BLOB,
    state        TEXT NOT NULL,
    incomplete   INTEGER NOT NULL DEFAULT 0,
    version      INTEGER NOT NULL DEFAULT 0,
    checksum     TEXT,
    tiers        TEXT NOT NULL DEFAULT '',
    closed_at    REAL,
    committed_at REAL,
    remote_key   TEXT,
    uploading_key TEXT,
    blocks       TEXT,
    storage_class TEXT,
    remote_etag  TEXT,
    rdev         INTEGER NOT NULL DEFAULT 0,
    link_of      INTEGER,
    stamp        TEXT,
    UNIQUE (parent, name)
);
CREATE INDEX IF NOT EXISTS inodes_state ON inodes (state);
CREATE TABLE IF NOT EXISTS tombstones (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    key      TEXT NOT NULL,
    stamp    TEXT,
    etag     TEXT,
    moved_to TEXT,
    keep     INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS sweeps (
    id   INTEGER PRIMARY KEY AUTOINCREMENT,
    old  TEXT NOT NULL,
    new  TEXT,
    mark INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS sweep_plans (
    sweep  INTEGER PRIMARY KEY,
    listed TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ranges (
    ino   INTEGER NOT NULL REFERENCES inodes(ino) ON DELETE CASCADE,
    start INTEGER NOT NULL,
    stop  INTEGER NOT NULL,
    PRIMARY KEY (ino, start)
);
CREATE TABLE IF NOT EXISTS hidden (
    key TEXT PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS xattrs (
    ino   INTEGER NOT NULL REFERENCES inodes(ino) ON DELETE CASCADE,
    name  BLOB NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (ino, name)
);
"""


def _row(values: tuple[object, ...]) -> Row:
    row = Row(*values)  # type: ignore[arg-type]
    row.state = State(row.state)
    row.incomplete = bool(row.incomplete)
    return row


class Journal:
    """Typed access to the journal database. Not thread-safe: trio thread only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._in_tx = False
        # Keys tombstoned or deleted while a listing was on its way, with a sequence number
        # (memory only, and only while listings are in flight): a listing answered before a
        # deletion but merged after it, when the tombstone is gone, must still not bring the
        # key back (``tombstoned_since``).
        self._tomb_seq = 0
        self._recent_tombs: dict[str, int] = {}
        # Inodes committed (or moved, or taken from the store) while a listing was on its
        # way, with the same sequence: a listing that began before cannot know of their
        # objects and decides nothing about them (``committed_since``; no clock compared).
        self._recent_commits: dict[int, int] = {}
        self._listing_marks: list[int] = []
        self._wal_named = False
        # Column values this connection last wrote per inode (``update`` writes only what
        # differs).
        self._written: dict[int, tuple[object, ...]] = {}
        # Rows committed closed whose files are still open here (``mark_open``).
        self._open_here: set[int] = set()
        self._background_checkpoints = False  # checkpoint_in_background was called
        # Group commit (``defer_commits``): the redo log, the statements of the unit under
        # way, the number of the last unit logged, and the number of units not committed.
        self._redo: RedoLog | None = None
        self._unit: list[Statement] | None = None
        self._redo_seq = 0
        self._uncommitted = 0
        self.on_uncommitted: Callable[[], None] | None = None  # the first unit of a batch
        try:
            self._db = sqlite3.connect(path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.executescript(_SCHEMA)
            self._check_version()
            self._replay_redo()
        except sqlite3.DatabaseError as exc:
            raise JournalCorrupt(f"cannot open journal {path}: {exc}") from exc

    def _check_version(self) -> None:
        found = self._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if found is None:
            self._db.execute(
                "INSERT INTO meta VALUES ('schema', ?), ('created', ?)",
                (str(SCHEMA_VERSION), str(time.time())),
            )
        elif int(found[0]) in (1, 2, 3, 4):
            # Each step adds what its version brought (the new tables come from the schema
            # script); one transaction, so a crash leaves the journal at its old version.
            with self.transaction():
                if int(found[0]) == 1:
                    # Version 2 added the read path: block checksums, storage class, etag,
                    # fetched ranges and hidden keys.
                    for column in ("blocks", "storage_class", "remote_etag"):
                        self._db.execute(f"ALTER TABLE inodes ADD COLUMN {column} TEXT")
                if int(found[0]) <= 2:
                    # Version 3 added special files (FIFOs, sockets, device nodes): their rdev.
                    self._db.execute(
                        "ALTER TABLE inodes ADD COLUMN rdev INTEGER NOT NULL DEFAULT 0")
                if int(found[0]) <= 3:
                    # Version 4 added hard links: every existing row is no alias (NULL).
                    self._db.execute("ALTER TABLE inodes ADD COLUMN link_of INTEGER")
                # Version 5 added versions across nodes (peers.py): the stamp of each row's
                # object, the version a deletion applies to, deletion sweeps and their marks.
                # (Tables an old journal never had were made by the schema script as they
                # are now: only what an existing one lacks is added.)
                self._add_column("inodes", "stamp", "TEXT")
                for column in ("stamp", "etag", "moved_to"):
                    self._add_column("tombstones", column, "TEXT")
                self._add_column("tombstones", "keep", "INTEGER NOT NULL DEFAULT 0")
                if "mark" not in self._columns("sweeps"):
                    # ``new`` may be NULL now (a removal): a column constraint, so the table
                    # is made again.
                    self._db.execute("ALTER TABLE sweeps RENAME TO sweeps_v4")
                    self._db.execute("CREATE TABLE sweeps (id INTEGER PRIMARY KEY "
                                     "AUTOINCREMENT, old TEXT NOT NULL, new TEXT,"
                                     " mark INTEGER NOT NULL DEFAULT 0)")
                    self._db.execute("INSERT INTO sweeps (id, old, new) SELECT id, old, new"
                                     " FROM sweeps_v4")
                    self._db.execute("DROP TABLE sweeps_v4")
                self._db.execute("UPDATE meta SET value = ? WHERE key = 'schema'",
                                 (str(SCHEMA_VERSION),))
        elif int(found[0]) != SCHEMA_VERSION:
            raise JournalCorrupt(
                f"journal {self.path} has schema {found[0]}, this ckptfs reads {SCHEMA_VERSION}"
            )
        # Not in the schema script: that runs before a journal of version 3 has the column.
        self._db.execute("CREATE INDEX IF NOT EXISTS inodes_link_of ON inodes (link_of)"
                         " WHERE link_of IS NOT NULL")
        # The keys' indexes hold set keys only: a new file has neither (its create's commit
        # then writes two index pages fewer to the WAL), and every query on them compares a
        # key, which SQLite knows implies IS NOT NULL. Journals made before had them whole.
        for column in ("remote_key", "uploading_key"):
            self._db.execute(f"DROP INDEX IF EXISTS inodes_{column}")
            self._db.execute(f"CREATE INDEX IF NOT EXISTS inodes_{column}_set ON inodes"
                             f" ({column}) WHERE {column} IS NOT NULL")
        self._db.execute("CREATE INDEX IF NOT EXISTS inodes_stamp ON inodes (stamp)"
                         " WHERE stamp IS NOT NULL")
        self._load_version()

    def _load_version(self) -> None:
        # The version counter (``next_version``): above every version a row or a sweep's
        # mark holds, so that a version made from now on is newer than every mark.
        found = self._db.execute(
            "SELECT max(coalesce((SELECT max(version) FROM inodes), 0),"
            " coalesce((SELECT max(mark) FROM sweeps), 0))").fetchone()
        self._version = int(found[0])

    def _columns(self, table: str) -> set[str]:
        return {str(r[1]) for r in self._db.execute(f"PRAGMA table_info({table})")}

    def _add_column(self, table: str, column: str, declaration: str) -> None:
        if column not in self._columns(table):
            self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")

    def close(self) -> None:
        self.commit_batch()
        self._db.close()
        if self._redo is not None:
            self._redo.close()

    def abandon(self) -> None:
        """Close as a SIGKILL would: what is not committed is rolled back, the redo log keeps
        it (tests: a node killed; the next open replays the log)."""
        self._db.close()
        if self._redo is not None:
            self._redo.close()

    # -- group commit (redo.py) -----------------------------------------------------------

    @property
    def _redo_path(self) -> Path:
        return Path(f"{self.path}-redo")

    def _replay_redo(self) -> None:
        """Units a killed run logged but did not commit, applied in their order (redo.py).
        Not while a live daemon writes the log (its lock is taken): its units are its own,
        and this connection sees what it committed."""
        self._redo_seq = self._committed_redo_seq()
        try:
            fd = os.open(self._redo_path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            try:
                redo_lock(fd, self._redo_path)
            except RedoLogBusy:
                return
            self._replay_units(read_units(self._redo_path, self._redo_seq))
            os.ftruncate(fd, 0)  # every unit in it is committed now, or never will be
        finally:
            os.close(fd)  # and the lock with it

    def _replay_units(self, units: list[list[Statement]]) -> None:
        if units:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._run_units(units)
                self._redo_seq += len(units)
                self._note_redo_seq()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._load_version()

    def defer_commits(self) -> None:
        """Group commit from now on: units commit in batches (``commit_batch``), each safe in
        the redo log before it returns. The caller commits the batches (mount.py: a few
        milliseconds after the first unit of each) and closes the journal at the end."""
        if self._redo is None:
            self._redo = RedoLog(self._redo_path)

    def commit_batch(self) -> None:
        """Commit the units run since the last batch (nothing to do without group commit).
        Not within a unit. If the commit fails (a full disk), the units stay in the redo log
        and in the open transaction, or, if SQLite rolled it back, are run again from the
        log: nothing acknowledged is lost, and the next call tries again."""
        if self._redo is None or self._in_tx:
            return
        if not self._db.in_transaction:
            self._uncommitted = 0
            return
        self._note_redo_seq()
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error:
            if not self._db.in_transaction:
                self._rerun_logged()
            raise
        self._uncommitted = 0
        try:
            self._redo.clear()
        except OSError as exc:  # its units are committed: a replay skips them (redo_seq)
            log.warning("journal: could not empty the redo log: %s", exc)

    def _rerun_logged(self) -> None:
        """SQLite rolled the batch back (a failed COMMIT): run its units again from the log,
        in a new transaction, so the database says what the requests were told."""
        self._db.execute("BEGIN IMMEDIATE")
        self._run_units(read_units(self._redo_path, self._committed_redo_seq()))
        self._written.clear()

    def _committed_redo_seq(self) -> int:
        """The number of the last unit the database holds (0: none logged yet)."""
        found = self._db.execute("SELECT value FROM meta WHERE key = 'redo_seq'").fetchone()
        return int(found[0]) if found else 0

    def _note_redo_seq(self) -> None:
        """In the transaction about to commit: its units are those up to ``_redo_seq``."""
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('redo_seq', ?)",
                         (str(self._redo_seq),))

    def _run_units(self, units: list[list[Statement]]) -> None:
        """Run logged units again, in the transaction under way (not logged again)."""
        for statements in units:
            for sql, params in statements:
                self._db.execute(sql, params)

    def _undo_unit(self, ran: bool) -> None:
        """The unit under way failed, or its append did; ``ran``: statements of it had run.
        Units take no savepoint (two statements each, on every request that changes
        anything): a statement that fails undoes itself, so a unit that failed at its first
        statement has nothing to undo. Otherwise (a statement failed after others, a check
        between them raised, the append failed, or SQLite rolled the whole transaction back
        on a full disk) the batch goes and its logged units run again from the log: the
        database then says exactly what the requests before were told (rare)."""
        if not ran and self._db.in_transaction:
            return
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
        self._rerun_logged()  # and forgets what ``_written`` held of the batch

    async def commit_batches(self, interval: float = BATCH_INTERVAL,
                             task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                             ) -> None:
        """Group commit for as long as this runs (the mount's nursery): each batch commits
        ``interval`` seconds after its first unit. The journal's ``close`` commits the last."""
        self.defer_commits()
        wake = [trio.Event()]
        self.on_uncommitted = lambda: wake[0].set()
        task_status.started()
        try:
            while True:
                await wake[0].wait()
                wake[0] = trio.Event()
                await trio.sleep(interval)
                try:
                    self.commit_batch()
                except sqlite3.Error as exc:
                    # The units are safe in the redo log; the requests go on meanwhile.
                    log.error("journal: group commit failed, trying again: %s", exc)
                    await trio.sleep(1.0)
                if self._uncommitted:
                    wake[0].set()  # failed, or a unit was under way: again
        finally:
            self.on_uncommitted = None

    @property
    def uncommitted(self) -> int:
        """Units run since the last batch committed (group commit only)."""
        return self._uncommitted

    def _write(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        """Run a statement that changes the database: in the unit under way, or as a unit of
        its own."""
        if self._redo is None:
            return self._db.execute(sql, params)
        if self._unit is not None:
            cur = self._db.execute(sql, params)
            self._unit.append((sql, params))
            return cur
        # A unit of one statement: ``_logged_unit`` inlined (two of these per create).
        if not self._db.in_transaction:
            self._db.execute("BEGIN IMMEDIATE")
        try:
            cur = self._db.execute(sql, params)
        except BaseException:
            self._undo_unit(ran=False)
            raise
        try:
            self._redo.append(self._redo_seq + 1, [(sql, params)])
        except BaseException:
            self._undo_unit(ran=True)
            raise
        self._logged()
        return cur

    def _logged(self) -> None:
        """A unit is in the redo log."""
        self._redo_seq += 1
        self._uncommitted += 1
        if self._uncommitted == 1 and self.on_uncommitted is not None:
            self.on_uncommitted()

    @property
    def total_changes(self) -> int:
        """Rows changed through this connection since it opened (moves with every commit)."""
        return self._db.total_changes

    def checkpoint_in_background(self) -> WalCheckpointer:
        """Turn SQLite's automatic checkpoint (two fsyncs inside a commit, on the loop) off;
        the caller runs the returned checkpointer's ``run`` in its nursery instead
        (walcheckpoint.py)."""
        self._db.execute("PRAGMA wal_autocheckpoint = 0")
        self._background_checkpoints = True
        return WalCheckpointer(self.path)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group several changes into one atomic commit (nesting joins the outer one)."""
        if self._in_tx:
            yield
            return
        if self._redo is not None:
            with self._logged_unit():
                yield
            return
        self._db.execute("BEGIN IMMEDIATE")
        self._in_tx = True
        try:
            yield
        except BaseException:
            self._written.clear()  # it may hold values of the statements rolled back
            self._db.execute("ROLLBACK")
            raise
        else:
            try:
                self._db.execute("COMMIT")
            except BaseException:
                self._written.clear()  # a failed COMMIT (a full disk) may roll back
                raise
        finally:
            self._in_tx = False

    @contextmanager
    def _logged_unit(self) -> Iterator[None]:
        """A unit under group commit: run in the batch's transaction, appended to the redo
        log at its end (or undone, if it failed or the append did: ``_undo_unit``)."""
        assert self._redo is not None
        if not self._db.in_transaction:
            self._db.execute("BEGIN IMMEDIATE")
        self._in_tx = True
        self._unit = []
        try:
            yield
            if self._unit:
                self._redo.append(self._redo_seq + 1, self._unit)
        except BaseException:
            self._undo_unit(ran=bool(self._unit))
            raise
        else:
            if self._unit:
                self._logged()
        finally:
            self._in_tx = False
            self._unit = None

    def next_version(self) -> int:
        """A version number above every one this journal has handed out: a row takes one
        whenever its bytes change (written here, or a new object found in the store), so
        that "is this row's content older than X" is a comparison (upload.py ``_sweep``)."""
        self._version += 1
        return self._version

    def current_version(self) -> int:
        """The last version handed out: every row's content known now is at or below it."""
        return self._version

    def make_durable(self) -> None:
        """Make every commit so far survive a power loss (fsync of the WAL and database).

        The WAL is fsynced here, not left to a checkpoint: with ``synchronous = NORMAL`` only
        a checkpoint syncs it, and a checkpoint that another connection's read snapshot holds
        back (an offline ``ckptfs retention --plan``) syncs nothing and says so only in a
        result nobody reads. Without ``checkpoint_in_background`` a PASSIVE checkpoint
        keeps the WAL short; with it, its thread does, and the loop waits for no more than
        the two fsyncs here.
        """
        committed = self._commit_or_keep_logged()
        if committed and not self._background_checkpoints:  # else its thread keeps it short
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        self._sync_files(log_too=not committed)

    async def make_durable_async(self) -> None:
        """``make_durable`` for a FUSE request (fsync, fsyncdir): the disk waits happen in a
        worker thread, so the loop keeps answering other requests meanwhile.

        The thread never touches the SQLite connection (one writer, on the loop): it fsyncs
        the WAL and the database through descriptors of its own. Every commit made before the
        call is in the WAL file by then, so the WAL's fsync covers it; a checkpoint running
        meanwhile (walcheckpoint.py's, in its thread, or SQLite's automatic one) syncs the
        frames it copies into the database itself before the WAL is reused. No PASSIVE
        checkpoint here: it would wait on the disk on the loop.
        """
        committed = self._commit_or_keep_logged()
        await trio.to_thread.run_sync(self._sync_files, not committed)

    def _commit_or_keep_logged(self) -> bool:
        """``commit_batch`` for ``make_durable``: whether the batch committed. On a full disk
        SQLite cannot grow its WAL (the writers filled the staging filesystem, and the
        eviction that would free it wants its units durable first: its failure was a
        writer's EIO); the batch then stays in the redo log, whose blocks are its own, and
        the caller syncs the log too. The database as at its last commit, and the log's units
        numbered after it (at its start, in order: the log is reused from its start at every
        commit), are then what a restart after a power loss replays."""
        try:
            self.commit_batch()
        except sqlite3.OperationalError as exc:
            if self._redo is None or exc.sqlite_errorcode != sqlite3.SQLITE_FULL:
                raise
            log.warning("journal: a full disk: the batch is made durable in the redo log "
                        "until it can commit (%s)", exc)
            return False
        return True

    def _sync_files(self, log_too: bool = False) -> None:
        for name in (f"{self.path}-wal", str(self.path)):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # no WAL: every commit is in the database (synced by its checkpoint)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if not self._wal_named:
            # The WAL's name in the directory must survive too (SQLite syncs no directory
            # in WAL mode); once per connection, which keeps the WAL file while it is open.
            fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._wal_named = True
        if log_too and self._redo is not None:
            self._redo.sync()

    # -- inodes ---------------------------------------------------------------------------

    def ensure_root(self, uid: int, gid: int, mode: int) -> Row:
        root = self.get(ROOT_INODE)
        if root is not None:
            return root
        now = time.time_ns()
        self._write(
            "INSERT INTO inodes (ino, parent, name, mode, uid, gid, atime_ns, mtime_ns, ctime_ns,"
            " state) VALUES (?, NULL, NULL, ?, ?, ?, ?, ?, ?, ?)",
            (ROOT_INODE, mode, uid, gid, now, now, now, State.STAGED.value),
        )
        root = self.get(ROOT_INODE)
        assert root is not None
        return root

    def get(self, ino: int) -> Row | None:
        found = self._db.execute(_SELECT + " WHERE ino = ?", (ino,)).fetchone()
        return _row(found) if found else None

    def lookup(self, parent: int, name: bytes) -> Row | None:
        found = self._db.execute(
            _SELECT + " WHERE parent = ? AND name = ?", (parent, name)
        ).fetchone()
        return _row(found) if found else None

    def children(self, parent: int, after_ino: int = 0, limit: int = 1000) -> list[Row]:
        """Entries of ``parent`` in inode order, starting after ``after_ino`` (a stable cursor)."""
        return [
            _row(r)
            for r in self._db.execute(
                _SELECT + " WHERE parent = ? AND ino > ? ORDER BY ino LIMIT ?",
                (parent, after_ino, limit),
            )
        ]

    def aliases(self, head: int) -> list[Row]:
        """The extra names (hard links) of inode ``head``, in inode order."""
        return [_row(r) for r in self._db.execute(
            _SELECT + " WHERE link_of = ? ORDER BY ino", (head,))]

    def linked_heads(self) -> dict[int, int]:
        """Every inode with extra names -> how many."""
        return {int(h): int(n) for h, n in self._db.execute(
            "SELECT link_of, count(*) FROM inodes WHERE link_of IS NOT NULL GROUP BY link_of")}

    def has_children(self, parent: int) -> bool:
        return (
            self._db.execute("SELECT 1 FROM inodes WHERE parent = ? LIMIT 1", (parent,)).fetchone()
            is not None
        )

    def insert(self, row: Row) -> Row:
        """Insert ``row`` (its ``ino`` is ignored) and return it with the new inode number.
        NameTaken if its directory has an entry of that name (the statement is undone; an
        enclosing transaction goes on)."""
        values = _values(row)
        try:
            cur = self._write(_INSERT, values)
        except sqlite3.IntegrityError as exc:
            if "inodes.parent, inodes.name" in str(exc):
                raise NameTaken(row.name or b"") from None
            raise
        assert cur.lastrowid is not None
        row.ino = cur.lastrowid
        self._remember(row.ino, values)
        return row

    def mark_open(self, inos: list[int]) -> None:
        """The rows ``inos``, just committed STAGED at their last writer's close(2), stay open
        here until the kernel's RELEASE: until the next ``update`` of each, the state
        queries (``rows_in_states``, ``linked_totals``) report them OPEN, as the daemon
        holds them (``sync`` does not wait for them, ``status`` lists them open). ``get``
        returns what is committed."""
        self._open_here.update(inos)

    def update(self, row: Row) -> None:
        """Write ``row``: only the columns that differ from what this connection last wrote
        for it (an UPDATE of every column rewrites every index entry: ~5x the cost of a size
        and mtime), nothing if none does, every column if it wrote nothing for it yet."""
        self._open_here.discard(row.ino)
        values = _values(row)
        last = self._written.get(row.ino)
        if last is None:
            self._write(_UPDATE_ALL, (*values, row.ino))
        else:
            if values == last and tuple(map(type, values)) == tuple(map(type, last)):
                return  # the usual case of a release: nothing to write
            # Which columns differ (in value or in type: 1 and 1.0, 1 and True are equal),
            # compared by C iterators: a loop in Python cost a few microseconds per update.
            changed = tuple(compress(_POSITIONS, map(
                operator.or_, map(operator.ne, values, last),
                map(operator.is_not, map(type, values), map(type, last)))))
            sets = _SETS.get(changed)
            if sets is None:
                sets = _SETS[changed] = ("UPDATE inodes SET " + ", ".join(
                    _COLUMNS[1 + i] + " = ?" for i in changed) + " WHERE ino = ?")
            self._write(sets, (*(values[i] for i in changed), row.ino))
        self._remember(row.ino, values)

    def _remember(self, ino: int, values: tuple[object, ...]) -> None:
        """What the database holds for ``ino`` once the statement just run commits. Every
        write of ``inodes`` goes through this class; a rollback forgets everything
        (``transaction``), so the memory never claims a value the database lost."""
        if len(self._written) >= _WRITTEN_MAX:
            self._written.clear()  # a bound on memory; the next updates write every column
        self._written[ino] = values

    def delete(self, ino: int) -> None:
        self._open_here.discard(ino)
        self._write("DELETE FROM inodes WHERE ino = ?", (ino,))
        self._written.pop(ino, None)

    def path_of(self, ino: int) -> bytes | None:
        """The path of ``ino`` relative to the mount root (b'' for the root); None if unlinked."""
        parts: list[bytes] = []
        rows = self._db.execute(
            "WITH RECURSIVE up(ino, parent, name, depth) AS ("
            " SELECT ino, parent, name, 0 FROM inodes WHERE ino = ?"
            " UNION ALL SELECT i.ino, i.parent, i.name, up.depth + 1"
            " FROM inodes i JOIN up ON i.ino = up.parent)"
            " SELECT ino, parent, name FROM up ORDER BY depth",
            (ino,),
        ).fetchall()
        if not rows:
            return None
        for r_ino, r_parent, r_name in rows:
            if r_ino == ROOT_INODE:
                return b"/".join(reversed(parts))
            if r_parent is None:
                return None
            parts.append(r_name)
        return None

    def holder_of(self, key: str) -> int | None:
        """The live inode whose committed copy is at ``key``, if any."""
        found = self._db.execute(
            "SELECT ino FROM inodes WHERE remote_key = ? AND parent IS NOT NULL LIMIT 1", (key,)
        ).fetchone()
        return int(found[0]) if found else None

    def with_stamp(self, stamp: str) -> list[int]:
        """Every live inode whose committed object carries ``stamp`` (peers.py)."""
        return [int(r[0]) for r in self._db.execute(
            "SELECT ino FROM inodes WHERE stamp = ? AND parent IS NOT NULL", (stamp,))]

    def holders_of(self, key: str) -> list[int]:
        """Every live inode whose committed copy is at ``key`` (keys.py: at most one, but a
        journal from before key ownership may hold more)."""
        return [int(r[0]) for r in self._db.execute(
            "SELECT ino FROM inodes WHERE remote_key = ? AND parent IS NOT NULL", (key,))]

    def descendants(self, ino: int) -> list[int]:
        """Every inode below directory ``ino``, deepest last."""
        return [
            r[0]
            for r in self._db.execute(
                "WITH RECURSIVE down(ino, depth) AS ("
                " SELECT ino, 1 FROM inodes WHERE parent = ?"
                " UNION ALL SELECT i.ino, down.depth + 1 FROM inodes i JOIN down"
                " ON i.parent = down.ino) SELECT ino FROM down ORDER BY depth, ino",
                (ino,),
            )
        ]

    def directories_under(self, ino: int) -> list[int]:
        """Every directory below directory ``ino`` (files are never visited: a rename of a
        checkpoint directory of 10,000 shards walks its few directories only)."""
        return [
            r[0]
            for r in self._db.execute(
                "WITH RECURSIVE down(ino) AS ("
                " SELECT ino FROM inodes WHERE parent = ? AND (mode & 61440) = 16384"
                " UNION ALL SELECT i.ino FROM inodes i JOIN down ON i.parent = down.ino"
                " WHERE (i.mode & 61440) = 16384) SELECT ino FROM down",
                (ino,),
            )
        ]

    def linked_totals(self, *states: State) -> tuple[int, int]:
        """How many linked inodes are in ``states`` and their bytes: one indexed count, for
        status and sync progress (no row objects, no path queries)."""
        marks = ", ".join("?" * len(states))
        count, size = self._db.execute(
            f"SELECT count(*), coalesce(sum(size), 0) FROM inodes "
            f"WHERE state IN ({marks}) AND parent IS NOT NULL", tuple(s.value for s in states),
        ).fetchone()
        if self._open_here:
            # Committed closed but open here (``mark_open``): counted as OPEN. Few: the
            # files between their close(2) and their RELEASE.
            marks = ", ".join("?" * len(self._open_here))
            for state, found in self._db.execute(
                    f"SELECT state, size FROM inodes WHERE ino IN ({marks}) "
                    "AND parent IS NOT NULL", tuple(self._open_here)).fetchall():
                moved = (State.OPEN in states) - (State(state) in states)
                count += moved
                size += moved * found
        return int(count), int(size)

    def incomplete_paths(self) -> set[str]:
        """The paths of the live files that came back incomplete (peers.py: records about
        them stay until a listing decides). Few: only after a crash."""
        found = set()
        for (ino,) in self._db.execute(
                "SELECT ino FROM inodes WHERE incomplete = 1 AND parent IS NOT NULL").fetchall():
            path = self.path_of(int(ino))
            if path is not None:
                found.add(os.fsdecode(path))
        return found

    def rows_in_states(self, *states: State) -> list[Row]:
        """The regular files in ``states`` (those of ``mark_open`` as OPEN)."""
        asked = set(states)
        if self._open_here and State.OPEN in asked:
            asked.add(State.STAGED)
        marks = ", ".join("?" * len(asked))
        rows = [
            _row(r)
            for r in self._db.execute(
                _SELECT + f" WHERE state IN ({marks}) AND (mode & 61440) = 32768 ORDER BY"
                " committed_at, closed_at, ino",
                tuple(s.value for s in asked),
            )
        ]
        if not self._open_here:
            return rows
        for row in rows:
            if row.ino in self._open_here:
                row.state = State.OPEN
        return [row for row in rows if row.state in states]

    def linked_rows(self) -> list[Row]:
        """Every inode in the tree but the root (files, directories, symlinks, special
        files), in one scan: adopting another store re-queues them all (mount.py)."""
        return [_row(r) for r in self._db.execute(
            _SELECT + " WHERE parent IS NOT NULL AND ino != ?", (ROOT_INODE,))]

    def orphans(self) -> list[Row]:
        return [
            _row(r)
            for r in self._db.execute(_SELECT + " WHERE parent IS NULL AND ino != ?", (ROOT_INODE,))
        ]

    def all_inos(self) -> set[int]:
        return {r[0] for r in self._db.execute("SELECT ino FROM inodes")}

    def unreconciled(self) -> list[Row]:
        """Inodes that may differ from the warm tier: every linked inode except the root, open
        or incomplete files, and COMMITTED or REMOTE ones still at their committed key.

        Start-up is then O(files to do), not O(files known): a remount of a staging
        directory with 100,000 committed files queues none of them. A COMMITTED or REMOTE
        entry renamed before the crash (its path no longer gives ``remote_key``) is in: its
        server-side move is the only thing that brings the object to its new key."""
        rows = [
            _row(r)
            for r in self._db.execute(
                _SELECT + " WHERE ino != ? AND parent IS NOT NULL AND incomplete = 0"
                " AND state != ? ORDER BY closed_at, ino",
                (ROOT_INODE, State.OPEN.value),
            )
        ]
        settled = (State.COMMITTED, State.REMOTE)
        if not any(row.state in settled for row in rows):
            return rows
        paths = self._linked_paths()
        return [row for row in rows
                if row.state not in settled or _key(row, paths.get(row.ino)) != row.remote_key]

    def _linked_paths(self) -> dict[int, bytes]:
        """The path of every inode reachable from the root, in one scan of the table (a
        ``path_of`` per row would be one recursive query each: slow for a large listing)."""
        edges = {int(ino): (parent, bytes(name)) for ino, parent, name in self._db.execute(
            "SELECT ino, parent, name FROM inodes WHERE parent IS NOT NULL")}
        paths: dict[int, bytes] = {ROOT_INODE: b""}

        def resolve(ino: int) -> bytes | None:
            chain: list[int] = []
            cursor: int | None = ino
            while cursor is not None and cursor not in paths:
                if cursor not in edges or len(chain) > len(edges):
                    return None  # unlinked ancestor (or a loop, which the tree never has)
                chain.append(cursor)
                cursor = edges[cursor][0]
            if cursor is None:
                return None
            for each in reversed(chain):
                parent, name = edges[each]
                above = paths[parent]
                paths[each] = above + b"/" + name if above else name
            return paths[ino]

        for ino in edges:
            resolve(ino)
        return paths

    def local_bytes(self) -> int:
        """Bytes of file data in staging: whole local files plus fetched ranges of the rest."""
        found = self._db.execute(
            "SELECT COALESCE(SUM(size), 0) FROM inodes WHERE (mode & 61440) = 32768"
            " AND state != ? AND link_of IS NULL", (State.REMOTE.value,)).fetchone()
        fetched = self._db.execute("SELECT COALESCE(SUM(stop - start), 0) FROM ranges").fetchone()
        return int(found[0]) + int(fetched[0])

    # -- small named values of this node (``meta``; e.g. restore pins, pins.py) ------------

    def set_value(self, key: str, value: str) -> None:
        self._write("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def values_under(self, prefix: str) -> dict[str, str]:
        rows = self._db.execute("SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?",
                                (len(prefix), prefix)).fetchall()
        return {str(k): str(v) for k, v in rows}

    def drop_value(self, key: str) -> None:
        self._write("DELETE FROM meta WHERE key = ?", (key,))

    # -- fetched ranges of files not wholly local -------------------------------------------

    def ranges(self, ino: int) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in self._db.execute(
            "SELECT start, stop FROM ranges WHERE ino = ? ORDER BY start", (ino,))]

    def set_ranges(self, ino: int, spans: list[tuple[int, int]]) -> None:
        with self.transaction():
            self._write("DELETE FROM ranges WHERE ino = ?", (ino,))
            for a, b in spans:
                self._write("INSERT INTO ranges VALUES (?, ?, ?)", (ino, a, b))

    def inos_with_ranges(self) -> list[int]:
        return [int(r[0]) for r in self._db.execute("SELECT DISTINCT ino FROM ranges")]

    # -- keys hidden by unlink = "local-only" (kept remotely for retention) --------------------

    def hide(self, key: str) -> None:
        self._write("INSERT OR IGNORE INTO hidden VALUES (?)", (key,))

    def unhide(self, key: str) -> None:
        self._write("DELETE FROM hidden WHERE key = ?", (key,))

    def is_hidden(self, key: str) -> bool:
        return self._db.execute("SELECT 1 FROM hidden WHERE key = ?", (key,)).fetchone() is not None

    def hidden_under(self, prefix: str) -> set[str]:
        return {str(r[0]) for r in self._db.execute(
            "SELECT key FROM hidden WHERE substr(key, 1, ?) = ?", (len(prefix), prefix))}

    def claimed_under(self, prefix: str) -> dict[str, int]:
        """Keys under ``prefix`` that a live inode holds or is uploading to -> that inode.
        A listing must not take such a key for a new entry: its holder may be moving away
        from it (a rename not yet carried to the store)."""
        found: dict[str, int] = {}
        # A range, not substr(): the column's index answers it (a listing per directory would
        # otherwise scan every row of a large journal).
        upper = _prefix_end(prefix)
        for column in ("remote_key", "uploading_key"):
            query = (f"SELECT {column}, ino FROM inodes WHERE parent IS NOT NULL AND"
                     f" {column} >= ?")
            args: tuple[str, ...] = (prefix,)
            if upper is not None:
                query, args = query + f" AND {column} < ?", (prefix, upper)
            for key, ino in self._db.execute(query, args):
                found.setdefault(str(key), int(ino))
        return found

    def tombstoned_under(self, prefix: str) -> set[str]:
        """Keys under ``prefix`` with a deletion still pending (they must not reappear)."""
        return {str(r[0]) for r in self._db.execute(
            "SELECT key FROM tombstones WHERE substr(key, 1, ?) = ?", (len(prefix), prefix))}

    def interrupted_uploads(self) -> list[Row]:
        return [_row(r) for r in self._db.execute(_SELECT + " WHERE uploading_key IS NOT NULL")]

    def paths_in_states(self, *states: State) -> list[bytes]:
        paths = []
        for row in self.rows_in_states(*states):
            path = self.path_of(row.ino)
            if path:
                paths.append(path)
        return paths

    # -- tombstones: remote keys to delete ------------------------------------------------

    def add_tombstone(self, key: str, stamp: str | None = None, etag: str | None = None,
                      moved_to: str | None = None, keep: bool = False) -> int:
        """``key`` is to be deleted from the warm tier; ``stamp`` and ``etag`` name the
        version this node knew there (peers.py: the deletion applies to that version), and
        ``moved_to`` the key it was copied to if the deletion ends a move. ``keep``: the key
        is not deleted but overwritten by this node (a rename over a file): only the
        version's writer is told."""
        cur = self._write(
            "INSERT INTO tombstones (key, stamp, etag, moved_to, keep) VALUES (?, ?, ?, ?, ?)",
            (key, stamp, etag, moved_to, int(keep)))
        assert cur.lastrowid is not None
        self._note_tombstone(key)
        return cur.lastrowid

    def _note_tombstone(self, key: str) -> None:
        self._tomb_seq += 1
        if self._listing_marks:
            self._recent_tombs[key] = self._tomb_seq

    def listing_started(self) -> int:
        """A listing is about to ask the store: its mark for ``tombstoned_since``."""
        self._listing_marks.append(self._tomb_seq)
        return self._tomb_seq

    def listing_done(self, mark: int) -> None:
        self._listing_marks.remove(mark)
        oldest = min(self._listing_marks, default=self._tomb_seq)
        self._recent_tombs = {k: s for k, s in self._recent_tombs.items() if s > oldest}
        self._recent_commits = {k: s for k, s in self._recent_commits.items() if s > oldest}

    def note_committed(self, ino: int) -> None:
        """``ino``'s object was just written, moved or taken from the store."""
        self._tomb_seq += 1
        if self._listing_marks:
            self._recent_commits[ino] = self._tomb_seq

    def committed_since(self, ino: int, mark: int) -> bool:
        """Whether ``ino`` was committed after the listing that took ``mark`` began."""
        return self._recent_commits.get(ino, 0) > mark

    def tombstoned_since(self, prefix: str, mark: int) -> set[str]:
        """Keys under ``prefix`` tombstoned, or deleted from the store, after ``mark``."""
        return {key for key, seq in self._recent_tombs.items()
                if seq > mark and key.startswith(prefix)}

    def tombstones(self) -> list[tuple[int, str]]:
        return [(r[0], r[1]) for r in self._db.execute("SELECT id, key FROM tombstones ORDER BY id")]

    def tombstone_key(self, tomb_id: int) -> str | None:
        found = self._db.execute("SELECT key FROM tombstones WHERE id = ?", (tomb_id,)).fetchone()
        return str(found[0]) if found else None

    def tombstone_pin(self, tomb_id: int) -> tuple[str | None, str | None, str | None, bool]:
        """The stamp and tag of the version a tombstone deletes (None, None: whatever is
        there), where it was moved to (None: a deletion), and whether the key is kept (only
        the writer is told)."""
        found = self._db.execute(
            "SELECT stamp, etag, moved_to, keep FROM tombstones WHERE id = ?",
            (tomb_id,)).fetchone()
        return (None, None, None, False) if found is None else \
            (found[0], found[1], found[2], bool(found[3]))

    def drop_tombstone(self, tomb_id: int) -> None:
        """The deletion is done (or no longer needed)."""
        key = self.tombstone_key(tomb_id)
        self._write("DELETE FROM tombstones WHERE id = ?", (tomb_id,))
        if key is not None:
            self._note_tombstone(key)  # deleted just now: a listing on its way may list it

    # -- sweeps: what other nodes left under a renamed directory --------------------------

    def add_sweep(self, old: str, new: str | None) -> int:
        """A directory was renamed from prefix ``old`` to ``new`` (both end in "/"), or
        removed (``new`` None): whatever other nodes committed under ``old`` is to be moved to
        ``new``, or deleted (upload.py ``_sweep``). Its mark is the version counter now: rows
        whose content is newer than the mark came after the rename."""
        cur = self._write("INSERT INTO sweeps (old, new, mark) VALUES (?, ?, ?)",
                          (old, new, self._version))
        assert cur.lastrowid is not None
        return cur.lastrowid

    def sweeps(self) -> list[int]:
        return [int(r[0]) for r in self._db.execute("SELECT id FROM sweeps ORDER BY id")]

    def sweep(self, sweep_id: int) -> tuple[str, str | None, int] | None:
        """``(old, new, mark)`` of a sweep (``new`` None: a removal)."""
        found = self._db.execute("SELECT old, new, mark FROM sweeps WHERE id = ?",
                                 (sweep_id,)).fetchone()
        return (str(found[0]), None if found[1] is None else str(found[1]),
                int(found[2])) if found else None

    def sweeping(self) -> list[str]:
        """The old prefixes of the sweeps not done yet."""
        return [str(r[0]) for r in self._db.execute("SELECT old FROM sweeps")]

    def drop_sweep(self, sweep_id: int) -> None:
        with self.transaction():
            self._write("DELETE FROM sweeps WHERE id = ?", (sweep_id,))
            self._write("DELETE FROM sweep_plans WHERE sweep = ?", (sweep_id,))

    def sweep_plan(self, sweep_id: int) -> dict[str, str] | None:
        """The objects a sweep found under its old prefix at its first listing (key ->
        ``upload.py`` signature of the version), or None before that listing."""
        found = self._db.execute("SELECT listed FROM sweep_plans WHERE sweep = ?",
                                 (sweep_id,)).fetchone()
        if found is None:
            return None
        listed = json.loads(found[0])
        return {str(k): str(v) for k, v in listed.items()}

    def set_sweep_plan(self, sweep_id: int, listed: dict[str, str]) -> None:
        self._write("INSERT OR REPLACE INTO sweep_plans (sweep, listed) VALUES (?, ?)",
                    (sweep_id, json.dumps(listed, sort_keys=True)))

    def tombstones_of(self, key: str) -> list[tuple[int, str | None]]:
        """(id, stamp) of the tombstones of ``key``."""
        return [(int(r[0]), r[1]) for r in self._db.execute(
            "SELECT id, stamp FROM tombstones WHERE key = ?", (key,))]

    def drop_tombstones_for(self, key: str) -> list[int]:
        ids = [r[0] for r in self._db.execute("SELECT id FROM tombstones WHERE key = ?", (key,))]
        self._write("DELETE FROM tombstones WHERE key = ?", (key,))
        return ids

    # -- xattrs ---------------------------------------------------------------------------

    def xattr_get(self, ino: int, name: bytes) -> bytes | None:
        found = self._db.execute(
            "SELECT value FROM xattrs WHERE ino = ? AND name = ?", (ino, name)
        ).fetchone()
        return bytes(found[0]) if found else None

    def xattr_set(self, ino: int, name: bytes, value: bytes) -> None:
        self._write(
            "INSERT INTO xattrs VALUES (?, ?, ?) ON CONFLICT (ino, name) DO UPDATE SET"
            " value = excluded.value",
            (ino, name, value),
        )

    def xattr_list(self, ino: int) -> list[bytes]:
        return [
            bytes(r[0])
            for r in self._db.execute("SELECT name FROM xattrs WHERE ino = ? ORDER BY name", (ino,))
        ]

    def xattr_remove(self, ino: int, name: bytes) -> bool:
        cur = self._write("DELETE FROM xattrs WHERE ino = ? AND name = ?", (ino, name))
        return cur.rowcount > 0


def _prefix_end(prefix: str) -> str | None:
    """The least string above every string that starts with ``prefix`` (None: no bound).

    SQLite compares TEXT as UTF-8 bytes, which orders as code points do, so the strings with
    the prefix are exactly those in [prefix, _prefix_end(prefix))."""
    while prefix:
        last = ord(prefix[-1])
        if last < 0x10FFFF:
            nxt = last + 1 if not 0xD800 <= last + 1 <= 0xDFFF else 0xE000
            return prefix[:-1] + chr(nxt)
        prefix = prefix[:-1]
    return None


def _key(row: Row, path: bytes | None) -> str | None:
    """The warm-tier key of ``row`` at ``path`` (directories end in "/"), as ``remote_key``."""
    if path is None:
        return None
    return os.fsdecode(path) + ("/" if stat.S_ISDIR(row.mode) else "")


_GET_COLUMNS = operator.attrgetter(*_COLUMNS[1:])
_STATE_AT = _COLUMNS.index("state") - 1
_INCOMPLETE_AT = _COLUMNS.index("incomplete") - 1


def _values(row: Row) -> tuple[object, ...]:
    """The columns after ``ino`` as SQLite stores them (every update computes them: one
    attrgetter, not a generator over 24 getattrs, which was a tenth of a create's CPU)."""
    values = list(_GET_COLUMNS(row))
    state = values[_STATE_AT]
    values[_STATE_AT] = state.value if isinstance(state, State) else state
    values[_INCOMPLETE_AT] = int(values[_INCOMPLETE_AT])
    return tuple(values)
