"""Lazy registration (coordination.py, docs/SEMANTICS.md "Many nodes"): a node registers only
before its first change, so a node that only reads never holds another node's markers, however
it dies. Without a mount, over one memory store, on a clock that jumps whenever every task
waits (tests/test_multinode.py); ``run_node(lazy=True)`` registers as a mount does, and
``Node.write`` goes through ``enlist`` as the mount's changing requests do.

The interleavings checked are the ones the soundness argument in coordination.py names: a
registration racing a barrier, a barrier seen before the node registered, a kill between
the registration and the first close, and the store down at the first change.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import trio
import trio.testing

from ckptfs.cluster.coordination import ACKS, HEARTBEAT, NODES, SLOW_ACK
from ckptfs.errors import StoreUnavailable
from ckptfs.state.journal import ROOT_INODE
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import MemoryTier, store_named
from tests.cluster import make_tier, run_node


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name = f"lazy-{request.node.name}-{id(tmp_path)}"
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


class GatedTier(FaultyTier):
    """Registrations (``.ckptfs/nodes/...`` puts) wait for ``opened`` before they land."""

    def __init__(self, store: str) -> None:
        super().__init__(MemoryTier("warm", f"memory://{store}", store))
        self.opened = trio.Event()
        self.waiting = trio.Event()

    async def put_small(self, key: str, data: bytes, *, if_absent: bool = False,
                        if_tag: str | None = None) -> str:
        if key.startswith(NODES):
            self.waiting.set()
            await self.opened.wait()
        return await super().put_small(key, data, if_absent=if_absent, if_tag=if_tag)


async def test_a_reader_killed_holds_no_marker(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    """A dead reader blocks nobody: B mounts, lists and reads, and is SIGKILLed; A's markers
    still go out."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(functools.partial(run_node, tmp_path / "a", store, lazy=True))
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, lazy=True))
        await a.write("step_1/__0_0.distcp", b"a" * 1000)
        await a.write("step_1/.metadata", b"meta")
        await wait_for_key(store, "step_1/.metadata")
        # B reads what A wrote (a listing and a fault-in), then dies.
        step = await b.fs.lookup(ROOT_INODE, b"step_1")
        assert {r.name for r in await b.fs.readdir(step.ino, 0)} == {
            b"__0_0.distcp", b".metadata"}
        fh = await b.fs.open((await b.fs.lookup(step.ino, b".metadata")).ino, 0)
        assert await b.fs.read(fh, 0, 100) == b"meta"
        b.fs.release(fh)
        await trio.sleep(30)  # it saw A's barrier meanwhile (if any), and acked nothing
        b_name = b.name
        b.kill()
        await b.stopped.wait()
        assert NODES + b_name not in keys(store)
        assert b.tier.calls["put_small"] == 0  # no registration, no ack, no heartbeat
        # Restarted over its journal (every entry it listed is queued again, and found
        # done): still nothing to register for.
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, lazy=True))
        assert not b.coordinator.registered and not b.uploader.work_left()
        b.kill()
        await b.stopped.wait()
        await a.write("step_2/__0_0.distcp", b"a" * 1000)
        await a.write("step_2/.metadata", b"meta")
        with trio.fail_after(30):
            await wait_for_key(store, "step_2/.metadata")
        await a.stop()


async def test_a_registration_racing_a_barrier(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    """B's first write waits for its registration. While that PUT is on its way, A's
    barrier does not see B and its marker goes out: right, since B's write has not returned.
    Once registered, B is waited for: A's next marker waits for B's slow shard."""
    gated = GatedTier(store)
    gated.bandwidth = 2_000  # B's 100 kB shard takes 50 s
    async with trio.open_nursery() as nursery:
        a = await nursery.start(functools.partial(run_node, tmp_path / "a", store, lazy=True))
        b = await nursery.start(functools.partial(
            run_node, tmp_path / "b", store, lazy=True, tier=gated))
        written = trio.Event()

        async def b_writes() -> None:
            await b.write("step_1/__1_0.distcp", b"b" * 100_000)
            written.set()

        nursery.start_soon(b_writes)
        await gated.waiting.wait()  # B's registration is on its way; its write waits
        await a.write("step_1/.metadata", b"meta 1")
        await wait_for_key(store, "step_1/.metadata")
        assert not written.is_set() and NODES + b.name not in keys(store)
        gated.opened.set()
        await written.wait()
        assert NODES + b.name in keys(store)
        await a.write("step_2/.metadata", b"meta 2")  # after B's close: waits for it
        await trio.sleep(20)
        assert "step_2/.metadata" not in keys(store)
        assert a.coordinator.waiting_for == [b.name]
        await wait_for_key(store, "step_2/.metadata")
        assert "step_1/__1_0.distcp" in keys(store)
        await a.stop()
        await b.stop()
    assert not [k for k in keys(store) if k.startswith(NODES)]


async def test_a_barrier_seen_before_registering_is_acked_after(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    """A waits for slow C; B, unregistered, sees A's barrier and acks nothing; B then writes
    (registers): A's listing now shows B, so B must ack that barrier too, or A waits forever."""
    slow = make_tier(store)
    slow.bandwidth = 2_000
    async with trio.open_nursery() as nursery:
        a = await nursery.start(functools.partial(run_node, tmp_path / "a", store, lazy=True))
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, lazy=True,
                                                  poll=0.5))
        c = await nursery.start(functools.partial(
            run_node, tmp_path / "c", store, lazy=True, tier=slow))
        await c.write("step_1/__2_0.distcp", b"c" * 100_000)  # 50 s to upload
        await a.write("step_1/.metadata", b"meta")
        await trio.sleep(15)
        assert a.coordinator.waiting_for == [c.name]
        assert b.tier.calls["put_small"] == 0
        await b.write("other/file", b"b")  # B registers while A waits
        await trio.sleep(2)
        assert b.name in set(await a.coordinator.nodes())
        await wait_for_key(store, "step_1/.metadata")
        assert "step_1/__2_0.distcp" in keys(store)
        assert b.coordinator.stats.barriers_acked >= 1
        for n in (a, b, c):
            await n.stop()
    assert not [k for k in keys(store) if k.startswith((NODES, ACKS))]


