"""The smallest real-mount round trip: write, remount, read back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.mounting import Mounter, ckptfs, wait_for

pytestmark = pytest.mark.mount


def test_write_remount_read(mounter: Mounter) -> None:
    m = mounter()
    (m.path / "step_1").mkdir()
    (m.path / "step_1" / "model.pt").write_bytes(b"x" * 100_000)
    os.symlink("step_1", m.path / "latest")
    assert m.state("step_1/model.pt") in ("staged", "uploading", "committed")
    m.umount()  # waits for the uploads
    assert (m.store / "step_1" / "model.pt").read_bytes() == b"x" * 100_000
    assert os.readlink(m.store / "latest") == "step_1"
    assert not any(m.path.iterdir())
    m.remount()
    assert (m.path / "step_1" / "model.pt").read_bytes() == b"x" * 100_000
    assert os.readlink(m.path / "latest") == "step_1"
    assert sorted(os.listdir(m.path)) == ["latest", "step_1"]
    assert m.state("step_1/model.pt") == "committed"


def test_long_staging_path(mounter: Mounter, tmp_path: Path) -> None:
    """A staging path too long for a unix socket still gets a control socket (elsewhere)."""
    staging = tmp_path / ("s" * 60) / ("t" * 60)
    m = mounter("long", staging=staging)
    (m.path / "f").write_bytes(b"data")
    status = json.loads(ckptfs("status", m.path, "--json").stdout)
    assert status["staging_dir"] == str(staging)
    ckptfs("sync", m.path)
    assert (m.store / "f").read_bytes() == b"data"


def _read_ahead_kb(path: Path) -> int:
    dev = os.stat(path).st_dev
    return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
               .read_text())


@pytest.mark.skipif(os.geteuid() != 0, reason="read_ahead_kb is set through sysfs (root)")
def test_kernel_readahead_is_set_on_the_mount(mounter: Mounter) -> None:
    """read_ahead_kb (default 1024) lands in the mount's bdi; the mount point is found in
    /proc/self/mountinfo even with a space in its path (an octal escape there)."""
    m = mounter("with space")
    assert " " in str(m.path)
    # Set by the daemon right after the kernel's INIT, which may be a moment after the mount.
    wait_for("read_ahead_kb 1024", lambda: _read_ahead_kb(m.path) == 1024, timeout=10)
    other = mounter("other", extra=["-o", "read_ahead_kb=2048"])
    wait_for("read_ahead_kb 2048", lambda: _read_ahead_kb(other.path) == 2048, timeout=10)
    assert _read_ahead_kb(m.path) == 1024
