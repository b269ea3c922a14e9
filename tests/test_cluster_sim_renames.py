"""The deterministic many-node simulation of tests/test_cluster_sim.py, with the renames that
checkpoint saving is made of and power losses (docs/SEMANTICS.md, "Store keys", "Many nodes,
one checkpoint", "Crashes and restarts").

Each node is the real filesystem core, uploader and coordinator (tests/cluster.py) over its own
staging directory, all over one memory store; virtual time (the autojump clock); every choice
(which node dies, when, for how long, which node writes the rotated file) comes from a seeded
generator.

A save of step N, the Lightning / NeMo tmp-dir commit: every rank writes its shard into
``step_N.tmp/``; after the job's barrier rank 0 writes the commit marker
``step_N.tmp/.metadata`` (DCP's ``finish``) and then renames ``step_N.tmp`` to ``step_N`` (the
framework's commit). Two variants: the job's barrier orders only the closes (every rank alive
and its close(2) returned: other nodes' shards are still uploading when rank 0 renames; rank
0 moves them once every node has committed them, upload.py ``_sweep``), or every rank's shard
is in the store before it (each rank fsyncs it with ``fsync = "remote"``). Other nodes follow
the move of their shards (peers.py).

A rotation: in every save one random rank also writes ``rot/latest_ckpt.new``; at the next
save rank 0 rotates ``mv rot/latest_ckpt rot/latest_ckpt.prev; mv rot/latest_ckpt.new
rot/latest_ckpt`` (files other nodes wrote, renamed over files other nodes wrote).

Faults, after each save: SIGKILLs (a kill mid-upload, restart on the same boot) and power
losses: the node is killed, its journal rolled back to its last durable point (taken by the
sim before the save, ``tests/cluster.py durable_point``), the data of the files it wrote since
lost, and it restarts with a new boot id. Rank 0 is only ever SIGKILLed (a power loss of rank 0
loses the job's own rename; the job would restart from the previous checkpoint, which this sim
does not model). Such a node *holds* other nodes' barriers (noderun.py) until an operator
decides. The sim models the operator doing what docs/SEMANTICS.md asks before giving up what
a node lost: the shard it lost is rewritten on that node (the sim knows its bytes; it goes to
``step_N/`` if rank 0's rename already happened), then ``ckptfs nodes --forget ID`` of its
own id on that node ends the hold; the markers held wait for the rewritten shards. Without
the operator the held markers would never go out.

Invariants, checked whenever a commit marker reaches the store and again at the end:
- every marker in the store has all the shards of its checkpoint, byte for byte;
- no ``*.tmp`` key is left once the rename of that save is done (at the end);
- every data key in the store holds the bytes (CRC32C) the journal of the node that owns it
  (``remote_key``) says, and has such an owner (at the end);
- liveness: every marker written reaches the store, every node is back.

64 nodes, 6 saves per variant (about 15 s each on 2 cores; 256 and 12 with
``CKPTFS_TEST_FULL=1``, tests/full.py); ``CKPTFS_SIM_NODES``,
``CKPTFS_SIM_SAVES`` and ``CKPTFS_SIM_SEED`` change them (16 nodes and 10 saves over a few
seeds is a quick search for new interleavings).
"""

from __future__ import annotations

import functools
import os
import random
from pathlib import Path

import crc32c
import pytest
import trio
import trio.testing

from ckptfs import errors
from ckptfs.engine.fs import Filesystem
from ckptfs.state.journal import ROOT_INODE, State
from ckptfs.store.integrity import format_crc
from ckptfs.store.tiers.base import CONTROL_PREFIX
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import store_named
from tests.cluster import Node, ObservedTier, durable_point, power_loss, run_node, write_file
from tests.full import full_or

NODES = int(os.environ.get("CKPTFS_SIM_NODES", full_or("64", "256")))
SAVES = int(os.environ.get("CKPTFS_SIM_SAVES", full_or("6", "12")))
SEED = int(os.environ.get("CKPTFS_SIM_SEED", "7"))
SHARD = 48 * 1024
BANDWIDTH = 16 * 1024  # a shard takes 3 s to upload
INTERVAL = 120.0
OPERATOR_DELAY = 60.0  # seconds between a held node's restart and the operator's decision


