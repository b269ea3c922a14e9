"""Q5, scale: how blocked time, upload time and the daemon's memory grow with the checkpoint.

Two sweeps, each point on a fresh ``ckptfs mount`` (so that the daemon's peak RSS is the
point's own) over a local directory (``--q5-store file``, default: a parallel filesystem) or an
S3 prefix on SeaweedFS (``--q5-store s3``; the run's server, which keeps objects on disk: the
earlier moto held a multipart object in memory several times over and could not take 8 GiB).

  size sweep   one file per checkpoint, --q5-sizes MiB (default 256 MiB ... 8 GiB)
  files sweep  --q5-files-mib MiB split into --q5-files files (default 1, 4, 16, 32), as the
               shards of a DCP checkpoint, written one after another by one writer

Per point: blocked time (every file written in 1 MiB write() calls, open to close), upload
time (the last close until every file's ``user.ckptfs.state`` reads ``committed``), and the daemon's peak resident set
(VmHWM of /proc/PID/status, over the mount's life: mount, writes, uploads). Target: under
300 MB while 8 GiB pass through. Each point's objects are deleted afterwards (the server's
disk), and so are the staging files (umount).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from questions.common import (
    Bench,
    MiB,
    ckptfs_config,
    ckptfs_mount,
    log,
    rss_bytes,
    sync_disk,
    write_file,
)

TITLE = "Q5 scale: checkpoint size and files per checkpoint"
PANELS = 2
RSS_TARGET = 300e6


def one_point(b: Bench, total_mib: int, files: int, block: bytes) -> dict[str, Any]:
    name = f"q5-{total_mib}m-{files}f"
    if b.opts.q5_store == "s3":
        bucket = b.s3.new_bucket("q5")
        cfg = ckptfs_config(b.work / f"{name}-staging", s3=b.s3, bucket=bucket)
    else:
        bucket = ""
        cfg = ckptfs_config(b.work / f"{name}-staging", store_dir=b.dir(f"{name}-store"))
    per_file = total_mib * MiB // files
    sync_disk()
    with ckptfs_mount(b.work, name, cfg) as m:
        rss_idle = rss_bytes(m.pid)
        ckpt = m.path / f"step_{total_mib}"
        ckpt.mkdir()
        paths = [ckpt / f"shard_{j:02d}.distcp" for j in range(files)]
        t0 = time.perf_counter()
        for path in paths:
            write_file(path, per_file, block)
        t1 = time.perf_counter()
        m.wait_committed(paths)
        t2 = time.perf_counter()
        peak = m.peak_rss()
    if bucket:
        b.s3.empty_bucket(bucket)
    else:
        shutil.rmtree(b.work / f"{name}-store", ignore_errors=True)
    shutil.rmtree(b.work / f"{name}-staging", ignore_errors=True)
    size = per_file * files
    point = {"mib": total_mib, "files": files, "bytes": size, "blocked_s": t1 - t0,
             "upload_after_close_s": t2 - t1, "durable_after_s": t2 - t0,
             "daemon_rss_idle": rss_idle, "daemon_peak_rss": peak}
    log(f"Q5 {total_mib} MiB x {files} files: blocked {t1 - t0:.2f} s "
        f"({size / (t1 - t0) / 1e6:.0f} MB/s), upload after close {t2 - t1:.2f} s, "
        f"peak RSS {peak / 1e6:.0f} MB")
    return point


def run(b: Bench) -> dict[str, Any]:
    o = b.opts
    block = os.urandom(MiB)
    log(f"Q5: store {o.q5_store}; sizes {o.q5_sizes} MiB x 1 file; "
        f"{o.q5_files_mib} MiB x {o.q5_files} files")
    by_size = [one_point(b, mib, 1, block) for mib in o.q5_sizes]
    by_files = []
    for files in o.q5_files:
        same = [p for p in by_size if p["files"] == files and p["mib"] == o.q5_files_mib]
        if same:
            by_files.append(same[0])
        else:
            by_files.append(one_point(b, o.q5_files_mib, files, block))
    where = "S3 on SeaweedFS" if o.q5_store == "s3" else "file store"
    summary = []
    for p in by_size + [p for p in by_files if p not in by_size]:
        measure = (f"{where}, {p['mib']} MiB x {p['files']} file(s): blocked s / upload after "
                   "close s / peak RSS MB")
        value = (f"{p['blocked_s']:.2f} / {p['upload_after_close_s']:.2f} / "
                 f"{p['daemon_peak_rss'] / 1e6:.0f}")
        summary.append((measure, value, ""))
    biggest = max(by_size + by_files, key=lambda p: p["bytes"])
    peak = max(p["daemon_peak_rss"] for p in by_size + by_files)
    summary.append((f"daemon peak RSS, all points (largest: {biggest['mib']} MiB)",
                    f"**{peak / 1e6:.0f} MB**", "< 300 MB at 8 GiB"))
    return {"title": TITLE, "store": o.q5_store, "by_size": by_size, "by_files": by_files,
            "summary": summary}


def _sweep(ax: Any, points: list[dict[str, Any]], key: str, xlabel: str, title: str) -> None:
    xs = [p[key] for p in points]
    ax.plot(xs, [p["blocked_s"] for p in points], "o-", label="blocked (write+close) s")
    ax.plot(xs, [p["upload_after_close_s"] for p in points], "s-", label="upload after close s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds")
    ax.set_title(title, fontsize=9)
    rss = ax.twinx()
    rss.plot(xs, [p["daemon_peak_rss"] / 1e6 for p in points], "^--", color="C3",
             label="daemon peak RSS MB")
    rss.axhline(RSS_TARGET / 1e6, color="C3", lw=0.6, ls=":")
    rss.set_ylabel("MB", color="C3")
    rss.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = rss.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left")


def plot(ax: Any, r: dict[str, Any]) -> None:
    _sweep(ax, r["by_size"], "mib", "checkpoint MiB (1 file)",
           f"Q5 size sweep ({r['store']} store)")


def plot_extra(ax: Any, r: dict[str, Any], i: int) -> None:
    mib = r["by_files"][0]["mib"] if r["by_files"] else 0
    _sweep(ax, r["by_files"], "files", f"files per checkpoint ({mib} MiB in all)",
           f"Q5 files sweep ({r['store']} store)")
