"""Retention for many nodes, without a mount (docs/RETENTION.md, "Several nodes"):

- checkpoint detection (``checkpoint_pattern``) for each naming style and nested run dirs;
- the safer defaults (the embedded policy never deletes the only remote copy);
- completeness by commit marker (never newest, never among the last N, never touched);
- the inventory from the store listing (other nodes' checkpoints and shards, ``.ckptfs/``
  excluded) and copies to a colder tier of every object of a checkpoint;
- the lease: one holder at a time, skipping with the holder's name, expiry, renewal while
  applying, a lost lease stopping the run, release;
- files open at apply time keep their checkpoint on NVMe and in the namespace.
"""

from __future__ import annotations

import builtins
import dataclasses
import itertools
import os
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from ckptfs.cluster.lease import LEASE_KEY, Lease, LeaseLost
from ckptfs.cluster.peers import mailbox_of
from ckptfs.config import DEFAULT_COMMIT_MARKERS, Config, KeepRules, load_config
from ckptfs.engine.fs import Filesystem
from ckptfs.engine.upload import Uploader
from ckptfs.errors import UserError
from ckptfs.lifecycle.checkpoints import (
    DEFAULT_DETECTOR,
    HOT,
    Checkpoint,
    Detector,
    LocalFile,
    RemoteFile,
    build,
)
from ckptfs.lifecycle.retention import (
    HEAD_CONCURRENCY,
    Policy,
    Retention,
    TierPolicy,
    newest_complete,
    plan,
)
from ckptfs.state.journal import ROOT_INODE, Journal, State
from ckptfs.state.staging import Staging
from ckptfs.store.tiers.base import ObjectInfo, ObjectMeta, Tier
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import MemoryTier, store_named
from tests.cluster import run_node
from tests.s3bucket import crc
from tests.test_retention_sim import write

T0 = 1_736_121_600.0
MARKERS = DEFAULT_COMMIT_MARKERS


# -- detection ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "name", "step"), [
    ("step_100/model.pt", "step_100", 100),
    ("step-100/model.pt", "step-100", 100),
    ("step100", "step100", 100),
    # Hugging Face Trainer
    ("checkpoint-500/model-00001-of-00002.safetensors", "checkpoint-500", 500),
    ("checkpoint-500/trainer_state.json", "checkpoint-500", 500),
    # Megatron-LM
    ("iter_0000500/mp_rank_00/model_optim_rng.pt", "iter_0000500", 500),
    ("latest_checkpointed_iteration.txt", "latest_checkpointed_iteration.txt", None),
    # DeepSpeed
    ("global_step500/zero_pp_rank_0_mp_rank_00_optim_states.pt", "global_step500", 500),
    ("latest", "latest", None),
    # a checkpoint that is one file
    ("ckpt_step_1000.pt", "ckpt_step_1000.pt", 1000),
    ("epoch3_step_250/a", "epoch3_step_250", 250),
    # nested run directories: the checkpoint is the directory whose name matches
    ("runs/exp1/step_100/model.pt", "runs/exp1/step_100", 100),
    ("runs/exp1/step_100/sub/dir/shard", "runs/exp1/step_100", 100),
    ("runs/exp2/checkpoint-7/x", "runs/exp2/checkpoint-7", 7),
    ("runs/exp1/latest", "runs", None),  # not a checkpoint: a pointer, by its top level
    ("runs/exp1/config.yaml", "runs", None),
    # not checkpoints: a temporary name being written, words that only contain a keyword
    ("step_100.tmp/.metadata", "step_100.tmp", None),
    ("steps_per_epoch.txt", "steps_per_epoch.txt", None),
    ("waiter_3/x", "waiter_3", None),
])
def test_default_detection(key: str, name: str, step: int | None) -> None:
    assert DEFAULT_DETECTOR.locate(key) == (name, step)