async def lookup_path(fs: Filesystem, path: str) -> int:
    ino = ROOT_INODE
    for part in path.split("/"):
        ino = (await fs.lookup(ino, part.encode())).ino
    return ino


class Sim:
    def __init__(self, nursery: trio.Nursery, root: Path, store: str, seed: int,
                 sync: bool) -> None:
        self.nursery = nursery
        self.sync = sync  # every rank waits for its shard to be in the store (fsync=remote)
        self.root = root
        self.store = store
        self.objects = store_named(store)
        self.rng = random.Random(seed)
        self.alive: dict[int, Node] = {}
        self.boots: dict[int, int] = {}
        self.durable: dict[int, tuple[Path, list[int]]] = {}  # durable copy, inodes since
        self.shards: dict[str, dict[str, bytes]] = {}  # checkpoint -> shard name -> bytes
        self.renamed: set[int] = set()  # steps rank 0 renamed
        self.violations: list[str] = []
        self.markers_written: list[str] = []
        self.kills = self.power_losses = self.held = self.rotations = 0
        self.rot_new: bytes | None = None  # what rot/latest_ckpt.new holds (last written)
        self.rot: dict[str, bytes] = {}  # rot/ name -> bytes, as rank 0 rotated them
        self.restarting = 0
        self.busy: set[int] = set()  # nodes down, or held and not seen to yet

    def dir(self, i: int) -> Path:
        return self.root / f"node{i:03d}"

    # -- nodes ------------------------------------------------------------------------------

    async def start(self, i: int) -> Node:
        tier = FaultyTier(ObservedTier(self.store, self.stored))
        tier.bandwidth = BANDWIDTH
        boot = self.boots.setdefault(i, 1)
        node: Node = await self.nursery.start(functools.partial(
            run_node, self.dir(i), self.store, tier=tier, node=f"node-{i:03d}",
            boot=f"boot-{boot}"))
        self.alive[i] = node
        return node

    def mark_durable(self, i: int) -> None:
        """The node's journal as a power loss now would leave it."""
        self.durable[i] = (durable_point(self.dir(i), self.alive[i].fs.journal), [])

    async def write(self, i: int, path: str, data: bytes) -> None:
        node = self.alive[i]
        ino = await write_file(node.fs, path, data)
        if i in self.durable:
            self.durable[i][1].append(ino)
        if self.sync:  # what fsync(2) does with fsync = "remote", before the job's barrier
            await node.uploader.wait_until_done(node.uploader.last_seq())

    async def fault(self, i: int, after: float, down_for: float, power: bool) -> None:
        await trio.sleep(after)
        if i in self.busy:
            return  # still being restarted or seen to by the operator
        node = self.alive.pop(i, None)
        if node is None:
            return
        self.restarting += 1
        self.busy.add(i)
        try:
            node.kill()
            await node.stopped.wait()
            if power:
                self.power_losses += 1
                durable, lost = self.durable.pop(i)
                power_loss(self.dir(i), durable, lost_data=tuple(lost))
                self.boots[i] += 1
            else:
                self.kills += 1
            await trio.sleep(down_for)
            node = await self.start(i)
            if node.coordinator.hold is not None:
                self.held += 1
                await self.operator(i, node)
        finally:
            self.restarting -= 1
            self.busy.discard(i)

    async def operator(self, i: int, node: Node) -> None:
        """What the operator does for a node back from a power loss: rewrite what it may have
        lost (its shards of checkpoints not yet complete in the store), then forget its own id
        on the node (it acknowledges again, once the rewritten shards are in the store)."""
        await trio.sleep(OPERATOR_DELAY)
        for checkpoint, shards in self.shards.items():
            step = int(checkpoint.removeprefix("step_"))
            name = f"__{i}_0.distcp"
            if name not in shards:
                continue
            where = checkpoint if step in self.renamed else checkpoint + ".tmp"
            obj = self.objects.get(f"{where}/{name}")
            if obj is None or obj.body != shards[name]:
                await write_file(node.fs, f"{where}/{name}", shards[name])
        await node.coordinator.forget(node.name)

    # -- the invariants ---------------------------------------------------------------------

    def stored(self, key: str) -> None:
        if key.endswith("/.metadata"):
            self.check_marker(key)

    def check_marker(self, key: str) -> None:
        where = key.rsplit("/", 1)[0]
        checkpoint = where.removesuffix(".tmp")
        for name, data in self.shards.get(checkpoint, {}).items():
            obj = self.objects.get(f"{where}/{name}")
            if obj is None or obj.body != data:
                self.violations.append(f"{key} stored while {where}/{name} is "
                                       f"{'missing' if obj is None else 'wrong'}")

    def check_owners(self) -> list[str]:
        """Every data key in the store is known to some node's journal, and holds the bytes
        (CRC32C and size) the journal of each node that wrote it (closed it there) records;
        the rotated files hold what the rotations put there."""
        problems = []
        known: set[str] = set()
        writers: dict[str, list[tuple[int, str | None, int]]] = {}
        for i, node in self.alive.items():
            for row in node.fs.journal.rows_in_states(State.COMMITTED, State.REMOTE):
                if row.parent is None or row.remote_key is None \
                        or row.remote_key.endswith("/"):
                    continue  # unlinked (a replaced file's row), or a directory
                known.add(row.remote_key)
                if row.closed_at is not None:  # written here, not a view of the store
                    writers.setdefault(row.remote_key, []).append((i, row.checksum, row.size))
        for key, obj in self.objects.items():
            if key.startswith(CONTROL_PREFIX) or key.endswith("/"):
                continue
            if key not in known:
                problems.append(f"{key}: no node's journal knows it")
            for i, checksum, size in writers.get(key, []):
                if format_crc(crc32c.crc32c(obj.body)) != checksum or len(obj.body) != size:
                    problems.append(f"{key}: node {i}, its writer, recorded other bytes")
                    if os.environ.get("CKPTFS_SIM_DEBUG"):
                        for row in self.alive[i].fs.journal.rows_in_states(
                                State.COMMITTED, State.REMOTE):
                            if row.remote_key == key:
                                print("DEBUG", key, row, obj.body[:20])
        for name, data in self.rot.items():
            rotated = self.objects.get(f"rot/{name}")
            if rotated is None or rotated.body != data:
                problems.append(f"rot/{name}: {'missing' if rotated is None else 'wrong'}")
        return problems

    # -- the job ----------------------------------------------------------------------------

    async def save(self, step: int, faults: int) -> None:
        checkpoint = f"step_{step}"
        tmp = checkpoint + ".tmp"
        self.shards[checkpoint] = {}
        rank0 = self.alive.get(0)
        if step > 1 and rank0 is not None and self.rot_new is not None:
            await self.rotate(rank0)
        writers = sorted(self.alive)
        for i in writers:
            if i != 0 and self.rng.random() < 0.2:
                self.mark_durable(i)  # the last durable point of this node
        async with trio.open_nursery() as ranks:
            for i in writers:
                data = self.rng.randbytes(SHARD)
                self.shards[checkpoint][f"__{i}_0.distcp"] = data
                ranks.start_soon(self.write, i, f"{tmp}/__{i}_0.distcp", data)
            rotator = self.rng.choice(writers)
            self.rot_new = f"rot {step} by {rotator}".encode() * 100
            ranks.start_soon(self.write, rotator, "rot/latest_ckpt.new", self.rot_new)
            self.rot["latest_ckpt.new"] = self.rot_new
        if len(writers) == NODES and 0 in self.alive:
            rank0 = self.alive[0]
            await self.write(0, f"{tmp}/.metadata", f"metadata of {checkpoint}".encode())
            self.markers_written.append(f"{checkpoint}/.metadata")
            await rank0.fs.rename(ROOT_INODE, tmp.encode(), ROOT_INODE, checkpoint.encode())
            self.renamed.add(step)
        else:
            del self.shards[checkpoint]  # the job's barrier failed: not a checkpoint
        candidates = list(range(NODES))
        for i in self.rng.sample(candidates, faults):
            power = i != 0 and i in self.durable and self.rng.random() < 0.5
            self.nursery.start_soon(self.fault, i, self.rng.uniform(0, 3),
                                    self.rng.uniform(5, 100), power)

    async def rotate(self, rank0: Node) -> None:
        """mv rot/latest_ckpt rot/latest_ckpt.prev; mv rot/latest_ckpt.new rot/latest_ckpt."""
        fs = rank0.fs
        try:
            rot = await lookup_path(fs, "rot")
            await fs.readdir(rot, 0)
            await fs.lookup(rot, b"latest_ckpt.new")
        except errors.NotFound:
            return  # its writer was killed before it got out: nothing to rotate
        try:
            await fs.lookup(rot, b"latest_ckpt")
            await fs.rename(rot, b"latest_ckpt", rot, b"latest_ckpt.prev")
            if "latest_ckpt" in self.rot:
                self.rot["latest_ckpt.prev"] = self.rot["latest_ckpt"]
        except errors.NotFound:
            pass
        await fs.rename(rot, b"latest_ckpt.new", rot, b"latest_ckpt")
        assert self.rot_new is not None
        self.rot["latest_ckpt"] = self.rot_new
        self.rot.pop("latest_ckpt.new", None)
        self.rotations += 1


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.mark.parametrize("sync", [
    True, False],
    ids=["fsync-remote-before-barrier", "close-before-barrier"])
