"""Group commit (ckptfs/state/journal.py ``defer_commits``, ckptfs/state/redo.py): a unit is
safe from a SIGKILL when it returns, although it commits later with others; a power loss leaves
a prefix of what happened; a unit that failed leaves nothing.

A SIGKILL is ``Journal.abandon`` (the connection closes without a commit, the redo log stays,
as a process's death leaves them), or a real ``os._exit`` in a child process. A power loss
is the database as at its last ``make_durable`` (SQLite's backup API beside the live one) and
whatever part of the redo log the disk happened to keep (it is fsynced only when a commit
fails on a full disk).
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.state import redo
from ckptfs.state.journal import ROOT_INODE, Journal, NameTaken, Row, State
from tests.cluster import durable_point


def new_row(name: str, size: int = 0) -> Row:
    now = time.time_ns()
    return Row(ino=0, parent=ROOT_INODE, name=name.encode(), mode=stat.S_IFREG | 0o644, uid=0,
               gid=0, size=size, atime_ns=now, mtime_ns=now, ctime_ns=now, state=State.STAGED)


def opened(path: Path, *, deferred: bool = True) -> Journal:
    journal = Journal(path)
    journal.ensure_root(0, 0, stat.S_IFDIR | 0o755)
    if deferred:
        journal.defer_commits()
    return journal


def state(journal: Journal) -> dict[str, object]:
    """What a restart would see: every entry (with its inode number) and every value."""
    rows = {bytes(r.name or b"").decode(): (r.ino, r.size) for r in journal.children(ROOT_INODE)}
    return {"rows": rows, "values": journal.values_under("k/")}


def test_units_not_committed_come_back_after_a_kill(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = opened(path)
    journal.insert(new_row("a", 1))
    journal.commit_batch()
    with journal.transaction():
        journal.insert(new_row("b", 2))
        journal.set_value("k/b", "two")
    journal.set_value("k/c", "three")
    seen = state(journal)
    assert journal.uncommitted == 2
    journal.abandon()
    reader = sqlite3.connect(path)  # the database alone holds only the first batch
    assert [r[0] for r in reader.execute("SELECT name FROM inodes WHERE parent = 1")] == [b"a"]
    reader.close()
    again = opened(path)
    assert state(again) == seen
    assert again.uncommitted == 0  # replayed and committed at the open
    again.close()


def test_a_real_sigkill_of_a_process_loses_no_acknowledged_unit(tmp_path: Path) -> None:
    """The child acknowledges each unit on its stdout, then dies by ``os._exit`` in the
    middle of a batch: every unit it acknowledged is there."""
    path = tmp_path / "journal.db"
    child = textwrap.dedent(f"""
        import os, sys, time, stat
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from ckptfs.state.journal import Journal, Row, State, ROOT_INODE
        j = Journal({str(path)!r}); j.ensure_root(0, 0, stat.S_IFDIR | 0o755); j.defer_commits()
        for i in range(200):
            now = time.time_ns()
            j.insert(Row(ino=0, parent=ROOT_INODE, name=b"f%d" % i, mode=0o100644, uid=0, gid=0,
                         size=i, atime_ns=now, mtime_ns=now, ctime_ns=now, state=State.OPEN))
            if i % 64 == 63:
                j.commit_batch()
            print(i, flush=True)
        os._exit(9)
    """)
    done = subprocess.run([sys.executable, "-c", child], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 9, done.stderr
    acknowledged = {f"f{line}" for line in done.stdout.split()}
    assert len(acknowledged) == 200
    journal = opened(path)
    assert set(state(journal)["rows"]) == acknowledged  # type: ignore[arg-type]
    journal.close()


def test_a_failed_unit_leaves_nothing_in_the_database_or_the_log(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = opened(path)
    journal.insert(new_row("a"))
    with pytest.raises(NameTaken), journal.transaction():
        journal.set_value("k/x", "half")
        journal.insert(new_row("a"))  # the name is taken: the whole unit goes
    assert journal.values_under("k/") == {}
    seen = state(journal)
    journal.abandon()
    again = opened(path)
    assert state(again) == seen
    again.close()


def test_a_redo_append_that_fails_fails_the_unit(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk under the redo log: the request gets the error and its change is undone
    (the log keeps no torn record in front of the next unit)."""
    path = tmp_path / "journal.db"
    journal = opened(path)
    journal.set_value("k/before", "1")
    real_pwrite = os.pwrite

    def full(fd: int, data: bytes, offset: int) -> int:
        real_pwrite(fd, data[:5], offset)  # a torn record first, as a disk filling up leaves it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(redo.os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        journal.set_value("k/lost", "2")
    monkeypatch.setattr(redo.os, "pwrite", real_pwrite)
    assert journal.values_under("k/") == {"k/before": "1"}
    journal.set_value("k/after", "3")
    seen = state(journal)
    journal.abandon()
    again = opened(path)
    assert state(again) == seen
    again.close()


