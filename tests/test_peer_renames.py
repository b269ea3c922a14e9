"""Renames made by another node (peers.py): a node follows them, never uploads the old name
again; a record names the exact version it applies to. Nodes without a mount over one memory
store, deterministic clock (tests/cluster.py).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from ckptfs.cluster.peers import mailbox_of
from ckptfs.engine.fs import Filesystem
from ckptfs.errors import NotFound
from ckptfs.state.journal import ROOT_INODE
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import MemoryTier, store_named
from tests.cluster import Node, make_tier, run_node


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = f"peers-{request.node.name}-{id(tmp_path)}"
    store_named(name).clear()
    return name


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def data_keys(store: str) -> set[str]:
    return {k for k in store_named(store) if not k.startswith(".ckptfs/")}


async def ino_of(fs: Filesystem, path: str) -> int:
    ino = ROOT_INODE
    for part in path.split("/"):
        ino = (await fs.lookup(ino, part.encode())).ino
    return ino


async def list_all(fs: Filesystem, path: str = "") -> None:
    """What ``ls -R`` does: every directory's listing is refreshed (beyond its ttl)."""
    ino = await ino_of(fs, path) if path else ROOT_INODE
    for row in list(await fs.readdir(ino, 0)):
        if row.name is not None and fs.getattr(row.ino).mode & 0o040000:
            await list_all(fs, f"{path}/{row.name.decode()}".lstrip("/"))


async def settle(*nodes: Node) -> None:
    """Three rounds of ``ls -R`` on every node past the listing ttl, each node's uploads done
    after each: what the nodes do about what they see has happened."""
    for _ in range(3):
        await trio.sleep(10)
        for node in nodes:
            await list_all(node.fs)
        for node in nodes:
            await node.uploader.wait_idle()


async def read(fs: Filesystem, path: str) -> bytes:
    fh = await fs.open(await ino_of(fs, path), 0)
    try:
        return await fs.read(fh, 0, 1 << 20)
    finally:
        fs.release(fh)


async def test_tmp_dir_commit_by_another_node_is_followed(
        tmp_path: Path, store: str, clock: trio.abc.Clock) -> None:
    """Lightning/NeMo/Orbax: every node writes its shard into ``step_1.tmp/``, rank 0 (node
    A) renames it to ``step_1``. Node B, listing again, drops its entry under the old name;
    nothing is uploaded under ``step_1.tmp`` again."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store))
        await a.write("step_1.tmp/shard_0", b"a" * 1000)
        await b.write("step_1.tmp/shard_1", b"b" * 1000)
        await a.uploader.wait_idle()
        await b.uploader.wait_idle()
        await trio.sleep(10)  # past the listing ttl: A sees B's shard before it renames
        await a.fs.rename(ROOT_INODE, b"step_1.tmp", ROOT_INODE, b"step_1")
        await a.uploader.wait_idle()
        assert data_keys(store) == {"step_1/", "step_1/shard_0", "step_1/shard_1"}
        # A record for B's version, the one A moved (none for A's own: it knows).
        assert any(k.startswith(mailbox_of(b.name)) for k in store_named(store))
        assert not any(k.startswith(mailbox_of(a.name)) for k in store_named(store))
        for _ in range(3):  # ls -R a few times, as a user would
            await trio.sleep(10)
            await list_all(b.fs)
            await b.uploader.wait_idle()
        assert data_keys(store) == {"step_1/", "step_1/shard_0", "step_1/shard_1"}
        with pytest.raises(NotFound):
            await ino_of(b.fs, "step_1.tmp/shard_1")
        assert await read(b.fs, "step_1/shard_1") == b"b" * 1000
        assert await read(b.fs, "step_1/shard_0") == b"a" * 1000
        # B acted on the record and deleted it, once its act was durable: a journal sync in
        # a worker thread, which the virtual clock does not wait for (a real-time bound).
        deadline = time.monotonic() + 60
        while any(k.startswith(mailbox_of(b.name)) for k in store_named(store)) and \
                time.monotonic() < deadline:
            await trio.sleep(1)
        assert not any(k.startswith(mailbox_of(b.name)) for k in store_named(store))
        await a.stop()
        await b.stop()


async def test_a_lost_object_without_a_move_record_is_uploaded_again(
        tmp_path: Path, store: str, clock: trio.abc.Clock) -> None:
    """The store lost it (no record says why): the local copy goes up again."""
    async with trio.open_nursery() as nursery:
        b = await nursery.start(run_node, tmp_path / "b", store)
        await b.write("step_1/shard_1", b"b" * 1000)
        await b.uploader.wait_idle()
        del store_named(store)["step_1/shard_1"]
        await trio.sleep(10)
        await list_all(b.fs)
        await b.uploader.wait_idle()
        assert store_named(store)["step_1/shard_1"].body == b"b" * 1000
        await b.stop()


async def test_a_record_of_another_version_is_not_followed(
        tmp_path: Path, store: str, clock: trio.abc.Clock) -> None:
    """``x.tmp`` renamed once by A, then written again by B (the same bytes, a version of
    its own) and lost: A's record names A's version, not B's, whatever the clocks say."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        await a.write("x.tmp/f", b"1" * 100)
        await a.uploader.wait_idle()
        await a.fs.rename(ROOT_INODE, b"x.tmp", ROOT_INODE, b"x")
        await a.uploader.wait_idle()
        await trio.sleep(1)
        b = await nursery.start(run_node, tmp_path / "b", store)
        await b.write("x.tmp/f", b"1" * 100)  # the same bytes, written after the rename
        await b.uploader.wait_idle()
        del store_named(store)["x.tmp/f"]
        await trio.sleep(10)
        await list_all(b.fs)
        await b.uploader.wait_idle()
        assert "x.tmp/f" in store_named(store)
        await a.stop()
        await b.stop()


