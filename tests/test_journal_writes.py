"""The journal's WAL is checkpointed by a worker thread, not inside the loop's commits
(ckptfs/state/walcheckpoint.py), and ``Journal.update`` writes only the columns
that changed, never fewer than a rollback undid."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import time
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.state.journal import ROOT_INODE, Journal, Row, State


def new_row(i: int) -> Row:
    now = time.time_ns()
    return Row(ino=0, parent=ROOT_INODE, name=f"f{i}".encode(), mode=0o100644, uid=0, gid=0,
               size=i, atime_ns=now, mtime_ns=now, ctime_ns=now, state=State.STAGED)


def db_pages(path: Path) -> int:
    return os.stat(path).st_size // 4096


async def test_commits_leave_the_database_file_to_the_checkpointer(tmp_path: Path) -> None:
    """3,000 commits (a WAL of well over SQLite's 1,000-page automatic checkpoint) never
    write the database file themselves; the checkpointer's first round copies them there,
    and a reader through a new connection sees every row before and after."""
    path = tmp_path / "journal.db"
    journal = Journal(path)
    journal.ensure_root(0, 0, 0o40755)
    walcheck = journal.checkpoint_in_background()
    walcheck.interval = 3600.0  # no round during the commits
    before = db_pages(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(walcheck.run, lambda: journal.total_changes)
        for i in range(3000):
            with journal.transaction():
                row = journal.insert(new_row(i))
                row.size += 1
                journal.update(row)
        assert walcheck.wal_bytes() > 1000 * 4096  # past the automatic checkpoint's mark
        assert db_pages(path) == before  # no commit copied a page into the database
        other = sqlite3.connect(path)
        assert other.execute("SELECT count(*) FROM inodes").fetchone()[0] == 3001
        busy, frames, copied = await trio.to_thread.run_sync(walcheck.checkpoint_now)
        assert busy == 0 and frames == copied > 0
        assert db_pages(path) > before
        assert other.execute("SELECT count(*) FROM inodes").fetchone()[0] == 3001
        other.close()
        nursery.cancel_scope.cancel()
    journal.close()
    reopened = Journal(path)
    assert len(reopened.children(ROOT_INODE, 0, limit=5000)) == 3000
    reopened.close()


async def test_a_round_runs_only_after_changes(tmp_path: Path) -> None:
    """Real time (the checkpoint runs in a thread, which a virtual clock does not wait for),
    with rounds every 20 ms."""
    journal = Journal(tmp_path / "journal.db")
    journal.ensure_root(0, 0, 0o40755)
    walcheck = journal.checkpoint_in_background()
    walcheck.interval = 0.02
    async with trio.open_nursery() as nursery:
        await nursery.start(walcheck.run, lambda: journal.total_changes)
        await trio.sleep(0.3)
        assert walcheck.checkpoints == 0  # nothing changed: nothing to copy
        journal.insert(new_row(1))
        with trio.fail_after(60):
            while walcheck.checkpoints == 0:
                await trio.sleep(0.01)
        await trio.sleep(0.3)
        assert walcheck.checkpoints == 1  # and none more while nothing changes
        nursery.cancel_scope.cancel()
    journal.close()


# -- Journal.update writes only what changed ----------------------------------------------------


def stored(journal: Journal, ino: int) -> Row:
    row = journal.get(ino)
    assert row is not None
    return row


def test_update_after_a_rollback_writes_what_the_rollback_undid(tmp_path: Path) -> None:
    """The memory of last written values must not outlive a rollback: the same values
    written again after one reach the database."""
    journal = Journal(tmp_path / "journal.db")
    journal.ensure_root(0, 0, 0o40755)
    row = journal.insert(new_row(1))
    row.size = 5
    journal.update(row)
    row.size = 7
    try:
        with journal.transaction():
            journal.update(row)
            raise RuntimeError("rolled back")
    except RuntimeError:
        pass
    assert stored(journal, row.ino).size == 5
    journal.update(row)  # size 7 again: the rolled-back write must be made now
    assert stored(journal, row.ino).size == 7
    journal.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["size", "state", "remote_key", "checksum",
                                           "incomplete", "closed_at", "name"]),
                          st.integers(0, 3), st.booleans()), max_size=30))
def test_the_database_always_holds_the_last_committed_values(
        tmp_path_factory: pytest.TempPathFactory,
        changes: list[tuple[str, int, bool]]) -> None:
    journal = Journal(tmp_path_factory.mktemp("j") / "journal.db")
    journal.ensure_root(0, 0, 0o40755)
    row = journal.insert(new_row(1))
    committed = dataclasses.replace(row)
    for column, value, roll_back in changes:
        new = {"size": value, "state": list(State)[value], "remote_key": f"k{value}",
               "checksum": None if value == 0 else f"c{value}", "incomplete": bool(value % 2),
               "closed_at": float(value), "name": f"n{value}".encode()}[column]
        setattr(row, column, new)
        if roll_back:
            try:
                with journal.transaction():
                    journal.update(row)
                    raise RuntimeError
            except RuntimeError:
                pass
        else:
            journal.update(row)
            committed = dataclasses.replace(row)
        assert stored(journal, row.ino) == committed
    journal.close()
