"""Ten simulated days of hourly checkpoints under the design's default policy.

The filesystem core and the uploader run for real (memory tiers, or S3 on the session's
SeaweedFS); time is simulated: each checkpoint is committed at its simulated hour (the
uploader stamps wall time, so the test moves ``committed_at`` to the simulated hour, as if
the clock had been there), and retention runs after each commit with ``now`` = that hour. At the end,
every tier must hold exactly what the rules select, computed here independently with
``datetime`` calendar arithmetic.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trio

from ckptfs.config import DEFAULT_COMMIT_MARKERS, Config
from ckptfs.engine.fs import ROOT_CALLER, Filesystem
from ckptfs.engine.upload import Uploader
from ckptfs.errors import NotFound
from ckptfs.lifecycle.retention import Policy, Retention, detector_for
from ckptfs.state.journal import ROOT_INODE, Journal, State
from ckptfs.state.staging import Staging
from ckptfs.store.tiers import open_tier
from ckptfs.store.tiers.base import Tier
from ckptfs.store.tiers.memory import MemoryTier
from tests.full import full_or
from tests.s3bucket import Server

T0 = datetime(2025, 3, 3, 0, 30, tzinfo=UTC).timestamp()  # a Monday, half past midnight
HOURS = 240
STEP = 100
# On the S3 server every simulated hour is a few dozen real requests: four days there in
# .ci/run (hourly -> daily transitions, archive milestones, one ISO week), the ten with
# CKPTFS_TEST_FULL=1 (tests/full.py) or CKPTFS_TEST_SIM_S3_HOURS=240.
S3_HOURS = int(os.environ.get("CKPTFS_TEST_SIM_S3_HOURS", full_or("96", "240")))


def name(i: int) -> str:
    return f"step_{(i + 1) * STEP}"


def when(i: int) -> float:
    return T0 + i * 3600


def expected_sets(hours: int = HOURS) -> dict[str, set[str]]:
    """The design's default policy after ``hours`` hourly checkpoints, by calendar
    arithmetic."""
    now = datetime.fromtimestamp(when(hours - 1), UTC)
    stamps = {name(i): datetime.fromtimestamp(when(i), UTC) for i in range(hours)}
    newest_first = sorted(stamps, key=lambda n: stamps[n], reverse=True)

    def newest_per(bucket: Callable[[datetime], Any], window: timedelta) -> set[str]:
        seen, keep = set(), set()
        for n in newest_first:
            if now - stamps[n] > window:
                continue
            b = bucket(stamps[n])
            if b not in seen:
                seen.add(b)
                keep.add(n)
        return keep

    hourly = newest_per(lambda d: (d.date(), d.hour), timedelta(hours=24))
    daily = newest_per(lambda d: d.date(), timedelta(days=7))
    weekly = newest_per(lambda d: d.isocalendar()[:2], timedelta(weeks=8))
    milestones = {name(round(f * hours) - 1) for f in (0.25, 0.5, 0.75, 1.0)}
    return {
        "hot": set(newest_first[:3]),
        "warm": set(newest_first[:3]) | hourly,
        "cold": daily | weekly,
        "archive": milestones,
    }


def config_for(urls: dict[str, str], server: Server | None = None,
               hours: int = HOURS) -> Config:
    extra = {"endpoint_url": server.endpoint, **server.tier_credentials} if server else {}
    return Config.model_validate({
        "staging_dir": "/tmp/unused",
        "total_steps": hours * STEP,
        "tier": [
            {"name": "hot", "keep": {"last": 3}},
            {"name": "warm", "url": urls["warm"], "keep": {"last": 3, "hourly": "24h"},
             "cost_per_tb_month": 25, **extra},
            {"name": "cold", "url": urls["cold"], "keep": {"daily": "7d", "weekly": "8w"},
             "cost_per_tb_month": 4, **extra},
            {"name": "archive", "url": urls["archive"],
             "keep": {"milestones": [0.25, 0.5, 0.75, 1.0]}, "cost_per_tb_month": 1, **extra},
        ],
    })


async def write(fs: Filesystem, path: str, data: bytes) -> int:
    parent = ROOT_INODE
    parts = path.split("/")
    for part in parts[:-1]:
        try:
            parent = (await fs.lookup(parent, part.encode())).ino
        except NotFound:
            parent = fs.mkdir(parent, part.encode(), 0o755, ROOT_CALLER).ino
    try:
        ino = (await fs.lookup(parent, parts[-1].encode())).ino
        fh = await fs.open(ino, os.O_WRONLY | os.O_TRUNC)
    except NotFound:
        fh, row = fs.create(parent, parts[-1].encode(), 0o644, os.O_WRONLY | os.O_CREAT,
                            ROOT_CALLER)
        ino = row.ino
    await fs.write(fh, 0, data)
    fs.flush(fh)
    fs.release(fh)
    return ino


async def simulate(tmp_path: Path, config: Config, tiers: dict[str, Tier],
                   hours: int = HOURS) -> Filesystem:
    staging = Staging(tmp_path / "staging")
    staging.prepare()
    journal = Journal(staging.root / "journal.db")
    # No tier for the core: no store listing merges into the namespace, so the run depends
    # on nothing but the simulated clock.
    fs = Filesystem(journal, staging)
    fs.start()
    uploader = Uploader(journal, fs.ns, staging, tiers["warm"], concurrency=4,
                        markers=DEFAULT_COMMIT_MARKERS)
    fs.listener = uploader
    retention = Retention(Policy.from_config(config), tiers, detector=detector_for(config),
                          markers=config.commit_markers,
                          fs=fs, scratch=staging.root / "tmp")
    async with trio.open_nursery() as nursery:
        await nursery.start(uploader.run)
        for i in range(hours):
            inos = [await write(fs, f"{name(i)}/model.pt", os.urandom(1000 + i)),
                    await write(fs, f"{name(i)}/.metadata", f"step {i}".encode())]
            inos.append(await write(fs, "latest", name(i).encode()))
            await uploader.wait_idle()
            for ino in inos:
                row = fs.ns.get(ino)
                assert row.state is State.COMMITTED
                row.committed_at = when(i)
                fs.ns.persist(row)
            result = await retention.run_once(now=when(i))
            assert not result.failed, result.failed
            assert not result.blocked, result.blocked
        assert not (await retention.run_once(now=when(hours - 1))).done  # a fixpoint
        report = await retention.report(now=when(hours - 1))
        nursery.cancel_scope.cancel()
    fs.report = report  # type: ignore[attr-defined]
    return fs


def local_state(fs: Filesystem) -> tuple[set[str], set[str]]:
    """(checkpoints in the namespace, checkpoints wholly on NVMe)."""
    present, local = set(), set()
    for row in fs.ns.children(ROOT_INODE, 0):
        assert row.name is not None
        n = row.name.decode()
        if n == "latest":
            continue
        present.add(n)
        files = list(fs.ns.children(row.ino, 0))
        if files and all(f.state is State.COMMITTED for f in files):
            local.add(n)
    return present, local


def checkpoints_of(keys: list[str]) -> set[str]:
    """Checkpoint names of store keys (not the nodes' shared state under .ckptfs/, such as
    the retirement records of deleted checkpoints)."""
    return {k.split("/")[0] for k in keys
            if k != "latest" and not k.endswith("/") and not k.startswith(".ckptfs/")}


def check_report(report: dict[str, Any], expected: dict[str, set[str]]) -> None:
    rows = {r["name"]: r for r in report["checkpoints"]}
    for tier in ("warm", "archive"):
        held = {n for n, r in rows.items() if r["tiers"][tier] == "committed" and n != "latest"}
        assert held == expected[tier], tier
    assert rows["latest"]["kept_by"] == ["pointer"]
    assert report["plan"] == []
    assert report["total"]["bytes"] == sum(t["bytes"] for t in report["tiers"])


async def test_ten_days_memory_tiers(tmp_path: Path) -> None:
    tag = f"{id(tmp_path)}"
    urls = {t: f"memory://sim-{t}-{tag}" for t in ("warm", "cold", "archive")}
    config = config_for(urls)
    tiers = {t.name: open_tier(t) for t in config.tier[1:]}
    fs = await simulate(tmp_path, config, tiers)
    expected = expected_sets()
    keep_any = set().union(*expected.values())
    assert len(keep_any) < HOURS / 4  # the policy really deletes
    for tier in ("warm", "cold", "archive"):
        objects = tiers[tier]
        assert isinstance(objects, MemoryTier)
        files = [k for k in objects.objects if not k.endswith("/")]
        assert checkpoints_of(files) == expected[tier], tier
        # Whole checkpoints, and the pointer wherever there is data.
        for n in expected[tier]:
            assert {f"{n}/model.pt", f"{n}/.metadata"} <= set(files)
        assert objects.objects["latest"].body == name(HOURS - 1).encode()
    present, local = local_state(fs)
    assert present == keep_any
    assert local == expected["hot"]
    check_report(fs.report, expected)  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_days_of_s3_storage_classes(tmp_path: Path, s3: Server) -> None:
    bucket = s3.new_bucket()
    # warm and cold are one prefix in two storage classes (in-place transitions); the
    # archive is another prefix of the same bucket (server-side copies with a class).
    urls = {"warm": f"s3://{bucket}/run1", "cold": f"s3://{bucket}/run1?storage_class=GLACIER",
            "archive": f"s3://{bucket}/archive?storage_class=DEEP_ARCHIVE"}
    config = config_for(urls, s3, S3_HOURS)
    tiers = {t.name: open_tier(t) for t in config.tier[1:]}
    try:
        fs = await simulate(tmp_path, config, tiers, S3_HOURS)
    finally:
        for tier in tiers.values():
            await tier.aclose()
    expected = expected_sets(S3_HOURS)
    client = s3.client()
    classes: dict[str, dict[str, str]] = {"run1": {}, "archive": {}}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            prefix, key = obj["Key"].split("/", 1)
            classes[prefix][key] = obj.get("StorageClass", "STANDARD")
    run1 = classes["run1"]
    standard = checkpoints_of([k for k, c in run1.items() if c == "STANDARD"])
    glacier = checkpoints_of([k for k, c in run1.items() if c == "GLACIER"])
    assert standard == expected["warm"]
    # A checkpoint both select stays in the warmer class (one object per key).
    assert glacier == expected["cold"] - expected["warm"]
    assert set(run1.values()) <= {"STANDARD", "GLACIER"}
    archive = classes["archive"]
    assert checkpoints_of(list(archive)) == expected["archive"]
    assert set(archive.values()) == {"DEEP_ARCHIVE"}
    assert "latest" in archive and run1["latest"] == "STANDARD"
    present, local = local_state(fs)
    assert present == set().union(*expected.values())
    assert local == expected["hot"]
    report = fs.report  # type: ignore[attr-defined]
    rows = {r["name"]: r for r in report["checkpoints"]}
    assert {n for n, r in rows.items() if r["tiers"]["cold"] == "committed"} == glacier
    check_report(report, expected)
