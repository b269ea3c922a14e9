"""A node that comes back from a power loss holds other nodes' barriers (noderun.py,
coordination.py; docs/SEMANTICS.md, "Many nodes, one checkpoint").

A power loss is simulated on the rig of tests/cluster.py: the node is killed (nothing
deregistered, its run record left unclean), its journal rolled back to a copy taken earlier
(its WAL lost) and its data files emptied, then it restarts with another boot id.
Deterministic: the autojump clock stands for time.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import trio
import trio.testing

from ckptfs.cluster.coordination import NODES
from ckptfs.cluster.noderun import HOLD_FILE, RUN_FILE, NodeRun
from ckptfs.engine.fs import ROOT_CALLER
from ckptfs.errors import NotFound
from ckptfs.state.journal import ROOT_INODE
from ckptfs.store.tiers.base import Finish, ObjectInfo, ObjectMeta, Progress
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import MemoryTier, store_named
from tests.cluster import Node, durable_point, make_tier, power_loss, run_node
from tests.mounting import Mounter, ckptfs
from tests.mounting import status as mounting_status
from tests.test_peer_renames import read


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = f"powerloss-{request.node.name}-{id(tmp_path)}"
    store_named(name).clear()
    return name


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def keys(store: str) -> set[str]:
    return set(store_named(store))


async def wait_for(predicate: object, timeout: float = 600) -> None:
    assert callable(predicate)
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.1)


async def _shard_closed_then_lost(
    nursery: trio.Nursery, tmp_path: Path, store: str, *, row_lost: bool,
) -> tuple[Node, Node, int]:
    """B closes its shard, A's marker posts a barrier B sees, B loses power before its upload
    and restarts on a new boot. ``row_lost``: the journal lost the shard's row altogether
    (created after the last durable point), else only its close (it comes back incomplete).
    Returns A, the restarted B and the shard's inode."""
    slow = make_tier(store)
    slow.bandwidth = 100  # B's shard never gets out before the power loss
    a = await nursery.start(run_node, tmp_path / "a", store)
    b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, tier=slow))
    if row_lost:
        durable = durable_point(tmp_path / "b", b.fs.journal)
    ckpt = b.fs.mkdir(ROOT_INODE, b"step_1", 0o755, ROOT_CALLER).ino
    fh, row = b.fs.create(ckpt, b"__1_0.distcp", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
    await b.fs.write(fh, 0, b"b" * 50_000)
    if not row_lost:
        durable = durable_point(tmp_path / "b", b.fs.journal)  # the close below never became durable
    b.fs.flush(fh)
    b.fs.release(fh)
    await a.write("step_1/__0_0.distcp", b"a" * 1000)
    await a.write("step_1/.metadata", b"meta")  # rank 0, after the job's barrier
    await wait_for(lambda: a.coordinator.waiting_for == [b.name])
    await trio.sleep(5)  # B has seen the barrier and waits for its shard's upload
    b.kill()
    await b.stopped.wait()
    power_loss(tmp_path / "b", durable, lost_data=(row.ino,))
    b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, boot="boot-2"))
    return a, b, row.ino


async def _back_from_power_loss(nursery: trio.Nursery, node: Node, root: Path, store: str,
                                durable: Path) -> Node:
    """``node`` loses power (its journal back at ``durable``), restarts on a new boot, its
    hold is cleared (the operator's ``--forget``), and it syncs."""
    node.kill()
    await node.stopped.wait()
    power_loss(root, durable)
    node = await nursery.start(functools.partial(run_node, root, store, boot="boot-2"))
    await node.coordinator.forget(node.name)
    await sync(node)
    return node


