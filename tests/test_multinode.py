"""Commit order across nodes (coordination.py), without a mount: nodes over one memory store.

Deterministic: a clock that jumps as soon as every task waits stands in for time, so "B's upload
takes 100 s" and "A waits an hour" cost nothing. Files stay under 256 KiB, which the uploader
and the memory tier read on the trio thread (the clock would jump while a thread runs).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import trio
import trio.testing

from ckptfs.cluster.coordination import ACKS, BARRIERS, NODES, DuplicateNode
from ckptfs.engine.fs import ROOT_CALLER
from ckptfs.state.journal import ROOT_INODE
from ckptfs.store.tiers.memory import store_named
from tests.cluster import make_tier, run_node


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = f"multi-{request.node.name}-{id(tmp_path)}"
    store_named(name).clear()
    return name


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def keys(store: str) -> set[str]:
    return set(store_named(store))


async def wait_for_key(store: str, key: str, timeout: float = 600) -> None:
    with trio.fail_after(timeout):
        while key not in store_named(store):
            await trio.sleep(0.1)


async def test_a_marker_waits_for_a_shard_another_node_closed_before_it(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    slow = make_tier(store)
    slow.bandwidth = 2_000  # B's 200 kB shard takes 100 s to upload
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(functools.partial(
            run_node, tmp_path / "b", store, tier=slow))
        await b.write("step_1/__1_0.distcp", b"b" * 200_000)
        await a.write("step_1/__0_0.distcp", b"a" * 1000)
        await a.write("step_1/.metadata", b"meta")  # rank 0, after DCP's barrier
        await wait_for_key(store, "step_1/__0_0.distcp")
        await trio.sleep(30)
        assert "step_1/.metadata" not in keys(store)
        assert "step_1/__1_0.distcp" not in keys(store)
        assert a.coordinator.waiting_for == [b.name]
        assert a.uploader.held_markers() == ["step_1/.metadata"]
        await wait_for_key(store, "step_1/.metadata")
        assert "step_1/__1_0.distcp" in keys(store)
        await a.stop()
        await b.stop()
    # Both left cleanly with nothing to upload: no node, barrier or ack is left behind.
    assert not [k for k in keys(store) if k.startswith((NODES, BARRIERS, ACKS))]


async def test_a_killed_node_keeps_the_marker_out_until_it_restarts(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    slow = make_tier(store)
    slow.bandwidth = 2_000
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(functools.partial(
            run_node, tmp_path / "b", store, tier=slow))
        b_name = b.name
        await b.write("step_1/__1_0.distcp", b"b" * 200_000)
        await a.write("step_1/.metadata", b"meta")
        await trio.sleep(10)
        b.kill()  # mid-upload
        await b.stopped.wait()
        await trio.sleep(3600)
        assert "step_1/.metadata" not in keys(store)
        assert a.coordinator.waiting_for == [b_name]
        assert NODES + b_name in keys(store)  # a killed node stays registered
        b = await nursery.start(run_node, tmp_path / "b", store)  # fast store this time
        assert b.name == b_name  # same staging directory, same node
        await wait_for_key(store, "step_1/.metadata")
        assert store_named(store)["step_1/__1_0.distcp"].body == b"b" * 200_000
        await a.stop()
        await b.stop()


async def test_a_node_that_left_cleanly_is_not_waited_for(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(run_node, tmp_path / "b", store)
        await b.write("step_1/__1_0.distcp", b"b")
        await b.uploader.wait_idle()
        await b.stop()
        assert NODES + b.name not in keys(store)
        await a.write("step_1/.metadata", b"meta")
        with trio.fail_after(5):
            await a.uploader.wait_idle()
        assert a.tier.calls["put_small"] == 1  # its registration: no barrier was needed
        await a.stop()


async def test_markers_of_two_nodes_do_not_wait_for_each_other(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(run_node, tmp_path / "b", store)
        await a.write("run_a/COMMITTED", b"a")
        await b.write("run_b/COMMITTED", b"b")
        with trio.fail_after(60):
            await a.uploader.wait_idle()
            await b.uploader.wait_idle()
        assert {"run_a/COMMITTED", "run_b/COMMITTED"} <= keys(store)
        await a.stop()
        await b.stop()


async def test_a_file_changed_while_uploading_is_still_waited_for(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    """A chmod (shutil.copystat, rsync -a) cancels B's upload in flight and queues the file
    again: it keeps its place, so the barrier B saw still waits for it."""
    slow = make_tier(store)
    slow.bandwidth = 1000
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(functools.partial(
            run_node, tmp_path / "b", store, tier=slow))
        await b.write("ckpt/shard_b", b"x" * 48 * 1024)  # uploading for 48 s
        await a.write("ckpt/.metadata", b"meta")
        await trio.sleep(3)
        assert a.coordinator.waiting_for == [b.name]
        ckpt = (await b.fs.lookup(ROOT_INODE, b"ckpt")).ino
        await b.fs.setattr((await b.fs.lookup(ckpt, b"shard_b")).ino, mode=0o444)
        await trio.sleep(10)
        assert "ckpt/.metadata" not in keys(store)
        slow.bandwidth = None
        await wait_for_key(store, "ckpt/.metadata")
        assert store_named(store)["ckpt/shard_b"].meta.mode == 0o444
        await a.stop()
        await b.stop()


async def test_a_store_error_while_waiting_for_acks_does_not_orphan_the_barrier(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    a_tier, b_tier = make_tier(store), make_tier(store)
    b_tier.bandwidth = 4096
    async with trio.open_nursery() as nursery:
        a = await nursery.start(functools.partial(
            run_node, tmp_path / "a", store, tier=a_tier))
        b = await nursery.start(functools.partial(
            run_node, tmp_path / "b", store, tier=b_tier))
        for i in range(3):
            await b.write(f"s{i}/shard", b"x" * 40_000)  # ~10 s to upload
            await a.write(f"s{i}/.metadata", b"m")
            await trio.sleep(1.5)
            a_tier.fail_next = 1  # one store error while A waits for B's ack
            await wait_for_key(store, f"s{i}/.metadata")
            assert f"s{i}/shard" in keys(store)
        await trio.sleep(10)
        assert a.coordinator.stats.barriers_posted == 3
        assert not [k for k in keys(store) if k.startswith((BARRIERS, ACKS))]
        await a.stop()
        await b.stop()


async def test_two_staging_directories_cannot_share_a_node_id(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    """They would not wait for each other: the second is refused (a restart of the first,
    over its own staging directory, is not)."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(functools.partial(run_node, tmp_path / "a", store, node="trainer"))
        with pytest.raises(DuplicateNode, match="trainer"):
            await run_node(tmp_path / "b", store, node="trainer")
        a.kill()
        await a.stopped.wait()
        a = await nursery.start(functools.partial(run_node, tmp_path / "a", store, node="trainer"))
        await a.stop()


async def test_a_file_whose_close_returned_is_waited_for_before_its_release(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    """close(2) returns after FLUSH; the kernel sends RELEASE later. A marker closed in
    between, on another node, still waits for the file."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(run_node, tmp_path / "b", store)
        ckpt = b.fs.mkdir(ROOT_INODE, b"ckpt", 0o755, ROOT_CALLER).ino
        fh, _ = b.fs.create(ckpt, b"shard_b", 0o644, os.O_WRONLY | os.O_CREAT, ROOT_CALLER)
        await b.fs.write(fh, 0, b"y" * 4096)
        b.fs.flush(fh)  # close(2) returned: the job's barrier, then rank 0's marker on A
        await a.write("ckpt/.metadata", b"meta")
        await trio.sleep(30)
        assert "ckpt/.metadata" not in keys(store)
        assert a.coordinator.waiting_for == [b.name]
        b.fs.release(fh)
        await wait_for_key(store, "ckpt/.metadata")
        assert "ckpt/shard_b" in keys(store)
        await a.stop()
        await b.stop()
