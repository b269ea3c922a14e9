"""Q8, responsiveness at scale: does the daemon stay fast with many files?

Measured from outside the daemon, file store on the local disk (the work dir):

  metadata rates  a plain directory and a ckptfs mount grow to each of --q8-files (1k, 10k,
                  100k) small files (1 KiB, 100 per directory, open/write/close one after
                  another); the growth rate is recorded every slice of files (the curve), and
                  at each size a batch of --q8-batch files is created, stat'ed and unlinked
                  (rates vs the plain directory). The batch's stat may be answered by the
                  kernel's attribute cache (ckptfs sets entry/attr timeouts); the "cold stat"
                  after each remount cannot be (a new mount has an empty cache).
  sync / status   at each size, after the files are committed: ``ckptfs sync`` and ``ckptfs
                  status`` with nothing pending, as the CLI (a process start, measured apart
                  as ``python -m ckptfs --help``) and as requests on the control socket from
                  one client process (ckptfs.ops.client, median of 3).
  remount         ``ckptfs umount`` (waits for uploads), then ``ckptfs mount`` over the same
                  staging until it returns (the kernel accepted the mount), until a getxattr
                  answers, and until ``ckptfs sync`` returns (whatever the start requeued is
                  done).
  longest answer  a probe process asks the mount every 5 ms (getxattr ``user.ckptfs.state``
                  of a file and readdir of a small directory, alternately) and records how
                  long each answer took (CLOCK_MONOTONIC, shared with this process): the
                  longest answer in each phase (a loop stall, or a request that queued, plus
                  the FUSE round trip). Beside it, at each size, the daemon's own figures
                  (``ckptfs status``: the loop's longest stall and its full garbage
                  collections since the mount; ckptfs/ops/loopwatch.py).
  fsync           a file of --q8-fsync-mib (1 GiB) written in 1 MiB calls, then fsync(2)ed,
                  the probe running: the longest answer while the fsync runs.
  creates         side by side, in --q8-create-rounds rounds whose order rotates: --q8-batch
                  1 KiB files created (open, write, close) in a fresh directory of a ckptfs
                  mount whose staging is on the VM's disk (the work dir), of one whose
                  staging is on tmpfs (/dev/shm, standing in for NVMe, as Q6 and Q9 do),
                  and in nullfs (questions/nullfs.py, the do-nothing pyfuse3 daemon): the
                  ratio to nullfs per round, and each daemon's CPU per create; with
                  ``--q8-baseline DIR``, another checkout's ckptfs (staging on tmpfs) in the
                  same rounds, e.g. the code before a change. Every round starts with
                  all mounts' uploads done (``ckptfs sync`` on each): a round measures one
                  side's create path and its own uploads, not the batch the side before it
                  is still uploading (until stop 38 it did, and the ratio paid for it). (The VM's disk
                  is ext4 mounted without a journal: there the kernel's inode allocator skips
                  inodes deleted in the last seconds one by one, ``recently_deleted()``, so a
                  create right after many deletions costs more; a journaled ext4 or XFS on
                  NVMe does not do this.)
  cluster         questions/cluster_rate.py at --q8-sim-nodes (64 ... 1000) simulated nodes
                  (virtual time): store requests per node per second, idle, during a save,
                  and during a rank-0 rotation (rm -r of a checkpoint every node wrote)
                  until every node has acted on the records of its shard's deletion.

Targets: creates >= 3,000/s and flat in the number of files, and >= 0.5x nullfs side by
side; the longest metadata
answer during a 512 MiB-1 GiB fsync <= 50 ms; remount of 20,000 files ready <= 5 s, of 100,000
<= 15 s; sync with nothing pending <= 0.1 s at 100,000 files; no O(n^2) in start-up or
scheduling (the curves). Nothing is asserted.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from questions import common
from questions.common import (
    CKPTFS,
    Bench,
    MiB,
    ckptfs,
    ckptfs_config,
    ckptfs_env,
    is_mounted,
    log,
    sync_disk,
    unmount,
    write_file,
)

TITLE = "Q8 responsiveness at scale"
PANELS = 2
PER_DIR = 100
PAYLOAD = b"x" * 1024
CREATE_TARGET = 3000.0
FSYNC_TARGET_S = 0.050

# The probe: a client asking the mount every `interval` s until its stdin closes; then it
# prints every answer's start (CLOCK_MONOTONIC) and duration.
PROBE = r"""
import json, os, select, sys, time
target, folder, interval = sys.argv[1], sys.argv[2], float(sys.argv[3])
starts, lats, errors, i = [], [], 0, 0
while True:
    if select.select([sys.stdin], [], [], interval)[0]:
        break
    t0 = time.monotonic()
    try:
        if i % 2:
            os.listdir(folder)
        else:
            os.getxattr(target, "user.ckptfs.state")
    except OSError:
        errors += 1
    starts.append(t0)
    lats.append(time.monotonic() - t0)
    i += 1
