"""Staging usage after removals: the space budget (``status``'s
``used_bytes``, ``staging_max_bytes``, the metric) must stay equal to the data the staging
directory holds, whoever removes files (retention's deletions, ``rm``) and in whatever order
the references go (an open handle, the kernel's lookup count).

A removed inode is dropped when its last handle closes and again when the kernel forgets it;
its space was given back each time, so usage drifted down with every deletion.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import trio
import trio.testing

from ckptfs.config import KeepRules
from ckptfs.engine.fs import Filesystem
from ckptfs.lifecycle.checkpoints import HOT
from ckptfs.lifecycle.retention import Policy, Retention, TierPolicy
from ckptfs.state.journal import ROOT_INODE
from tests.mounting import Mounter, ckptfs, status, sync, wait_for
from tests.test_retention_nodes import MARKERS, local_node, memory_tiers
from tests.test_retention_sim import write

MiB = 1024 * 1024


def on_disk(fs: Filesystem) -> int:
    """Apparent bytes of the staging data files (what ``used`` accounts for)."""
    data = fs.staging.root / "data"
    return sum(p.stat().st_size for p in data.iterdir() if p.is_file())


def forget_removed(fs: Filesystem) -> int:
    """The kernel's forget of every removed inode it still references (as after an
    invalidation or drop_caches); returns how many."""
    removed = [ino for ino in list(fs.ns._lookups)
               if ino != ROOT_INODE and fs.journal.get(ino) is not None
               and fs.journal.get(ino).parent is None]  # type: ignore[union-attr]
    for ino in removed:
        fs.forget(ino, fs.ns._lookups[ino])
    return len(removed)


async def test_usage_matches_the_disk_after_retention_deletes_and_forgets(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    tiers = memory_tiers(f"{id(tmp_path)}", "warm")
    fs, uploader, journal, staging = await local_node(tmp_path, tiers["warm"])
    policy = Policy((TierPolicy(HOT, KeepRules(last=3), HOT, HOT),
                     TierPolicy("warm", KeepRules(last=2), "memory:w", "memory")))
    retention = Retention(policy, tiers, fs=fs, markers=MARKERS)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(uploader.run)
            reader = None
            deleted = 0
            for step in range(1, 7):
                await write(fs, f"step_{step}/model.pt", os.urandom(1000 + step))
                await write(fs, f"step_{step}/.metadata", b"m")
                await uploader.wait_idle()
                if step == 3:
                    # A reader of step_1 while retention deletes it: the name goes, the
                    # data stays until the handle is closed (then the kernel forgets it).
                    row = fs.ns.lookup(fs.ns.lookup(ROOT_INODE, b"step_1").ino, b"model.pt")
                    reader = await fs.open(row.ino, os.O_RDONLY)
                result = await retention.run_once()
                deleted += sum(a.kind == "delete" for a in result.done)
                assert fs.space.used == on_disk(fs), step
                if reader is not None and step == 4:
                    fs.release(reader)
                    reader = None
                    assert fs.space.used == on_disk(fs)
                forget_removed(fs)
                assert fs.space.used == on_disk(fs) == journal.local_bytes(), step
            assert deleted >= 3
            # rm of a file open elsewhere: the name goes at once, the data with the last
            # handle, the row with the kernel's forget.
            ino = await write(fs, "scratch.bin", os.urandom(5000))
            fh = await fs.open(ino, os.O_RDONLY)
            await fs.unlink(ROOT_INODE, b"scratch.bin")
            assert fs.space.used == on_disk(fs)
            fs.release(fh)
            assert fs.space.used == on_disk(fs)
            assert forget_removed(fs) == 1
            assert fs.space.used == on_disk(fs) == journal.local_bytes()
            nursery.cancel_scope.cancel()
    finally:
        fs.close()
        journal.close()
        staging.close()


@pytest.mark.mount
def test_status_usage_matches_the_disk_after_retention_deletes(
        mounter: Mounter, tmp_path: Path) -> None:
    """A real mount: checkpoints listed (the kernel references them), retention deletes the
    old ones, the kernel forgets them (drop_caches): ``status`` reports what ``du`` sees."""
    if os.geteuid() != 0:
        pytest.skip("needs root (drop_caches makes the kernel forget the removed inodes)")
    store = tmp_path / "store"
    store.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"""
retention_interval = 0

[[tier]]
name = "hot"
keep = {{ last = 3 }}

[[tier]]
name = "warm"
url = "file://{store}"
keep = {{ last = 2 }}
""")
    m = mounter("m", config=cfg)
    for step in range(1, 7):
        (m.path / f"step_{step}").mkdir()
        (m.path / f"step_{step}" / "model.pt").write_bytes(os.urandom(MiB + step))
        (m.path / f"step_{step}" / ".metadata").write_bytes(b"m")
    subprocess.run(["ls", "-lR", str(m.path)], capture_output=True, check=True)
    sync(m)
    ckptfs("retention", m.path, "--apply")
    assert sorted(p.name for p in m.path.iterdir()) == ["step_4", "step_5", "step_6"]
    Path("/proc/sys/vm/drop_caches").write_text("2\n")

    def settled() -> bool:
        used = status(m)["staging"]["used_bytes"]
        return bool(used == on_disk_dir(m.staging / "data"))

    wait_for("staging usage to match the disk", settled, timeout=10)
    assert on_disk_dir(m.staging / "data") == 3 * MiB + 4 + 5 + 6 + 3


def on_disk_dir(data: Path) -> int:
    return sum(p.stat().st_size for p in data.iterdir() if p.is_file())
