"""Archive storage classes without a mount (memory tiers with classes, autojump clock).

The node whose retention moved a checkpoint into an archive class of the
warm tier's prefix must know it (``archived``, EAGAIN at open naming ``ckptfs restore``, and
``restore`` finds the files), however the class changed: its own run, a run cut short before
the journal learnt it (the next run or listing catches up), another node's run or a lifecycle
rule (the listing, or the read that meets the archived object).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ckptfs.config import Config
from ckptfs.engine.fs import Filesystem, state_label
from ckptfs.errors import NeedsRestore, StoreRefused, StoreUnavailable
from ckptfs.lifecycle.pins import pin_in_store
from ckptfs.lifecycle.restore import restore
from ckptfs.lifecycle.retention import Policy, Retention, RunResult
from ckptfs.state.journal import ROOT_INODE, Row, State
from ckptfs.store.tiers.base import Tier
from ckptfs.store.tiers.faulty import FaultyTier
from ckptfs.store.tiers.memory import MemoryTier, store_named
from ckptfs.store.tiers.transfer import unwrap
from tests.cluster import Node, run_node

MARKERS = (".metadata",)


def policy_config(store: str, hot: int = 1, warm: int = 1) -> Config:
    return Config.model_validate({
        "staging_dir": "/tmp/unused",
        "tier": [
            {"name": "hot", "keep": {"last": hot}},
            {"name": "warm", "url": f"memory://{store}", "keep": {"last": warm}},
            {"name": "cold", "url": f"memory://{store}?storage_class=GLACIER",
             "keep": {"all": True}},
        ],
    })


@asynccontextmanager
async def archive_node(tmp_path: Path, name: str = "a", store: str | None = None,
                       hot: int = 1, warm: int = 1) -> AsyncIterator[tuple[Node, Retention,
                                                                           dict[str, Tier]]]:
    """A node over a memory store, and its retention: hot and warm keep the last complete
    checkpoint, cold (the same prefix in GLACIER) keeps them all."""
    store = store or f"ret-archive-{id(tmp_path)}"
    if name == "a":
        store_named(store).clear()
    async with trio.open_nursery() as nursery:
        node: Node = await nursery.start(run_node, tmp_path / name, store)
        config = policy_config(store, hot, warm)
        tiers: dict[str, Tier] = {
            "warm": node.tier,
            "cold": MemoryTier("cold", f"memory://{store}?storage_class=GLACIER", store)}
        retention = Retention(Policy.from_config(config), tiers, fs=node.fs, markers=MARKERS)
        try:
            yield node, retention, tiers
        finally:
            await node.stop()
            nursery.cancel_scope.cancel()


async def write_steps(node: Node, steps: range) -> None:
    for step in steps:
        await node.write(f"step_{step}/model.pt", bytes([step]) * (300 * 1024))
        await node.write(f"step_{step}/.metadata", b"m")
    await node.uploader.wait_idle()


def row_at(fs: Filesystem, path: str) -> Row:
    row = fs.ns.get(ROOT_INODE)
    for part in path.split("/"):
        row = fs.ns.lookup(row.ino, part.encode())
    return row


def classes(tier: Tier) -> dict[str, str]:
    tier = unwrap(tier)
    assert isinstance(tier, MemoryTier)
    return {k: o.storage_class for k, o in tier.objects.items() if k.startswith("step_")}


async def read_all(fs: Filesystem, row: Row) -> bytes:
    fh = await fs.open(row.ino, os.O_RDONLY)
    try:
        return await fs.read(fh, 0, row.size)
    finally:
        fs.release(fh)


async def no_report(progress: dict[str, Any]) -> None:
    await trio.lowlevel.checkpoint()


async def test_the_node_that_archived_knows_it_and_restore_finds_it(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with archive_node(tmp_path) as (node, retention, tiers):
        await write_steps(node, range(1, 4))
        result = await retention.run_once()
        assert not result.failed, result.failed
        assert classes(tiers["warm"])["step_1/model.pt"] == "GLACIER"
        assert classes(tiers["warm"])["step_3/model.pt"] == "STANDARD"
        row = row_at(node.fs, "step_1/model.pt")
        assert row.state is State.REMOTE and state_label(row) == "archived"
        with pytest.raises(NeedsRestore, match="ckptfs restore"):
            await node.fs.open(row.ino, os.O_RDONLY)
        MemoryTier.restore_delay = 300.0  # minutes of waiting, skipped by the autojump clock
        try:
            done = await restore(node.fs, row_at(node.fs, "step_1"), days=1, local=False,
                                 report=no_report, poll_interval=60)
        finally:
            MemoryTier.restore_delay = 0.0
        assert (done.files, done.restored_files) == (2, 2)
        assert classes(tiers["warm"])["step_1/model.pt"] == "STANDARD"
        assert state_label(row_at(node.fs, "step_1/model.pt")) == "remote"
        assert await read_all(node.fs, row_at(node.fs, "step_1/model.pt")) == \
            bytes([1]) * (300 * 1024)


async def test_a_transition_the_journal_missed_is_learnt_by_the_next_run(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """The copy to GLACIER happened but its verification failed (a transient HEAD error):
    the action failed, the journal did not learn the class from it; the next run sees the
    object already in cold (nothing to copy) and the journal learns the class anyway."""
    async with archive_node(tmp_path) as (node, retention, tiers):
        await write_steps(node, range(1, 4))
        warm = node.tier
        assert isinstance(warm, FaultyTier)
        cold = tiers["cold"]
        assert isinstance(cold, MemoryTier)
        real_head = cold.head
        failing = {"n": 0}

        async def head_fails_once(key: str) -> Any:
            if key == "step_1/model.pt" and failing["n"] == 0:
                failing["n"] += 1
                from ckptfs.errors import StoreUnavailable
                raise StoreUnavailable("HEAD timed out")
            return await real_head(key)

        cold.head = head_fails_once  # type: ignore[method-assign]
        first = await retention.run_once()
        assert any(a.checkpoint == "step_1" for a, _ in first.failed), first.failed
        assert classes(warm)["step_1/model.pt"] == "GLACIER"
        # Not evicted (the copy did not complete in that run) or evicted by a later round:
        # either way, after the next run the journal knows the class.
        await retention.run_once()
        row = row_at(node.fs, "step_1/model.pt")
        assert row.storage_class == "GLACIER"
        assert state_label(row) == "archived"


async def test_a_class_changed_behind_the_node_is_learnt_by_listing_and_by_reads(
        tmp_path: Path, autojump_clock: trio.testing.MockClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another node's retention (or a lifecycle rule) moved objects in place: same tag, new
    class. A listing of the directory teaches the journal; a read that meets the archived
    object before any listing fails like an open of an archived file (EAGAIN naming
    ``ckptfs restore``, a restore requested; EIO from the read itself) and teaches it too."""
    async with archive_node(tmp_path) as (node, _, tiers):
        await write_steps(node, range(1, 3))
        fs = node.fs
        rows = [row_at(fs, f"step_1/{n}") for n in ("model.pt", ".metadata")]
        fs.evict(*rows)
        cold = tiers["cold"]
        assert isinstance(cold, MemoryTier)
        for key in ("step_1/model.pt", "step_1/.metadata", "step_2/model.pt"):
            cold.place(key, cold.objects[key])  # in place, same tag: a lifecycle transition
        row = row_at(fs, "step_1/model.pt")
        assert state_label(row) == "remote"  # not known yet
        assert fs.lister is not None
        await fs.lister.refresh(row_at(fs, "step_1"), wait=float("inf"), current=True)
        assert state_label(row_at(fs, "step_1/model.pt")) == "archived"
        # step_2 is on NVMe here: still readable, and archived once evicted.
        two = row_at(fs, "step_2/model.pt")
        fs.evict(two)
        two.storage_class = None  # as if no listing had run since the transition
        fs.ns.persist(two)
        # The restore the read requests takes a while.
        monkeypatch.setattr(MemoryTier, "restore_delay", 3600.0)
        fh = await fs.open(two.ino, os.O_RDONLY)
        try:
            # EIO from read(2) (EAGAIN would read as "no data yet"), naming the command.
            with pytest.raises(StoreRefused, match="ckptfs restore"):
                await fs.read(fh, 0, 4096)
        finally:
            fs.release(fh)
        assert row_at(fs, "step_2/model.pt").storage_class == "GLACIER"
        with pytest.raises(NeedsRestore, match="ckptfs restore"):  # the open: EAGAIN
            await fs.open(two.ino, os.O_RDONLY)
        assert cold.objects["step_2/model.pt"].restored_at is not None  # restore requested