json.dump({"starts": starts, "lats": lats, "errors": errors}, sys.stdout)
"""

# Control-socket latency from one client process (no interpreter start in the figure).
CONTROL = r"""
import json, sys, time
from ckptfs.ops import client
mnt, reps = sys.argv[1], int(sys.argv[2])
out = {"sync": [], "status": []}
for _ in range(reps):
    t = time.perf_counter(); client.sync(mnt); out["sync"].append(time.perf_counter() - t)
    t = time.perf_counter(); client.status(mnt); out["status"].append(time.perf_counter() - t)
json.dump(out, sys.stdout)
"""


class Probe:
    def __init__(self, target: Path, folder: Path, interval: float = 0.005) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE, str(target), str(folder),
                                      str(interval)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.samples: list[tuple[float, float]] = []
        self.errors = 0

    def stop(self) -> None:
        if self.proc.returncode is None:
            out, _ = self.proc.communicate(timeout=600)
            data = json.loads(out or b'{"starts": [], "lats": [], "errors": 0}')
            self.samples += list(zip(data["starts"], data["lats"]))
            self.errors += data["errors"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def window(samples: list[tuple[float, float]], t0: float, t1: float) -> dict[str, Any]:
    """Probe answers that overlapped [t0, t1]: count, longest and p99 (ms), answers > 50 ms."""
    lats = sorted(lat for start, lat in samples if start <= t1 and start + lat >= t0)
    if not lats:
        return {"n": 0, "max_ms": None, "p99_ms": None, "over_50ms": 0}
    return {"n": len(lats), "max_ms": lats[-1] * 1e3,
            "p99_ms": lats[min(len(lats) - 1, int(0.99 * len(lats)))] * 1e3,
            "over_50ms": sum(1 for x in lats if x > 0.05)}


def file_path(root: Path, k: int) -> Path:
    return root / f"d{k // PER_DIR:05d}" / f"f{k:07d}"


def grow(root: Path, start: int, stop: int, slice_n: int) -> tuple[float, list[list[float]]]:
    """Create files start..stop-1 (1 KiB each); returns (seconds, [[files, rate], ...])."""
    curve: list[list[float]] = []
    t0 = ts = time.perf_counter()
    for k in range(start, stop):
        p = file_path(root, k)
        if k % PER_DIR == 0:
            p.parent.mkdir(exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, PAYLOAD)
        os.close(fd)
        if (k + 1) % slice_n == 0:
            now = time.perf_counter()
            curve.append([k + 1, slice_n / (now - ts)])
            ts = now
    return time.perf_counter() - t0, curve


def batch_rates(folder: Path, n: int, daemon: int | None = None) -> dict[str, Any]:
    """Create, stat, unlink ``n`` 1 KiB files in a fresh directory: operations per second
    (and with ``daemon``, that process's CPU time per create)."""
    folder.mkdir()
    paths = [folder / f"b{i:06d}" for i in range(n)]
    cpu0 = _cpu_s(daemon) if daemon else 0.0
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, PAYLOAD)
        os.close(fd)
    t1 = time.perf_counter()
    cpu_us = (_cpu_s(daemon) - cpu0) / n * 1e6 if daemon else None
    for p in paths:
        os.stat(p)
    t2 = time.perf_counter()
    for p in paths:
        os.unlink(p)
    t3 = time.perf_counter()
    folder.rmdir()
    return {"create_per_s": n / (t1 - t0), "stat_per_s": n / (t2 - t1),
            "unlink_per_s": n / (t3 - t2), "t": [t0, t1, t2, t3], "cpu_us_per_create": cpu_us}


