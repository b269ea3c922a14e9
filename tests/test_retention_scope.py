"""How much of the store a node's retention run inventories.

- After a save (``scope="local"``) a node lists only the checkpoints it has NVMe copies of,
  evicts from that view, and takes the lease (then lists the whole store) only if that
  view shows shared work; once per interval (``scope="interval"``) it takes the lease
  and only the holder lists everything.
- The partial view never evicts a copy the hot tier's rules keep in the full view, and only
  what a store tier holds (hypothesis, on the pure planner: the subset argument in
  ``Retention._local_round``).
"""

from __future__ import annotations

import builtins
from pathlib import Path

import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ckptfs.cluster.lease import LEASE_KEY, Lease
from ckptfs.config import KeepRules
from ckptfs.lifecycle.checkpoints import DEFAULT_DETECTOR, HOT, LocalFile, RemoteFile, build
from ckptfs.lifecycle.retention import Policy, Retention, TierPolicy, plan, select
from ckptfs.state.journal import State
from ckptfs.store.tiers.base import ObjectInfo
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import MemoryTier
from tests.test_retention_nodes import MARKERS, T0, fill, local_node, memory_tiers
from tests.test_retention_sim import write


class CountsListings(FaultyTier):
    """Records the prefix of every listing."""

    def __init__(self, inner: MemoryTier) -> None:
        super().__init__(inner)
        self.prefixes: builtins.list[str] = []

    async def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        self.prefixes.append(prefix)
        return await super().list(prefix)


def hot_last(n: int, warm: KeepRules) -> Policy:
    return Policy((TierPolicy(HOT, KeepRules(last=n), HOT, HOT),
                   TierPolicy("warm", warm, "memory:w", "memory")))


async def test_after_a_save_a_node_lists_only_its_own_checkpoints(tmp_path: Path) -> None:
    """40 checkpoints of other nodes in the store, 4 here: the local run lists step_41..44
    (and the registrations), evicts 41..43, never lists the store's root and never writes
    the lease; an interval run takes the lease and then lists everything."""
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    inner = tiers["warm"]
    assert isinstance(inner, MemoryTier)
    await fill(inner, tmp_path, range(1, 41))
    counting = CountsListings(inner)
    fs, uploader, journal, staging = await local_node(tmp_path, counting)
    retention = Retention(hot_last(1, KeepRules(all=True)), {"warm": counting}, fs=fs,
                          markers=MARKERS, node="b")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            inos = [await write(fs, f"step_{s}/model.pt", b"w" * 100) for s in range(41, 45)]
            for s in range(41, 45):
                await write(fs, f"step_{s}/.metadata", b"m")
            await uploader.wait_idle()
            counting.prefixes.clear()
            result = await retention.run_once(scope="local")
            assert sorted(a.checkpoint for a in result.done if a.kind == "evict") == \
                ["step_41", "step_42", "step_43"]
            assert "" not in counting.prefixes
            assert {p for p in counting.prefixes if not p.startswith(".ckptfs/")} == \
                {"step_41", "step_42", "step_43", "step_44"}
            assert [fs.ns.get(i).state for i in inos] == [State.REMOTE] * 3 + [State.COMMITTED]
            assert LEASE_KEY not in inner.objects  # nothing shared: no lease write

            # Next save: only step_44 (and the new one) have NVMe copies now.
            await write(fs, "step_45/model.pt", b"w" * 100)
            await write(fs, "step_45/.metadata", b"m")
            await uploader.wait_idle()
            counting.prefixes.clear()
            await retention.run_once(scope="local")
            assert {p for p in counting.prefixes if p.startswith("step_")} == \
                {"step_44", "step_45"}

            counting.prefixes.clear()
            result = await retention.run_once(scope="interval")
            assert result.held_by is None
            assert "" in counting.prefixes  # the holder inventories the whole store
            holder, _ = await Lease(inner, "x", 600).read()
            assert holder is None or holder.expires <= retention.clock()  # released

            # Another node holds the lease: an interval run lists nothing but its own.
            assert await Lease(inner, "a", 600).acquire() is None
            counting.prefixes.clear()
            result = await retention.run_once(scope="interval")
            assert result.held_by is not None and result.held_by.node == "a"
            assert "" not in counting.prefixes
            nursery.cancel_scope.cancel()
    finally:
        fs.close()
        journal.close()
        staging.close()