async def test_a_directory_rename_lists_it_again_within_its_ttl(
        tmp_path: Path, store: str, clock: trio.abc.Clock) -> None:
    """Rank 0 renames ``step_1.tmp`` as soon as every shard is committed: its own listing of
    the directory (it made it) is within the ttl and has not seen B's shard; the rename
    lists it again and takes B's shard along (tests/test_store_keys_mount.py on a mount)."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store))
        await a.write("step_1.tmp/shard_0", b"a" * 1000)
        await a.fs.readdir(await ino_of(a.fs, "step_1.tmp"), 0)
        await b.write("step_1.tmp/shard_1", b"b" * 1000)
        await a.uploader.wait_idle()
        await b.uploader.wait_idle()
        await a.fs.rename(ROOT_INODE, b"step_1.tmp", ROOT_INODE, b"step_1")
        await a.uploader.wait_idle()
        assert data_keys(store) == {"step_1/", "step_1/shard_0", "step_1/shard_1"}
        assert await read(a.fs, "step_1/shard_1") == b"b" * 1000
        await a.stop()
        await b.stop()


async def _rename_while_b_uploads(nursery: trio.Nursery, tmp_path: Path,
                                  store: str) -> tuple[Node, Node]:
    """Nodes A and B write ``step_1.tmp/``; rank 0 (A) writes the marker after the job's
    barrier and renames the directory while B's shard is still uploading (10 s)."""
    a = await nursery.start(run_node, tmp_path / "a", store)
    slow = make_tier(store)
    slow.bandwidth = 1000  # B's shard takes 10 s
    b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, tier=slow))
    await a.write("step_1.tmp/shard_0", b"a" * 1000)
    await b.write("step_1.tmp/shard_1", b"b" * 10_000)
    await a.write("step_1.tmp/.metadata", b"meta")  # after the job's barrier
    await a.fs.rename(ROOT_INODE, b"step_1.tmp", ROOT_INODE, b"step_1")
    return a, b


async def test_tmp_dir_commit_right_after_the_barrier_moves_shards_still_uploading(
        tmp_path: Path, store: str, clock: trio.abc.Clock) -> None:
    """The job's barrier guarantees every rank's close(2) returned, not that its shard is in
    the store: rank 0 writes the marker into ``step_1.tmp/`` and renames the directory while
    node B's shard is still uploading. The marker must not reach the store before B's shard
    is at ``step_1/``, and nothing may be left under ``step_1.tmp/``."""
    async with trio.open_nursery() as nursery:
        a, b = await _rename_while_b_uploads(nursery, tmp_path, store)
        with trio.fail_after(600):
            while "step_1/.metadata" not in store_named(store):
                await trio.sleep(0.5)
        assert store_named(store).get("step_1/shard_1") is not None, sorted(data_keys(store))
        await settle(a, b)
        assert data_keys(store) == {"step_1/", "step_1/shard_0", "step_1/shard_1",
                                    "step_1/.metadata"}
        await a.stop()
        await b.stop()


async def test_the_sweep_of_a_rename_survives_a_kill_of_the_renaming_node(
        tmp_path: Path, store: str, clock: trio.abc.Clock) -> None:
    """Rank 0 is killed right after its rename, before the sweep ran: the sweep is in the
    journal and runs after the restart."""
    async with trio.open_nursery() as nursery:
        a, b = await _rename_while_b_uploads(nursery, tmp_path, store)
        assert a.fs.journal.sweeps()
        a.kill()
        await a.stopped.wait()
        await trio.sleep(30)  # B's shard is in the store under the old name by now
        assert "step_1.tmp/shard_1" in store_named(store)
        a = await nursery.start(run_node, tmp_path / "a", store)
        with trio.fail_after(600):
            while "step_1/.metadata" not in store_named(store):
                await trio.sleep(0.5)
        await a.uploader.wait_idle()
        assert not a.fs.journal.sweeps()
        assert data_keys(store) == {"step_1/", "step_1/shard_0", "step_1/shard_1",
                                    "step_1/.metadata"}
        await a.stop()
        await b.stop()


