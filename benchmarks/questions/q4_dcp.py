"""Q4, DCP: torch.distributed.checkpoint with 4 ranks saving and 2 ranks loading (resharding).

  plain   a plain directory
  ckptfs  a ckptfs mount whose warm tier is a local directory; the save's uploads run in the
          background while the load reads the checkpoint back (from the staging dir: this is
          the "resume on the same node" case; Q3 measures a fresh node)

gloo on CPU, one process per rank (questions/dcp_worker.py), a --q4-mib MiB state dict of fp32
DTensors sharded on dim 0. The same 4 processes save to the plain dir, then to ckptfs; after
``ckptfs sync`` (a resume comes long after the save) the same 2 processes load from each.
Reported: the time every rank is blocked in dcp.save / dcp.load (rank 0's clock between
barriers around the call). ``--q4-ranks 4,2`` is the default; ``--quick`` uses 1,1 (each
rank is a process that imports torch, ~2.5 CPU-s: 6 of them took ~25 s of a loaded 2-CPU
machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from questions.common import HERE, Bench, ckptfs_config, ckptfs_mount, log, sync_disk

TITLE = "Q4 DCP save (N ranks) and load (M ranks, resharded)"


def run_group(b: Bench, mode: str, world: int, targets: dict[str, Path],
              mib: int) -> dict[str, Any]:
    """One process per rank; each does every target in turn. Blocked seconds per target."""
    init = b.work / f"q4-{mode}.filestore"
    ckpts = [a for name, path in targets.items() for a in ("--ckpt", f"{name}={path}")]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / "dcp_worker.py"), mode, "--rank", str(r), "--world",
         str(world), "--init", str(init), "--mib", str(mib), *ckpts],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        for r in range(world)]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=1800)
            outs.append((proc.returncode, out, err))
    finally:
        for proc in procs:  # only if something above failed: ours, by pid
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - t0
    for rank, (rc, _out, err) in enumerate(outs):
        if rc != 0:
            raise RuntimeError(f"DCP {mode} rank {rank} exited {rc}:\n{err[-3000:]}")
    line = next(x for x in outs[0][1].splitlines() if x.startswith("RESULT "))
    return {"blocked_s": json.loads(line[7:])["seconds"], "group_wall_s": wall}


def run(b: Bench) -> dict[str, Any]:
    mib = b.opts.q4_mib
    save_ranks, load_ranks = b.opts.q4_ranks
    log(f"Q4: DCP {mib} MiB, save with {save_ranks} ranks, load with {load_ranks}")
    sync_disk()
    cfg = ckptfs_config(b.work / "q4-ckptfs-staging", store_dir=b.dir("q4-ckptfs-store"))
    with ckptfs_mount(b.work, "q4-ckptfs", cfg) as m:
        targets = {"plain": b.dir("q4-plain") / "step_100", "ckptfs": m.path / "step_100"}
        save = run_group(b, "save", save_ranks, targets, mib)
        # Resume comes long after the save: its uploads are done by then.
        sync_s = m.sync()
        sync_disk()
        load = run_group(b, "load", load_ranks, targets, mib)
        rss = m.peak_rss()
    s, ld = save["blocked_s"], load["blocked_s"]
    summary = [
        ("save s (blocked): plain / ckptfs", f"{s['plain']:.2f} / {s['ckptfs']:.2f}", ""),
        ("save: ckptfs / plain", f"**{s['ckptfs'] / s['plain']:.2f}**", "(info)"),
        ("load s (blocked): plain / ckptfs", f"{ld['plain']:.2f} / {ld['ckptfs']:.2f}", ""),
        ("load: ckptfs / plain", f"**{ld['ckptfs'] / ld['plain']:.2f}**", "(info)"),
    ]
    return {"title": TITLE, "mib": mib, "save_ranks": save_ranks, "load_ranks": load_ranks,
            "save": save, "load": load, "ckptfs_sync_after_save_s": sync_s,
            "daemon_peak_rss": rss, "summary": summary}


def plot(ax: Any, r: dict[str, Any]) -> None:
    names = list(r["save"]["blocked_s"])
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [r["save"]["blocked_s"][n] for n in names], 0.4,
           label=f"save, {r['save_ranks']} ranks")
    ax.bar([x + 0.2 for x in xs], [r["load"]["blocked_s"][n] for n in names], 0.4,
           label=f"load, {r['load_ranks']} ranks")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("seconds blocked")
    ax.set_title(f"Q4 DCP {r['mib']} MiB", fontsize=9)
    top = max(r["save"]["blocked_s"][n] for n in names)
    ax.set_ylim(top=top * 1.3)  # room for the legend
    ax.legend(fontsize=7, loc="upper left")
