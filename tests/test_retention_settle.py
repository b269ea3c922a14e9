"""Checkpoints without a commit marker: plain ``torch.save`` into
``step_N/`` gets its "keep last N" by the settle rule (checkpoints.settle), as long as no
other node writes to the store; ls-tiers and ``retention --plan`` say why one is skipped.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from ckptfs.config import KeepRules
from ckptfs.engine.fs import Filesystem
from ckptfs.engine.upload import Uploader
from ckptfs.lifecycle.checkpoints import HOT
from ckptfs.lifecycle.retention import Policy, Retention, TierPolicy
from ckptfs.ops.retention_cli import print_retention
from ckptfs.store.tiers.base import ObjectMeta, Tier
from tests.mounting import Mounter, ckptfs, sync
from tests.test_retention_nodes import MARKERS, local_node, memory_tiers
from tests.test_retention_sim import write

POLICY = Policy((TierPolicy(HOT, KeepRules(last=1), HOT, HOT),
                 TierPolicy("warm", KeepRules(last=2), "memory:w", "memory")))


@asynccontextmanager
async def node(tmp_path: Path, settle: float | None = 600.0
               ) -> AsyncIterator[tuple[Filesystem, Uploader, Retention, Tier]]:
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    fs, uploader, journal, staging = await local_node(tmp_path, tiers["warm"])
    retention = Retention(POLICY, tiers, fs=fs, markers=MARKERS, node="me", settle=settle)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            yield fs, uploader, retention, tiers["warm"]
            nursery.cancel_scope.cancel()
    finally:
        fs.close()
        journal.close()
        staging.close()


async def torch_save(fs: Filesystem, uploader: Uploader, steps: range) -> None:
    for step in steps:
        await write(fs, f"step_{step}/model.pt", os.urandom(100 + step))
        await write(fs, f"step_{step}/optim.pt", os.urandom(50 + step))
        await uploader.wait_idle()


def names(fs: Filesystem) -> list[str]:
    from ckptfs.state.journal import ROOT_INODE

    return sorted(r.name.decode() for r in fs.ns.children(ROOT_INODE, 0) if r.name)


def notes(report: dict[str, object]) -> dict[str, str | None]:
    return {r["name"]: r["note"] for r in report["checkpoints"]}  # type: ignore[attr-defined]


async def test_plain_save_into_step_dirs_gets_keep_last(
        tmp_path: Path, autojump_clock: trio.testing.MockClock,
        capsys: pytest.CaptureFixture[str]) -> None:
    async with node(tmp_path) as (fs, uploader, retention, _):
        await torch_save(fs, uploader, range(1, 5))
        result = await retention.run_once()
        # step_1..3 have a later checkpoint: complete; the last 2 of them stay.
        assert ("delete", "step_1") in {(a.kind, a.checkpoint) for a in result.done}
        assert names(fs) == ["step_2", "step_3", "step_4"]
        report = await retention.report()
        note = notes(report)
        assert note["step_3"] == "no commit marker; complete: a later checkpoint exists"
        assert note["step_4"] is not None and note["step_4"].startswith(
            "no commit marker: complete once a later checkpoint exists or 10m after its "
            "last file")
        assert "COMMITTED" in note["step_4"]
        print_retention(report, applied=False)
        assert "skipped  step_4: no commit marker" in capsys.readouterr().out
        # Ten minutes later the newest settles too: last 2 is step_3 and step_4.
        later = await retention.run_once(now=time.time() + 601)
        assert ("delete", "step_2") in {(a.kind, a.checkpoint) for a in later.done}
        assert names(fs) == ["step_3", "step_4"]
        assert notes(await retention.report(now=time.time() + 601))["step_4"] == \
            "no commit marker; complete: nothing written to it for 10m"


async def test_a_later_checkpoint_counts_by_when_it_was_written_not_committed(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Uploads run in parallel: step_4's file can be committed before step_3's although it
    was written after it. step_3 still has a later checkpoint (the CI flake of stop 23)."""
    async with node(tmp_path) as (fs, uploader, retention, _):
        await torch_save(fs, uploader, range(1, 5))
        from ckptfs.state.journal import State

        rows = fs.ns.journal.rows_in_states(State.COMMITTED)
        newest = max(r.committed_at or 0.0 for r in rows)
        for listed in rows:
            # step_3's files are committed last, after step_4's; they were written in order.
            if (fs.ns.path_of(listed.ino) or b"").startswith(b"step_3/"):
                row = fs.ns.get(listed.ino)
                row.committed_at = newest + 5
                fs.ns.persist(row)
        note = notes(await retention.report())
        assert note["step_3"] == "no commit marker; complete: a later checkpoint exists", note


