"""Hard links (docs/HARD_LINKS.md): one inode, several names; in the store one object per name.

Unit level: the core and the uploader over a memory tier behind the fault wrapper, with
trio's autojump clock (tests/test_upload.py's rig): nlink and shared bytes, unlink of either
name (the first name's object adopted or the inode carried to the other key, with the other
name's upload in flight, before anything was uploaded, while open), rewrites and metadata
changes uploading every name, no name published while written, rename over a name and
between names of one file, a transient error, retention deleting a checkpoint that holds
one name, eviction as a unit, link of a remote file, refused kinds, a restart between link
and upload, the schema 3 -> 4 migration. The real-mount test is at the end.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from ckptfs.engine.fs import ROOT_CALLER
from ckptfs.errors import NotPermitted
from ckptfs.state.journal import ROOT_INODE, SCHEMA_VERSION, Journal, Row, State
from ckptfs.state.staging import Staging
from ckptfs.store.tiers.base import Kind
from ckptfs.store.tiers.memory import MemoryTier
from tests.corerig import RecordingTier, Rig, open_rig, read_path
from tests.mounting import Mounter, sync
from tests.test_retention_settle import node as retention_node
from tests.test_retention_sim import write

ROOT = ROOT_INODE


@pytest.fixture
async def rig(tmp_path: Path, request: pytest.FixtureRequest,
              autojump_clock: trio.abc.Clock) -> AsyncIterator[Rig]:
    inner = MemoryTier("warm", "memory://links", f"links-{request.node.name}")
    inner.objects.clear()
    async with open_rig(tmp_path, RecordingTier(inner), inner) as opened:
        yield opened


async def _link(rig: Rig, src: str, dst: str) -> Row:
    parent_path, _, name = dst.rpartition("/")
    parent = await rig.ino(parent_path) if parent_path else ROOT
    return await rig.fs.link(await rig.ino(src), parent, name.encode())


def _nlink(rig: Rig, ino: int) -> int:
    return rig.fs.ns.nlink(rig.fs.getattr(ino))


def _data_files(rig: Rig) -> dict[str, bytes]:
    return {k: v for k, v in rig.files().items() if not k.startswith(".ckptfs/")}


async def test_link_one_inode_two_names_shared_bytes(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    ino = await rig.write("step_1/model.pt", b"v1" * 1000)
    head = await _link(rig, "step_1/model.pt", "step_1/copy.pt")
    assert head.ino == ino == await rig.ino("step_1/copy.pt")
    assert _nlink(rig, ino) == 2
    # Written through one name, read through the other at once.
    fh = await rig.fs.open(await rig.ino("step_1/copy.pt"), os.O_WRONLY | os.O_TRUNC)
    await rig.fs.write(fh, 0, b"v2" * 500)
    rig.fs.flush(fh)
    rig.fs.release(fh)
    assert await read_path(rig, "step_1/model.pt") == b"v2" * 500
    await rig.settle()
    # The store has no hard links: each name is its own object with the same bytes.
    assert _data_files(rig) == {"step_1/model.pt": b"v2" * 500, "step_1/copy.pt": b"v2" * 500}
    names = [r for r in rig.fs.ns.children(await rig.ino("step_1"), 0)]
    assert {r.name for r in names} == {b"model.pt", b"copy.pt"}
    assert all(r.state is State.COMMITTED and r.version == head.version for r in names)
    assert names[0].checksum == names[1].checksum


async def test_unlink_of_an_extra_name_deletes_only_its_object(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    ino = await rig.write("a", b"A" * 100)
    await _link(rig, "a", "b")
    await rig.settle()
    await rig.fs.unlink(ROOT, b"b")
    await rig.settle()
    assert _data_files(rig) == {"a": b"A" * 100}
    assert _nlink(rig, ino) == 1
    assert await read_path(rig, "a") == b"A" * 100


@pytest.mark.parametrize("evicted", [False, True])
async def test_unlink_of_the_first_name_keeps_the_inode_under_the_other(
        rig: Rig, autojump_clock: trio.abc.Clock, evicted: bool) -> None:
    """Both objects committed: the inode adopts the other name's object, nothing is copied;
    with the bytes evicted, they are fetched from that object."""
    ino = await rig.write("a", b"A" * 100)
    await _link(rig, "a", "b")
    await rig.settle()
    if evicted:
        rig.fs.evict(rig.fs.getattr(ino))
        assert rig.fs.getattr(ino).state is State.REMOTE
    calls = dict(rig.tier.calls)
    await rig.fs.unlink(ROOT, b"a")
    await rig.settle()
    assert rig.tier.calls["copy"] == calls.get("copy", 0)
    assert rig.tier.calls["put_file"] == calls.get("put_file", 0)
    assert _data_files(rig) == {"b": b"A" * 100}
    assert await rig.ino("b") == ino and _nlink(rig, ino) == 1
    row = rig.fs.getattr(ino)
    assert row.remote_key == "b" and row.link_of is None
    assert await read_path(rig, "b") == b"A" * 100


async def test_unlink_of_the_first_name_while_the_other_uploads(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """The extra name's upload is in flight (a slow store) when the first name goes: the
    inode is carried to the extra name's key; one object with the bytes remains."""
    ino = await rig.write("a", b"A" * 100)
    await rig.settle()
    rig.tier.latency = 1.0
    await _link(rig, "a", "b")
    await trio.sleep(0.5)  # b's put is on its way
    await rig.fs.unlink(ROOT, b"a")
    await rig.settle()
    assert _data_files(rig) == {"b": b"A" * 100}
    row = rig.fs.getattr(ino)
    assert row.remote_key == "b" and row.state is State.COMMITTED
    assert not rig.fs.journal.tombstones()


