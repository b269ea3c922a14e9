"""Q8's simulated cluster: store requests per node per second at N nodes.

N nodes of tests/cluster.py (each the real filesystem core, uploader and coordinator over its
own staging directory and SQLite journal; no FUSE) share one memory store, in virtual time (a
trio MockClock that jumps as soon as every task waits), as tests/test_cluster_sim.py runs 64.
No kills: the nodes start, stay idle for --idle virtual seconds (only the coordinators' polls),
then save once: every node writes a shard of --shard bytes (its store link limited to --bw
bytes/s), node 0 writes the commit marker ``.metadata`` after all, and the clock runs until the
marker is in the store. Then a rotation: a second save, and node 0 removes the first checkpoint
(``rm -r``: every node's shard, each node still holding its copy); the clock runs until the
store has none of it left and every node has read and acted on the records of its shard's
deletion (peers.py: none is left). Prints one JSON object: the requests per node per virtual
second, idle, during the save (and the coordination share) and during the rotation, by
operation, and the wall seconds each phase took here.

Run by questions/q8_responsiveness.py as a child with PYTHONPATH holding the ckptfs checkout
(for ``ckptfs`` and ``tests.cluster``).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio
import trio.testing

from ckptfs.cluster.peers import FATES
from ckptfs.engine.fs import Filesystem
from ckptfs.state.journal import ROOT_INODE
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import MemoryTier, store_named
from tests.cluster import Node, run_node


async def save(nodes: list[Node], objects: dict[str, Any], step: int, shard: int,
               rng: random.Random) -> None:
    """Every node writes its shard of ``step_<step>``, node 0 the marker after them; returns
    once the marker is in the store."""
    async with trio.open_nursery() as ranks:
        for i, nd in enumerate(nodes):
            ranks.start_soon(nd.write, f"step_{step}/__{i}_0.distcp", rng.randbytes(shard))
    marker = f"step_{step}/.metadata"
    await nodes[0].write(marker, f"metadata of step_{step}".encode())
    with trio.fail_after(7200):
        while marker not in objects:
            await trio.sleep(0.5)


async def remove(fs: Filesystem, name: str) -> None:
    """``rm -r name`` (a top-level directory) on a node, as it sees the store."""
    assert fs.lister is not None
    top = await fs.lookup(ROOT_INODE, name.encode())
    await fs.lister.refresh_tree(top, current=True)
    for child in list(fs.ns.children(top.ino, 0)):
        assert child.name is not None
        await fs.unlink(top.ino, child.name)
    await fs.rmdir(ROOT_INODE, name.encode())


async def simulate(n: int, idle: float, shard: int, bw: float, root: Path) -> dict[str, Any]:
    store = f"q8-sim-{n}-{time.monotonic_ns()}"
    objects = store_named(store)
    objects.clear()
    nodes: list[Node] = []
    rng = random.Random(8)
    wall: dict[str, float] = {}
    out: dict[str, Any] = {"nodes": n}
    async with trio.open_nursery() as nursery:
        w0 = time.perf_counter()
        for i in range(n):
            tier = FaultyTier(MemoryTier("warm", f"memory://{store}", store))
            tier.bandwidth = bw
            node: Node = await nursery.start(functools.partial(
                run_node, root / f"node{i:04d}", store, tier=tier, node=f"node-{i:04d}",
                poll=1.0, idle_poll=10.0))
            nodes.append(node)
        wall["start"] = time.perf_counter() - w0

        def ops() -> Counter[str]:
            total: Counter[str] = Counter()
            for nd in nodes:
                total.update(nd.tier.calls)
            return total

        w0, before, t0 = time.perf_counter(), ops(), trio.current_time()
        await trio.sleep(idle)
        during = ops() - before
        out["idle_virtual_s"] = trio.current_time() - t0
        out["idle_per_node_s"] = sum(during.values()) / n / out["idle_virtual_s"]
        out["idle_by_op"] = dict(during)
        wall["idle"] = time.perf_counter() - w0

        w0, before, t0 = time.perf_counter(), ops(), trio.current_time()
        await save(nodes, objects, 1, shard, rng)
        took = trio.current_time() - t0
        during = ops() - before
        out["save_virtual_s"] = took
        out["save_per_node_s"] = sum(during.values()) / n / took
        out["save_control_per_node_s"] = sum(
            v for op, v in during.items() if op in ("put_small", "get_small")) / n / took
        out["save_by_op"] = dict(during)
        wall["save"] = time.perf_counter() - w0

        await save(nodes, objects, 2, shard, rng)
        w0, before, t0 = time.perf_counter(), ops(), trio.current_time()
        await remove(nodes[0].fs, "step_1")
        with trio.fail_after(7200):
            while any(k.startswith(("step_1", FATES)) for k in objects):
                await trio.sleep(0.5)
        took = trio.current_time() - t0
        during = ops() - before
        out["rotation_virtual_s"] = took
        out["rotation_per_node_s"] = sum(during.values()) / n / took
        out["rotation_by_op"] = dict(during)
        out["records_written"] = sum(nd.fs.peers.records_written for nd in nodes
                                     if nd.fs.peers is not None)
        wall["rotation"] = time.perf_counter() - w0

        w0 = time.perf_counter()
        async with trio.open_nursery() as stops:
            for nd in nodes:
                stops.start_soon(nd.stop)
        wall["stop"] = time.perf_counter() - w0
    out["wall_s"] = wall
    out["shard_upload_s"] = shard / bw
    objects.clear()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("nodes", type=int)
    p.add_argument("--idle", type=float, default=600.0, help="virtual seconds idle")
    p.add_argument("--shard", type=int, default=48 * 1024, help="bytes per node's shard")
    p.add_argument("--bw", type=float, default=16 * 1024, help="store bytes/s per node")
    p.add_argument("--dir", type=Path, required=True, help="where the staging dirs go")
    a = p.parse_args()
    # Each node holds its journal (db, -wal, -shm) and staging files open.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory(prefix="sim-", dir=a.dir) as root:
        clock = trio.testing.MockClock(autojump_threshold=0)
        result = trio.run(simulate, a.nodes, a.idle, a.shard, a.bw, Path(root), clock=clock)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