async def test_a_kill_between_registering_and_closing_is_cleaned_up_at_restart(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    """B registered (its first open) and was killed before closing anything: it is waited
    for until it comes back; back with nothing to upload, it removes its registration."""
    async with trio.open_nursery() as nursery:
        a = await nursery.start(functools.partial(run_node, tmp_path / "a", store, lazy=True))
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, lazy=True))
        b_name = b.name
        await b.coordinator.enlist()
        b.kill()
        await b.stopped.wait()
        assert NODES + b_name in keys(store)
        await a.write("step_1/.metadata", b"meta")
        await trio.sleep(60)
        assert "step_1/.metadata" not in keys(store)
        assert a.coordinator.waiting_for == [b_name]
        b = await nursery.start(functools.partial(run_node, tmp_path / "b", store, lazy=True))
        assert NODES + b_name not in keys(store)
        assert not b.coordinator.registered
        await wait_for_key(store, "step_1/.metadata")
        await a.stop()
        await b.stop()


async def test_the_store_down_at_the_first_change_fails_it_after_the_timeout(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    """The first write waits for the registration with backoff, then fails having changed
    nothing; with the store back, the next one registers and goes on."""
    tier = make_tier(store)
    async with trio.open_nursery() as nursery:
        b = await nursery.start(functools.partial(
            run_node, tmp_path / "b", store, lazy=True, tier=tier, register_timeout=120))
        tier.down = True
        started = trio.current_time()
        with pytest.raises(StoreUnavailable, match="could not register"):
            await b.write("step_1/shard", b"x")
        assert 100 <= trio.current_time() - started <= 121
        assert tier.calls["put_small"] > 3  # retried meanwhile
        assert not list(await b.fs.readdir(ROOT_INODE, 0))  # nothing was made
        tier.down = False
        await b.write("step_1/shard", b"x")
        assert NODES + b.name in keys(store)
        await wait_for_key(store, "step_1/shard")
        await b.stop()


async def test_a_registered_node_says_when_it_was_last_seen_and_what_it_has_left(
    tmp_path: Path, store: str, clock: trio.abc.Clock
) -> None:
    slow = make_tier(store)
    slow.bandwidth = 1_000  # 200 s for B's shard
    async with trio.open_nursery() as nursery:
        a = await nursery.start(functools.partial(run_node, tmp_path / "a", store, lazy=True))
        b = await nursery.start(functools.partial(
            run_node, tmp_path / "b", store, lazy=True, tier=slow))
        await b.write("step_1/__1_0.distcp", b"b" * 200_000)
        await trio.sleep(HEARTBEAT + 15)
        record = json.loads(store_named(store)[NODES + b.name].body)
        assert record["pending_files"] == 1 and record["pending_bytes"] == 200_000
        assert "token" not in json.dumps(await a.coordinator.describe())
        await a.write("step_1/.metadata", b"meta")
        await trio.sleep(SLOW_ACK + 5)  # what a slow node's registration says is read now
        assert a.coordinator.waiting_for == [b.name]
        info = a.coordinator.status()["waiting_for_info"][b.name]
        assert info["pending_files"] == 1 and "token" not in info
        b_name = b.name
        b.kill()
        await b.stopped.wait()
        await trio.sleep(3 * HEARTBEAT)
        described = {n["node"]: n for n in await a.coordinator.describe()}
        assert described[b_name]["seen_ago_s"] >= 2 * HEARTBEAT  # no heartbeat since
        assert described[a.name]["seen_ago_s"] < HEARTBEAT + 5
        await a.coordinator.forget(b_name)
        await wait_for_key(store, "step_1/.metadata")
        await a.stop()