async def test_unlink_of_the_first_name_before_anything_is_uploaded(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    rig.tier.down = True
    ino = await rig.write("a", b"A" * 100)
    await _link(rig, "a", "b")
    await rig.fs.unlink(ROOT, b"a")
    rig.tier.down = False
    rig.uploader.hurry()
    await rig.settle()
    assert _data_files(rig) == {"b": b"A" * 100}
    assert rig.fs.getattr(ino).remote_key == "b"


async def test_a_transient_error_on_the_new_names_upload_is_retried(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    await rig.write("a", b"A" * 100)
    await rig.settle()
    rig.tier.fail_next = 1
    await _link(rig, "a", "b")
    await rig.settle()
    assert not rig.uploader.failed()
    assert _data_files(rig) == {"a": b"A" * 100, "b": b"A" * 100}


async def test_retention_deleting_the_first_names_checkpoint_keeps_the_other(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """As retention deletes ``step_1`` (retention.py ``_delete``): its names go from the
    namespace first, then its keys from the store, at once. The file lives on as
    ``step_2/m``, whose object was not written yet: it must come from NVMe, not from the
    deleted key."""
    await rig.write("step_1/m", b"M" * 100)
    rig.fs.mkdir(ROOT, b"step_2", 0o755, ROOT_CALLER)
    await rig.settle()
    rig.tier.down = True
    await _link(rig, "step_1/m", "step_2/m")
    step_1 = await rig.ino("step_1")
    await rig.fs.unlink(step_1, b"m")
    del rig.objects["step_1/m"]
    rig.tier.down = False
    rig.uploader.hurry()
    await rig.settle()
    assert not rig.uploader.failed()
    assert _data_files(rig) == {"step_2/m": b"M" * 100}
    assert await read_path(rig, "step_2/m") == b"M" * 100
    assert rig.fs.getattr(await rig.ino("step_2/m")).remote_key == "step_2/m"


async def test_retention_deletes_one_names_checkpoint_and_the_file_lives_on(
        tmp_path: Path) -> None:
    """``ln step_1/model.pt step_2/model.pt``; retention (warm keeps the last 2 of 3)
    deletes step_1: its name goes, step_2's object and name stay, with the same inode."""
    async with retention_node(tmp_path) as (fs, uploader, retention, warm):
        ino = await write(fs, "step_1/model.pt", b"w" * 100)
        await write(fs, "step_1/.metadata", b"m")
        step_2 = fs.mkdir(ROOT, b"step_2", 0o755, ROOT_CALLER).ino
        await fs.link(ino, step_2, b"model.pt")
        await write(fs, "step_2/.metadata", b"m")
        await write(fs, "step_3/.metadata", b"m")
        await uploader.wait_idle()
        result = await retention.run_once()
        assert [(a.kind, a.checkpoint) for a in result.done if a.kind == "delete"] == \
            [("delete", "step_1")]
        await uploader.wait_idle()
        assert isinstance(warm, MemoryTier)
        assert {k for k in warm.objects if k.startswith("step_")} == \
            {"step_2/", "step_2/model.pt", "step_2/.metadata", "step_3/", "step_3/.metadata"}
        assert warm.objects["step_2/model.pt"].body == b"w" * 100
        assert (await fs.lookup(step_2, b"model.pt")).ino == ino
        assert fs.ns.nlink(fs.getattr(ino)) == 1


async def test_unlink_of_the_first_name_of_an_open_file(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    ino = await rig.write("a", b"A" * 100)
    await _link(rig, "a", "b")
    fh = await rig.fs.open(ino, os.O_WRONLY)
    await rig.fs.unlink(ROOT, b"a")
    await rig.fs.write(fh, 0, b"B" * 10)
    rig.fs.flush(fh)
    rig.fs.release(fh)
    await rig.settle()
    assert _data_files(rig) == {"b": b"B" * 10 + b"A" * 90}


async def test_rewrite_uploads_every_name_again(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    await rig.write("a", b"1" * 100)
    await _link(rig, "a", "b")
    await _link(rig, "b", "c")
    await rig.settle()
    await rig.write("b", b"2" * 50)
    await rig.settle()
    assert _data_files(rig) == {k: b"2" * 50 for k in ("a", "b", "c")}
    ino = await rig.ino("a")
    await rig.fs.setattr(ino, mode=0o600)
    await rig.settle()
    assert {rig.objects[k].meta.mode for k in ("a", "b", "c")} == {0o600}


async def test_an_extra_name_is_not_published_while_the_file_is_written(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    ino = await rig.write("a", b"1" * 100)
    await rig.settle()
    fh = await rig.fs.open(ino, os.O_WRONLY | os.O_TRUNC)
    await _link(rig, "a", "b")
    await rig.fs.write(fh, 0, b"2" * 10)
    await rig.settle()
    assert "b" not in rig.objects  # open for writing: never uploaded
    rig.fs.flush(fh)
    rig.fs.release(fh)
    await rig.settle()
    assert _data_files(rig) == {"a": b"2" * 10, "b": b"2" * 10}


async def test_rename_over_a_name_of_a_linked_file(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``ln a b; mv c a`` then ``mv d b``: each replaced name drops out of its inode."""
    old = await rig.write("a", b"old" * 10)
    await _link(rig, "a", "b")
    new = await rig.write("c", b"new" * 10)
    await rig.settle()
    await rig.fs.rename(ROOT, b"c", ROOT, b"a")
    await rig.settle()
    assert _data_files(rig) == {"a": b"new" * 10, "b": b"old" * 10}
    assert await rig.ino("a") == new and await rig.ino("b") == old
    assert _nlink(rig, old) == 1
    await _link(rig, "b", "e")
    other = await rig.write("d", b"ddd")
    await rig.settle()
    await rig.fs.rename(ROOT, b"d", ROOT, b"e")
    await rig.settle()
    assert _data_files(rig) == {"a": b"new" * 10, "b": b"old" * 10, "e": b"ddd"}
    assert await rig.ino("e") == other and _nlink(rig, old) == 1


async def test_rename_over_the_first_name_before_the_other_is_uploaded(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``ln a b`` (b not in the store yet, a evicted-free but committed), ``mv c a``: the
    inode is carried from key ``a`` to ``b`` while c's copy waits to overwrite ``a``."""
    old = await rig.write("a", b"old" * 10)
    new = await rig.write("c", b"new" * 10)
    await rig.settle()
    rig.tier.latency = 0.5
    rig.tier.down = True
    await _link(rig, "a", "b")
    await rig.fs.rename(ROOT, b"c", ROOT, b"a")
    rig.tier.down = False
    rig.uploader.hurry()
    await rig.settle()
    assert not rig.uploader.failed()
    assert _data_files(rig) == {"a": b"new" * 10, "b": b"old" * 10}
    assert await rig.ino("b") == old and await rig.ino("a") == new
    assert rig.fs.getattr(old).remote_key == "b"


async def test_a_new_name_that_is_a_commit_marker_waits_for_earlier_files(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """``ln pointer latest``: ``latest`` is a marker; its object is put only after every
    file closed before the link has reached the store."""
    rig.tier.latency = 1.0
    await rig.write("step_1/shard", b"s" * 1000)
    await rig.write("pointer", b"step_1")
    await _link(rig, "pointer", "latest")
    await rig.settle()
    starts = {key: t for what, key, t in rig.tier.events if what == "start"}
    ends = {key: t for what, key, t in rig.tier.events if what == "end"}
    assert starts["latest"] >= max(ends["step_1/shard"], ends["pointer"])
    assert _data_files(rig)["latest"] == b"step_1"


async def test_rename_between_two_names_of_one_file_does_nothing(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    ino = await rig.write("a", b"x")
    await _link(rig, "a", "b")
    await rig.fs.rename(ROOT, b"b", ROOT, b"a")
    await rig.fs.rename(ROOT, b"a", ROOT, b"b")
    await rig.settle()
    assert _data_files(rig) == {"a": b"x", "b": b"x"} and _nlink(rig, ino) == 2


async def test_rename_of_an_extra_name_moves_only_its_object(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    await rig.write("a", b"x" * 10)
    await _link(rig, "a", "b")
    await rig.settle()
    rig.fs.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    await rig.fs.rename(ROOT, b"b", await rig.ino("d"), b"b")
    await rig.settle()
    assert _data_files(rig) == {"a": b"x" * 10, "d/b": b"x" * 10}


async def test_bytes_stay_local_until_every_name_is_committed(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    ino = await rig.write("a", b"A" * 100)
    await rig.settle()
    await _link(rig, "a", "b")  # b not uploaded yet
    rig.fs.evict(rig.fs.getattr(ino))
    assert rig.fs.getattr(ino).state is State.COMMITTED
    _, _, kept = await rig.fs.evict_tree(ROOT)
    assert any("another name" in why for why in kept)
    await rig.settle()
    assert (await rig.fs.evict_tree(ROOT))[:2] == (1, 100)  # one inode, its bytes once
    assert rig.fs.getattr(ino).state is State.REMOTE
    assert rig.fs.journal.local_bytes() == 0


async def test_link_of_a_file_known_only_from_the_store_fetches_it(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    ino = await rig.write("a", b"A" * 100)
    await rig.settle()
    rig.fs.evict(rig.fs.getattr(ino))
    await _link(rig, "a", "b")
    assert rig.fs.getattr(ino).state is State.COMMITTED
    await rig.settle()
    assert _data_files(rig) == {"a": b"A" * 100, "b": b"A" * 100}


async def test_links_of_a_fifo_and_a_device_node(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    """A special file's names are one inode here and entries of their own in the store
    (each the same marker: type, mode, rdev); unlinking the first name hands the inode to
    the other, whose entry stays, and the first one's goes."""
    for kind, rdev in ((stat.S_IFIFO, 0), (stat.S_IFCHR, os.makedev(1, 3))):
        tag = "fifo" if kind == stat.S_IFIFO else "chr"
        first = rig.fs.mknod(ROOT, f"{tag}_a".encode(), kind | 0o640, ROOT_CALLER, rdev)
        await _link(rig, f"{tag}_a", f"{tag}_b")
        assert await rig.ino(f"{tag}_b") == first.ino and _nlink(rig, first.ino) == 2
        await rig.settle()
        entries = {k: o.meta for k, o in rig.objects.items() if k.startswith(tag)}
        assert set(entries) == {f"{tag}_a", f"{tag}_b"}
        assert {(m.kind, m.mode, m.rdev) for m in entries.values()} == {
            (Kind.SPECIAL, kind | 0o640, rdev)}
        await rig.fs.setattr(first.ino, mode=0o600)  # every name's entry follows
        await rig.fs.unlink(ROOT, f"{tag}_a".encode())
        await rig.settle()
        row = rig.fs.getattr(await rig.ino(f"{tag}_b"))
        assert row.ino == first.ino and _nlink(rig, row.ino) == 1
        assert stat.S_IFMT(row.mode) == kind and row.rdev == rdev
        entries = {k: o.meta for k, o in rig.objects.items() if k.startswith(tag)}
        assert set(entries) == {f"{tag}_b"}
        assert entries[f"{tag}_b"].mode == kind | 0o600


async def test_link_of_a_directory_or_symlink_is_refused(
        rig: Rig, autojump_clock: trio.abc.Clock) -> None:
    d = rig.fs.mkdir(ROOT, b"d", 0o755, ROOT_CALLER)
    s = rig.fs.symlink(ROOT, b"s", b"d", ROOT_CALLER)
    for ino in (d.ino, s.ino):
        with pytest.raises(NotPermitted):
            await rig.fs.link(ino, ROOT, b"x")


async def test_links_survive_a_restart_and_a_lost_upload_is_redone(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    """The daemon dies after ``link`` returned, before the new name's object was put."""
    inner = MemoryTier("warm", "memory://h", f"h-{id(tmp_path)}")
    tier = RecordingTier(inner)
    async with open_rig(tmp_path, tier, inner) as first:
        ino = await first.write("a", b"A" * 100)
        await first.settle()
        tier.hang = True
        await _link(first, "a", "b")
    tier.hang = False
    assert "b" not in inner.objects
    async with open_rig(tmp_path, tier, inner) as second:
        second.uploader.requeue_from_journal()
        await second.settle()
        assert await second.ino("b") == ino and _nlink(second, ino) == 2
        assert second.files() == {"a": b"A" * 100, "b": b"A" * 100}
        assert second.fs.journal.local_bytes() == 100


def _journal_of_schema(path: Path, version: int) -> None:
    """Turn a new journal at ``path`` into one as schema ``version`` (3 or 4) made it."""
    db = sqlite3.connect(path)
    # Schema 5 added stamps, pinned tombstones and deletion sweeps.
    db.execute("DROP INDEX inodes_stamp")
    db.execute("ALTER TABLE inodes DROP COLUMN stamp")
    for column in ("stamp", "etag", "moved_to", "keep"):
        db.execute(f"ALTER TABLE tombstones DROP COLUMN {column}")
    db.execute("DROP TABLE sweeps")
    db.execute("CREATE TABLE sweeps (id INTEGER PRIMARY KEY AUTOINCREMENT, old TEXT NOT NULL,"
               " new TEXT NOT NULL)")
    db.execute("INSERT INTO sweeps (old, new) VALUES ('a/', 'b/')")
    # The keys' indexes were whole (not partial) before.
    for column in ("remote_key", "uploading_key"):
        db.execute(f"DROP INDEX inodes_{column}_set")
        db.execute(f"CREATE INDEX inodes_{column} ON inodes ({column})")
    if version == 3:
        db.execute("DROP INDEX inodes_link_of")
        db.execute("ALTER TABLE inodes DROP COLUMN link_of")
    db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (str(version),))
    db.commit()
    db.close()


@pytest.mark.parametrize("version", [3, 4])
def test_an_old_journal_is_migrated(tmp_path: Path, version: int) -> None:
    staging = Staging(tmp_path / "s")
    staging.prepare()
    path = staging.root / "journal.db"
    journal = Journal(path)
    journal.ensure_root(0, 0, stat.S_IFDIR | 0o755)
    journal.close()
    _journal_of_schema(path, version)
    journal = Journal(path)
    assert SCHEMA_VERSION == 5
    root = journal.get(ROOT_INODE)
    assert root is not None and root.link_of is None and root.stamp is None
    assert journal.linked_heads() == {}
    # A rename sweep left by the old version is kept; a new one may be a removal.
    assert [journal.sweep(i) for i in journal.sweeps()] == [("a/", "b/", 0)]
    journal.add_sweep("c/", None)
    tomb = journal.add_tombstone("x", "n:r.1", "etag", "y")
    assert journal.tombstone_pin(tomb) == ("n:r.1", "etag", "y", False)
    journal.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == ("5",)
    indexes = {r[0]: r[1] for r in db.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND name LIKE 'inodes_%key%'")}
    assert indexes == {f"inodes_{c}_set": f"CREATE INDEX inodes_{c}_set ON inodes ({c}) WHERE"
                       f" {c} IS NOT NULL" for c in ("remote_key", "uploading_key")}
    db.close()
    staging.close()


# -- a real mount ---------------------------------------------------------------------------


@pytest.mark.mount
@pytest.mark.timeout(300)
def test_hard_links_on_a_mount(mounter: Mounter) -> None:
    m = mounter("a")
    step = m.path / "step_1"
    step.mkdir()
    (step / "model.pt").write_bytes(b"v1" * 1000)
    os.link(step / "model.pt", step / "copy.pt")
    first, second = os.stat(step / "model.pt"), os.stat(step / "copy.pt")
    assert first.st_ino == second.st_ino and first.st_nlink == second.st_nlink == 2
    with open(step / "copy.pt", "r+b") as f:  # written through one name...
        f.write(b"XY")
    assert (step / "model.pt").read_bytes() == b"XY" + b"v1" * 999  # ...read through the other
    with pytest.raises(PermissionError) as refused:
        os.link(step, m.path / "dir-link")
    assert refused.value.errno == errno.EPERM

    # A rename over one name takes only that name; an unlink keeps the others.
    (m.path / "other").write_bytes(b"other")
    os.link(step / "model.pt", m.path / "third")
    assert os.stat(step / "model.pt").st_nlink == 3
    os.rename(m.path / "other", m.path / "third")
    assert (m.path / "third").read_bytes() == b"other"
    os.link(step / "copy.pt", step / "keep.pt")
    os.unlink(step / "model.pt")
    assert os.stat(step / "copy.pt").st_nlink == 2
    data = b"XY" + b"v1" * 999
    sync(m)
    store = m.store
    assert store is not None
    # In the store every name is an object of its own with the same bytes.
    assert (store / "step_1/copy.pt").read_bytes() == (store / "step_1/keep.pt").read_bytes() \
        == data
    assert not (store / "step_1/model.pt").exists() and not (store / "other").exists()
    assert (store / "third").read_bytes() == b"other"

    m.umount()
    m.remount()
    kept = [os.stat(step / n) for n in ("copy.pt", "keep.pt")]
    assert kept[0].st_ino == kept[1].st_ino and kept[0].st_nlink == 2
    assert (step / "keep.pt").read_bytes() == data

    # Another node (a fresh staging directory) sees separate files with the same bytes.
    b = mounter("b", extra=["-o", "metadata_ttl=0.2s"])
    there = [os.stat(b.path / "step_1" / n) for n in ("copy.pt", "keep.pt")]
    assert there[0].st_ino != there[1].st_ino and there[0].st_nlink == there[1].st_nlink == 1
    assert (b.path / "step_1/copy.pt").read_bytes() == (b.path / "step_1/keep.pt").read_bytes() \
        == data
