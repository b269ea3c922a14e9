"""Write-path benchmark: what a training process blocks on when it writes a checkpoint.

Three configurations, measured side by side in one run, interleaved:

  plain   a plain directory on the same disk as the ckptfs staging directory (no FUSE)
  nullfs  benchmarks/nullfs.py, a pyfuse3 + trio filesystem that discards the data: the
          ceiling of the FUSE stack (kernel FUSE + libfuse + pyfuse3 + trio, zero work)
  ckptfs  `python -m ckptfs mount` with a staging and a store directory

Workloads:

  seq_1m     sequential write of --seq-size MiB in 1 MiB write() calls (open..close)
  seq_128k   the same in 128 KiB write() calls
  torch_save torch.save of a transformer-like state dict of about --torch-size MiB

Blocked time is open + write() calls + close(). fsync is not part of it (a training loop does
not fsync). After each run the script deletes the file at once (so that ckptfs's background
upload of it is cancelled and does not compete with the next run: benchmarks/upload.py
measures writes under upload load), calls sync(2) (timed, reported separately) and, before
the next run on a FUSE daemon, waits until that daemon is idle.

Prints a markdown table (medians of --reps interleaved runs), the target ratios, and the
sizes of the write requests the kernel actually sends to a FUSE daemon (seen by nullfs);
writes every raw number to benchmarks/results/write_path.json (--quick: write_path.quick.json).
It never asserts: the ratios are for people to read.

Besides wall time it records the CPU seconds of the writer and of the FUSE daemon, and how
much CPU everything else on the machine used meanwhile ("other load", a noise gauge). With
``--configs`` it can also run nullfs variants that take the FUSE write path apart (nullfs
plus a pwrite into a staging-like file, direct I/O, no getxattr, writeback cache): see
NULLFS_VARIANTS and benchmarks/README.md.

Caveats: the page cache is not dropped between runs by default (``--drop-caches`` tries,
best effort, and it is global to the machine); all configurations write into the page cache
(of the same disk, or of the FUSE file), and with GiBs of free RAM nothing here waits for the
disk except sync(2). Numbers on a shared 2-core machine are noisy: the full run waits up to
``--quiet-wait`` seconds for an idle machine before each run; look at the per-run values.

Usage::

    python benchmarks/write_path.py --quick     # 256 MiB / 128 MiB, 3 reps, ~20 s
    python benchmarks/write_path.py             # 2 GiB / 1 GiB, 5 reps, ~5-15 min
    python benchmarks/write_path.py --configs plain,nullfs,nullfs-pwrite,nullfs-dio,ckptfs
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MiB = 1024 * 1024
CONFIGS = ("plain", "nullfs", "ckptfs")
# Opt-in nullfs variants (--configs ...): where does the FUSE write path spend its time?
NULLFS_VARIANTS = {
    "nullfs": [],
    "nullfs-pwrite": ["--backing-dir", "{base}/nullfs-pwrite-backing"],  # + land the bytes
    "nullfs-pwrite128k": ["--backing-dir", "{base}/nullfs-pwrite128k-backing",
                          "--pwrite-chunk", "131072"],  # ... in 128 KiB pwrite() calls
    "nullfs-wbc": ["--writeback-cache"],  # FUSE writeback cache
    "nullfs-noxattr": ["--getxattr-enosys"],  # no security.capability round trip per write()
    "nullfs-dio": ["--direct-io"],  # FOPEN_DIRECT_IO on writable opens
    "nullfs-pwrite-dio": ["--backing-dir", "{base}/nullfs-pwrite-dio-backing", "--direct-io"],
}
ALL_CONFIGS = ("plain", *NULLFS_VARIANTS, "ckptfs")
WORKLOADS = ("seq_1m", "seq_128k", "torch_save")
CHUNK = {"seq_1m": MiB, "seq_128k": 128 * 1024}
TITLES = {
    "seq_1m": "sequential write, 1 MiB calls",
    "seq_128k": "sequential write, 128 KiB calls",
    "torch_save": "torch.save(state_dict, path)",
}
MOUNT_TIMEOUT = 60.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- mounts ---------------------------------------------------------------------------------


def is_mounted(path: Path) -> bool:
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def lazy_unmount(path: Path) -> None:
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, check=False)


def process_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def machine_busy_s() -> float:
    """CPU seconds spent busy by the whole machine (all CPUs, /proc/stat), steal included."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice are inside user]
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]
    return busy / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(max_wait: float, threshold: float = 0.3, window: float = 0.5) -> float:
    """Wait (up to max_wait s) until the machine is nearly idle; returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait:
        b0 = machine_busy_s()
        time.sleep(window)
        if (machine_busy_s() - b0) / window < threshold:
            break
    return time.monotonic() - t0


def wait_daemon_idle(pid: int, max_wait: float = 30.0, window: float = 0.2) -> float:
    """Wait until a daemon uses (almost) no CPU: no leftover work of the previous run."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait:
        c0 = sum(process_cpu(pid))
        time.sleep(window)
        if sum(process_cpu(pid)) - c0 <= 0.02 * window + 0.011:  # below one clock tick
            break
    return time.monotonic() - t0