def test_a_reader_beside_the_live_writer_leaves_its_log_alone(tmp_path: Path) -> None:
    """An offline tool opening the journal of a live daemon (``ckptfs retention --plan``)
    sees what the daemon committed; it neither replays the daemon's units nor empties its
    log, which a SIGKILL of the daemon then still needs."""
    path = tmp_path / "journal.db"
    journal = opened(path)
    journal.set_value("k/a", "1")
    journal.commit_batch()
    journal.set_value("k/b", "2")
    seen = state(journal)
    log = Path(f"{path}-redo").read_bytes()
    reader = Journal(path)
    assert reader.values_under("k/") == {"k/a": "1"}
    reader.close()
    assert Path(f"{path}-redo").read_bytes() == log
    journal.abandon()
    again = opened(path)
    assert state(again) == seen
    again.close()


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs")
    path = tmp_path / "disk"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "redo-test", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """What the writers do: fill ``disk`` to its last byte; the file that does it."""
    filler = disk / "filler"
    with open(filler, "wb") as f, pytest.raises(OSError, match="No space"):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    return filler


def test_a_disk_the_writers_filled_leaves_the_log_its_room(disk: Path) -> None:
    """The writers fill the staging filesystem to its last byte: the units that would free it
    (an upload's, an eviction's) still go in the log, whose blocks it took when it opened and
    keeps after every commit (a log emptied by truncation met ENOSPC there, and the uploads
    that would have made room failed for good: a staging-full test hung)."""
    path = disk / "journal.db"
    journal = opened(path)
    for i in range(100):  # the WAL's pages, reused after the checkpoint
        journal.set_value("k/1", str(i))
    journal.make_durable()  # commits, checkpoints
    filler = fill(disk)
    for i in range(180):  # the log has room; the WAL reuses its pages
        journal.set_value("k/1", str(i))
        if i % 50 == 49:
            journal.commit_batch()
    seen = state(journal)
    journal.abandon()
    filler.unlink()
    again = opened(path)
    assert state(again) == seen
    again.close()


