"""``ckptfs evict --staging DIR [PREFIX]``: drop NVMe copies of committed files with no daemon.

The way out of a staging disk too full to mount (staging.py refuses a mount below
``MIN_FREE_BYTES_TO_MOUNT`` free, and only a running daemon could evict): this process takes
the directory's lock as a daemon does, reads the journal, and leaves every file it evicts in
the state the daemon's own eviction (``Filesystem.evict``, which it calls) leaves: REMOTE,
read back from the warm tier at the next mount.

Invariants:
- Only with ``<staging>/lock`` held (flock, non-blocking, ``Staging.lock``): a daemon that
  owns the directory makes this refuse (StagingLocked: use ``ckptfs evict MOUNTPOINT/PATH``);
  while this runs, no daemon can mount it.
- Only linked regular files in state COMMITTED with a ``remote_key`` (uploaded to the warm
  tier and acknowledged) lose their local copy, and not those whose store copy is in an
  archive storage class (a read would then need a restore first), nor those renamed since
  the store copy was made (the move to the new key is still to do, and if the old key is
  gone by then, the uploader falls back to uploading the local copy). OPEN, incomplete,
  STAGED and UPLOADING files, and COMMITTED ones the journal knows no store copy of, are kept
  and reported. REMOTE files lose what is left of their data file: fetched ranges (a cache of
  the store copy; kept if that copy is archived) or the leftover of an eviction cut short.
- Journal first, as the daemon does: the rows are recorded REMOTE (and fetched ranges
  dropped) in one transaction, their data files moved into ``<staging>/trash``, the journal
  made durable (WAL fsynced), and only then are the files unlinked. What is in the trash is
  garbage (staging.py): this command empties it too, as a mount does.
- ``--dry-run`` takes the lock too (a mounted directory is refused the same way), reads, and
  changes nothing.

A crash (or SIGKILL, or power loss) between any two steps loses nothing:

1. before the journal commit: nothing changed; run it again.
2. after the commit, before it is durable: a power loss may roll the commit back; no data
   file was unlinked yet, so the rows are COMMITTED with their whole data, as before.
3. after the commit, between the moves into the trash: some REMOTE rows still have their
   old data file and no fetched ranges. The next mount's replay removes such files
   (``Filesystem._remove_remote_leftovers``), and so does the next run of this command
   (which is the way on when the disk is still too full to mount).
4. after the moves, between unlinks: files left in the trash; the next mount or run of this
   command unlinks them.
5. a power loss that kept some moves and lost the commit: COMMITTED rows without their data
   file, which the next mount's replay turns REMOTE (``Filesystem._repair_committed``: their
   store copy is there), logging the loss; the daemon's eviction has the same window (it
   syncs the journal after the moves, in a worker thread: fs.py ``_mark_evicted``).

Called by cli.py only; never while a daemon serves the directory (the lock says so).
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from ckptfs.errors import CkptfsError, UserError
from ckptfs.state.journal import ROOT_INODE, Journal, Row, State
from ckptfs.state.staging import MIN_FREE_BYTES_TO_MOUNT, Staging, StagingLocked
from ckptfs.store.tiers.base import ARCHIVE_CLASSES

# The journal's name in a staging directory (mount.py names it too; this module stays clear
# of pyfuse3, which mount.py imports).
JOURNAL_NAME = "journal.db"


@dataclass
class Outcome:
    """What an offline eviction did (or, with ``dry_run``, would do)."""

    evicted_files: int = 0
    freed_bytes: int = 0  # disk blocks given back (data files are sparse: not their sizes)
    kept: list[str] = field(default_factory=list)  # "path: why", files that keep their data
    # Free space on the staging filesystem afterwards (a dry run: what it would be then)...
    free_bytes: int = 0
    free_before: int = 0  # ...and when it started
    dry_run: bool = False

    @property
    def mountable(self) -> bool:
        return self.free_bytes >= MIN_FREE_BYTES_TO_MOUNT


def evict_offline(staging_dir: Path, prefix: str = "", dry_run: bool = False) -> Outcome:
    """Evict committed files at or under ``prefix`` (a path relative to the mount root; ""
    is everything) of the unmounted staging directory ``staging_dir``. UserError for
    anything the user can fix: not a staging directory, mounted, no such path."""
    if not (staging_dir / JOURNAL_NAME).is_file():
        # Checked before the lock: taking it creates <staging>/lock, and a typo must not
        # leave a file behind (or a directory that looks like a staging directory).
        raise UserError(f"{staging_dir} is not a ckptfs staging directory (no {JOURNAL_NAME})")
    staging = Staging(staging_dir)
    try:
        staging.lock()
    except StagingLocked:
        raise UserError(
            f"staging directory {staging_dir} is mounted (its ckptfs daemon{_holder(staging_dir)} "
            f"holds its lock): evict through the mount instead, 'ckptfs evict "
            f"MOUNTPOINT/PATH'") from None
    try:
        try:
            journal = Journal(staging_dir / JOURNAL_NAME)
        except CkptfsError as exc:
            raise UserError(f"{exc}{_full_hint(staging)}", exit_code=1) from None
        try:
            return _evict(journal, staging, prefix, dry_run)
        except sqlite3.Error as exc:
            # The journal cannot be written (a disk with no room even for a WAL frame):
            # the transaction rolled back and nothing was unlinked.
            raise UserError(f"cannot update the journal in {staging_dir}: {exc}"
                            f"{_full_hint(staging)}", exit_code=1) from None
        finally:
            journal.close()
    finally:
        staging.close()


def _evict(journal: Journal, staging: Staging, prefix: str, dry_run: bool) -> Outcome:
    from ckptfs.engine.fs import Filesystem  # the daemon's core: its eviction is the one used

    fs = Filesystem(journal, staging)
    top = _resolve(journal, prefix)
    # Oldest first (``rows_in_states`` order): the order the daemon evicts in.
    candidates = journal.rows_in_states(*State)
    if top != ROOT_INODE:
        below = {top, *journal.descendants(top)}
        candidates = [row for row in candidates if row.ino in below]
    # COMMITTED rows among these are renamed ones whose move to the new key is not done.
    unsettled = {row.ino for row in journal.unreconciled()}
    out = Outcome(dry_run=dry_run)
    victims: list[Row] = []
    leftovers: list[Row] = []  # REMOTE files with (part of) a data file
    for row in candidates:  # regular files only
        if row.parent is None:
            continue  # unlinked while open: the next mount purges it, data and all
        if row.link_of is not None:
            continue  # a hard link's extra name: its bytes are its head's
        if row.state is State.REMOTE:
            if row.storage_class in ARCHIVE_CLASSES and journal.ranges(row.ino):
                # Fetched while restored: dropped, it could not be read again without
                # another restore.
                path = os.fsdecode(journal.path_of(row.ino) or b"?")
                out.kept.append(f"{path}: fetched parts of an archived store copy "
                                f"({row.storage_class})")
            elif staging.exists(row.ino):
                leftovers.append(row)
                out.evicted_files += 1
                out.freed_bytes += _allocated(staging, row.ino)
            continue
        why = _keep_reason(row, row.ino in unsettled)
        if not why and not fs.evictable(row):
            why = "another name of it (a hard link) is not committed to the store yet"
        if why:
            path = os.fsdecode(journal.path_of(row.ino) or b"?")
            out.kept.append(f"{path}: {why}")
            continue
        victims.append(row)
        out.evicted_files += 1
        out.freed_bytes += _allocated(staging, row.ino)
    trash = _trash(staging)
    out.evicted_files += len(trash)
    out.freed_bytes += sum(size for _, size in trash)
    out.free_before = staging.free_bytes()
    if dry_run:
        out.free_bytes = out.free_before + out.freed_bytes
        return out
    if trash:
        staging.remove_trashed([path for path, _ in trash])
    with journal.transaction():
        for row in leftovers:
            journal.set_ranges(row.ino, [])  # fetched ranges: a cache, fetched again
    # Records the victims REMOTE, makes the journal durable, then unlinks their data.
    fs.evict(*victims)
    journal.make_durable()  # the dropped ranges too, before their data goes
    for row in leftovers:
        staging.unlink(row.ino)
    out.free_bytes = staging.free_bytes()
    return out


def _keep_reason(row: Row, unsettled: bool) -> str:
    """Why ``row`` (linked, regular, not REMOTE) keeps its local data; "" if it may go.
    ``unsettled``: the journal has work left for it (``Journal.unreconciled``)."""
    if row.incomplete:
        return "incomplete (its writer never closed it)"
    if row.state is State.OPEN:
        return "open for writing when the daemon stopped, not committed to the store"
    if row.state is not State.COMMITTED:
        return f"{row.state.value}, not committed to the store yet"
    if row.remote_key is None:
        return "committed, but the journal records no store copy"
    if row.storage_class in ARCHIVE_CLASSES:
        return f"its store copy is archived ({row.storage_class}): kept readable here"
    if unsettled:
        return "committed, but renamed since: the mount moves its store copy first"
    return ""


def _resolve(journal: Journal, prefix: str) -> int:
    """The inode at ``prefix`` (relative to the mount root), or a UserError naming it."""
    ino = ROOT_INODE
    for part in (p for p in prefix.split("/") if p and p != "."):
        found = journal.lookup(ino, os.fsencode(part))
        if found is None:
            raise UserError(f"{prefix}: no such file or directory in the journal (a path "
                            f"relative to the mount root, e.g. step_100/model.pt)")
        ino = found.ino
    return ino


def _trash(staging: Staging) -> list[tuple[Path, int]]:
    """What an interrupted eviction left in ``<staging>/trash``, with the bytes it holds."""
    try:
        entries = list(os.scandir(staging.trash_dir))
    except FileNotFoundError:
        return []
    return [(Path(entry.path), entry.stat().st_blocks * 512) for entry in entries]


def _allocated(staging: Staging, ino: int) -> int:
    try:
        return os.stat(staging.path(ino)).st_blocks * 512
    except FileNotFoundError:
        return 0  # lost already (a crash, a power loss): only the journal changes


def _holder(staging_dir: Path) -> str:
    """", pid N," from the lock file (the daemon writes its pid there), or "" if unreadable."""
    try:
        pid = (staging_dir / "lock").read_text().strip()
    except OSError:
        return ""
    return f", pid {pid}," if pid.isdigit() else ""


def _full_hint(staging: Staging) -> str:
    try:
        free = staging.free_bytes()
    except OSError:
        return ""
    if free >= MIN_FREE_BYTES_TO_MOUNT:
        return ""
    return (f" ({free // 1024} KiB free: SQLite needs some room to open and update the "
            f"journal; free a few MiB on that filesystem, e.g. {staging.root}/daemon.log, "
            f"and run this again)")