async def test_shared_work_seen_locally_takes_the_lease(tmp_path: Path) -> None:
    """warm keeps the last 1: a local run that sees an older checkpoint of its own to
    delete takes the lease and lists the whole store, where step_1..3 of other nodes go
    too."""
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    inner = tiers["warm"]
    assert isinstance(inner, MemoryTier)
    await fill(inner, tmp_path, range(1, 4))
    counting = CountsListings(inner)
    fs, uploader, journal, staging = await local_node(tmp_path, counting)
    retention = Retention(hot_last(1, KeepRules(last=1)), {"warm": counting}, fs=fs,
                          markers=MARKERS, node="b")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            for s in (4, 5):
                await write(fs, f"step_{s}/model.pt", b"w" * 100)
                await write(fs, f"step_{s}/.metadata", b"m")
            await uploader.wait_idle()
            counting.prefixes.clear()
            result = await retention.run_once(scope="local")
            assert "" in counting.prefixes
            deleted = sorted(a.checkpoint for a in result.done if a.kind == "delete")
            assert deleted == ["step_1", "step_2", "step_3", "step_4"]
            left = {i.key.split("/")[0] for i in await inner.list()
                    if not i.key.startswith(".ckptfs/")}
            assert left == {"step_5"}
            nursery.cancel_scope.cancel()
    finally:
        fs.close()
        journal.close()
        staging.close()


# -- the subset argument, on the pure planner ---------------------------------------------------

checkpoint_sets = st.lists(
    st.tuples(st.booleans(), st.booleans(), st.booleans()),  # here, complete, in cold
    min_size=1, max_size=12)
rules = st.builds(KeepRules, last=st.integers(0, 4),
                  daily=st.sampled_from([None, "3d"]))


@settings(max_examples=300, deadline=None)
@given(checkpoint_sets, st.integers(1, 4), rules, rules)
# The full plan waits for step_1's copy into cold; the partial view evicts it at once.
@example([(True, True, False), (False, True, False), (True, True, False)], 1,
         KeepRules(last=2), KeepRules(last=3))
def test_the_local_view_never_evicts_what_the_full_view_keeps(
        cps: list[tuple[bool, bool, bool]], hot: int, warm: KeepRules, cold: KeepRules) -> None:
    """Every checkpoint in the warm tier (some also in cold); those ``here`` also have
    committed NVMe copies. The plan from only the checkpoints here (with their objects)
    evicts nothing that the plan from everything keeps on NVMe."""
    policy = Policy((TierPolicy(HOT, KeepRules(last=hot), HOT, HOT),
                     TierPolicy("warm", warm, "memory:w", "memory"),
                     TierPolicy("cold", cold, "memory:c", "memory")))
    local: list[LocalFile] = []
    remote: dict[str, list[RemoteFile]] = {"warm": [], "cold": []}
    ino = 10
    for step, (here, complete, in_cold) in enumerate(cps, start=1):
        keys = [f"step_{step}/m"] + ([f"step_{step}/.metadata"] if complete else [])
        when = T0 + step * 7200
        for key in keys:
            remote["warm"].append(RemoteFile(key, 4, mtime=when))
            if in_cold:
                remote["cold"].append(RemoteFile(key, 4, mtime=when))
            if here:
                local.append(LocalFile(key, ino, 4, State.COMMITTED, committed_at=when,
                                       closed_at=when, mtime=when))
                ino += 1
    now = T0 + (len(cps) + 1) * 7200

    def evicted_and_hot(files: list[LocalFile], objs: dict[str, list[RemoteFile]]
                        ) -> tuple[set[str], set[str], set[str]]:
        """Evicted by the plan; selected by the hot tier's rules; held whole remotely."""
        checkpoints = build(files, objs, step_regex="", tier_order=["hot", "warm", "cold"],
                            detector=DEFAULT_DETECTOR, markers=MARKERS)
        actions = plan(checkpoints, policy, now)
        stored = {c.name for c in checkpoints if c.held & {"warm", "cold"}}
        return ({a.checkpoint for a in actions if a.kind == "evict"},
                set(select(checkpoints, policy, now).get(HOT, {})), stored)

    _, hot_full, stored_full = evicted_and_hot(local, remote)
    mine = {f.key.split("/")[0] for f in local}
    subset = {t: [r for r in objs if r.key.split("/")[0] in mine] for t, objs in remote.items()}
    evicted_local, _, _ = evicted_and_hot(local, subset)
    # What the hot rules keep (seeing every checkpoint) stays; what goes has a store copy.
    # (The full plan may wait longer: until a colder tier that must hold a checkpoint does,
    # so that its copy can read from NVMe. The partial view cannot see that need; the copy
    # then reads from the warm tier. RETENTION.md, "After a save".)
    assert not evicted_local & hot_full
    assert evicted_local <= stored_full