def test_make_durable_on_a_disk_too_full_to_commit_syncs_the_log(
        tmp_path: Path, disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writers filled the disk and the batch needs more WAL than SQLite has: the COMMIT
    fails (SQLITE_FULL), and ``make_durable`` (an eviction's, which would free the disk) syncs
    the redo log instead of failing (it failed a writer with EIO, 1 run in 10 of the staging
    test under load). A power loss then finds the database at its last commit and the units
    after it in the log."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    path = disk / "journal.db"
    journal = opened(path)
    journal.set_value("k/first", "1")
    journal.make_durable()
    durable = shutil.copy(path, tmp_path / "durable.db")  # checkpointed: the WAL is in it
    filler = fill(disk)
    for i in range(800):  # more pages than the WAL has (~160 KB): its COMMIT needs blocks
        journal.set_value(f"k/{i:04d}", "x" * 400)
    with pytest.raises(sqlite3.OperationalError, match="full"):
        journal.commit_batch()
    monkeypatch.setattr(os, "fsync", fsync)
    journal.make_durable()
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert f"{path}-redo" in synced
    seen = state(journal)
    log = Path(f"{path}-redo").read_bytes()
    journal.abandon()
    # The power loss: the database as at its last durable commit, the log as synced.
    filler.unlink()
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    shutil.copy(durable, path)
    Path(f"{path}-redo").write_bytes(log)
    again = opened(path)
    assert state(again) == seen
    assert len(seen["values"]) == 801  # type: ignore[arg-type]
    again.close()


def test_make_durable_commits_the_batch_first(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = opened(path)
    journal.set_value("k/a", "1")
    journal.make_durable()
    assert journal.uncommitted == 0
    reader = sqlite3.connect(path)
    assert reader.execute("SELECT value FROM meta WHERE key = 'k/a'").fetchone() == ("1",)
    reader.close()
    journal.close()


def test_a_batch_sqlite_rolled_back_runs_again_from_the_log(tmp_path: Path) -> None:
    """A COMMIT that fails so badly that SQLite rolls the transaction back (a full disk):
    the units are run again from the log before anything else happens."""
    path = tmp_path / "journal.db"
    journal = opened(path)
    journal.set_value("k/a", "1")
    journal.insert(new_row("b", 7))
    seen = state(journal)
    journal._db.execute("ROLLBACK")  # what SQLite may do after SQLITE_FULL
    journal._rerun_logged()
    assert state(journal) == seen
    journal.commit_batch()
    journal.close()
    again = opened(path, deferred=False)
    assert state(again) == seen
    again.close()


async def test_commit_batches_commits_a_few_milliseconds_after_the_first_unit(
        tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = opened(path, deferred=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.commit_batches, 0.01)
        journal.set_value("k/a", "1")
        assert journal.uncommitted == 1
        await trio.sleep(0.1)
        assert journal.uncommitted == 0
        reader = sqlite3.connect(path)
        assert reader.execute("SELECT value FROM meta WHERE key = 'k/a'").fetchone() == ("1",)
        reader.close()
        nursery.cancel_scope.cancel()
    journal.close()


def test_read_units_stops_at_a_gap_and_at_a_damaged_record(tmp_path: Path) -> None:
    path = tmp_path / "log"
    log = redo.RedoLog(path)
    for seq in (3, 4, 6):
        log.append(seq, [("SELECT ?", (seq,))])
    log.close()
    assert [u[0][1] for u in redo.read_units(path, 2)] == [(3,), (4,)]  # 6 after a gap
    assert [u[0][1] for u in redo.read_units(path, 3)] == [(4,)]
    assert redo.read_units(path, 4) == []
    data = path.read_bytes()
    path.write_bytes(data[:20] + bytes([data[20] ^ 1]) + data[21:])  # the first one damaged
    assert redo.read_units(path, 2) == []


# -- the generator's programs against a reference -----------------------------------------------

OPS = st.lists(st.one_of(
    st.tuples(st.just("set"), st.integers(0, 5), st.integers(0, 99)),
    st.tuples(st.just("drop"), st.integers(0, 5)),
    st.tuples(st.just("pair"), st.integers(0, 5), st.integers(0, 5)),  # one unit, two changes
    st.tuples(st.just("create"), st.integers(0, 9)),
    st.tuples(st.just("failed"), st.integers(0, 5)),  # a unit that raises half way
    st.tuples(st.just("commit")),
    st.tuples(st.just("durable")),
    st.tuples(st.just("kill")),
    st.tuples(st.just("power"), st.floats(0, 1)),
), max_size=40)


def keep_durable_point(journal: Journal, path: Path) -> Path:
    """``make_durable``, and the database as a power loss from now on would leave it."""
    journal.make_durable()
    return durable_point(path.parent, journal)


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_generated_programs_keep_every_acknowledged_unit(tmp_path_factory: pytest.TempPathFactory,
                                                         ops: list[tuple[object, ...]]) -> None:
    """After a kill the journal holds exactly what was acknowledged; after a power loss, the
    state after some acknowledged unit at or after the last ``make_durable`` (a prefix)."""
    root = tmp_path_factory.mktemp("redo")
    path = root / "journal.db"
    journal = opened(path)
    history = [state(journal)]  # the state after each acknowledged unit
    durable_at = 0
    durable = keep_durable_point(journal, path)
    for op in ops:
        kind = op[0]
        if kind == "set":
            journal.set_value(f"k/{op[1]}", str(op[2]))
        elif kind == "drop":
            journal.drop_value(f"k/{op[1]}")
        elif kind == "pair":
            with journal.transaction():
                journal.set_value(f"k/{op[1]}", "pair")
                journal.drop_value(f"k/{op[2]}")
                journal.set_value(f"k/{op[2]}", "pair")
        elif kind == "create":
            try:
                journal.insert(new_row(f"f{op[1]}", int(op[1])))
            except NameTaken:
                pass
        elif kind == "failed":
            with pytest.raises(RuntimeError), journal.transaction():
                journal.set_value(f"k/{op[1]}", "never")
                raise RuntimeError("the request failed half way")
        elif kind == "commit":
            journal.commit_batch()
        elif kind == "durable":
            durable = keep_durable_point(journal, path)
            durable_at = len(history) - 1
        elif kind == "kill":
            journal.abandon()
            journal = opened(path)
            assert state(journal) == history[-1]
        elif kind == "power":
            log = Path(f"{path}-redo").read_bytes()
            journal.abandon()
            for suffix in ("-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
            shutil.copy(durable, path)
            Path(f"{path}-redo").write_bytes(log[:int(len(log) * float(op[1]))])  # type: ignore[arg-type]
            journal = opened(path)
            after = state(journal)
            assert after in history[durable_at:], "not a prefix of what happened"
            history = history[:history.index(after, durable_at) + 1]
            durable_at = len(history) - 1
            durable = keep_durable_point(journal, path)
            continue
        now = state(journal)
        if now != history[-1]:
            history.append(now)
    journal.abandon()
    journal = opened(path)
    assert state(journal) == history[-1]
    journal.close()