async def test_a_nodes_marker_is_carried_by_another_nodes_rename_while_its_own_removal_waits(
        tmp_path: Path, store: str, clock: trio.abc.Clock) -> None:
    """B removed an old checkpoint (its sweep waits for the nodes' acks) and then closed its
    marker into ``step_1.tmp/``; A renames ``step_1.tmp``. B's ack of A's sweep must wait for
    that marker: it waits for B's sweep only if it is in a related directory, and this one is
    not, so without the wait A's sweep ran first and the marker reached ``step_1.tmp/`` after
    it, where it stayed (found by the model checker)."""
    async with trio.open_nursery() as nursery:
        slow = make_tier(store)
        slow.bandwidth = 1000  # A's shard takes 20 s: A acks B's barriers only then
        a = await nursery.start(functools.partial(run_node, tmp_path / "a", store, tier=slow))
        b = await nursery.start(run_node, tmp_path / "b", store)
        await b.write("old/x", b"x")
        await b.uploader.wait_until_done(b.uploader.last_seq())
        await a.write("step_1.tmp/shard_0", b"a" * 20_000)
        await _rmtree(b, "old")
        await b.write("step_1.tmp/b.done", b"done")
        await a.fs.rename(ROOT_INODE, b"step_1.tmp", ROOT_INODE, b"step_1")
        with trio.fail_after(900):
            while "step_1/b.done" not in store_named(store) or b.fs.journal.sweeps() or \
                    a.fs.journal.sweeps():
                await trio.sleep(1)
        for _ in range(2):
            await trio.sleep(10)
            await a.uploader.wait_idle()
            await b.uploader.wait_idle()
        assert data_keys(store) == {"step_1/", "step_1/shard_0", "step_1/b.done"}
        await a.stop()
        await b.stop()


async def _rmtree(node: Node, path: str) -> None:
    """``rm -r path`` on ``node`` (files, then the directory)."""
    directory = await ino_of(node.fs, path)
    for child in list(node.fs.ns.children(directory, 0)):
        assert child.name is not None
        await node.fs.unlink(directory, child.name)
    await node.fs.rmdir(ROOT_INODE, path.encode())


class _ReadsAfterDeletes(FaultyTier):
    """Holds a read of ``held`` until that key has been deleted: the read reaches the store
    after this node's sweep carried the file away and retired the old key."""

    def __init__(self, store: str, held: str) -> None:
        super().__init__(MemoryTier("warm", f"memory://{store}", store))
        self.held = held
        self.deleted = trio.Event()

    async def read_into(self, key: str, offset: int, length: int, fd: int,
                        fd_offset: int) -> int:
        if key == self.held:
            await self.deleted.wait()
        return await super().read_into(key, offset, length, fd, fd_offset)

    async def delete(self, key: str, *, if_etag: str | None = None) -> None:
        await super().delete(key, if_etag=if_etag)
        if key == self.held:
            self.deleted.set()


async def test_a_read_follows_the_sweep_that_moved_its_file_meanwhile(
        tmp_path: Path, store: str, clock: trio.abc.Clock) -> None:
    """A reads B's shard under the directory it has just renamed, while its own sweep moves
    the shard to the new key and deletes the old one: the read goes to the new key (it
    failed with EIO, the old key gone; found by the model checker with an exchange, which
    makes both files local first)."""
    tier = _ReadsAfterDeletes(store, "step_1.tmp/shard_1")
    async with trio.open_nursery() as nursery:
        a = await nursery.start(functools.partial(run_node, tmp_path / "a", store, tier=tier))
        b = await nursery.start(run_node, tmp_path / "b", store)
        await b.write("step_1.tmp/shard_1", b"b" * 1000)
        await b.uploader.wait_idle()
        await trio.sleep(10)  # past the listing ttl
        await list_all(a.fs)
        await a.fs.rename(ROOT_INODE, b"step_1.tmp", ROOT_INODE, b"step_1")
        assert await read(a.fs, "step_1/shard_1") == b"b" * 1000
        assert tier.deleted.is_set()
        await a.uploader.wait_idle()
        assert data_keys(store) == {"step_1/", "step_1/shard_1"}
        await a.stop()
        await b.stop()