def test_custom_and_legacy_detection() -> None:
    custom = Detector.from_pattern(r"(?:^|/)ep(?P<step>\d+)(?=/|$)")
    assert custom.locate("a/ep12/w.bin") == ("a/ep12", 12)
    assert custom.locate("step_5/w.bin") == ("step_5", None)
    legacy = Detector.from_pattern(step_regex=r"(\d+)(?!.*\d)")
    assert legacy.locate("my_run_500/x/step_7") == ("my_run_500", 500)
    assert legacy.locate("latest") == ("latest", None)


def test_build_groups_nested_run_dirs() -> None:
    keys = ["runs/exp1/step_100/a", "runs/exp1/step_100/.metadata", "runs/exp1/step_200/a",
            "runs/exp2/checkpoint-50/a", "runs/exp2/checkpoint-50/COMMITTED", "runs/latest"]
    cps = {c.name: c for c in build([], {"warm": [RemoteFile(k, 1) for k in keys]},
                                    step_regex="", tier_order=["hot", "warm"],
                                    detector=DEFAULT_DETECTOR, markers=MARKERS)}
    assert set(cps) == {"runs/exp1/step_100", "runs/exp1/step_200", "runs/exp2/checkpoint-50",
                        "runs"}
    assert cps["runs/exp1/step_100"].complete and cps["runs/exp2/checkpoint-50"].complete
    assert cps["runs/exp1/step_200"].busy == "no marker"
    assert cps["runs"].step is None


