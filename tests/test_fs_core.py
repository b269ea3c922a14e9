"""Unit tests of the filesystem core (fs.py) without a mount: fast and deterministic."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptfs import errors
from ckptfs.engine.fs import RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_CALLER, Filesystem
from ckptfs.state.journal import ROOT_INODE, Journal, State
from ckptfs.state.staging import Staging

ROOT = ROOT_INODE


def open_fs(root: Path) -> Filesystem:
    staging = Staging(root)
    staging.prepare()
    fs = Filesystem(Journal(root / "journal.db"), staging)
    fs.start()
    return fs


def close_fs(fs: Filesystem) -> None:
    fs.close()
    fs.journal.close()
    fs.staging.close()


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[Filesystem]:
    f = open_fs(tmp_path / "staging")
    yield f
    close_fs(f)


async def write_file(fs: Filesystem, parent: int, name: bytes, data: bytes) -> int:
    fh, row = fs.create(parent, name, 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    await fs.write(fh, 0, data)
    fs.flush(fh)
    fs.release(fh)
    return row.ino


async def read_file(fs: Filesystem, ino: int) -> bytes:
    fh = await fs.open(ino, os.O_RDONLY)
    try:
        return await fs.read(fh, 0, 1 << 30)
    finally:
        fs.release(fh)


async def test_close_stages_and_reopen_starts_new_version(fs: Filesystem) -> None:
    fh, row = fs.create(ROOT, b"a", 0o644, os.O_RDWR | os.O_CREAT, ROOT_CALLER)
    assert row.state is State.OPEN
    await fs.write(fh, 0, b"hello")
    assert fs.getattr(row.ino).size == 5
    fs.release(fh)
    assert row.state is State.STAGED and row.closed_at is not None
    version = row.version
    fh = await fs.open(row.ino, os.O_WRONLY)
    assert row.state is State.OPEN and row.version == version + 1
    fs.release(fh)
    assert fs.journal.get(row.ino).state is State.STAGED  # type: ignore[union-attr]


async def test_two_writers_stay_open_until_the_last_closes(fs: Filesystem) -> None:
    fh1, row = fs.create(ROOT, b"a", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    fh2 = await fs.open(row.ino, os.O_WRONLY)
    fs.release(fh1)
    assert row.state is State.OPEN
    fs.release(fh2)
    assert row.state is State.STAGED


async def test_sparse_write_and_o_trunc(fs: Filesystem) -> None:
    fh, row = fs.create(ROOT, b"s", 0o644, os.O_RDWR | os.O_CREAT, ROOT_CALLER)
    await fs.write(fh, 5 << 30, b"end")  # past 4 GiB
    assert row.size == (5 << 30) + 3
    assert await fs.read(fh, 1 << 30, 4) == b"\0" * 4
    fs.release(fh)
    fh = await fs.open(row.ino, os.O_WRONLY | os.O_TRUNC)
    assert row.size == 0
    fs.release(fh)


async def test_unlink_while_open_keeps_data_until_release(fs: Filesystem) -> None:
    ino = await write_file(fs, ROOT, b"f", b"data")
    fh = await fs.open(ino, os.O_RDONLY)
    await fs.unlink(ROOT, b"f")
    with pytest.raises(errors.NotFound):
        await fs.lookup(ROOT, b"f")
    assert await fs.read(fh, 0, 10) == b"data"
    fs.release(fh)
    assert not fs.staging.exists(ino)
    assert fs.journal.get(ino) is not None  # the kernel may still stat it until forget
    fs.forget(ino, 1)
    assert fs.journal.get(ino) is None


async def test_rename_semantics(fs: Filesystem) -> None:
    a = await write_file(fs, ROOT, b"a", b"A")
    b = await write_file(fs, ROOT, b"b", b"B")
    with pytest.raises(errors.AlreadyExists):
        await fs.rename(ROOT, b"a", ROOT, b"b", RENAME_NOREPLACE)
    await fs.rename(ROOT, b"a", ROOT, b"b", RENAME_EXCHANGE)
    assert await read_file(fs, (await fs.lookup(ROOT, b"b")).ino) == b"A"
    assert await read_file(fs, (await fs.lookup(ROOT, b"a")).ino) == b"B"
    await fs.rename(ROOT, b"a", ROOT, b"b")  # replaces b, whose data goes once unreferenced
    assert (await fs.lookup(ROOT, b"b")).ino == b
    assert fs.journal.get(a) is not None  # still known to the kernel (lookup count)
    fs.forget(a, 10)
    assert fs.journal.get(a) is None and not fs.staging.exists(a)


async def test_directory_rules(fs: Filesystem) -> None:
    d = fs.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    sub = fs.mkdir(d.ino, b"sub", 0o755, ROOT_CALLER)
    await write_file(fs, sub.ino, b"f", b"x")
    with pytest.raises(errors.NotEmpty):
        await fs.rmdir(ROOT, b"d")
    with pytest.raises(errors.InvalidArgument):
        await fs.rename(ROOT, b"d", sub.ino, b"loop")
    with pytest.raises(errors.IsADirectory):
        await fs.unlink(ROOT, b"d")
    e = fs.mkdir(ROOT, b"e", 0o755, ROOT_CALLER)
    with pytest.raises(errors.NotEmpty):
        await fs.rename(ROOT, b"e", ROOT, b"d")
    await fs.rename(ROOT, b"d", ROOT, b"e")  # over an empty directory
    assert fs.journal.path_of((await fs.lookup(sub.ino, b"f")).ino) == b"e/sub/f"
    assert (await fs.lookup(ROOT, b"e")).ino == d.ino and e.ino != d.ino
    with pytest.raises(errors.NameTooLong):
        fs.mkdir(ROOT, b"n" * 256, 0o755, ROOT_CALLER)


async def test_xattrs_and_virtual_state(fs: Filesystem) -> None:
    ino = await write_file(fs, ROOT, b"f", b"x")
    fs.setxattr(ino, b"user.k", b"v")
    assert fs.getxattr(ino, b"user.k") == b"v"
    assert fs.listxattr(ino) == [b"user.k"]
    assert fs.getxattr(ino, b"user.ckptfs.state") == b"staged"
    with pytest.raises(errors.NotPermitted):
        fs.setxattr(ino, b"user.ckptfs.state", b"committed")
    with pytest.raises(errors.NoSuchAttribute):
        fs.getxattr(ino, b"security.capability")
    fs.removexattr(ino, b"user.k")
    with pytest.raises(errors.NoSuchAttribute):
        fs.getxattr(ino, b"user.k")


async def test_setgid_directory_inherits_group(fs: Filesystem) -> None:
    d = fs.mkdir(ROOT, b"shared", 0o2775, ROOT_CALLER)
    await fs.setattr(d.ino, gid=4242, mode=stat.S_IFDIR | 0o2775)
    sub = fs.mkdir(d.ino, b"sub", 0o755, ROOT_CALLER)
    assert sub.gid == 4242 and sub.mode & stat.S_ISGID


async def test_replay_marks_open_files_incomplete_and_keeps_closed(tmp_path: Path) -> None:
    root = tmp_path / "staging"
    fs = open_fs(root)
    closed = await write_file(fs, ROOT, b"closed", b"c" * 1000)
    fh, row = fs.create(ROOT, b"open", 0o600, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    await fs.write(fh, 0, b"o" * 300)
    # The daemon dies: no release, no close. Simulate by dropping the objects.
    fs.journal.close()
    fs.staging.close()

    fs2 = open_fs(root)
    try:
        assert await read_file(fs2, closed) == b"c" * 1000
        reopened = fs2.getattr(row.ino)
        assert reopened.incomplete and reopened.size == 300
        assert fs2.getxattr(row.ino, b"user.ckptfs.state") == b"incomplete"
        assert [r.ino for r in fs2.journal.rows_in_states(State.STAGED)] == [closed]
    finally:
        close_fs(fs2)


async def test_the_close_commits_the_file_staged_and_its_release_writes_nothing(
        fs: Filesystem) -> None:
    """The last writer's close(2) (FLUSH) records the file staged in the journal: what a
    crash before its RELEASE replays it to. It stays OPEN in memory until the RELEASE
    (nothing uploads it before), which then has nothing to write: one commit per closed
    file, not two."""
    fh, row = fs.create(ROOT, b"a", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    await fs.write(fh, 0, b"x" * 1024)
    fs.flush(fh)
    assert row.state is State.OPEN and row.closed_at is not None
    held = fs.journal.get(row.ino)
    assert held is not None and held.state is State.STAGED and held.size == 1024
    assert held.closed_at == row.closed_at
    # The state queries (status, sync) see it open, as the daemon holds it.
    assert [r.ino for r in fs.journal.rows_in_states(State.OPEN)] == [row.ino]
    assert fs.journal.rows_in_states(State.STAGED, State.UPLOADING) == []
    assert fs.journal.linked_totals(State.STAGED, State.UPLOADING) == (0, 0)
    assert fs.journal.linked_totals(State.OPEN) == (1, 1024)
    changes = fs.journal.total_changes
    fs.release(fh)
    assert row.state is State.STAGED and row.closed_at == held.closed_at
    assert fs.journal.total_changes == changes
    assert [r.ino for r in fs.journal.rows_in_states(State.STAGED)] == [row.ino]
    assert fs.journal.rows_in_states(State.OPEN) == []
    assert fs.journal.linked_totals(State.STAGED, State.UPLOADING) == (1, 1024)


@pytest.mark.parametrize("then", ["nothing", "a write", "bytes the daemon did not see"])
async def test_a_crash_between_the_close_and_its_release(tmp_path: Path, then: str) -> None:
    """Killed after close(2) returned, before RELEASE: the file comes back staged, unless it
    was written after that close (through a descriptor dup'ed before it: recorded by the
    daemon's write, or only in the data file, as a passthrough write the daemon had not seen
    yet), which makes it a file never closed: incomplete."""
    root = tmp_path / "staging"
    fs = open_fs(root)
    fh, row = fs.create(ROOT, b"a", 0o644, os.O_RDWR | os.O_CREAT, ROOT_CALLER)
    await fs.write(fh, 0, b"x" * 1000)
    fs.flush(fh)
    if then == "a write":
        await fs.write(fh, 1000, b"y" * 10)
    elif then == "bytes the daemon did not see":
        fd = os.open(fs.staging.path(row.ino), os.O_WRONLY | os.O_APPEND)
        os.write(fd, b"z" * 10)
        os.close(fd)
    fs.journal.close()  # the daemon dies: no RELEASE
    fs.staging.close()
    fs2 = open_fs(root)
    try:
        back = fs2.getattr(row.ino)
        if then == "nothing":
            assert back.state is State.STAGED and not back.incomplete and back.size == 1000
            assert [r.ino for r in fs2.journal.rows_in_states(State.STAGED)] == [row.ino]
        else:
            assert back.incomplete and back.size == 1010
        assert (await read_file(fs2, row.ino))[:1000] == b"x" * 1000
    finally:
        close_fs(fs2)


async def test_stray_staging_files_are_reported_not_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "staging"
    close_fs(open_fs(root))
    (root / "data" / "999").write_bytes(b"who am I")
    fs = open_fs(root)
    close_fs(fs)
    assert (root / "data" / "999").exists()
    assert "no journal entry" in caplog.text