async def test_a_linked_name_another_node_rewrote_shows_its_new_version(
        tmp_path: Path, store: str, clock: trio.abc.Clock) -> None:
    """B links A's file ``d/f`` as ``d/g``; A writes ``d/f`` again. B's ``d/f`` shows A's new
    version and ``d/g`` keeps the bytes it linked (its own object). Before, B's ``d/f`` kept
    the old bytes for good: a name of a linked file never took another node's version
    (found by the model checker)."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(run_node, tmp_path / "b", store)
        await a.write("d/f", b"old" * 100)
        await a.uploader.wait_idle()
        await trio.sleep(10)  # past the listing ttl
        await list_all(b.fs)
        await b.coordinator.enlist()
        await b.fs.link(await ino_of(b.fs, "d/f"), await ino_of(b.fs, "d"), b"g")
        await b.uploader.wait_idle()
        await a.write("d/f", b"new" * 50)
        await a.uploader.wait_idle()
        for _ in range(2):
            await trio.sleep(10)
            await list_all(b.fs)
            await b.uploader.wait_idle()
        assert await read(b.fs, "d/f") == b"new" * 50
        assert await read(b.fs, "d/g") == b"old" * 100
        assert data_keys(store) == {"d/", "d/f", "d/g"}
        assert (await ino_of(b.fs, "d/f")) != (await ino_of(b.fs, "d/g"))
        await a.stop()
        await b.stop()


async def test_a_file_removed_after_its_directorys_rename_takes_a_rewrite_still_uploading(
        tmp_path: Path, store: str, clock: trio.abc.Clock) -> None:
    """B rewrote A's ``step_1/x`` (closed before the job's barrier, still uploading); A
    renames ``step_1`` to ``step_2`` and removes ``step_2/x``. A's deletions must not run
    before the rename's sweep has brought B's version: it came back at ``step_2/x`` for good
    (found by the model checker)."""
    slow = make_tier(store)
    slow.bandwidth = 100  # B's 1,000 bytes take 10 s
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, tier=slow))
        await a.write("step_1/x", b"a" * 500)
        await a.uploader.wait_idle()
        await trio.sleep(10)  # past the listing ttl: B sees A's file
        await list_all(b.fs)
        await b.write("step_1/x", b"b" * 1000)
        await a.fs.rename(ROOT_INODE, b"step_1", ROOT_INODE, b"step_2")
        await a.fs.unlink(await ino_of(a.fs, "step_2"), b"x")
        await a.uploader.wait_idle()
        await b.uploader.wait_idle()
        await settle(a, b)
        assert data_keys(store) == {"step_2/"}
        for node in (a, b):
            with pytest.raises(NotFound):
                await ino_of(node.fs, "step_2/x")
        await a.stop()
        await b.stop()


class _DeletesHeld(FaultyTier):
    """Holds deletions of ``held`` until ``release`` is set: a deletion pending at a key
    while the node lists its directory."""

    def __init__(self, store: str, held: str) -> None:
        super().__init__(MemoryTier("warm", f"memory://{store}", store))
        self.held = held
        self.release = trio.Event()
        self.waiting = trio.Event()

    async def delete(self, key: str, *, if_etag: str | None = None) -> None:
        if key == self.held:
            self.waiting.set()
            await self.release.wait()
        await super().delete(key, if_etag=if_etag)


async def test_a_deletion_of_an_older_version_does_not_take_the_file_now_at_its_key(
        tmp_path: Path, store: str, clock: trio.abc.Clock) -> None:
    """A exchanges ``a/x`` with ``b/y`` (both its own, committed): each is put again under its
    new name, and the old version of ``b/y`` is retired, pinned to its tag. While that
    deletion waits, the file now at ``b/y`` is evicted and ``b/`` is listed: the pending
    deletion made the listing take the file for gone (it was known from the store only) and
    drop it (here ``b/y`` was then missing). In the generator's program (seed 139) the
    deletion, finding no file of A's holding the key any more, then removed the new version
    too, and the store lost ``b/y``."""
    tier = _DeletesHeld(store, "b/y")
    async with trio.open_nursery() as nursery:
        a = await nursery.start(functools.partial(run_node, tmp_path / "a", store, tier=tier))
        await a.write("a/x", b"x" * 1000)
        await a.write("b/y", b"y" * 500)
        await a.uploader.wait_idle()
        await a.fs.rename(await ino_of(a.fs, "a"), b"x", await ino_of(a.fs, "b"), b"y",
                          flags=2)  # RENAME_EXCHANGE
        await tier.waiting.wait()  # b/y's new version is in; the old one's deletion waits
        assert store_named(store)["b/y"].body == b"x" * 1000
        await a.fs.evict_tree(await ino_of(a.fs, "b"))
        await trio.sleep(10)  # past the listing ttl
        await list_all(a.fs)
        tier.release.set()
        await a.uploader.wait_idle()
        assert store_named(store)["b/y"].body == b"x" * 1000
        assert store_named(store)["a/x"].body == b"y" * 500
        assert await read(a.fs, "b/y") == b"x" * 1000
        await a.stop()