async def test_renames_and_power_losses_never_lose_or_tear_a_checkpoint(
        tmp_path: Path, clock: trio.abc.Clock, sync: bool) -> None:
    """``sync``: every rank's shard is in the store before the job's barrier (each rank
    fsyncs it with ``fsync = "remote"``); without, the barrier orders only the closes."""
    store = f"simren-{id(tmp_path)}"
    store_named(store).clear()
    async with trio.open_nursery() as nursery:
        sim = Sim(nursery, tmp_path, store, seed=SEED, sync=sync)
        for i in range(NODES):
            await sim.start(i)
        for step in range(1, SAVES + 1):
            await sim.save(step, faults=0 if step == 1 else sim.rng.randint(1, 4))
            await trio.sleep(INTERVAL)

        with trio.fail_after(7200):
            while len(sim.alive) < NODES or sim.restarting:
                await trio.sleep(1)
            for node in list(sim.alive.values()):
                await node.uploader.wait_idle()
            for marker in sim.markers_written:
                while marker not in sim.objects:
                    await trio.sleep(1)
        await trio.sleep(60)  # every node lists once more (ls -R by a user, below)
        for node in list(sim.alive.values()):
            for where in [f"step_{step}" for step in sim.renamed] + ["rot"]:
                try:
                    await node.fs.readdir(await lookup_path(node.fs, where), 0)
                except errors.NotFound:
                    pass
            await node.fs.readdir(ROOT_INODE, 0)
        for node in list(sim.alive.values()):
            await node.uploader.wait_idle()
        owners = sim.check_owners()
        for node in list(sim.alive.values()):
            await node.stop()

    print(f"\n{NODES} nodes, {SAVES} saves, {sim.kills} kills, {sim.power_losses} power "
          f"losses ({sim.held} held), {sim.rotations} rotations, "
          f"{len(sim.markers_written)} markers")
    assert not sim.violations, sim.violations[:5]
    for marker in sim.markers_written:
        assert marker in sim.objects, f"{marker} never reached the store"
        sim.check_marker(marker)
    assert not sim.violations, sim.violations[:5]
    tmp_left = sorted(k for k in sim.objects
                      if k.split("/")[0].endswith(".tmp")
                      and int(k.split("/")[0][5:-4]) in sim.renamed)
    assert not tmp_left, tmp_left[:5]
    assert not owners, owners[:5]
    # And nothing else: the renamed checkpoints, the rotated files, the shards of saves whose
    # barrier failed (never renamed), directories.
    expected = {f"step_{step}/{name}" for step in sim.renamed
                for name in [*sim.shards[f"step_{step}"], ".metadata"]}
    expected |= {f"rot/{name}" for name in sim.rot}
    stray = sorted(k for k in sim.objects
                   if not k.startswith(CONTROL_PREFIX) and not k.endswith("/")
                   and k not in expected and not (k.split("/")[0].endswith(".tmp")
                                                   and int(k.split("/")[0][5:-4])
                                                   not in sim.renamed))
    assert not stray, stray[:5]
    assert sim.kills and sim.power_losses