@dataclass
class Target:
    name: str
    dir: Path
    daemon_pid: int | None = None
    stats: Callable[[], dict[str, Any]] | None = None  # nullfs only


@contextmanager
def plain_target(base: Path) -> Iterator[Target]:
    d = base / "plain"
    d.mkdir()
    yield Target("plain", d)


@contextmanager
def nullfs_target(base: Path, variant: str = "nullfs") -> Iterator[Target]:
    mnt = base / f"mnt-{variant}"
    mnt.mkdir()
    stats_file = base / f"{variant}.stats.json"
    extra = [a.format(base=base) for a in NULLFS_VARIANTS[variant]]
    if "--backing-dir" in extra:
        Path(extra[extra.index("--backing-dir") + 1]).mkdir()
    log_path = base / f"{variant}.log"
    with open(log_path, "wb") as logf:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "nullfs.py"), str(mnt), "--stats-file", str(stats_file),
             *extra],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not is_mounted(mnt):
            if proc.poll() is not None:
                raise RuntimeError(f"nullfs exited with {proc.returncode}: "
                                   f"{log_path.read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("nullfs did not mount in time")
            time.sleep(0.05)

        def stats() -> dict[str, Any]:
            os.path.exists(mnt / ".nullfs-stats")  # the lookup makes nullfs write stats_file
            stats: dict[str, Any] = json.loads(stats_file.read_text())
            return stats

        yield Target(variant, mnt, proc.pid, stats)
    finally:
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # the nullfs process we started, by its pid
            proc.wait()
        lazy_unmount(mnt)


@contextmanager
def ckptfs_target(base: Path) -> Iterator[Target]:
    mnt, staging, store = base / "mnt-ckptfs", base / "ckptfs-staging", base / "ckptfs-store"
    mnt.mkdir()
    cli = [sys.executable, "-m", "ckptfs"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run(
            [*cli, "mount", str(mnt), "--staging", str(staging), "--store", str(store)],
            capture_output=True, text=True, env=env, cwd=REPO, timeout=MOUNT_TIMEOUT * 2,
            stdin=subprocess.DEVNULL, check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"ckptfs mount failed:\n{done.stdout}{done.stderr}")
        info = json.loads(os.getxattr(mnt, "user.ckptfs.daemon"))
        yield Target("ckptfs", mnt, int(info["pid"]))
    finally:
        if is_mounted(mnt):
            subprocess.run([*cli, "umount", str(mnt), "--timeout", "60"], capture_output=True,
                           env=env, cwd=REPO, timeout=180, check=False)
        lazy_unmount(mnt)


# -- workloads ------------------------------------------------------------------------------


def make_state_dict(target_bytes: int) -> dict[str, Any]:
    """A transformer-like state dict (hidden 1024, fp32): big matrices and small vectors."""
    import torch

    gen = torch.Generator().manual_seed(0)
    h = 1024

    def t(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen)

    layer_bytes = 4 * (4 * h * h + 2 * 4 * h * h)  # q,k,v,o + fc1,fc2 (vectors ignored)
    n_layers = max(1, target_bytes // layer_bytes)
    vocab = max(1, (target_bytes - n_layers * layer_bytes) // (4 * h))
    sd: dict[str, Any] = {"embed.weight": t(vocab, h)}
    for i in range(n_layers):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            sd[p + f"attn.{name}.weight"] = t(h, h)
        sd[p + "attn.o.bias"] = t(h)
        sd[p + "ln1.weight"], sd[p + "ln1.bias"] = t(h), t(h)
        sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"] = t(4 * h, h), t(4 * h)
        sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"] = t(h, 4 * h), t(h)
        sd[p + "ln2.weight"], sd[p + "ln2.bias"] = t(h), t(h)
    sd["final_ln.weight"] = t(h)
    return sd


def state_dict_bytes(sd: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def seq_write(path: Path, total: int, chunk: int, buf: memoryview) -> tuple[float, float]:
    """(open+write seconds, close seconds)."""
    piece = buf[:chunk]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = total
        while left:
            n = os.write(fd, piece[: min(chunk, left)])
            left -= n
    except BaseException:
        os.close(fd)
        raise
    t1 = time.perf_counter()
    os.close(fd)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def torch_save(path: Path, sd: dict[str, Any]) -> tuple[float, float]:
    import torch

    t0 = time.perf_counter()
    torch.save(sd, path)  # opens, writes and closes: one blocked time, no separate close
    return time.perf_counter() - t0, 0.0


# -- one run --------------------------------------------------------------------------------


@dataclass
class Run:
    config: str
    workload: str
    rep: int
    bytes: int
    write_s: float
    close_s: float
    sync_s: float
    daemon_cpu_user_s: float | None = None
    daemon_cpu_sys_s: float | None = None
    writer_cpu_user_s: float = 0.0
    writer_cpu_sys_s: float = 0.0
    other_cpu_s: float = 0.0
    waited_for_quiet_s: float = 0.0
    nullfs_ops: dict[str, int] = field(default_factory=dict)
    nullfs_write_sizes: dict[str, int] = field(default_factory=dict)

    @property
    def blocked_s(self) -> float:
        return self.write_s + self.close_s


def diff_counter(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    out = {k: v - before.get(k, 0) for k, v in after.items()}
    return {k: v for k, v in out.items() if v}


def drop_caches() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def one_run(target: Target, workload: str, rep: int, args: argparse.Namespace,
            buf: memoryview, sd: dict[str, Any] | None) -> Run:
    path = target.dir / f"bench-{workload}-{rep}.bin"
    if target.daemon_pid:
        wait_daemon_idle(target.daemon_pid)
    waited = wait_for_quiet(args.quiet_wait) if args.quiet_wait > 0 and rep >= 0 else 0.0
    before_stats = target.stats() if target.stats else None
    before_cpu = process_cpu(target.daemon_pid) if target.daemon_pid else None
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    busy0 = machine_busy_s()
    if workload == "torch_save":
        assert sd is not None
        write_s, close_s = torch_save(path, sd)
    else:
        write_s, close_s = seq_write(path, args.seq_bytes, CHUNK[workload], buf)
    busy1 = machine_busy_s()
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    after_cpu = process_cpu(target.daemon_pid) if target.daemon_pid else None
    after_stats = target.stats() if target.stats else None
    size = os.stat(path).st_size
    # Delete at once: ckptfs starts uploading a file as soon as it is closed, and an upload
    # of this run must not compete with the next one (benchmarks/upload.py measures that).
    os.unlink(path)
    if target.daemon_pid:  # ckptfs frees the staging data once its uploader lets go of it
        wait_daemon_idle(target.daemon_pid)
    t0 = time.perf_counter()
    os.sync()  # not blocked time: keeps one run's dirty pages from slowing the next
    sync_s = time.perf_counter() - t0
    if args.drop_caches:
        drop_caches()
    run = Run(target.name, workload, rep, size, write_s, close_s, sync_s,
              writer_cpu_user_s=ru1.ru_utime - ru0.ru_utime,
              writer_cpu_sys_s=ru1.ru_stime - ru0.ru_stime)
    if before_cpu and after_cpu:
        run.daemon_cpu_user_s = after_cpu[0] - before_cpu[0]
        run.daemon_cpu_sys_s = after_cpu[1] - before_cpu[1]
    ours = (run.writer_cpu_user_s + run.writer_cpu_sys_s + (run.daemon_cpu_user_s or 0)
            + (run.daemon_cpu_sys_s or 0))
    # CPU the rest of the machine used meanwhile (other sessions, kworkers): a noise gauge.
    run.other_cpu_s = max(0.0, (busy1 - busy0) - ours)
    run.waited_for_quiet_s = waited
    if before_stats and after_stats:
        run.nullfs_ops = diff_counter(after_stats["ops"], before_stats["ops"])
        run.nullfs_write_sizes = diff_counter(after_stats["write_sizes"],
                                              before_stats["write_sizes"])
    return run


# -- report ---------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt_size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} B"


def summarize(runs: list[Run]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for w in WORKLOADS:
        for c in ALL_CONFIGS:
            rs = [r for r in runs if r.workload == w and r.config == c]
            if not rs:
                continue
            blocked = med([r.blocked_s for r in rs])
            size = rs[0].bytes
            s: dict[str, Any] = {
                "bytes": size,
                "runs": len(rs),
                "blocked_s_median": blocked,
                "mb_per_s": size / blocked / 1e6,
                "blocked_s_best": min(r.blocked_s for r in rs),
                "mb_per_s_best": size / min(r.blocked_s for r in rs) / 1e6,
                "write_s_median": med([r.write_s for r in rs]),
                "close_s_median": med([r.close_s for r in rs]),
                "sync_after_s_median": med([r.sync_s for r in rs]),
                "blocked_s_all": [round(r.blocked_s, 4) for r in rs],
                "writer_cpu_s_median": med([r.writer_cpu_user_s + r.writer_cpu_sys_s
                                            for r in rs]),
                "other_cpu_share_median": med([r.other_cpu_s / r.blocked_s for r in rs]),
                # writer + daemon CPU per GiB: a cost that load on a shared machine moves less
                "cpu_s_per_gib_median": med([
                    (r.writer_cpu_user_s + r.writer_cpu_sys_s + (r.daemon_cpu_user_s or 0)
                     + (r.daemon_cpu_sys_s or 0)) / (r.bytes / 2**30) for r in rs]),
            }
            if rs[0].daemon_cpu_user_s is not None:
                s["daemon_cpu_user_s_median"] = med([r.daemon_cpu_user_s or 0 for r in rs])
                s["daemon_cpu_sys_s_median"] = med([r.daemon_cpu_sys_s or 0 for r in rs])
            out.setdefault(w, {})[c] = s
    return out


def paired_ratios(runs: list[Run], workload: str, num: str, den: str) -> list[float]:
    """Per-rep time ratio num/den (runs of one rep are adjacent in time)."""
    out = []
    for rep in sorted({r.rep for r in runs}):
        a = [r for r in runs if (r.workload, r.config, r.rep) == (workload, num, rep)]
        b = [r for r in runs if (r.workload, r.config, r.rep) == (workload, den, rep)]
        if a and b:
            out.append(a[0].blocked_s / b[0].blocked_s)
    return out


def ratios(summary: dict[str, Any], runs: list[Run]) -> list[dict[str, Any]]:
    rows = []

    def add(label: str, workload: str, num: str, den: str, kind: str, target: str) -> None:
        ws = summary.get(workload, {})
        if num not in ws or den not in ws:
            return
        t_num, t_den = ws[num]["blocked_s_median"], ws[den]["blocked_s_median"]
        paired = paired_ratios(runs, workload, num, den)
        if kind == "throughput":  # num MB/s / den MB/s = den time / num time
            value = t_den / t_num
            paired = [1 / p for p in paired]
        else:
            value = t_num / t_den
        b_num, b_den = ws[num]["blocked_s_best"], ws[den]["blocked_s_best"]
        best = b_den / b_num if kind == "throughput" else b_num / b_den
        rows.append({"ratio": label, "workload": workload, "value": value, "target": target,
                     "value_best_of_runs": best,
                     "paired_per_rep": [round(p, 3) for p in paired],
                     "cpu_per_gib_num_over_den": ws[num]["cpu_s_per_gib_median"]
                     / ws[den]["cpu_s_per_gib_median"]})

    add("seq 1 MiB: ckptfs / nullfs throughput", "seq_1m", "ckptfs", "nullfs", "throughput",
        ">= 0.85")
    add("seq 128 KiB: ckptfs / nullfs throughput", "seq_128k", "ckptfs", "nullfs",
        "throughput", ">= 0.85")
    add("torch.save: ckptfs time / plain dir time", "torch_save", "ckptfs", "plain", "time",
        "<= 2.0")
    add("torch.save: ckptfs / nullfs throughput", "torch_save", "ckptfs", "nullfs",
        "throughput", "(info)")
    add("seq 1 MiB: nullfs / plain throughput (FUSE ceiling)", "seq_1m", "nullfs", "plain",
        "throughput", "(info)")
    add("seq 1 MiB: ckptfs / plain throughput", "seq_1m", "ckptfs", "plain", "throughput",
        "(info)")
    add("seq 128 KiB: nullfs / plain throughput (FUSE ceiling)", "seq_128k", "nullfs",
        "plain", "throughput", "(info)")
    for variant in NULLFS_VARIANTS:
        if variant == "nullfs":
            continue
        for w in ("seq_1m", "seq_128k", "torch_save"):
            add(f"{w}: {variant} / nullfs throughput", w, variant, "nullfs", "throughput",
                "(info)")
        add(f"seq 1 MiB: ckptfs / {variant} throughput", "seq_1m", "ckptfs", variant,
            "throughput", "(info)")
    return rows


def write_size_report(runs: list[Run], config: str = "nullfs") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for w in WORKLOADS:
        rs = [r for r in runs if r.workload == w and r.config == config]
        if not rs:
            continue
        sizes: Counter[int] = Counter()
        ops: Counter[str] = Counter()
        for r in rs:
            sizes.update({int(k): v for k, v in r.nullfs_write_sizes.items()})
            ops.update(r.nullfs_ops)
        requests = sum(sizes.values())
        total = sum(k * v for k, v in sizes.items())
        out[w] = {
            "write_requests_per_run": requests / len(rs),
            "mean_request_bytes": total / requests if requests else 0,
            "max_request_bytes": max(sizes) if sizes else 0,
            "sizes": {str(k): v for k, v in sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1])},
            "ops_per_run": {k: v / len(rs) for k, v in sorted(ops.items())},
            "getxattr_per_write": ops["getxattr"] / ops["write"] if ops["write"] else 0,
        }
    return out


def print_report(args: argparse.Namespace, env: dict[str, Any], summary: dict[str, Any],
                 ratio_rows: list[dict[str, Any]], sizes: dict[str, Any]) -> None:
    p = print
    p(f"\n## Write path, {env['date']} ({'quick' if args.quick else 'full'}: seq "
      f"{fmt_size(args.seq_bytes)}, torch.save {env['torch_state_dict_bytes'] / MiB:.0f} MiB, "
      f"median of {args.reps} interleaved runs)\n")
    p(f"{env['cpus']} CPUs, {env['mem_gib']:.0f} GiB RAM, kernel {env['kernel']}, "
      f"workdir {env['workdir']} ({env['workdir_fstype']}), load avg at start "
      f"{env['loadavg_start']}\n")
    p("| workload | config | MB/s | best MB/s | write+close s | write s | close s | daemon CPU s (usr+sys)"
      " | CPU s/GiB (writer+daemon) | sync(2) after s | other load | all runs, write+close s |")
    p("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for w, per in summary.items():
        for c, s in per.items():
            cpu = ("-" if "daemon_cpu_user_s_median" not in s else
                   f"{s['daemon_cpu_user_s_median']:.2f}+{s['daemon_cpu_sys_s_median']:.2f}")
            close = "-" if w == "torch_save" else f"{s['close_s_median']:.4f}"
            write = "-" if w == "torch_save" else f"{s['write_s_median']:.3f}"
            p(f"| {TITLES[w]} ({fmt_size(s['bytes']) if w != 'torch_save' else '%.0f MiB' % (s['bytes'] / MiB)})"
              f" | {c} | {s['mb_per_s']:.0f} | {s['mb_per_s_best']:.0f} | {s['blocked_s_median']:.3f}"
              f" | {write} | {close}"
              f" | {cpu} | {s['cpu_s_per_gib_median']:.2f} | {s['sync_after_s_median']:.2f}"
              f" | {s['other_cpu_share_median']:.2f}"
              f" | {', '.join(f'{x:.3f}' for x in s['blocked_s_all'])} |")
    p("\n| ratio | median | best runs | target | per rep | CPU s/GiB, first / second |")
    p("|---|---:|---:|---|---|---:|")
    for r in ratio_rows:
        p(f"| {r['ratio']} | {r['value']:.2f} | {r['value_best_of_runs']:.2f} | {r['target']} | "
          f"{', '.join(f'{x:.2f}' for x in r['paired_per_rep'])} | "
          f"{r['cpu_per_gib_num_over_den']:.2f} |")
    if sizes:
        p("\nFUSE write requests as received by nullfs (same kernel, libfuse and mount options "
          "as ckptfs):\n")
        p("| workload | requests/run | mean size | max size | sizes (count over all runs) |"
          " getxattr per write |")
        p("|---|---:|---:|---:|---|---:|")
        for w, s in sizes.items():
            top = list(s["sizes"].items())
            shown = ", ".join(f"{fmt_size(int(k))} x{v}" for k, v in top[:4])
            if len(top) > 4:
                shown += f", +{len(top) - 4} other sizes"
            p(f"| {w} | {s['write_requests_per_run']:.0f} | {fmt_size(round(s['mean_request_bytes']))}"
              f" | {fmt_size(s['max_request_bytes'])} | {shown} | {s['getxattr_per_write']:.2f} |")
    p("\nMB/s = 10^6 bytes/s over open+write+close (no fsync), from the median time; best MB/s "
      "and 'best runs' use the fastest run of each config. daemon CPU = CPU seconds of the "
      "FUSE daemon during the run. other load = CPUs' worth of time used by everything else on "
      "the machine during the run (other sessions, kworkers): a noise gauge, 0 is quiet. Page "
      "cache not dropped between runs (sync(2) after each run instead); every number is in the "
      "JSON.")


# -- main -----------------------------------------------------------------------------------


def environment(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    import pyfuse3
    import torch
    import trio

    def git(*a: str) -> str:
        done = subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,
                              check=False)
        return done.stdout.strip()

    fstype = subprocess.run(["findmnt", "-no", "FSTYPE", "-T", str(base)],
                            capture_output=True, text=True, check=False).stdout.strip()
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyfuse3": pyfuse3.__version__,
        "trio": trio.__version__,
        "libfuse": os.path.realpath("/lib/x86_64-linux-gnu/libfuse3.so.3").rsplit(".so.", 1)[-1],
        "ckptfs_commit": git("rev-parse", "HEAD"),
        "ckptfs_dirty": bool(git("status", "--porcelain", "--", "ckptfs")),
        "workdir": str(base),
        "workdir_fstype": fstype,
        "vm_dirty_ratio": Path("/proc/sys/vm/dirty_ratio").read_text().strip(),
        "vm_dirty_background_ratio": Path("/proc/sys/vm/dirty_background_ratio").read_text().strip(),
        "fuse_max_pages_limit": (Path("/proc/sys/fs/fuse/max_pages_limit").read_text().strip()
                                 if Path("/proc/sys/fs/fuse/max_pages_limit").exists() else None),
        "loadavg_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "page_cache": ("not dropped between runs unless --drop-caches (best effort, global to "
                       "the machine); sync(2) after every run, outside the timed part"),
        "drop_caches": bool(args.drop_caches),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="ckptfs write-path benchmark (plain / nullfs / ckptfs)")
    ap.add_argument("--quick", action="store_true",
                    help="small sizes (seq 256 MiB, torch.save 128 MiB): well under a minute")
    ap.add_argument("--seq-size", type=int, metavar="MiB",
                    help="sequential write size in MiB (default 2048, quick 256)")
    ap.add_argument("--torch-size", type=int, metavar="MiB",
                    help="torch.save state dict size in MiB (default 1024, quick 128)")
    ap.add_argument("--reps", type=int, help="interleaved repetitions, median taken "
                    "(default 5, quick 3)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated, from " + ",".join(ALL_CONFIGS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="subset of " + ",".join(WORKLOADS))
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                    help="where the plain dir, the staging dir and the mountpoints are created")
    ap.add_argument("--json", type=Path, help="raw results (default benchmarks/results/"
                    "write_path.json, with --quick write_path.quick.json)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="echo 3 > /proc/sys/vm/drop_caches after each run (machine-wide!)")
    ap.add_argument("--quiet-wait", type=float, metavar="S",
                    help="before each run, wait up to S seconds for the machine to be idle "
                    "(< 0.3 CPUs busy); default 15, quick 0")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    args.seq_bytes = (args.seq_size or (256 if args.quick else 2048)) * MiB
    args.torch_bytes = (args.torch_size or (128 if args.quick else 1024)) * MiB
    if args.reps is None:
        args.reps = 3 if args.quick else 5
    if args.quiet_wait is None:
        args.quiet_wait = 0.0 if args.quick else 15.0
    args.configs = [c for c in args.configs.split(",") if c]
    args.workloads = [w for w in args.workloads.split(",") if w]
    for c in args.configs:
        if c not in ALL_CONFIGS:
            ap.error(f"unknown config {c}")
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w}")
    if args.json is None:
        args.json = HERE / "results" / ("write_path.quick.json" if args.quick else "write_path.json")
    return args


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that unmount


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args.workdir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="ckptfs-bench-", dir=args.workdir))
    runs: list[Run] = []
    try:
        free = shutil.disk_usage(base).free
        need = max(args.seq_bytes, args.torch_bytes) * 2
        if free < need:
            raise SystemExit(f"{base}: {free / 2**30:.1f} GiB free, need {need / 2**30:.1f}")
        env = environment(args, base)
        sd = None
        if "torch_save" in args.workloads:
            log(f"building a ~{args.torch_bytes // MiB} MiB state dict")
            sd = make_state_dict(args.torch_bytes)
            env["torch_state_dict_bytes"] = state_dict_bytes(sd)
            env["torch_state_dict_tensors"] = len(sd)
        else:
            env["torch_state_dict_bytes"] = 0
        buf = memoryview(os.urandom(MiB))
        with ExitStack() as stack:
            targets: dict[str, Target] = {}
            for c in args.configs:
                if c == "plain":
                    targets[c] = stack.enter_context(plain_target(base))
                elif c == "ckptfs":
                    targets[c] = stack.enter_context(ckptfs_target(base))
                else:
                    targets[c] = stack.enter_context(nullfs_target(base, c))
            if "ckptfs" in targets:
                staging_dev = os.stat(base / "ckptfs-staging").st_dev
                env["staging_same_device_as_plain"] = staging_dev == os.stat(base).st_dev
            env["daemon_pids"] = {c: t.daemon_pid for c, t in targets.items() if t.daemon_pid}
            log(f"mounted; daemon pids {env['daemon_pids']}; warming up")
            warm = argparse.Namespace(**{**vars(args), "seq_bytes": 32 * MiB})
            small_sd = make_state_dict(8 * MiB) if sd is not None else None
            for t in targets.values():
                one_run(t, "seq_1m", -1, warm, buf, None)
                if small_sd is not None:
                    one_run(t, "torch_save", -1, warm, buf, small_sd)
            for rep in range(args.reps):
                order = args.configs[rep % len(args.configs):] + args.configs[:rep % len(args.configs)]
                for w in args.workloads:
                    for c in order:
                        run = one_run(targets[c], w, rep, args, buf, sd)
                        runs.append(run)
                        log(f"rep {rep} {w:10s} {c:6s} {run.bytes / run.blocked_s / 1e6:7.0f} MB/s"
                            f"  write+close {run.blocked_s:.3f}s  sync {run.sync_s:.2f}s"
                            f"  other CPU {run.other_cpu_s / run.blocked_s:.0%}")
        env["loadavg_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        summary = summarize(runs)
        ratio_rows = ratios(summary, runs)
        sizes = write_size_report(runs)
        variant_sizes = {c: write_size_report(runs, c) for c in args.configs
                         if c in NULLFS_VARIANTS and c != "nullfs"}
        print_report(args, env, summary, ratio_rows, sizes)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "environment": env,
            "summary": summary,
            "ratios": ratio_rows,
            "fuse_write_requests": sizes,
            "fuse_write_requests_variants": variant_sizes,
            "runs": [{**r.__dict__, "blocked_s": r.blocked_s} for r in runs],
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        log(f"raw results in {args.json}")
        return 0
    finally:
        for mnt in base.glob("mnt-*"):
            lazy_unmount(mnt)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
