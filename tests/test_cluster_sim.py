"""A deterministic simulation of a training job of 64 nodes saving sharded checkpoints to one
store, with nodes killed mid-upload and restarted (docs/SEMANTICS.md, "Many nodes").

Each node is the real filesystem core, uploader and coordinator (tests/cluster.py) over its own
staging directory; the store is one memory tier (conditional writes and strongly consistent
listings, as S3 has). Time is virtual and jumps as soon as every task waits; the kills come
from a seeded random generator. Every save is DCP's: each rank closes its shard, and rank 0,
after the job's barrier (every rank alive and done), writes ``.metadata``, the commit marker.

Invariant, checked at the moment every marker is stored and again at the end: every marker in
the store has all the shards of its checkpoint, byte for byte. Liveness: every marker written
reaches the store once the killed nodes are back.

The store requests per node per second, idle and during a save, are printed (run with ``-s``)
and bounded; docs/SEMANTICS.md quotes them.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from pathlib import Path

import pytest
import trio
import trio.testing

from ckptfs.cluster.coordination import BARRIERS
from ckptfs.store.tiers.base import CONTROL_PREFIX
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import store_named
from tests.cluster import Node, ObservedTier, run_node

NODES = 64
SHARD = 48 * 1024
BANDWIDTH = 16 * 1024  # bytes per second of each node's store link: a shard takes 3 s
SAVES = 6
INTERVAL = 120.0  # seconds between saves
IDLE = 600.0  # seconds of idleness measured before the first save
POLL, IDLE_POLL = 1.0, 10.0  # node_poll_interval, node_idle_poll_interval (the defaults)


class Sim:
    def __init__(self, nursery: trio.Nursery, root: Path, store: str, seed: int) -> None:
        self.nursery = nursery
        self.root = root
        self.store = store
        self.objects = store_named(store)
        self.rng = random.Random(seed)
        self.alive: dict[int, Node] = {}
        self.started: list[Node] = []  # every incarnation, for the request counts
        self.shards: dict[str, dict[str, bytes]] = {}  # checkpoint -> shard key -> bytes
        self.violations: list[str] = []
        self.markers_written: list[str] = []
        self.kills = 0

    # -- nodes ------------------------------------------------------------------------------

    async def start(self, i: int) -> None:
        tier = FaultyTier(ObservedTier(self.store, self.stored))
        tier.bandwidth = BANDWIDTH
        node: Node = await self.nursery.start(functools.partial(
            run_node, self.root / f"node{i:03d}", self.store, tier=tier, node=f"node-{i:03d}",
            poll=POLL, idle_poll=IDLE_POLL))
        self.alive[i] = node
        self.started.append(node)

    async def kill_and_restart(self, i: int, after: float, down_for: float) -> None:
        await trio.sleep(after)
        node = self.alive.pop(i, None)
        if node is None:
            return
        node.kill()
        self.kills += 1
        await node.stopped.wait()
        await trio.sleep(down_for)
        await self.start(i)

    def requests(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for node in self.started:
            total.update(node.tier.calls)
        return total

    # -- the invariant ----------------------------------------------------------------------

    def stored(self, key: str) -> None:
        if key.endswith("/.metadata"):
            self.marker_stored(key)

    def marker_stored(self, key: str) -> None:
        checkpoint = key.rsplit("/", 1)[0]
        for shard, data in self.shards.get(checkpoint, {}).items():
            obj = self.objects.get(shard)
            if obj is None or obj.body != data:
                self.violations.append(f"{key} stored while {shard} is "
                                       f"{'missing' if obj is None else 'wrong'}")

    # -- the job ----------------------------------------------------------------------------

    async def save(self, step: int, *, kills: int) -> str | None:
        """Every live rank writes its shard; rank 0 writes the marker if every rank did (the
        barrier of a real job fails otherwise); then ``kills`` random nodes die mid-upload."""
        checkpoint = f"step_{step}"
        self.shards[checkpoint] = {}
        writers = sorted(self.alive)
        async with trio.open_nursery() as ranks:
            for i in writers:
                data = self.rng.randbytes(SHARD)
                key = f"{checkpoint}/__{i}_0.distcp"
                self.shards[checkpoint][key] = data
                ranks.start_soon(self.alive[i].write, key, data)
        marker = None
        if len(writers) == NODES and 0 in self.alive:
            marker = f"{checkpoint}/.metadata"
            await self.alive[0].write(marker, f"metadata of {checkpoint}".encode())
            self.markers_written.append(marker)
        for i in self.rng.sample(range(NODES), kills):
            self.nursery.start_soon(self.kill_and_restart, i, self.rng.uniform(0, 3),
                                    self.rng.uniform(5, 100))
        return marker


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_64_nodes_never_publish_a_torn_checkpoint(tmp_path: Path,
                                                          clock: trio.abc.Clock) -> None:
    store = f"sim-{id(tmp_path)}"
    store_named(store).clear()
    async with trio.open_nursery() as nursery:
        sim = Sim(nursery, tmp_path, store, seed=12)
        for i in range(NODES):
            await sim.start(i)

        # Idle: only the coordinators' polls.
        before, t0 = sim.requests(), trio.current_time()
        await trio.sleep(IDLE)
        idle = sum((sim.requests() - before).values()) / NODES / (trio.current_time() - t0)

        # A clean save, measured from the first shard to the marker in the store.
        before, t0 = sim.requests(), trio.current_time()
        marker = await sim.save(1, kills=0)
        assert marker is not None
        with trio.fail_after(300):
            while marker not in sim.objects:
                await trio.sleep(0.5)
        took = trio.current_time() - t0
        during = sim.requests() - before
        saving = sum(during.values()) / NODES / took
        control = sum(n for op, n in during.items() if op in ("put_small", "get_small")) \
            / NODES / took

        # Saves with nodes killed mid-upload and restarted at random.
        for step in range(2, SAVES + 1):
            await trio.sleep(INTERVAL)
            await sim.save(step, kills=sim.rng.randint(1, 6))

        # Every node back: every marker written reaches the store.
        with trio.fail_after(3600):
            while len(sim.alive) < NODES:
                await trio.sleep(1)
            for node in list(sim.alive.values()):
                await node.uploader.wait_idle()
        for node in list(sim.alive.values()):
            await node.stop()

    print(f"\n{NODES} nodes, {sim.kills} kills, {len(sim.markers_written)} of {SAVES} saves "
          f"marked; store requests per node per second: idle {idle:.3f}, during a save "
          f"{saving:.2f} ({control:.2f} of them coordination; the save took {took:.1f}s of "
          f"which uploading a shard takes {SHARD / BANDWIDTH:.1f}s)")
    assert not sim.violations, sim.violations[:5]
    assert sim.kills > 0
    for marker in sim.markers_written:
        assert marker in sim.objects, f"{marker} never reached the store"
        sim.marker_stored(marker)  # and again, at the end
    assert not sim.violations, sim.violations[:5]
    # Saves with a dead rank were never marked, and their markers never appear.
    marked = {m.rsplit("/", 1)[0] for m in sim.markers_written}
    assert {k.split("/")[0] for k in sim.objects if k.endswith("/.metadata")} == marked
    # Clean unmounts leave no barrier behind; a poll every IDLE_POLL when idle.
    assert not [k for k in sim.objects if k.startswith(BARRIERS)]
    assert [k for k in sim.objects if k.startswith(CONTROL_PREFIX + "nodes/")] == []
    assert idle <= 1.2 / IDLE_POLL
    assert control < 4 / POLL
