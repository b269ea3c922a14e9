"""Retention on a real mount: unmodified ``torch.save`` writes ten checkpoints; the NVMe, the
store and ``ckptfs ls-tiers`` (both forms, with and without the mount) agree with a small
policy; ``--plan`` changes nothing; an evicted checkpoint still loads through the mount; the
applier also runs by itself after commits.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.mounting import Mount, Mounter, ckptfs

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.mount

STEPS = [100 * i for i in range(1, 11)]


def write_config(path: Path, store: Path, hot: int, warm: int, interval: int,
                 milestones: str = "[0.5, 1.0]") -> Path:
    # The staging directory the mounter gives mount "m" (ls-tiers without a mount reads it).
    staging = path.parent / "m" / "staging"
    path.write_text(f"""
staging_dir = "{staging}"
total_steps = 1000
retention_interval = {interval}

[[tier]]
name = "hot"
keep = {{ last = {hot} }}

[[tier]]
name = "warm"
url = "{store.as_uri()}"
keep = {{ last = {warm}, milestones = {milestones} }}
cost_per_tb_month = 20
""")
    return path


def save_checkpoints(m: Mount) -> dict[int, Any]:
    """Ten checkpoints as a trainer writes them: a directory per step, then ``latest``."""
    saved = {}
    for step in STEPS:
        state = {"w": torch.full((64, 64), float(step)), "step": step}
        (m.path / f"step_{step}").mkdir()
        torch.save(state, m.path / f"step_{step}" / "model.pt")
        torch.save({"lr": 0.1}, m.path / f"step_{step}" / "optim.pt")
        # The commit marker: without one a checkpoint is never complete (docs/RETENTION.md).
        (m.path / f"step_{step}" / "COMMITTED").write_text("")
        (m.path / "latest").write_text(str(step))
        saved[step] = state
    return saved


def store_checkpoints(store: Path) -> set[str]:
    return {p.name for p in store.iterdir() if p.name.startswith("step_")}


def snapshot(m: Mount, store: Path) -> tuple[dict[str, str], dict[str, int]]:
    """Every file's state as the mount says, and every store file's size."""
    states = {}
    for d in sorted(m.path.iterdir()):
        for f in sorted(d.iterdir()) if d.is_dir() else [d]:
            states[str(f.relative_to(m.path))] = m.state(str(f.relative_to(m.path)))
    files = {str(p.relative_to(store)): p.stat().st_size for p in store.rglob("*")
             if p.is_file() and not str(p.relative_to(store)).startswith(".ckptfs/")}
    return states, files


def ls_tiers(*args: str | os.PathLike[str]) -> dict[str, Any]:
    done = ckptfs("ls-tiers", *args, "--json")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def check_report(report: dict[str, Any], hot: set[str], warm: set[str]) -> None:
    rows = {r["name"]: r for r in report["checkpoints"]}
    assert set(rows) == warm | {"latest"}
    for name, row in rows.items():
        if name == "latest":
            assert row["step"] is None and row["kept_by"] == ["pointer"]
            continue
        assert row["step"] == int(name.split("_")[1]) and row["state"] == "complete"
        assert row["tiers"]["warm"] == "committed"
        assert row["tiers"]["hot"] == ("committed" if name in hot else "absent"), name
        assert row["size"] > 64 * 64 * 4 and row["age_s"] is not None
    assert "warm: milestone 0.5" in rows["step_500"]["kept_by"]
    assert rows["step_1000"]["kept_by"] == ["hot: last 2", "warm: last 4", "warm: milestone 1"]
    assert report["plan"] == []
    tiers = {t["name"]: t for t in report["tiers"]}
    assert tiers["warm"]["bytes"] == sum(r["size"] for r in rows.values())
    assert tiers["warm"]["monthly_cost"] == pytest.approx(tiers["warm"]["bytes"] / 1e12 * 20,
                                                          abs=1e-6)
    assert report["total"]["bytes"] == tiers["hot"]["bytes"] + tiers["warm"]["bytes"]


def test_policy_on_a_real_mount(mounter: Mounter, tmp_path: Path) -> None:
    store = tmp_path / "store"
    config = write_config(tmp_path / "ckptfs.toml", store, hot=2, warm=4, interval=0)
    m = mounter(config=config)
    saved = save_checkpoints(m)
    ckptfs("sync", m.path)
    assert store_checkpoints(store) == {f"step_{s}" for s in STEPS}

    before = snapshot(m, store)
    plan = ckptfs("retention", m.path, "--plan").stdout
    assert "step_100: delete" in plan and "step_800: evict from hot" in plan
    assert "step_500: evict from hot" in plan and "step_500: delete" not in plan
    assert snapshot(m, store) == before, "--plan changed something"

    applied = ckptfs("retention", m.path, "--apply").stdout
    assert "done     step_100: delete" in applied

    hot = {"step_900", "step_1000"}
    warm = {"step_500", "step_700", "step_800", "step_900", "step_1000"}
    assert store_checkpoints(store) == warm
    assert (store / "latest").read_text() == "1000"
    assert {p.name for p in m.path.iterdir()} == warm | {"latest"}
    for name in warm:
        expected = "committed" if name in hot else "remote"
        assert m.state(f"{name}/model.pt") == expected, name

    report = ls_tiers(m.path)
    check_report(report, hot, warm)
    human = ckptfs("ls-tiers", m.path, env={**os.environ, "COLUMNS": "250"}).stdout
    for needle in ("checkpoints", "kept by", "step_500", "milestone 0.5", "warm: last 4",
                   "total", "$/month"):
        assert needle in human, needle

    # An evicted checkpoint loads through the mount (fetched back from the store).
    loaded = torch.load(m.path / "step_500" / "model.pt")
    assert torch.equal(loaded["w"], saved[500]["w"]) and loaded["step"] == 500
    # Reading it brought it back to NVMe (a local copy once the fetches pause: fetch.py): a
    # cache the next run evicts again.
    deadline = time.monotonic() + 60
    while m.state("step_500/model.pt") != "committed" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ckptfs("retention", m.path, "--plan").stdout == "step_500: evict from hot\n"
    ckptfs("retention", m.path, "--apply")
    assert m.state("step_500/model.pt") == "remote"

    # Without the mount: from the journal and the store, the same answer.
    m.umount()
    offline = ls_tiers("--config", config)
    offline_rows = {r["name"]: r for r in offline["checkpoints"]}
    assert set(offline_rows) == warm | {"latest"}
    assert offline_rows["step_500"]["kept_by"] == report_rows(report)["step_500"]["kept_by"]
    assert "nothing to do" in ckptfs("retention", "--config", config, "--plan").stdout


def report_rows(report: dict[str, Any]) -> dict[str, Any]:
    return {r["name"]: r for r in report["checkpoints"]}


def test_retention_runs_by_itself_after_commits(mounter: Mounter, tmp_path: Path) -> None:
    store = tmp_path / "store"
    config = write_config(tmp_path / "ckptfs.toml", store, hot=1, warm=2, interval=3600,
                          milestones="[1.0]")
    m = mounter(config=config)
    for step in STEPS[:4]:
        (m.path / f"step_{step}").mkdir()
        torch.save({"step": step}, m.path / f"step_{step}" / "model.pt")
        (m.path / f"step_{step}" / "COMMITTED").write_text("")
    ckptfs("sync", m.path)
    deadline = time.monotonic() + 60
    while store_checkpoints(store) != {"step_300", "step_400"}:
        assert time.monotonic() < deadline, f"store: {store_checkpoints(store)}"
        time.sleep(0.2)
    while m.state("step_300/model.pt") != "remote":
        assert time.monotonic() < deadline, m.state("step_300/model.pt")
        time.sleep(0.2)
    assert m.state("step_400/model.pt") == "committed"
    assert {p.name for p in m.path.iterdir()} == {"step_300", "step_400"}