def run_nullfs(b: Bench, batch: int) -> dict[str, Any]:
    """The floor of any pyfuse3 + trio daemon here: nullfs.py (no journal, no staging file)
    answers the same create sequence (lookup, create, getattr of the directory, write, flush,
    release); creates/s and its CPU time per create, beside ckptfs's."""
    with common.nullfs_mount(b.dir("q8-nullfs"), "q8-nullfs") as m:
        cpu0 = _cpu_s(m.pid)
        t0 = time.perf_counter()
        for i in range(batch):
            fd = os.open(m.path / f"b{i:06d}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, PAYLOAD)
            os.close(fd)
        secs = time.perf_counter() - t0
        cpu = _cpu_s(m.pid) - cpu0
        for i in range(batch):
            os.unlink(m.path / f"b{i:06d}")
    log(f"Q8 nullfs: {batch / secs:.0f} creates/s, {cpu / batch * 1e6:.0f} us daemon CPU each")
    return {"create_per_s": batch / secs, "cpu_us_per_create": cpu / batch * 1e6}


CREATE_SIDES = ("ckptfs-disk", "ckptfs-tmpfs", "nullfs")
BASELINE = "ckptfs-baseline"  # --q8-baseline: another checkout's ckptfs, staging on tmpfs


def create_sides(baseline: Path | None) -> tuple[str, ...]:
    """The sides of the ``creates`` part: with ``--q8-baseline``, another checkout's ckptfs
    too (staging on tmpfs), e.g. the code before a change, in the same rotating rounds."""
    return CREATE_SIDES + ((BASELINE,) if baseline is not None else ())


def run_creates(b: Bench, batch: int, rounds: int,
                baseline: Path | None = None) -> dict[str, Any]:
    """The ``creates`` part (module docstring): rows of {round, side, create_per_s,
    cpu_us_per_create}."""
    base = Path(tempfile.mkdtemp(prefix="q8-creates-", dir="/dev/shm"))
    rows: list[dict[str, Any]] = []
    sides = create_sides(baseline)
    try:
        with ExitStack() as stack:
            mounts = {}
            for side, where in (("ckptfs-disk", b.dir("q8-creates")), ("ckptfs-tmpfs", base),
                                (BASELINE, base)):
                if side not in sides:
                    continue
                cfg = ckptfs_config(where / f"{side}-staging", store_dir=b.dir(f"q8-{side}-store"),
                                    extra='log_level = "warning"')
                src = baseline.resolve() if side == BASELINE and baseline is not None else None
                mounts[side] = stack.enter_context(common.ckptfs_mount(where, side, cfg,
                                                                       src=src))
            null = stack.enter_context(common.nullfs_mount(b.dir("q8-creates-null"), "null"))
            for rnd in range(rounds):
                order = sides[rnd % len(sides):] + sides[:rnd % len(sides)]
                for side in order:
                    m = mounts.get(side)
                    # Every mount's uploads done, not only this one's: the side before would
                    # otherwise upload its batch during this round (its yield gate holds it
                    # only while its own job writes), and whichever side follows it pays.
                    for other in mounts.values():
                        other.sync()
                    sync_disk()
                    pid = m.pid if m is not None else null.pid
                    # nullfs has no mkdir: its files go in its root, named per round.
                    folder = m.path / f"round{rnd}" if m is not None else null.path
                    if m is not None:
                        folder.mkdir()
                    cpu0 = _cpu_s(pid)
                    t0 = time.perf_counter()
                    for i in range(batch):
                        fd = os.open(folder / f"r{rnd}-{i:06d}",
                                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                        os.write(fd, PAYLOAD)
                        os.close(fd)
                    secs = time.perf_counter() - t0
                    cpu = _cpu_s(pid) - cpu0
                    rows.append({"round": rnd, "side": side, "create_per_s": batch / secs,
                                 "cpu_us_per_create": cpu / batch * 1e6})
                    log(f"Q8 creates round {rnd} {side:>12}: {batch / secs:.0f}/s, "
                        f"{cpu / batch * 1e6:.0f} us daemon CPU each")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"batch": batch, "rounds": rows}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stat_rate(root: Path, sample: list[int]) -> float:
    t0 = time.perf_counter()
    for k in sample:
        os.stat(file_path(root, k))
    return len(sample) / (time.perf_counter() - t0)


def timed_cli(*args: Any, timeout: float = 1800) -> float:
    t0 = time.perf_counter()
    ckptfs(*args, timeout=timeout)
    return time.perf_counter() - t0


def control_latency(mnt: Path, reps: int = 3) -> dict[str, Any]:
    done = subprocess.run([*CKPTFS[:1], "-c", CONTROL, str(mnt), str(reps)],
                          capture_output=True, text=True, env=ckptfs_env(), timeout=1800,
                          check=True, stdin=subprocess.DEVNULL)
    raw = json.loads(done.stdout)
    return {"sync_s": statistics.median(raw["sync"]), "status_s": statistics.median(raw["status"]),
            "raw": raw}


def cli_start_s() -> float:
    """The CLI's fixed cost: ``python -m ckptfs --help`` (interpreter start and imports)."""
    t0 = time.perf_counter()
    subprocess.run([*CKPTFS, "--help"], capture_output=True, env=ckptfs_env(), check=False,
                   cwd=common.CKPTFS_SRC, stdin=subprocess.DEVNULL)
    return time.perf_counter() - t0


def run_plain(b: Bench, counts: list[int], batch: int, slice_n: int) -> dict[str, Any]:
    root = b.dir("q8-plain")
    points, curve, have = [], [], 0
    try:
        for n in counts:
            secs, c = grow(root, have, n, slice_n)
            curve += c
            rates = batch_rates(root / f"batch-{n}", batch)
            rates.pop("t")
            points.append({"files": n, "grow_s": secs, "grow_per_s": (n - have) / secs, **rates})
            log(f"Q8 plain {n} files: grew at {(n - have) / secs:.0f}/s; batch create "
                f"{rates['create_per_s']:.0f}/s stat {rates['stat_per_s']:.0f}/s unlink "
                f"{rates['unlink_per_s']:.0f}/s")
            have = n
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"points": points, "curve": curve}