@pytest.mark.parametrize("row_lost", [False, True], ids=["close-lost", "row-lost"])
async def test_a_node_back_from_a_power_loss_holds_the_marker_until_an_operator_decides(
    tmp_path: Path, store: str, clock: trio.abc.Clock, row_lost: bool
) -> None:
    async with trio.open_nursery() as nursery:
        a, b, _ = await _shard_closed_then_lost(nursery, tmp_path, store, row_lost=row_lost)
        await trio.sleep(3600)
        # Without the hold B acked at once (nothing queued) and the marker went out torn.
        assert "step_1/.metadata" not in keys(store)
        assert "step_1/__1_0.distcp" not in keys(store)
        assert a.coordinator.waiting_for == [b.name]
        status = b.coordinator.status()["hold"]
        assert status is not None and "power loss" in status["reason"]
        assert status["barriers"] and status["barriers"][0].startswith(a.name + "/")
        assert status["boot_id"] == "boot-2" and status["previous_boot_id"] == "boot-1"
        registration = json.loads(store_named(store)[NODES + b.name].body)
        assert "power loss" in registration["hold"]  # 'ckptfs nodes' on A says why
        assert (tmp_path / "b" / HOLD_FILE).exists()

        # The operator gives the shard up: forget B on A. The marker goes out without it,
        # B notices, clears its hold and registers again.
        await a.coordinator.forget(b.name)
        await wait_for(lambda: "step_1/.metadata" in keys(store))
        assert "step_1/__1_0.distcp" not in keys(store)
        await wait_for(lambda: b.coordinator.hold is None)
        assert not (tmp_path / "b" / HOLD_FILE).exists()
        await wait_for(lambda: NODES + b.name in keys(store))
        assert "hold" not in json.loads(store_named(store)[NODES + b.name].body)

        # The next checkpoint is ordered as usual: B is waited for and acks.
        b.tier.bandwidth = 2_000
        await b.write("step_2/__1_0.distcp", b"c" * 100_000)  # 50 s to upload
        await a.write("step_2/.metadata", b"meta")
        await trio.sleep(20)
        assert "step_2/.metadata" not in keys(store)
        await wait_for(lambda: "step_2/.metadata" in keys(store))
        assert "step_2/__1_0.distcp" in keys(store)
        await a.stop()
        await b.stop()


async def test_the_hold_survives_restarts_and_a_clean_unmount_until_cleared_on_the_node(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    async with trio.open_nursery() as nursery:
        a, b, _ = await _shard_closed_then_lost(nursery, tmp_path, store, row_lost=False)
        await b.stop()  # clean: but holding, so it stays registered
        assert NODES + b.name in keys(store)
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store,
                                                  boot="boot-2"))
        assert b.coordinator.hold is not None
        await trio.sleep(600)
        assert "step_1/.metadata" not in keys(store)

        # On B itself, forgetting its own id is the operator's "give up what it lost".
        await b.coordinator.forget(b.name)
        assert b.coordinator.hold is None
        await wait_for(lambda: "step_1/.metadata" in keys(store))
        with pytest.raises(ValueError, match="itself"):
            await b.coordinator.forget(b.name)  # not holding: refused as before
        await a.stop()
        await b.stop()
    assert NODES + b.name not in keys(store)  # not holding any more: it left cleanly
    b2 = NodeRun(tmp_path / "b", "boot-3")
    assert b2.start("b", incomplete=0) is None  # a clean stop, then a reboot: no hold