async def test_a_new_version_is_not_taken_for_the_archived_one(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """The transition and a rewrite of the file race: the journal's row is the new version
    (uploaded in STANDARD); what retention learnt of the old object must not stick to it."""
    async with archive_node(tmp_path, hot=3) as (node, retention, tiers):
        await write_steps(node, range(1, 4))
        fs = node.fs
        old = row_at(fs, "step_1/model.pt")
        state = await retention.collect()
        local = state.local["step_1/model.pt"]
        info = await tiers["warm"].head("step_1/model.pt")
        await node.write("step_1/model.pt", b"new version")
        await node.uploader.wait_idle()
        from dataclasses import replace
        retention._learn_class("step_1/model.pt", local, replace(info, storage_class="GLACIER"))
        row = row_at(fs, "step_1/model.pt")
        assert row.ino == old.ino and row.storage_class is None
        assert state_label(row) == "committed"


# -- restore pins ------------------------------------------------------------------------------


def kept_by(report: dict[str, Any], name: str) -> list[str]:
    row = next(r for r in report["checkpoints"] if r["name"] == name)
    return list(row["kept_by"])


@pytest.mark.parametrize("local", [True, False])
async def test_a_restore_is_not_undone_until_its_days_are_over(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, local: bool) -> None:
    """``restore`` (``--local``: also to NVMe) of an archived checkpoint: retention keeps it
    in the warm class (and on NVMe) for the restore's days, ls-tiers says why; after that,
    the rules apply again (back to GLACIER, evicted) and the pins are removed."""
    async with archive_node(tmp_path) as (node, retention, tiers):
        await write_steps(node, range(1, 4))
        await retention.run_once()
        fs = node.fs
        await restore(fs, row_at(fs, "step_1"), days=2, local=local, report=no_report,
                      poll_interval=60)
        assert classes(tiers["warm"])["step_1/model.pt"] == "STANDARD"
        after = await retention.run_once()
        assert not [a for a in after.done if a.checkpoint == "step_1"], after.done
        assert classes(tiers["warm"])["step_1/model.pt"] == "STANDARD"
        assert row_at(fs, "step_1/model.pt").state is \
            (State.COMMITTED if local else State.REMOTE)
        report = await retention.report()
        rules = kept_by(report, "step_1")
        assert any(r.startswith("warm: restored, pinned until") for r in rules), rules
        assert any(r.startswith("hot: restored") for r in rules) == local, rules
        row = next(r for r in report["checkpoints"] if r["name"] == "step_1")
        assert set(row["pinned"]) == ({"hot", "warm"} if local else {"warm"})
        assert not any("step_2" in k for k in store_pin_keys(tiers))
        # Three days later: nothing holds it any more.
        later = time.time() + 3 * 86400
        done = await retention.run_once(now=later)
        assert {(a.kind, a.checkpoint) for a in done.done} >= \
            ({("copy", "step_1"), ("evict", "step_1")} if local else {("copy", "step_1")})
        assert classes(tiers["warm"])["step_1/model.pt"] == "GLACIER"
        assert row_at(fs, "step_1/model.pt").state is State.REMOTE
        assert not store_pin_keys(tiers)
        assert not fs.journal.values_under("pin:")


def store_pin_keys(tiers: dict[str, Tier]) -> list[str]:
    warm = unwrap(tiers["warm"])
    assert isinstance(warm, MemoryTier)
    return [k for k in warm.objects if k.startswith(".ckptfs/pins/")]


async def test_another_nodes_run_in_the_middle_of_a_restore_does_not_undo_it(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """The lease holder (another node, its own journal) runs between the two promotes of a
    restore, when step_1 is half in STANDARD, half in GLACIER: the pin is already in the
    store, so its run leaves step_1 alone, and after the restore step_1 stays STANDARD."""
    async with archive_node(tmp_path) as (node, retention, tiers):
        await write_steps(node, range(1, 4))
        await retention.run_once()
        store = unwrap(tiers["warm"])
        assert isinstance(store, MemoryTier)
        other = Retention(retention.policy, {
            "warm": MemoryTier("warm", store.url, f"ret-archive-{id(tmp_path)}"),
            "cold": tiers["cold"]}, markers=MARKERS, node="b")
        runs: list[RunResult] = []
        real_promote = node.tier.promote

        async def promote_then_other_node_runs(key: str) -> None:
            await real_promote(key)
            if not runs:
                runs.append(await other.run_once())

        node.tier.promote = promote_then_other_node_runs  # type: ignore[method-assign]
        await restore(node.fs, row_at(node.fs, "step_1"), days=1, local=False,
                      report=no_report, poll_interval=60)
        assert runs and not [a for a in runs[0].done if a.checkpoint == "step_1"], runs
        assert {classes(store)[k] for k in ("step_1/model.pt", "step_1/.metadata")} == \
            {"STANDARD"}
        again = await other.run_once()
        assert not [a for a in again.done if a.checkpoint == "step_1"], again.done


async def test_a_pin_without_its_restore_shows_blocked(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """The restore died after writing its pin, before any object left GLACIER: the run
    plans the copy back to warm as blocked (restore first) and does nothing."""
    async with archive_node(tmp_path) as (node, retention, tiers):
        await write_steps(node, range(1, 4))
        await retention.run_once()
        await pin_in_store(node.tier, "step_1", time.time() + 86400)
        result = await retention.run_once()
        assert not result.failed and not [a for a in result.done if a.checkpoint == "step_1"]
        assert [(a.kind, a.tier) for a in result.blocked if a.checkpoint == "step_1"] == \
            [("copy", "warm")]
        assert classes(tiers["warm"])["step_1/model.pt"] == "GLACIER"


async def test_a_restore_cut_short_by_a_store_error_is_neither_undone_nor_lost(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """The second promote of a restore fails (the store is down for a moment): the restore
    reports the error with step_1 half in STANDARD, half in GLACIER. A retention run then
    copies nothing back to GLACIER and removes nothing (the pin wants warm, the rest can
    only come from the archive: blocked); the restore run again completes it."""
    async with archive_node(tmp_path) as (node, retention, tiers):
        await write_steps(node, range(1, 4))
        await retention.run_once()
        tier = node.tier
        real_promote = tier.promote
        promoted: list[str] = []

        async def second_fails(key: str) -> None:
            if len(promoted) == 1:
                promoted.append("failed")
                tier.fail_next = 1
            else:
                promoted.append(key)
            await real_promote(key)

        tier.promote = second_fails  # type: ignore[method-assign]
        with pytest.raises(StoreUnavailable):
            await restore(node.fs, row_at(node.fs, "step_1"), days=1, local=False,
                          report=no_report, poll_interval=60)
        half = classes(tiers["warm"])
        assert sorted(half[k] for k in ("step_1/model.pt", "step_1/.metadata")) == \
            ["GLACIER", "STANDARD"]
        result = await retention.run_once()
        assert not [a for a in result.done if a.checkpoint == "step_1"], result.done
        assert [(a.kind, a.tier) for a in result.blocked if a.checkpoint == "step_1"] == \
            [("copy", "warm")]
        assert classes(tiers["warm"]) == half  # nothing moved, nothing deleted
        tier.promote = real_promote  # type: ignore[method-assign]
        await restore(node.fs, row_at(node.fs, "step_1"), days=1, local=False,
                      report=no_report, poll_interval=60)
        assert {classes(tiers["warm"])[k] for k in ("step_1/model.pt", "step_1/.metadata")} \
            == {"STANDARD"}
        again = await retention.run_once()
        assert not [a for a in again.done if a.checkpoint == "step_1"], again.done
        assert not [a for a in again.blocked if a.checkpoint == "step_1"], again.blocked