def run_ckptfs(b: Bench, counts: list[int], batch: int, slice_n: int,
               fsync_mib: int) -> dict[str, Any]:
    o = b.opts
    mnt, staging, store = b.dir("q8-mnt"), b.dir("q8-staging"), b.dir("q8-store")
    cfg = b.work / "q8.toml"
    cfg.write_text(ckptfs_config(staging, store_dir=store))
    points: list[dict[str, Any]] = []
    curve: list[list[float]] = []
    probes: list[Probe] = []
    out: dict[str, Any] = {"points": points, "curve": curve}
    have = 0
    rng = random.Random(8)

    def start_probe() -> Probe:
        p = Probe(mnt / "probe" / "target", mnt / "probe")
        probes.append(p)
        return p

    failed = True
    try:
        out["mount_empty_s"] = timed_cli("mount", mnt, "-c", cfg, timeout=o.q8_mount_timeout)
        (mnt / "probe").mkdir()
        write_file(mnt / "probe" / "target", 1024, PAYLOAD)
        probe = start_probe()
        for n in counts:
            pt: dict[str, Any] = {"files": n}
            t0 = time.monotonic()
            (mnt / "files").mkdir(exist_ok=True)
            secs, c = grow(mnt / "files", have, n, slice_n)
            t1 = time.monotonic()
            curve += c
            pt["grow_s"], pt["grow_per_s"] = secs, (n - have) / secs
            pt["_w_grow"] = (t0, t1)
            daemon = int(json.loads(os.getxattr(mnt, "user.ckptfs.daemon"))["pid"])
            rates = batch_rates(mnt / f"batch-{n}", batch, daemon)
            tb = rates.pop("t")
            tb = [x - time.perf_counter() + time.monotonic() for x in tb]
            pt.update(rates)
            pt["_w_batch"] = (tb[0], tb[3])
            t0 = time.monotonic()
            pt["sync_drain_s"] = timed_cli("sync", mnt)
            pt["_w_sync_drain"] = (t0, time.monotonic())
            t0 = time.monotonic()
            pt["sync_idle_cli_s"] = timed_cli("sync", mnt)
            pt["status_cli_s"] = timed_cli("status", mnt)
            ctl = control_latency(mnt)
            pt["sync_idle_s"], pt["status_s"] = ctl["sync_s"], ctl["status_s"]
            pt["_w_sync_idle"] = (t0, time.monotonic())
            # The daemon's own view since its mount (this size's growth, batch and drain; the
            # first size's since the first mount): a loop stall, or a request that queued?
            report = json.loads(ckptfs("status", mnt, "--json").stdout)
            mine = report[0] if isinstance(report, list) else report
            pt["daemon_loop"] = mine.get("loop")
            log(f"Q8 ckptfs {n} files: grew at {pt['grow_per_s']:.0f}/s; batch create "
                f"{rates['create_per_s']:.0f}/s stat {rates['stat_per_s']:.0f}/s unlink "
                f"{rates['unlink_per_s']:.0f}/s; sync drain {pt['sync_drain_s']:.2f} s, "
                f"idle sync {pt['sync_idle_s'] * 1e3:.0f} ms, status "
                f"{pt['status_s'] * 1e3:.0f} ms (CLI {pt['sync_idle_cli_s']:.2f} / "
                f"{pt['status_cli_s']:.2f} s)")
            # Remount over the same staging.
            probe.stop()
            pt["umount_s"] = timed_cli("umount", mnt, "--timeout", "1800", timeout=1900)
            unmount(mnt)
            t0 = time.monotonic()
            ckptfs("mount", mnt, "-c", cfg, timeout=o.q8_mount_timeout)
            t1 = time.monotonic()
            os.getxattr(mnt / "probe" / "target", "user.ckptfs.state")
            t2 = time.monotonic()
            probe = start_probe()
            ckptfs("sync", mnt)
            t3 = time.monotonic()
            pt["remount_s"], pt["remount_answer_s"] = t1 - t0, t2 - t0
            pt["remount_sync_s"] = t3 - t0
            pt["_w_after_remount"] = (t2, t3)
            sample = rng.sample(range(n), min(batch, n))
            pt["cold_stat_per_s"] = stat_rate(mnt / "files", sample)
            log(f"Q8 ckptfs {n} files: umount {pt['umount_s']:.2f} s; mount returned after "
                f"{pt['remount_s']:.2f} s, first answer {pt['remount_answer_s']:.2f} s, sync "
                f"done {pt['remount_sync_s']:.2f} s; cold stat {pt['cold_stat_per_s']:.0f}/s")
            points.append(pt)
            have = n
        # fsync of a big file, the probe running
        big = mnt / "big"
        block = os.urandom(MiB)
        sync_disk()
        fd = os.open(big, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            t0 = time.monotonic()
            for _ in range(fsync_mib):
                os.write(fd, block)
            t1 = time.monotonic()
            os.fsync(fd)
            t2 = time.monotonic()
        finally:
            os.close(fd)
        out["fsync"] = {"mib": fsync_mib, "write_s": t1 - t0, "fsync_s": t2 - t1,
                        "_w_write": (t0, t1), "_w_fsync": (t1, t2)}
        big.unlink()
        ckptfs("sync", mnt)
        probe.stop()
        failed = False
    finally:
        for p in probes:
            p.kill()
        if is_mounted(mnt):
            wait = ["--no-wait"] if failed else ["--timeout", "1800"]
            ckptfs("umount", mnt, *wait, timeout=1900, check=False)
        unmount(mnt)
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    samples = [s for p in probes for s in p.samples]
    out["probe"] = {"answers": len(samples), "errors": sum(p.errors for p in probes),
                    "max_ms": max((lat for _, lat in samples), default=0) * 1e3}

    def resolve(d: dict[str, Any]) -> None:
        for key in [k for k in d if k.startswith("_w_")]:
            d[key[3:] + "_probe"] = window(samples, *d.pop(key))

    for pt in points:
        resolve(pt)
    resolve(out["fsync"])
    log(f"Q8 fsync of {fsync_mib} MiB: {out['fsync']['fsync_s']:.2f} s; longest answer during "
        f"it {out['fsync']['fsync_probe']['max_ms']} ms")
    return out


def run_sim(b: Bench, nodes: list[int]) -> dict[str, Any]:
    o = b.opts
    env = ckptfs_env()  # ckptfs and tests.cluster from the checkout benchmarked
    rows, notes = [], []
    for n in nodes:
        t0 = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, str(Path(__file__).with_name("cluster_rate.py")), str(n),
                 "--idle", str(o.q8_sim_idle), "--dir", str(b.dir("q8-sim"))],
                capture_output=True, text=True, env=env, cwd=common.CKPTFS_SRC,
                timeout=o.q8_sim_timeout, check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            notes.append(f"{n} nodes: over {o.q8_sim_timeout:.0f} s, stopped")
            log(f"Q8 sim {n} nodes: over {o.q8_sim_timeout:.0f} s; larger runs skipped")
            break
        if done.returncode != 0:
            raise RuntimeError(f"cluster_rate.py {n} failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout)
        row["run_s"] = time.perf_counter() - t0
        rows.append(row)
        log(f"Q8 sim {n} nodes: requests/node/s idle {row['idle_per_node_s']:.3f}, save "
            f"{row['save_per_node_s']:.2f} ({row['save_control_per_node_s']:.2f} coordination),"
            f" save took {row['save_virtual_s']:.1f} virtual s, rank-0 rotation "
            f"{row['rotation_per_node_s']:.3f} over {row['rotation_virtual_s']:.0f} virtual s "
            f"({row['records_written']} records); {row['run_s']:.1f} s here")
    return {"runs": rows, "notes": notes}


def run(b: Bench) -> dict[str, Any]:
    o = b.opts
    counts = sorted(set(o.q8_files))
    slice_n = max(50, min(1000, counts[-1] // 50))
    log(f"Q8: files {counts}, batch {o.q8_batch}, fsync {o.q8_fsync_mib} MiB, simulated "
        f"nodes {o.q8_sim_nodes}; load average {os.getloadavg()[0]:.2f}")
    res: dict[str, Any] = {"title": TITLE, "files": counts, "batch": o.q8_batch,
                           "slice": slice_n, "cli_start_s": cli_start_s(),
                           "loadavg_start": os.getloadavg()}
    parts = o.q8_parts
    if "scale" in parts:
        res["plain"] = run_plain(b, counts, o.q8_batch, slice_n)
        res["nullfs"] = run_nullfs(b, o.q8_batch)
        res["ckptfs"] = run_ckptfs(b, counts, o.q8_batch, slice_n, o.q8_fsync_mib)
    if "creates" in parts:
        res["creates"] = run_creates(b, o.q8_batch, o.q8_create_rounds,
                                     getattr(o, "q8_baseline", None))
    if "sim" in parts:
        res["sim"] = run_sim(b, o.q8_sim_nodes)
    res["loadavg_end"] = os.getloadavg()
    res["summary"] = summarize(res)
    return res


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def summarize(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    if "ckptfs" in r:
        rows += _scale_rows(r)
    if "creates" in r:
        rows += _create_rows(r["creates"])
    for s in r.get("sim", {}).get("runs", []):
        measure = (f"sim {s['nodes']} nodes: store requests/node/s idle / save (coordination)"
                   " / rank-0 rotation until every node acted on its records")
        value = (f"{s['idle_per_node_s']:.3f} / {s['save_per_node_s']:.2f} "
                 f"({s['save_control_per_node_s']:.2f}) / {s['rotation_per_node_s']:.3f}; "
                 f"{s['run_s']:.0f} s wall")
        rows.append((measure, value, ""))
    for note in r.get("sim", {}).get("notes", []):
        rows.append(("sim", note, ""))
    return rows


def _create_rows(c: dict[str, Any]) -> list[tuple[str, str, str]]:
    sides = CREATE_SIDES + ((BASELINE,) if any(x["side"] == BASELINE for x in c["rounds"])
                            else ())
    by = {side: [x for x in c["rounds"] if x["side"] == side] for side in sides}
    null = by["nullfs"]

    def medians(rows: list[dict[str, Any]]) -> str:
        return (f"{statistics.median(x['create_per_s'] for x in rows):.0f}/s, "
                f"{statistics.median(x['cpu_us_per_create'] for x in rows):.0f} us")

    out = []
    for side in [x for x in sides if x != "nullfs"]:
        ratios = [x["create_per_s"] / n["create_per_s"] for x, n in zip(by[side], null)]
        each = ", ".join(f"{v:.2f}" for v in ratios)
        measure = (f"{c['batch']} creates of 1 KiB, {side} / nullfs (rounds); creates/s, "
                   "daemon CPU us per create")
        value = f"**{statistics.median(ratios):.2f}** ({each}); {medians(by[side])}"
        out.append((measure, value, "≥ 0.5"))
    out.append(("nullfs in the same rounds: creates/s, daemon CPU us per create",
                medians(null), ""))
    if BASELINE in by:
        ratios = [x["create_per_s"] / y["create_per_s"]
                  for x, y in zip(by["ckptfs-tmpfs"], by[BASELINE])]
        each = ", ".join(f"{v:.2f}" for v in ratios)
        measure = "creates/s, ckptfs-tmpfs / ckptfs-baseline (the other checkout, tmpfs; rounds)"
        out.append((measure, f"**{statistics.median(ratios):.2f}** ({each})", ""))
    return out


def _scale_rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    plain = {p["files"]: p for p in r["plain"]["points"]}
    ck = r["ckptfs"]
    rows: list[tuple[str, str, str]] = []

    def row(measure: str, value: str, target: str = "") -> None:
        rows.append((measure, value, target))

    for p in ck["points"]:
        n, q = p["files"], plain[p["files"]]
        ratio = p["create_per_s"] / q["create_per_s"]
        row(f"{n} files: creates/s growing, batch: ckptfs / plain (batch ratio)",
            f"{p['grow_per_s']:.0f}, **{p['create_per_s']:.0f}** / {q['grow_per_s']:.0f}, "
            f"{q['create_per_s']:.0f} ({ratio:.3f})", "≥ 3,000/s, ≥ 1/10 plain, flat")
        if p.get("cpu_us_per_create"):
            row(f"{n} files: daemon CPU per create in the batch, us",
                f"{p['cpu_us_per_create']:.0f}")
        row(f"{n} files: stat/s batch, cold after remount; unlink/s: ckptfs / plain",
            f"{p['stat_per_s']:.0f}, {p['cold_stat_per_s']:.0f}; {p['unlink_per_s']:.0f} / "
            f"{q['stat_per_s']:.0f}; {q['unlink_per_s']:.0f}")
        row(f"{n} files: idle sync / status on the socket, ms (CLI s; start alone "
            f"{r['cli_start_s']:.2f} s)",
            f"**{p['sync_idle_s'] * 1e3:.0f}** / {p['status_s'] * 1e3:.0f} "
            f"({p['sync_idle_cli_s']:.2f} / {p['status_cli_s']:.2f})", "sync ≤ 100 ms at 100,000")
        row(f"{n} files: remount s: mount returned / first answer / sync done (umount s)",
            f"**{p['remount_s']:.2f}** / {p['remount_answer_s']:.2f} / "
            f"{p['remount_sync_s']:.2f} ({p['umount_s']:.2f})",
            "≤ 5 s at 20,000, ≤ 15 s at 100,000")
        loop = p.get("daemon_loop")
        if loop:
            row(f"{n} files: the daemon's longest loop stall, ms (stalls over 100 ms); full "
                "garbage collections: longest ms (count)",
                f"{loop['longest_stall_s'] * 1e3:.0f} ({loop['stalls']}); "
                f"{loop['gc_longest_s'] * 1e3:.0f} ({loop['gc_full_collections']})")
        row(f"{n} files: longest probe answer ms: growing / batch / sync drain / idle "
            "sync+status / after remount",
            " / ".join(_ms(p[k]["max_ms"]) for k in (
                "grow_probe", "batch_probe", "sync_drain_probe", "sync_idle_probe",
                "after_remount_probe")))
    if "nullfs" in r:
        row("creates/s of a do-nothing pyfuse3 daemon (nullfs.py), the floor here; its CPU "
            "per create",
            f"{r['nullfs']['create_per_s']:.0f}; {r['nullfs']['cpu_us_per_create']:.0f} us")
    f = ck["fsync"]
    row(f"fsync of {f['mib']} MiB: s; longest probe answer during it, ms (answers)",
        f"{f['fsync_s']:.2f}; **{_ms(f['fsync_probe']['max_ms'])}** ({f['fsync_probe']['n']})",
        "≤ 50 ms")
    return rows


def plot(ax: Any, r: dict[str, Any]) -> None:
    if "ckptfs" not in r:
        ax.axis("off")
        return
    for name, d, style in (("plain", r["plain"], "o-"), ("ckptfs", r["ckptfs"], "s-")):
        xs = [c[0] for c in d["curve"]]
        ax.plot(xs, [c[1] for c in d["curve"]], style, ms=2, label=f"{name} creates/s")
    ax.axhline(CREATE_TARGET, color="C3", lw=0.6, ls=":", label="target 3,000/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("files on the mount")
    ax.set_ylabel("creates / s (1 KiB files)")
    ax.set_title("Q8 create rate vs files present", fontsize=9)
    ax.legend(fontsize=7)


def plot_extra(ax: Any, r: dict[str, Any], i: int) -> None:
    if "ckptfs" not in r:
        ax.axis("off")
        return
    pts = r["ckptfs"]["points"]
    xs = [p["files"] for p in pts]
    ax.plot(xs, [p["remount_s"] for p in pts], "o-", label="remount: mount returned s")
    ax.plot(xs, [p["remount_sync_s"] for p in pts], "s-", label="remount: sync done s")
    ax.plot(xs, [p["sync_idle_s"] for p in pts], "^-", label="idle sync s (socket)")
    ax.plot(xs, [(p["after_remount_probe"]["max_ms"] or 0) / 1e3 for p in pts], "v--",
            label="longest answer after remount s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("committed files")
    ax.set_ylabel("seconds")
    ax.set_title("Q8 remount / sync vs files", fontsize=9)
    ax.legend(fontsize=7)
