"""The benchmarks must not rot: ``benchmarks/run_all.py --quick`` runs every question end to end,
``benchmarks/restore.py --quick`` both stores.

It checks that the runner produced its table, JSON and PNG and that no question failed, never
the figures themselves (benchmarks print numbers, they do not assert them; on a shared CI
machine they mean little). Needs /dev/fuse, torch, moto and matplotlib; rclone is optional
(without it Q2 says so and skips that configuration).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mount, pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = ("q1", "q2", "q3", "q4", "q5")


def test_run_all_quick(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    done = subprocess.run(
        # The work dir stays the default (/var/tmp, removed by the runner): ckptfs keeps its
        # control socket in the staging dir, and pytest's tmp_path is too long for AF_UNIX.
        [sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=480, stdin=subprocess.DEVNULL, cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, f"run_all.py --quick failed:\n{done.stdout}\n{done.stderr[-6000:]}"
    assert "| question | measurement | value | target |" in done.stdout
    data = json.loads((out / "run_all.quick.json").read_text())
    assert set(data["results"]) == set(QUESTIONS)
    for q, result in data["results"].items():
        assert "error" not in result, f"{q}: {result.get('error')}"
        assert not result.get("errors"), f"{q}: {result.get('errors')}"
        assert result["summary"], q
        for measure, _value, _target in result["summary"]:
            assert f"| {q} | {measure} |" in done.stdout
    assert data["machine"]["nproc"] >= 1
    png = (out / "run_all.quick.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # every mount the runner made is gone
    work = next(line.split("work dir ", 1)[1].split(";")[0]
                for line in done.stderr.splitlines() if "work dir " in line)
    assert work not in Path("/proc/self/mountinfo").read_text()
    assert not Path(work).exists()


def test_restore_quick(tmp_path: Path) -> None:
    """``benchmarks/restore.py --quick``: both stores, table and JSON there, every mount gone."""
    out = tmp_path / "results"
    done = subprocess.run(
        # No page-cache drop: it is machine-wide, and CI shares the machine.
        [sys.executable, str(REPO / "benchmarks" / "restore.py"), "--quick", "--no-drop-caches",
         "--out", str(out)],
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL, cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, f"restore.py --quick failed:\n{done.stdout}\n{done.stderr[-6000:]}"
    assert "| store | measurement | value | target |" in done.stdout
    data = json.loads((out / "restore.quick.json").read_text())
    assert set(data["results"]) == {"s3", "file"}
    for store, result in data["results"].items():
        assert "error" not in result, f"{store}: {result.get('error')}"
        assert result["summary"], store
    work = next(line.split("work dir ", 1)[1].split(";")[0]
                for line in done.stderr.splitlines() if "work dir " in line)
    assert work not in Path("/proc/self/mountinfo").read_text()
    assert not Path(work).exists()