async def test_another_registered_node_keeps_the_marker_rule(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Another node is registered with the store: its shards of these checkpoints may be
    on their way, so without a marker nothing is complete, however old (multi-node safety)."""
    async with node(tmp_path) as (fs, uploader, retention, warm):
        await warm.put_small(".ckptfs/nodes/node-b", b"{}")
        await warm.put_small(".ckptfs/nodes/me", b"{}")  # this node's own: not another
        await torch_save(fs, uploader, range(1, 5))
        result = await retention.run_once(now=time.time() + 86400)
        assert not [a for a in result.done if a.kind == "delete"], result.done
        assert names(fs) == ["step_1", "step_2", "step_3", "step_4"]
        note = notes(await retention.report())["step_1"]
        assert note is not None and "other nodes write to the store (node-b)" in note


async def test_a_higher_step_left_by_an_earlier_run_settles_nothing(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Training resumed from an older checkpoint: step_900 of the earlier run is in the store.
    step_5, being saved now (model.pt committed, optim.pt not written yet), must not count as
    complete because of it; step_6 starting does settle step_5."""
    async with node(tmp_path) as (fs, uploader, retention, warm):
        src = tmp_path / "old"
        src.write_bytes(b"x" * 10)
        await warm.put_file("step_900/model.pt", src, 10,
                            ObjectMeta(mtime_ns=int((time.time() - 86400) * 1e9)))
        await write(fs, "step_5/model.pt", b"half of a save")
        await uploader.wait_idle()
        state = await retention.collect()
        by_name = {c.name: c for c in state.checkpoints}
        assert by_name["step_5"].busy == "no marker"
        await torch_save(fs, uploader, range(6, 7))
        state = await retention.collect()
        assert {c.name: c for c in state.checkpoints}["step_5"].busy is None


async def test_settle_off_requires_a_marker(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with node(tmp_path, settle=None) as (fs, uploader, retention, _):
        await torch_save(fs, uploader, range(1, 5))
        result = await retention.run_once(now=time.time() + 86400)
        assert not [a for a in result.done if a.kind == "delete"]
        note = notes(await retention.report())["step_1"]
        assert note is not None and "checkpoint_settle is off" in note


@pytest.mark.mount
def test_plain_save_on_a_mount_is_managed_and_the_plan_says_why(
        mounter: Mounter, tmp_path: Path) -> None:
    """On a real mount with the default ``checkpoint_settle``: ``retention --plan`` shows
    what it will delete and why the newest is skipped; ``--apply`` keeps the last 2."""
    store = tmp_path / "store"
    store.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"""
retention_interval = 0

[[tier]]
name = "hot"
keep = {{ last = 1 }}

[[tier]]
name = "warm"
url = "file://{store}"
keep = {{ last = 2 }}
""")
    m = mounter("m", config=cfg)
    for step in range(1, 5):
        (m.path / f"step_{step}").mkdir()
        (m.path / f"step_{step}" / "model.pt").write_bytes(os.urandom(4096 + step))
    sync(m)
    planned = ckptfs("retention", m.path, "--plan").stdout
    assert "step_1: delete" in planned, planned
    assert "skipped  step_4: no commit marker: complete once a later checkpoint exists" \
        in planned, planned
    ckptfs("retention", m.path, "--apply")
    assert sorted(p.name for p in m.path.iterdir()) == ["step_2", "step_3", "step_4"]
    assert sorted(p.name for p in store.iterdir() if not p.name.startswith(".")) == \
        ["step_2", "step_3", "step_4"]
    table = ckptfs("ls-tiers", m.path, env={**os.environ, "COLUMNS": "300"}).stdout
    assert "no commit marker; complete: a later checkpoint exists" in table, table


def test_offline_plan_does_not_count_this_staging_directory_as_another_writer(
        tmp_path: Path) -> None:
    """``ckptfs retention --plan --config`` without a daemon: the staging directory's node is
    still registered (an unmount that left files behind keeps it so); it is this node, not
    another writer, so marker-less checkpoints settle as they do in the daemon."""
    from ckptfs.ops.retention_cli import gather

    store = tmp_path / "store"
    for step in (1, 2, 3):
        (store / f"step_{step}").mkdir(parents=True)
        (store / f"step_{step}" / "model.pt").write_bytes(b"w" * step)
        os.utime(store / f"step_{step}" / "model.pt", (1_700_000_000 + step,) * 2)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"""
node_id = "this-node"
staging_dir = "{tmp_path / 'staging'}"

[[tier]]
name = "hot"
keep = {{ last = 1 }}

[[tier]]
name = "warm"
url = "file://{store}"
keep = {{ last = 1 }}
""")
    (store / ".ckptfs" / "nodes").mkdir(parents=True)
    (store / ".ckptfs" / "nodes" / "this-node").write_text("{}")
    plan = {(a["kind"], a["checkpoint"]) for a in gather(None, cfg, apply=False)["plan"]}
    assert plan == {("delete", "step_1"), ("delete", "step_2")}, plan
    (store / ".ckptfs" / "nodes" / "node-b").write_text("{}")
    report = gather(None, cfg, apply=False)
    assert report["plan"] == []
    notes = {r["name"]: r["note"] for r in report["checkpoints"]}
    assert "other nodes write to the store (node-b)" in notes["step_1"]