async def test_a_kill_without_a_reboot_does_not_hold(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    """A SIGKILL keeps the page cache: the journal knows every close, the node acks as soon
    as its files are uploaded (tests/test_multinode.py covers the order)."""
    async with trio.open_nursery() as nursery:
        b = await nursery.start(run_node, tmp_path / "b", store)
        b.kill()
        await b.stopped.wait()
        record = json.loads((tmp_path / "b" / RUN_FILE).read_text())
        assert record["clean"] is False and record["boot_id"] == "boot-1"
        b = await nursery.start(run_node, tmp_path / "b", store)  # same boot
        assert b.coordinator.hold is None
        await b.stop()
    assert json.loads((tmp_path / "b" / RUN_FILE).read_text())["clean"] is True


def test_an_unknown_boot_id_after_an_unclean_stop_holds(tmp_path: Path) -> None:
    first = NodeRun(tmp_path, None)
    assert first.start("n", incomplete=0) is None  # no record: a new staging directory
    again = NodeRun(tmp_path, None)  # the previous run never stopped cleanly
    hold = again.start("n", incomplete=2)
    assert hold is not None and "2 came back incomplete" in hold.reason
    assert "ckptfs nodes MOUNT --forget n" in hold.reason
    (tmp_path / HOLD_FILE).write_text("garbage")
    assert NodeRun(tmp_path, "x").start("n", incomplete=0) is not None  # still held
    assert oct((tmp_path / RUN_FILE).stat().st_mode & 0o777) == "0o600"


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_a_mount_back_from_a_power_loss_says_it_holds_until_told(
    tmp_path: Path, mounter: Mounter
) -> None:
    """The daemon's side: the run record of the staging directory, ``ckptfs status`` (text and
    JSON), ``ckptfs nodes`` and the end of the hold on the node itself."""
    staging = tmp_path / "b" / "staging"
    staging.mkdir(parents=True)
    # What a node that lost power leaves: a run that never stopped, on another boot.
    (staging / RUN_FILE).write_text(json.dumps({"boot_id": "a-boot-before", "clean": False}))
    b = mounter("b", staging=staging)
    node = mounting_status(b)["node"]
    assert node["hold"] is not None and "power loss" in node["hold"]["reason"]
    assert node["hold"]["previous_boot_id"] == "a-boot-before"
    shown = ckptfs("status", b.path).stdout
    assert "holding" in shown and "--forget" in shown
    listed = json.loads(ckptfs("nodes", b.path, "--json").stdout)
    assert [n.get("hold") is not None for n in listed["nodes"] if n["self"]] == [True]
    b.umount()  # clean, but holding: the hold stays for the next mount
    assert (staging / HOLD_FILE).exists()
    assert json.loads((staging / RUN_FILE).read_text())["clean"] is True
    b.remount()
    assert mounting_status(b)["node"]["hold"] is not None
    ckptfs("nodes", b.path, "--forget", node["node"])  # the operator decides, on the node
    assert mounting_status(b)["node"]["hold"] is None
    assert not (staging / HOLD_FILE).exists()
    b.umount()
    b.remount()  # stopped cleanly on this boot: no hold
    assert mounting_status(b)["node"]["hold"] is None


async def test_shards_rewritten_before_the_operator_forgets_are_waited_for(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    """"Rewrite the lost shards first" (docs/SEMANTICS.md): B rewrites its lost shard, then
    the operator forgets B's own id on B. The ack that follows must wait for the rewritten
    shard (the barrier was noted while B held, before the rewrite), or the marker goes out
    without it."""
    async with trio.open_nursery() as nursery:
        a, b, _ = await _shard_closed_then_lost(nursery, tmp_path, store, row_lost=True)
        await trio.sleep(60)
        assert b.coordinator.held_barriers
        b.tier.bandwidth = 1_000
        await b.write("step_1/__1_0.distcp", b"b" * 50_000)  # 50 s to upload
        await b.coordinator.forget(b.name)
        await wait_for(lambda: "step_1/.metadata" in keys(store))
        assert store_named(store)["step_1/__1_0.distcp"].body == b"b" * 50_000
        await a.stop()
        await b.stop()


async def sync(node: Node) -> None:
    """``ckptfs sync`` on the node."""
    await node.uploader.wait_until_done(node.uploader.last_seq())


@pytest.mark.parametrize("then", ["", "removed", "rewritten"])
async def test_a_move_the_power_loss_made_the_journal_forget(
    tmp_path: Path, store: str, clock: trio.abc.Clock, then: str
) -> None:
    """A renames B's file and the move reaches the store; a power loss rolls A's journal back
    to between its rename and the move's commit. Tried again, the move finds the old key
    gone: the new key holding the version means the move was done (it is committed, not
    incomplete); nothing there (B removed it once A's move was in the store, as the job's
    rules have it, and tells nobody of its own deletion) means it goes on A too; another
    version there (B rewrote it since) is what A shows."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, node="n-b"))
        await b.write("step_1/shard", b"s" * 5000)
        await sync(b)
        step = (await a.fs.lookup(ROOT_INODE, b"step_1")).ino
        await a.fs.lookup(step, b"shard")
        await a.fs.rename(step, b"shard", step, b".metadata")
        durable = durable_point(tmp_path / "a", a.fs.journal)  # the rename, not the move's commit
        await sync(a)
        await wait_for(lambda: "step_1/shard" not in keys(store))
        assert "step_1/.metadata" in keys(store)
        if then:
            b_step = (await b.fs.lookup(ROOT_INODE, b"step_1")).ino
            await trio.sleep(60)  # B's listing shows A's move
            await b.fs.lookup(b_step, b".metadata")
            if then == "removed":
                await b.fs.unlink(b_step, b".metadata")
            else:
                await b.write("step_1/.metadata", b"new" * 100)
            await sync(b)
            assert ("step_1/.metadata" in keys(store)) is (then == "rewritten")
        a = await _back_from_power_loss(nursery, a, tmp_path / "a", store, durable)
        step = (await a.fs.lookup(ROOT_INODE, b"step_1")).ino
        if then == "removed":
            with pytest.raises(NotFound):
                await a.fs.lookup(step, b".metadata")
            assert "step_1/.metadata" not in keys(store)
        else:
            row = await a.fs.lookup(step, b".metadata")
            assert not row.incomplete and row.remote_key == "step_1/.metadata"
            assert await read(a.fs, "step_1/.metadata") == (
                b"new" * 100 if then == "rewritten" else b"s" * 5000)
        await a.stop()
        await b.stop()


class _Held(FaultyTier):
    """The tier of a node back from a power loss whose requests about ``key`` wait for
    ``release``: another node acts on the file in between. Counts the puts to ``key``."""

    def __init__(self, store: str, key: str) -> None:
        super().__init__(MemoryTier("warm", f"memory://{store}", store))
        self.key = key
        self.release = trio.Event()
        self.puts = 0

    async def head(self, key: str) -> ObjectInfo:
        if key == self.key:
            await self.release.wait()
        return await super().head(key)

    async def put_file(self, key: str, source: Path, size: int, meta: ObjectMeta,
                       progress: Progress | None = None, *,
                       finish: Finish | None = None) -> str | None:
        if key == self.key:
            await self.release.wait()
            self.puts += 1
        return await super().put_file(key, source, size, meta, progress, finish=finish)


@pytest.mark.parametrize("then", ["", "rewritten"])
async def test_an_upload_the_power_loss_made_the_journal_forget(
    tmp_path: Path, store: str, clock: trio.abc.Clock, then: str
) -> None:
    """A's file reached the store and was committed; a power loss rolls A's journal back to
    before the commit. Before putting it again, A looks at its key: its own object of that
    version means the upload was done (committed, no second put); B's version there, put
    after A's start had read its records, with B's record naming A's version (B rewrote the
    file once A's was in the store), means the file went on A too. Put again, A's old
    version landed over B's: the store lost B's rewrite."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, node="n-b"))
        await a.write("step_1/x", b"a" * 5000)
        durable = durable_point(tmp_path / "a", a.fs.journal)  # closed, not committed
        await sync(a)
        await trio.sleep(60)  # B's listing shows A's file
        b_step = (await b.fs.lookup(ROOT_INODE, b"step_1")).ino
        await b.fs.lookup(b_step, b"x")
        a.kill()
        await a.stopped.wait()
        power_loss(tmp_path / "a", durable)
        held = _Held(store, "step_1/x")
        a = await nursery.start(functools.partial(run_node, tmp_path / "a", store,
                                                  boot="boot-2", tier=held))
        if then:
            await b.write("step_1/x", b"b" * 300)  # its record of A's version, then its put
            await sync(b)
        held.release.set()
        await a.coordinator.forget(a.name)
        await sync(a)
        assert held.puts == 0
        assert store_named(store)["step_1/x"].body == (b"b" * 300 if then else b"a" * 5000)
        await trio.sleep(60)
        step = (await a.fs.lookup(ROOT_INODE, b"step_1")).ino
        row = await a.fs.lookup(step, b"x")
        assert not row.incomplete
        assert row.state.value == ("remote" if then else "committed")
        assert await read(a.fs, "step_1/x") == (b"b" * 300 if then else b"a" * 5000)
        await a.stop()
        await b.stop()


@pytest.mark.parametrize("then", ["renamed", "removed"])
async def test_a_directory_whose_marker_the_power_loss_made_the_journal_forget(
    tmp_path: Path, store: str, clock: trio.abc.Clock, then: str
) -> None:
    """A made ``step_1.tmp`` with a shard in it, and both reached the store; a power loss
    rolls A's journal back to before their commits. Meanwhile B renamed the directory to
    ``step_1`` (rank 0's tmp-dir commit) or removed it: its sweep told A, for the shard and
    for the directory's marker (which carries its writer's stamp). Back, A lets both go
    instead of putting them again: put again, ``step_1.tmp/`` came back (seed 173)."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, node="n-b"))
        await a.write("step_1.tmp/x", b"a" * 5000)
        durable = durable_point(tmp_path / "a", a.fs.journal)  # made and closed, nothing committed
        await sync(a)
        await trio.sleep(60)  # B's listing shows A's directory
        tmp = await b.fs.lookup(ROOT_INODE, b"step_1.tmp")
        await b.fs.lookup(tmp.ino, b"x")
        if then == "renamed":
            await b.fs.rename(ROOT_INODE, b"step_1.tmp", ROOT_INODE, b"step_1")
        else:
            await b.fs.unlink(tmp.ino, b"x")
            await b.fs.rmdir(ROOT_INODE, b"step_1.tmp")
        await sync(b)
        assert not {k for k in keys(store) if k.startswith("step_1.tmp/")}
        a = await _back_from_power_loss(nursery, a, tmp_path / "a", store, durable)
        assert not {k for k in keys(store) if k.startswith("step_1.tmp/")}
        with pytest.raises(NotFound):
            await a.fs.lookup(ROOT_INODE, b"step_1.tmp")
        if then == "renamed":
            assert store_named(store)["step_1/x"].body == b"a" * 5000
            await trio.sleep(60)
            assert await read(a.fs, "step_1/x") == b"a" * 5000
        await a.stop()
        await b.stop()
