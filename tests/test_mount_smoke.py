"""The smallest real-mount round trip: write, remount, read back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.mounting import Mounter, ckptfs

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