@pytest.mark.parametrize(("text", "needles"), [
    ("checkpoint_pattern = 'step_(\\d+)'", ["checkpoint_pattern", "named group"]),
    ("checkpoint_pattern = 'step_(?P<step>\\d+'", ["checkpoint_pattern", "regular expression"]),
    ("checkpoint_pattern = '(?P<step>\\d+)'\nstep_regex = '(\\d+)'",
     ["checkpoint_pattern", "not both"]),
    ("retention_lease = '1s'", ["retention_lease", "at least 3s"]),
    ("retention_lease = 'soon'", ["retention_lease", "'soon'"]),
])
def test_bad_detection_and_lease_keys_are_one_line(tmp_path: Path, text: str,
                                                   needles: list[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text + "\n")
    with pytest.raises(UserError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


# -- defaults ----------------------------------------------------------------------------------


def test_embedded_default_never_deletes_the_only_remote_copy() -> None:
    config = Config()
    assert config.tier[1].keep.all and config.retention_lease.total_seconds() == 600
    policy = Policy.from_config(config)
    cps = [Checkpoint(f"step_{i}", i, T0 + i * 3600, 10, held=frozenset({HOT, "warm"}),
                      files=((f"step_{i}/m", 10),)) for i in range(1, 40)]
    actions = plan(cps, policy, T0 + 100 * 86400)
    assert {a.kind for a in actions} == {"evict"}  # only NVMe copies go (hot keeps last 3)
    assert len(actions) == 36


# -- completeness by commit marker ---------------------------------------------------------------


def remote(*keys: str, size: int = 4) -> list[RemoteFile]:
    return [RemoteFile(k, size, mtime=T0 + i) for i, k in enumerate(keys)]


def checkpoints(warm: list[RemoteFile], cold: list[RemoteFile] | None = None,
                local: list[LocalFile] | None = None) -> dict[str, Checkpoint]:
    return {c.name: c for c in build(local or [], {"warm": warm, "cold": cold or []},
                                     step_regex="", tier_order=["hot", "warm", "cold"],
                                     detector=DEFAULT_DETECTOR, markers=MARKERS)}


def test_no_marker_is_never_complete_newest_or_deleted() -> None:
    warm = remote("step_0/a",  # old, never finished
                  "step_1/a", "step_1/.metadata", "step_2/a", "step_2/.metadata",
                  "step_3/a")  # newest, no marker yet (still being written by some node)
    cps = checkpoints(warm)
    assert cps["step_3"].busy == "no marker" and cps["step_0"].busy == "no marker"
    assert newest_complete(cps.values()).name == "step_2"  # type: ignore[union-attr]
    policy = Policy((TierPolicy(HOT, KeepRules(last=1), HOT, HOT),
                     TierPolicy("warm", KeepRules(last=1), "memory:w", "memory"),
                     TierPolicy("cold", KeepRules(), "memory:c", "memory")))
    actions = plan(list(cps.values()), policy, T0 + 3600)
    # last = 1 keeps the last *complete* one; the marker-less ones are left alone, old or new.
    assert [(a.kind, a.checkpoint) for a in actions] == [("delete", "step_1")]


def test_single_file_checkpoint_and_marker_on_any_tier() -> None:
    cps = checkpoints(remote("ckpt_step_5.pt", "step_6/a"), cold=remote("step_6/.metadata"))
    assert cps["ckpt_step_5.pt"].complete  # one object: whole by nature
    assert cps["step_6"].complete  # its marker survives on cold (an interrupted removal)


def test_local_marker_must_be_committed() -> None:
    local = [LocalFile("step_1/a", 10, 4, State.COMMITTED, committed_at=T0),
             LocalFile("step_1/.metadata", 11, 4, State.STAGED)]
    assert checkpoints([], local=local)["step_1"].busy == "uploading"
    local[1] = LocalFile("step_1/.metadata", 11, 4, State.COMMITTED, committed_at=T0)
    assert checkpoints(remote("step_1/a", "step_1/.metadata"), local=local)["step_1"].complete


def test_shards_of_other_nodes_belong_to_the_checkpoint() -> None:
    """This node's journal knows rank 0; the store also has rank 1 (another node's): the
    checkpoint has both, and NVMe does not hold it whole."""
    local = [LocalFile("step_1/r0", 10, 4, State.COMMITTED, committed_at=T0),
             LocalFile("step_1/.metadata", 11, 4, State.COMMITTED, committed_at=T0)]
    c = checkpoints(remote("step_1/r0", "step_1/r1", "step_1/.metadata"), local=local)["step_1"]
    assert dict(c.files) == {"step_1/r0": 4, "step_1/r1": 4, "step_1/.metadata": 4}
    assert c.held == {"warm"} and c.partial == {"hot"}


# -- inventory from the store, copies of every object -------------------------------------------


def memory_tiers(tag: str, *names: str) -> dict[str, Tier]:
    out: dict[str, Tier] = {}
    for n in names:
        store = f"ret-nodes-{n}-{tag}"
        store_named(store).clear()
        out[n] = MemoryTier(n, f"memory://{store}", store)
    return out


async def put(tier: Tier, tmp_path: Path, key: str, data: bytes) -> None:
    src = tmp_path / "src"
    src.write_bytes(data)
    meta = ObjectMeta(mtime_ns=int(T0 * 1e9), checksum=crc(data))
    await tier.put_file(key, src, len(data), meta)


def two_tier_policy(warm: KeepRules, cold: KeepRules) -> Policy:
    return Policy((TierPolicy(HOT, KeepRules(last=1), HOT, HOT),
                   TierPolicy("warm", warm, "memory:w", "memory"),
                   TierPolicy("cold", cold, "memory:c", "memory")))


async def test_inventory_from_the_store_and_copies_of_every_object(tmp_path: Path) -> None:
    tiers = memory_tiers(f"{id(tmp_path)}", "warm", "cold")
    warm, cold = tiers["warm"], tiers["cold"]
    assert isinstance(warm, MemoryTier) and isinstance(cold, MemoryTier)
    bodies = {}
    for step in (1, 2):
        for part in ("rank0", "rank1", "sub/rank2", ".metadata"):
            key = f"step_{step}/{part}"
            bodies[key] = os.urandom(100 + step)
            await put(warm, tmp_path, key, bodies[key])
    await put(warm, tmp_path, "step_3/rank0", b"no marker yet")
    await warm.put_small(".ckptfs/nodes/other", b"{}")
    retention = Retention(two_tier_policy(KeepRules(last=1), KeepRules(all=True)), tiers,
                          markers=MARKERS, node="a", clock=lambda: T0 + 3600)
    report = await retention.report()
    assert {r["name"] for r in report["checkpoints"]} == {"step_1", "step_2", "step_3"}
    result = await retention.run_once()
    assert not result.failed, result.failed
    # step_1 went to cold with every object (no journal named them), then left warm.
    assert {k for k in cold.objects if k.startswith("step_1/")} == \
        {"step_1/rank0", "step_1/rank1", "step_1/sub/rank2", "step_1/.metadata"}
    for key in ("step_1/rank0", "step_1/rank1", "step_1/sub/rank2", "step_1/.metadata"):
        assert cold.objects[key].body == bodies[key]
    assert not any(k.startswith("step_1/") for k in warm.objects)
    # step_2 (the last complete one) is in warm (and cold keeps all); step_3 untouched.
    assert "step_2/rank1" in warm.objects and "step_2/rank1" in cold.objects
    assert "step_3/rank0" in warm.objects and "step_3/rank0" not in cold.objects
    assert ".ckptfs/nodes/other" in warm.objects and LEASE_KEY not in warm.objects
    assert not any(k.startswith(".ckptfs") for k in cold.objects)


async def test_a_node_copies_shards_it_never_wrote(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Two nodes write one checkpoint; node A's retention copies B's shard too."""
    store = f"ret-nodes-shared-{id(tmp_path)}"
    store_named(store).clear()
    cold_tier = memory_tiers(f"{id(tmp_path)}", "cold")["cold"]
    assert isinstance(cold_tier, MemoryTier)
    async with trio.open_nursery() as nursery:
        a = await nursery.start(run_node, tmp_path / "a", store)
        b = await nursery.start(run_node, tmp_path / "b", store)
        for step in (1, 2):
            await b.write(f"step_{step}/__1_0.distcp", b"b" * 1000)
            await a.write(f"step_{step}/__0_0.distcp", b"a" * 1000)
            await a.write(f"step_{step}/.metadata", b"meta")
        with trio.fail_after(600):
            while not {"step_2/.metadata", "step_2/__1_0.distcp"} <= set(store_named(store)):
                await trio.sleep(1)
        retention = Retention(two_tier_policy(KeepRules(last=1), KeepRules(all=True)),
                              {"warm": a.tier, "cold": cold_tier}, fs=a.fs, markers=MARKERS,
                              node=a.name, scratch=tmp_path / "scratch")
        result = await retention.run_once()
        assert not result.failed, result.failed
        assert {"step_1/__0_0.distcp", "step_1/__1_0.distcp", "step_1/.metadata"} <= \
            set(cold_tier.objects)
        assert cold_tier.objects["step_1/__1_0.distcp"].body == b"b" * 1000
        assert not any(k.startswith("step_1/") for k in store_named(store))
        # A record of the deletion for B, the writer of the shard, naming its version.
        assert any(k.startswith(mailbox_of(b.name)) for k in store_named(store))
        # B still has its shard on NVMe. Its listing misses it from the warm tier; since
        # the record names exactly the version B holds, B drops its copy instead of
        # uploading it again (which would bring a marker-less step_1 back).
        assert b.fs.lister is not None
        for _ in range(3):
            await b.fs.lister.refresh_tree(b.fs.ns.get(ROOT_INODE))
            await trio.sleep(10)  # past metadata_ttl: the next refresh lists again
        await b.uploader.wait_idle()
        assert not any(k.startswith("step_1") for k in store_named(store))
        assert b"step_1" not in {r.name for r in b.fs.ns.children(ROOT_INODE, 0)}
        assert b"step_2" in {r.name for r in b.fs.ns.children(ROOT_INODE, 0)}
        # ... and deletes the record once it acted on it and made that durable (a journal
        # sync in a worker thread, which the virtual clock does not wait for).
        deadline = time.monotonic() + 60
        while any(k.startswith(mailbox_of(b.name)) for k in store_named(store)) and \
                time.monotonic() < deadline:
            await trio.sleep(1)
        assert not any(k.startswith(mailbox_of(b.name)) for k in store_named(store))
        await a.stop()
        await b.stop()


# -- the lease -----------------------------------------------------------------------------------


async def test_lease_one_holder_at_a_time(tmp_path: Path) -> None:
    tier = memory_tiers(f"{id(tmp_path)}", "warm")["warm"]
    a, b = Lease(tier, "a", 600), Lease(tier, "b", 600)
    assert await a.acquire() is None and a.valid()
    holder = await b.acquire()
    assert holder is not None and holder.node == "a" and not b.holds()
    assert await a.acquire() is None  # its own lease: taken again (renewed)
    await a.release()
    assert LEASE_KEY not in tier.objects  # type: ignore[attr-defined]
    assert await b.acquire() is None


async def test_lease_race_has_one_winner(tmp_path: Path) -> None:
    tier = memory_tiers(f"{id(tmp_path)}", "warm")["warm"]
    leases = [Lease(tier, f"n{i}", 600) for i in range(5)]
    results: dict[str, object] = {}

    async def take(lease: Lease) -> None:
        results[lease.node] = await lease.acquire()

    async with trio.open_nursery() as nursery:
        for lease in leases:
            nursery.start_soon(take, lease)
    winners = [n for n, r in results.items() if r is None]
    assert len(winners) == 1
    assert all(getattr(r, "node", None) == winners[0] for r in results.values() if r)


async def test_expired_lease_is_taken_and_its_old_holder_loses_it(tmp_path: Path) -> None:
    tier = memory_tiers(f"{id(tmp_path)}", "warm")["warm"]
    a = Lease(tier, "a", 600)
    later = Lease(tier, "b", 600, wall=lambda: time.time() + 601)
    assert await a.acquire() is None
    assert await later.acquire() is None  # a's lease has expired by b's clock
    with pytest.raises(LeaseLost):
        await a.renew()
    assert not a.valid()
    await a.release()  # not ours any more: left alone
    holder, _ = await later.read()
    assert holder is not None and holder.node == "b"


async def test_an_unreadable_lease_counts_as_expired(tmp_path: Path) -> None:
    tier = memory_tiers(f"{id(tmp_path)}", "warm")["warm"]
    await tier.put_small(LEASE_KEY, b"garbage")
    assert await Lease(tier, "a", 600).acquire() is None


def deletable() -> Policy:
    """hot and warm keep the last one: older complete checkpoints are deleted."""
    return Policy((TierPolicy(HOT, KeepRules(last=1), HOT, HOT),
                   TierPolicy("warm", KeepRules(last=1), "memory:w", "memory")))


async def fill(tier: Tier, tmp_path: Path, steps: range) -> None:
    for step in steps:
        await put(tier, tmp_path, f"step_{step}/m", b"x" * step)
        await put(tier, tmp_path, f"step_{step}/.metadata", b"m")


async def test_another_holder_skips_the_round_and_names_the_holder(tmp_path: Path) -> None:
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    await fill(tiers["warm"], tmp_path, range(1, 5))
    assert await Lease(tiers["warm"], "node-a", 600).acquire() is None
    before = set(tiers["warm"].objects)  # type: ignore[attr-defined]
    retention = Retention(deletable(), tiers, markers=MARKERS, node="node-b")
    result = await retention.run_once()
    assert result.held_by is not None and result.held_by.node == "node-a"
    assert not result.done and "node node-a" in (result.skipped or "")
    assert result.as_dict()["lease"]["holder"] == "node-a"
    assert set(tiers["warm"].objects) == before  # type: ignore[attr-defined]


async def test_lease_is_renewed_while_applying_and_released_after(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    inner = tiers["warm"]
    assert isinstance(inner, MemoryTier)
    await fill(inner, tmp_path, range(1, 6))
    slow = FaultyTier(inner, latency=5.0)  # every store request takes 5 s
    writes: list[tuple[float, str]] = []
    put_small = inner.put_small

    async def recording(key: str, data: bytes, **kw: object) -> str:
        if key == LEASE_KEY:
            writes.append((trio.current_time(), data.decode()))
        return await put_small(key, data, **kw)  # type: ignore[arg-type]

    inner.put_small = recording  # type: ignore[method-assign]
    retention = Retention(deletable(), {"warm": slow}, markers=MARKERS,
                          node="a", lease_length=30.0, clock=trio.current_time)
    started = trio.current_time()
    result = await retention.run_once()
    took = trio.current_time() - started
    assert not result.failed and len(result.done) == 4, (result, writes, took)
    assert took > 60  # 4 deletions of 2 objects and listings, 5 s each
    # Taken (after the first listings), then renewed every 10 s until the run ends.
    first = writes[0][0] - started
    assert len(writes) >= int((took - first) // 10), (len(writes), took, writes)
    assert all(b - a <= 10.0 + 1e-6 for (a, _), (b, _) in itertools.pairwise(writes)), writes
    assert all('"holder": "a"' in body for _, body in writes)
    assert LEASE_KEY not in inner.objects  # released


async def test_a_lost_lease_stops_the_run(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    inner = tiers["warm"]
    assert isinstance(inner, MemoryTier)
    await fill(inner, tmp_path, range(1, 10))
    slow = FaultyTier(inner, latency=5.0)
    retention = Retention(deletable(), {"warm": slow}, markers=MARKERS,
                          node="a", lease_length=30.0, clock=trio.current_time)

    async def thief() -> None:
        await trio.sleep(25)  # another node takes the lease (say, after a clock jump)
        await inner.put_small(LEASE_KEY, b'{"holder": "x", "expires": 1e12}')

    async with trio.open_nursery() as nursery:
        nursery.start_soon(thief)
        result = await retention.run_once()
    assert len(result.done) < 8  # stopped early: not every old checkpoint was deleted
    assert any(k.startswith("step_2/") for k in inner.objects)
    assert b'"x"' in inner.objects[LEASE_KEY].body  # the thief's lease is left alone


# -- files open at apply time ----------------------------------------------------------------------


async def local_node(tmp_path: Path, tier: Tier) -> tuple[Filesystem, Uploader, Journal, Staging]:
    staging = Staging(tmp_path / "staging")
    staging.prepare()
    journal = Journal(staging.root / "journal.db")
    fs = Filesystem(journal, staging)
    fs.start()
    uploader = Uploader(journal, fs.ns, staging, tier, concurrency=2, markers=MARKERS)
    fs.listener = uploader
    return fs, uploader, journal, staging


@pytest.mark.parametrize("warm_keep", [KeepRules(last=1), KeepRules(all=True)])
async def test_a_file_opened_at_apply_time_keeps_its_checkpoint(
        tmp_path: Path, warm_keep: KeepRules) -> None:
    """Planned for deletion (warm last 1) or eviction (warm keeps all), then a reader opens
    step_1/model.pt: step_1 stays (in the namespace and on NVMe); step_2 goes."""
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    fs, uploader, journal, staging = await local_node(tmp_path, tiers["warm"])
    policy = Policy((TierPolicy(HOT, KeepRules(last=1), HOT, HOT),
                     TierPolicy("warm", warm_keep, "memory:w", "memory")))
    retention = Retention(policy, tiers, fs=fs, markers=MARKERS)  # apply() directly: no lease
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            inos = {}
            for step in (1, 2, 3):
                inos[step] = await write(fs, f"step_{step}/model.pt", b"w" * 100)
                await write(fs, f"step_{step}/.metadata", b"m")
            await uploader.wait_idle()
            state = await retention.collect()
            actions = [a for a in plan(state.checkpoints, policy, state.now)
                       if a.checkpoint in ("step_1", "step_2")]
            kind = "delete" if warm_keep.last else "evict"
            assert {(a.kind, a.checkpoint) for a in actions} == \
                {(kind, "step_1"), (kind, "step_2")}
            fh = await fs.open(inos[1], os.O_RDONLY)  # a reader, after the plan was made
            result = await retention.apply(actions, state)
            assert [a.checkpoint for a in result.done] == ["step_2"]
            assert [(a.checkpoint, "open" in e) for a, e in result.failed] == [("step_1", True)]
            assert fs.ns.get(inos[1]).state is State.COMMITTED  # still on NVMe
            if kind == "evict":
                assert fs.ns.get(inos[2]).state is State.REMOTE
            fs.release(fh)
            again = await retention.run_once()
            assert [(a.kind, a.checkpoint) for a in again.done] == [(kind, "step_1")]
            nursery.cancel_scope.cancel()
    finally:
        fs.close()
        journal.close()
        staging.close()


async def test_evictions_need_no_lease_and_a_quiet_run_writes_nothing(tmp_path: Path) -> None:
    """Evicting this node's NVMe copies is node-local: done even while another node holds
    the lease; a run with nothing shared to do never writes the lease."""
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    warm = tiers["warm"]
    assert isinstance(warm, MemoryTier)
    fs, uploader, journal, staging = await local_node(tmp_path, warm)
    policy = Policy((TierPolicy(HOT, KeepRules(last=1), HOT, HOT),
                     TierPolicy("warm", KeepRules(all=True), "memory:w", "memory")))
    retention = Retention(policy, tiers, fs=fs, markers=MARKERS, node="b")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            inos = [await write(fs, f"step_{step}/model.pt", b"w" * 100) for step in (1, 2, 3)]
            for step in (1, 2, 3):
                await write(fs, f"step_{step}/.metadata", b"m")
            await uploader.wait_idle()
            assert await Lease(warm, "a", 600).acquire() is None
            result = await retention.run_once()
            assert sorted((a.kind, a.checkpoint) for a in result.done) == \
                [("evict", "step_1"), ("evict", "step_2")]
            assert result.held_by is None  # nothing shared was planned: the lease not asked
            assert [fs.ns.get(i).state for i in inos] == [State.REMOTE, State.REMOTE,
                                                          State.COMMITTED]
            holder, _ = await Lease(warm, "x", 600).read()
            assert holder is not None and holder.node == "a"  # a's lease untouched
            nursery.cancel_scope.cancel()
    finally:
        fs.close()
        journal.close()
        staging.close()


class ListsKeysOnly(FaultyTier):
    """A store whose listing gives key and size only (as S3's does), with slow HEADs."""

    async def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        return [dataclasses.replace(i, meta_known=False) for i in await super().list(prefix)]


async def test_objects_unknown_to_the_journal_are_headed_concurrently(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """The first run after a mount HEADs every object the journal does not know: 64 objects
    at 1 s a HEAD take 64 s one at a time, about 64 / HEAD_CONCURRENCY s together; every
    object's metadata still reaches the inventory, in listing order."""
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    inner = tiers["warm"]
    await fill(inner, tmp_path, range(1, 33))
    slow = ListsKeysOnly(inner, latency=1.0)
    retention = Retention(deletable(), {"warm": slow}, markers=MARKERS, node="node-b")
    t0 = trio.current_time()
    state = await retention.collect()
    took = trio.current_time() - t0
    assert slow.calls["head"] == 64
    assert HEAD_CONCURRENCY >= 8
    assert took < 64 / 8 + 2, took  # (+ the listing)
    files = state.remote["warm"]
    assert [f.key for f in files] == [i.key for i in await inner.list()
                                      if not i.key.startswith(".ckptfs/")]
    assert all(f.checksum is not None for f in files)
