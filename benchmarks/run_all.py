"""Does the two-stage promise hold against the alternatives? One command, one run, side by side.

Runs the questions of benchmarks/README.md ("run_all.py"), one module each in
benchmarks/questions/, starting what they need (one SeaweedFS S3 server on 127.0.0.1 shared by
every question, ckptfs / nullfs / rclone mounts, a bandwidth-limited store), then prints one
markdown table of figures and ratios and writes to --out (default benchmarks/results/):

  run_all.json   every raw number, the options and the machine
  run_all.png    one panel per question (matplotlib)

(``--quick``: run_all.quick.json / run_all.quick.png.)

  Q1 training blocked time: torch.save every K steps, direct to a slow store vs hand-written
     two-stage vs ckptfs                                          (questions/q1_training.py)
  Q2 write path: plain dir vs nullfs vs ckptfs vs rclone --vfs-cache-mode writes
                                                                 (questions/q2_write_path.py)
  Q3 upload vs raw boto3 upload_file, restore through a fresh mount vs boto3 download_file,
     torch.save while an upload runs                              (questions/q3_transfer.py)
  Q4 DCP: 4-process save, 2-process load, ckptfs vs plain dir      (questions/q4_dcp.py)
  Q5 scale: checkpoint size and files per checkpoint vs blocked time, upload time and daemon
     peak RSS                                                      (questions/q5_scale.py)
  Q6 node data path: R ranks write then read back, tmpfs and the local disk, plain vs ckptfs
     with FUSE passthrough vs without; torch.save; the fault-in read  (questions/q6_data_path.py)
  Q7 restore on a fresh node vs boto3 download_file / copyfile, and the second read vs a plain
     dir and the FUSE read ceiling (nullfs)                       (questions/q7_restore.py)
  Q8 responsiveness at scale: create/stat/unlink rates vs a plain dir, sync/status latency,
     remount time and the longest answer to a probe at 1k/10k/100k files, during a 1 GiB
     fsync; store requests per node in a simulated cluster    (questions/q8_responsiveness.py)
  Q9 the upload beside the job: a burst on tmpfs with uploads running (yield gate on / off),
     the time to the store, stage 2 on S3 from the last close vs boto3
                                                               (questions/q9_beside_the_job.py)

Benchmarks print figures; they never assert them. ``--quick`` is a smoke mode that CI runs so
that the scripts do not rot (tiny sizes, one round, each question's code run once but not every
repetition of it: see QUICK below; ~90-110 CPU-seconds in all, 1.7-3 min on this shared
2-CPU machine under other sessions' load); its numbers mean little.

Usage::

    python benchmarks/run_all.py --quick --out /tmp/bench
    python benchmarks/run_all.py                        # default sizes, see --help
    python benchmarks/run_all.py --only q1,q5 --q5-sizes 256,1024,8192
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # questions.*

from questions.common import Bench, error_cell, log, machine, machine_busy_s

QUESTIONS = {
    "q1": "questions.q1_training",
    "q2": "questions.q2_write_path",
    "q3": "questions.q3_transfer",
    "q4": "questions.q4_dcp",
    "q5": "questions.q5_scale",
    "q6": "questions.q6_data_path",
    "q7": "questions.q7_restore",
    "q8": "questions.q8_responsiveness",
    "q9": "questions.q9_beside_the_job",
}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# --quick: every question's code once, at the least that runs it. Most of the time is fixed
# cost (a ckptfs mount is ~2.5 s and 1.7-2.6 CPU-s: two interpreter starts), so besides tiny sizes
# it cuts mounts and processes: one checkpoint (Q1), one size (Q2), one point (Q5), one rank
# per side (Q4: each is a process importing torch), Q6 on tmpfs only (the disk place runs the
# same code), Q7's second read for its last store only (q7_restore.run). The S3 server is started
# once and shared, as in a full run.
QUICK: dict[str, Any] = {
    "q1_mib": 32, "ckpts": 1, "every": 1, "step_s": 0.05,
    "q2_sizes": [8], "q2_torch_mib": 16, "q2_reps": 1, "q2_chunks_kib": [1024],
    "q3_mib": 16, "q3_files": 2, "q3_torch_mib": 16, "q3_reps": 1,
    "q4_mib": 8, "q4_ranks": [1, 1],
    "q5_sizes": [16], "q5_files": [1], "q5_files_mib": 16, "q5_store": "s3",
    "q6_places": ["tmpfs"], "q6_ranks": [2], "q6_mib": 8, "q6_disk_mib": 8,
    "q6_torch_mib": 16, "q6_fault_mib": 8, "q6_repeat": 1,
    "q7_mib": 16, "q7_files": 2, "q7_reps": 1, "q7_restore_reps": 1,
    "q8_files": [200], "q8_batch": 50, "q8_fsync_mib": 16, "q8_sim_nodes": [4],
    "q8_create_rounds": 1,
    "q8_sim_idle": 30.0,
    "q9_mib": 8, "q9_ranks": 2, "q9_torch_mib": 16, "q9_reps": 1,
}


# --quick runs this many questions at once, the longest first (see main).
QUICK_CONCURRENCY = 3
QUICK_FIRST = ("q7", "q6", "q3", "q4", "q9", "q8", "q2", "q1", "q5")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke mode: tiny sizes, 3 questions at once")
    p.add_argument("--only", default=",".join(QUESTIONS), help="questions to run, e.g. q1,q3")
    p.add_argument("--out", type=Path, default=HERE / "results",
                   help="where run_all[.quick].json/.png go")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                   help="temp files, staging dirs and stores go in a fresh dir under here")
    p.add_argument("--replot", type=Path, metavar="JSON",
                   help="only redraw the PNG (next to it) from a run_all JSON, run nothing")
    p.add_argument("--stem", help="name of the result files [run_all, or run_all.quick]")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--ckptfs-src", type=Path, default=HERE.parent,
                   help="directory holding the ckptfs package to benchmark (default: this "
                        "working tree)")
    p.add_argument("--store-dir", type=Path,
                   help="Q1: where the simulated shared store keeps its bytes [a fresh dir on "
                        "/dev/shm if it has room, else in the work dir]: a shared store's "
                        "writes do not land on the node's own disk")
    p.add_argument("--local-dir", type=Path,
                   help="Q1: the node's local disk (local and two-stage checkpoints, ckptfs "
                        "staging) [the work dir]; /dev/shm stands in for fast NVMe")
    p.add_argument("--store-bw", type=float, default=100e6,
                   help="Q1: bandwidth of the slow shared store, bytes/s")
    g = p.add_argument_group("sizes (MiB); --quick replaces every default with a tiny one")
    g.add_argument("--q1-mib", type=int, help="Q1 state dict size [1024]")
    g.add_argument("--ckpts", type=int, help="Q1 checkpoints per loop [3]")
    g.add_argument("--every", type=int, help="Q1 steps between checkpoints [5]")
    g.add_argument("--step-s", type=float, help="Q1 seconds per training step [2.5]")
    g.add_argument("--q2-sizes", type=int_list, help="Q2 file sizes [64,256,1024]")
    g.add_argument("--q2-torch-mib", type=int, help="Q2 torch.save size [1024]")
    g.add_argument("--q2-reps", type=int, help="Q2 repetitions, interleaved [3]")
    g.add_argument("--q2-chunks-kib", type=int_list,
                   help="Q2 write() call sizes of the sequential writes, KiB [1024]")
    p.add_argument("--q2-variants", type=str_list, default=[],
                   help="Q2: nullfs variants to add, e.g. nullfs-pwrite,nullfs-dio (see "
                        "questions/q2_write_path.py)")
    g.add_argument("--q3-mib", type=int, help="Q3 upload / restore total size [2048]")
    g.add_argument("--q3-files", type=int, help="Q3 files [8]")
    g.add_argument("--q3-torch-mib", type=int,
                   help="Q3 torch.save size, uploader idle vs uploading --q3-mib [1024]")
    g.add_argument("--q3-reps", type=int, help="Q3 torch.save rounds [2]")
    g.add_argument("--q4-mib", type=int, help="Q4 DCP checkpoint size [1024]")
    g.add_argument("--q4-ranks", type=int_list, help="Q4 ranks that save, ranks that load [4,2]")
    g.add_argument("--q5-sizes", type=int_list,
                   help="Q5 checkpoint sizes, one file [256,1024,2048,4096,8192]")
    g.add_argument("--q5-files", type=int_list, help="Q5 files per checkpoint [1,4,16,32]")
    g.add_argument("--q5-files-mib", type=int, help="Q5 checkpoint size of the files sweep [1024]")
    g.add_argument("--q5-store", choices=("file", "s3"),
                   help="Q5 warm tier: a directory, or S3 on SeaweedFS [file]")
    g.add_argument("--q6-places", type=str_list, help="Q6 places: tmpfs (/dev/shm), disk "
                   "(the work dir or --q6-disk-dir) [tmpfs,disk]")
    g.add_argument("--q6-ranks", type=int_list, help="Q6 ranks writing at once [1,4]")
    g.add_argument("--q6-mib", type=int, help="Q6 MiB per rank on tmpfs [1024]")
    g.add_argument("--q6-disk-mib", type=int, help="Q6 MiB per rank on the disk [256]")
    g.add_argument("--q6-torch-mib", type=int, help="Q6 torch.save state dict, one writer [1024]")
    g.add_argument("--q6-fault-mib", type=int, help="Q6 fault-in checkpoint, in all [1024]")
    g.add_argument("--q6-repeat", type=int, help="Q6 rounds, best of [3]")
    p.add_argument("--q6-disk-dir", type=Path, help="Q6: the local disk's place [the work dir]")
    p.add_argument("--q6-no-settle", action="store_true",
                   help="Q6: read back at once, while the upload's checksum pass may still read "
                        "the files (by default the read waits for two upload tries)")
    p.add_argument("--q6-demo", action="store_true",
                   help="Q6: also the demo filesystem (tests/passthrough_fs.py) in stock and in "
                        "passthrough mode: what FUSE allows with no ckptfs logic")
    g.add_argument("--q7-mib", type=int, help="Q7 checkpoint size, in all [2048]")
    g.add_argument("--q7-files", type=int, help="Q7 files in the checkpoint [4]")
    g.add_argument("--q7-reps", type=int, help="Q7 second-read rounds, median [3]")
    g.add_argument("--q7-restore-reps", type=int,
                   help="Q7 restore rounds, baseline and ckptfs alternating, median [3]")
    p.add_argument("--q7-store", choices=("s3", "file", "both"), default="both",
                   help="Q7 warm tier: S3 on SeaweedFS, a directory, or both")
    p.add_argument("--q7-restore-only", action="store_true",
                   help="Q7: only the restore (no second read, no nullfs)")
    p.add_argument("--q7-ckptfs-config", default="",
                   help="Q7: extra top-level config lines for every ckptfs mount, e.g. "
                        "'fetch_block_size = 16777216'")
    p.add_argument("--q7-no-drop-caches", action="store_true",
                   help="Q7: never drop the page cache (machine-wide; --quick never drops it)")
    g.add_argument("--q8-files", type=int_list,
                   help="Q8 file counts the mount grows to (1 KiB files) [1000,10000,100000]")
    g.add_argument("--q8-batch", type=int,
                   help="Q8 files created, stat'ed and unlinked at each count [1000]")
    g.add_argument("--q8-fsync-mib", type=int, help="Q8 file fsync'ed under the probe [1024]")
    g.add_argument("--q8-sim-nodes", type=int_list,
                   help="Q8 simulated cluster sizes, nodes [64,256,1000]")
    g.add_argument("--q8-sim-idle", type=float,
                   help="Q8 virtual seconds of idleness measured per cluster [600]")
    g.add_argument("--q8-create-rounds", type=int,
                   help="Q8 rounds of the side-by-side creates (ckptfs, staging on the disk "
                        "and on tmpfs, and nullfs), order rotating [5]")
    p.add_argument("--q8-baseline", type=Path, default=None,
                   help="Q8 creates: also mount the ckptfs package of this checkout (staging "
                        "on tmpfs) in the same rounds, e.g. the code before a change")
    p.add_argument("--q8-parts", type=str_list, default=["scale", "creates", "sim"],
                   help="Q8 parts: scale (grow, batch, remount, fsync), creates (side by "
                        "side with nullfs), sim (simulated cluster)")
    g.add_argument("--q9-mib", type=int, help="Q9 MiB per rank (burst and S3) [256]")
    g.add_argument("--q9-ranks", type=int, help="Q9 ranks writing at once [4]")
    g.add_argument("--q9-torch-mib", type=int, help="Q9 torch.save state dict [1024]")
    g.add_argument("--q9-reps", type=int, help="Q9 rounds, order rotating [3]")
    p.add_argument("--q9-baseline", type=Path, default=None,
                   help="Q9 burst: also mount the ckptfs package of this checkout (its default "
                        "configuration, passthrough on), e.g. the code before the yield gate")
    p.add_argument("--q9-parts", type=str_list, default=["burst", "s3"],
                   help="Q9 parts: burst (tmpfs, uploads running), s3 (stage 2 vs boto3)")
    p.add_argument("--q8-sim-timeout", type=float, default=900.0,
                   help="Q8: wall seconds one simulated cluster may take; larger ones are "
                        "skipped after one runs over")
    p.add_argument("--q8-mount-timeout", type=float, default=1800.0,
                   help="Q8: wall seconds a remount may take")
    a = p.parse_args(argv)
    full = {"q1_mib": 1024, "ckpts": 3, "every": 5, "step_s": 2.5,
            "q2_sizes": [64, 256, 1024], "q2_torch_mib": 1024, "q2_reps": 3,
            "q2_chunks_kib": [1024],
            "q3_mib": 2048, "q3_files": 8, "q3_torch_mib": 1024, "q3_reps": 2,
            "q4_mib": 1024, "q4_ranks": [4, 2],
            "q5_sizes": [256, 1024, 2048, 4096, 8192], "q5_files": [1, 4, 16, 32],
            "q5_files_mib": 1024, "q5_store": "file",
            "q6_places": ["tmpfs", "disk"], "q6_ranks": [1, 4], "q6_mib": 1024,
            "q6_disk_mib": 256, "q6_torch_mib": 1024, "q6_fault_mib": 1024, "q6_repeat": 3,
            "q7_mib": 2048, "q7_files": 4, "q7_reps": 3, "q7_restore_reps": 3,
            "q8_files": [1000, 10000, 100000], "q8_batch": 1000, "q8_fsync_mib": 1024,
            "q8_sim_nodes": [64, 256, 1000], "q8_sim_idle": 600.0, "q8_create_rounds": 5,
            "q9_mib": 256, "q9_ranks": 4, "q9_torch_mib": 1024, "q9_reps": 3}
    for key, value in (QUICK if a.quick else full).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.q7_files < 1 or a.q7_mib < a.q7_files:
        p.error("--q7-mib must be at least --q7-files (whole MiB per file)")
    bad = [x for x in a.q6_places if x not in ("tmpfs", "disk")]
    if bad:
        p.error(f"--q6-places: unknown {bad}; choose from tmpfs, disk")
    a.only = [q.strip() for q in a.only.split(",") if q.strip()]
    unknown = [q for q in a.only if q not in QUESTIONS]
    if unknown:
        p.error(f"unknown question(s) {unknown}; choose from {', '.join(QUESTIONS)}")
    return a


def print_table(results: dict[str, Any], info: dict[str, Any], quick: bool) -> str:
    what = (f"quick: {QUICK_CONCURRENCY} questions at once, figures disturb each other"
            if quick else "full")
    head = (f"## ckptfs benchmarks ({what}), {info['date']}, "
            f"{info['nproc']} CPUs, {info['mem_gib']} GiB RAM, load avg at start "
            f"{info['loadavg_start'][0]:.2f}")
    lines = [head, "",
             "| question | measurement | value | target |", "|---|---|---:|---|"]
    for q, r in results.items():
        if "error" in r:
            lines.append(f"| {q} | FAILED | {error_cell(r['error'])} | |")
            continue
        for measure, value, target in r["summary"]:
            lines.append(f"| {q} | {measure} | {value} | {target} |")
        lines.append(f"| {q} | (noise) machine CPUs busy, load avg at start / end | "
                     f"{r['machine_cpus_busy']:.2f} of {info['nproc']}, "
                     f"{r['loadavg_1m'][0]:.1f} / {r['loadavg_1m'][1]:.1f} | |")
    text = "\n".join(lines)
    print("\n" + text + "\n", flush=True)
    return text


def make_plot(results: dict[str, Any], modules: dict[str, Any], path: Path,
              title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for q, r in results.items():
        if "error" in r:
            continue
        n = getattr(modules[q], "PANELS", 1)
        panels += [(q, i) for i in range(n)]
    cols = 3
    rows = max(1, (len(panels) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (q, i) in zip(flat, panels):
        fn = modules[q].plot
        try:
            fn(ax, results[q]) if i == 0 else modules[q].plot_extra(ax, results[q], i)
        except Exception:  # noqa: BLE001 (a broken panel must not lose the JSON)
            ax.text(0.5, 0.5, f"{q}: plot failed", ha="center")
            traceback.print_exc()
    for ax in flat[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        data = json.loads(args.replot.read_text())
        results = data["results"]
        modules = {q: importlib.import_module(QUESTIONS[q]) for q in results}
        info = data["machine"]
        quick = data["options"].get("quick")
        make_plot(results, modules, args.replot.with_suffix(".png"),
                  f"ckptfs run_all ({'quick' if quick else 'full'}) {info['date']}, "
                  f"{info['nproc']} CPUs, shared machine")
        return 0
    from questions import common

    common.CKPTFS_SRC = args.ckptfs_src.resolve()
    common.control()  # import ckptfs.ops.client from there now, before any question's thread
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckptfs-run-all-", dir=args.workdir))
    stem = args.stem or ("run_all.quick" if args.quick else "run_all")
    info = machine()
    log(f"work dir {work}; questions {', '.join(args.only)}")

    # SIGTERM behaves like Ctrl-C: every `finally` unmounts what it mounted.
    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    modules = {q: importlib.import_module(QUESTIONS[q]) for q in args.only}
    bench = Bench(work, args.quick, args)
    done: dict[str, Any] = {}

    def run_one(q: str) -> None:
        t0, busy0, load0 = time.perf_counter(), machine_busy_s(), os.getloadavg()[0]
        try:
            found = modules[q].run(bench)
        except Exception:  # noqa: BLE001 (one broken question must not hide the rest)
            traceback.print_exc()
            found = {"error": traceback.format_exc()}
        wall = time.perf_counter() - t0
        # Noise gauge: CPUs busy on the whole machine (ours included) while it ran.
        busy = (machine_busy_s() - busy0) / wall
        found.update(wall_s=wall, machine_cpus_busy=round(busy, 2),
                     loadavg_1m=(round(load0, 2), round(os.getloadavg()[0], 2)))
        done[q] = found
        log(f"{q} done in {wall:.1f} s (machine: {busy:.2f} CPUs busy on average)")

    t_all = time.perf_counter()
    try:
        with bench.stack:
            if args.quick:
                # A smoke run is mostly waiting for interpreter starts and mounts, and on a
                # shared machine each runnable process of ours gets its share of the CPUs:
                # several questions at once finish sooner. Their figures then disturb each
                # other (the table says so); a full run measures one question at a time.
                # A Ctrl-C / SIGTERM reaches this thread only: the questions running finish
                # (and unmount) before the pool's exit returns.
                order = sorted(args.only, key=lambda q: QUICK_FIRST.index(q))
                with ThreadPoolExecutor(QUICK_CONCURRENCY) as pool:
                    list(pool.map(run_one, order))
            else:
                for q in args.only:
                    run_one(q)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    results = {q: done[q] for q in args.only if q in done}
    info["loadavg_end"] = os.getloadavg()
    info["wall_s"] = time.perf_counter() - t_all
    table = print_table(results, info, args.quick)
    opts = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"machine": info, "options": opts, "table": table, "results": results},
        indent=2, default=str))
    make_plot(results, modules, args.out / f"{stem}.png",
              f"ckptfs run_all ({'quick' if args.quick else 'full'}) {info['date']}, "
              f"{info['nproc']} CPUs, shared machine")
    log(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')} "
        f"in {info['wall_s']:.0f} s")
    return 1 if any("error" in r or r.get("errors") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
