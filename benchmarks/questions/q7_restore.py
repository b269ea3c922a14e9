"""Q7, reading a checkpoint back through ckptfs (the former benchmarks/restore.py, folded
into run_all.py).

Two measurements, for each warm tier (``--q7-store s3|file|both``):

1. **Restore on a fresh node.** A checkpoint of ``--q7-mib`` (2048) MiB in ``--q7-files`` (4)
   files is written through a ckptfs mount and synced to the store; that mount and its staging
   dir are then removed. Measured side by side, ``--q7-restore-reps`` (3) rounds alternating
   which side goes first, page cache dropped before each side, median round reported:
     baseline  S3: boto3 ``download_file`` of every object into a local dir (4 files at once,
               16 MiB parts x 4, as Q3), then reading the local files; file store: plain
               ``shutil.copyfile`` of every object out of the store dir, then reading.
     ckptfs    a FRESH mount (empty staging dir) over the populated store; the files are read
               through it. Reported with and without the mount time (CLI start + root listing).
   Ratio: throughput ckptfs / baseline; target >= 1.0 on S3, >= 0.8 on a file store.
   The S3 store is SeaweedFS (``weed mini`` on loopback, started by tests/seaweed.py: a real
   server, which moto is not: moto copied the whole object for every range GET and capped both
   sides near 20 MiB/s).

2. **Second read, now local** (skipped with ``--q7-restore-only``). The same files read again
   through one more fresh mount once it has read them all (every block
   fetched: state ``committed``) vs the same bytes in a plain local directory (the baseline's),
   side by side with two do-nothing FUSE filesystems (``questions/nullfs.py``, same mount options and
   worker settings as ckptfs), the ceiling of a Python FUSE read path:
     nullfs        reads answer zeros (no I/O at all: FUSE round trips only)
     nullfs-pread  reads answer ``os.pread`` of a backing file (the files were written
                   through it): the least a staging filesystem must do
   The kernel keeps a FUSE file's page cache across opens (measured: a second read of an
   unchanged nullfs file sends no READ at all), so three cases:
     cached  page cache warm: the kernel answers, the daemon is not asked (a real second read)
     daemon  the FUSE files' page cache is evicted (``posix_fadvise(DONTNEED)`` on the files
             of the mount) before every read, the daemons' own files and the plain dir stay
             cached: every byte goes through the daemon, the case the ceiling is about
     cold    the whole page cache dropped before each configuration, one read (disk-bound;
             nullfs answers zeros, so it has no cold case)
   cached: each timed read right after an untimed one of the same files (the kernel drops a
   FUSE file's pages when it refreshes its attributes, after the 10 s attribute timeout);
   daemon: every configuration once untimed first. ``--q7-reps`` (3) rounds, interleaved,
   median. Ratio: ckptfs / nullfs throughput (daemon case), target >= 0.9.

Readers: one thread per file, at most 4 at once, ``read()`` calls of 1 MiB into one buffer
(the data is discarded). The page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``,
needs root; machine-wide) where a phase must start cold: before each restore side and before
each cold read. Without root, with ``--q7-no-drop-caches`` or in ``--quick`` (CI shares the
machine) the drop is skipped and the table says so.

Every mount is unmounted in a ``finally`` (ckptfs with ``umount``, then ``fusermount3 -u -z``);
nullfs is stopped by its own pid. Nothing is asserted. The fresh mount gets
``--q7-ckptfs-config`` as extra top-level config lines (e.g. 'fetch_block_size = 16777216').

    python benchmarks/run_all.py --only q7                                # 2 GiB in 4 files
    python benchmarks/run_all.py --only q7 --q7-files 1 --q7-store file   # one 2 GiB file
    python benchmarks/run_all.py --only q7 --q7-store s3 --q7-restore-only --q7-mib 1024
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from questions.common import (
    Bench,
    CkptfsMount,
    MiB,
    SeaweedS3,
    ckptfs_config,
    ckptfs_mount,
    control,
    log,
    nullfs_mount,
    write_file,
)

TITLE = "Q7 restore on a fresh node, and the second read, vs baselines and the FUSE ceiling"

PART, PART_CONC, FILE_CONC = 16 * MiB, 4, 4  # boto3 side, as Q3 (ckptfs's upload defaults)
READ_CALL = MiB
STALL_S = 0.1  # a read() call slower than this is counted as a stall


# -- measuring ------------------------------------------------------------------------------


@dataclass
class ReadRun:
    seconds: float
    bytes: int
    calls: int
    slowest_call_s: float
    stalls: int  # read() calls slower than STALL_S
    reader_cpu_s: float  # this process (the readers), user + sys
    daemon_cpu_s: float | None = None  # the FUSE daemon, user + sys

    def mbs(self) -> float:
        return self.bytes / self.seconds / 1e6


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read_one(path: Path) -> tuple[int, int, float, int]:
    buf = bytearray(READ_CALL)
    total = calls = stalls = 0
    slowest = 0.0
    with open(path, "rb", buffering=0) as f:
        while True:
            t0 = time.perf_counter()
            n = f.readinto(buf)
            dt_call = time.perf_counter() - t0
            calls += 1
            slowest = max(slowest, dt_call)
            stalls += dt_call > STALL_S
            if not n:
                break
            total += n
    return total, calls, slowest, stalls


def read_all(paths: list[Path], daemon_pid: int | None = None) -> ReadRun:
    """Read every file, one thread per file (at most FILE_CONC at once), 1 MiB calls."""
    cpu0 = os.times()
    d0 = proc_cpu_s(daemon_pid) if daemon_pid else 0.0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(FILE_CONC, len(paths))) as pool:
        parts = list(pool.map(_read_one, paths))
    elapsed = time.perf_counter() - t0
    cpu1 = os.times()
    return ReadRun(elapsed, sum(p[0] for p in parts), sum(p[1] for p in parts),
                   max(p[2] for p in parts), sum(p[3] for p in parts),
                   (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
                   proc_cpu_s(daemon_pid) - d0 if daemon_pid else None)


DROPPED: dict[str, bool | None] = {"ok": None, "skip": False}


def drop_caches() -> bool:
    """sync, then drop the page cache, dentries and inodes (machine-wide; needs root)."""
    os.sync()
    if DROPPED["skip"]:
        DROPPED["ok"] = False
        return False
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        ok = True
    except OSError:
        ok = False
    if DROPPED["ok"] is None and not ok:  # said once
        log("cannot write /proc/sys/vm/drop_caches (not root?): page cache NOT dropped")
    DROPPED["ok"] = ok if DROPPED["ok"] is None else (DROPPED["ok"] and ok)
    return ok


def ckptfs_status(mnt: Path) -> dict[str, Any]:
    """What ``ckptfs status --json`` prints, or the error."""
    try:
        found: dict[str, Any] = control().status(mnt)
    except Exception as exc:  # noqa: BLE001 (a figure of the table, not the run)
        return {"error": str(exc)[-500:]}
    return found


def file_states(paths: list[Path]) -> list[str]:
    out = []
    for p in paths:
        try:
            out.append(os.getxattr(p, "user.ckptfs.state").decode())
        except OSError as exc:
            out.append(f"? ({exc.strerror})")
    return out


# -- the stores -----------------------------------------------------------------------------


@dataclass
class Store:
    kind: str  # "s3" | "file"
    work: Path
    s3: SeaweedS3 | None = None
    bucket: str = ""

    @property
    def store_dir(self) -> Path:
        return self.work / f"{self.kind}-store"

    def config(self, staging: Path, extra: str) -> str:
        if self.kind == "s3":
            return ckptfs_config(staging, s3=self.s3, bucket=self.bucket, prefix="run",
                                 extra=extra)
        return ckptfs_config(staging, store_dir=self.store_dir, extra=extra)

    def baseline_fetch(self, names: list[str], dest: Path) -> None:
        """Bring every object into ``dest`` the plain way (4 files at once)."""
        dest.mkdir(parents=True, exist_ok=True)
        if self.kind == "s3":
            from boto3.s3.transfer import TransferConfig

            assert self.s3 is not None
            s3 = self.s3.client()
            cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                                 max_concurrency=PART_CONC)

            def one(n: str) -> None:
                s3.download_file(self.bucket, f"run/{n}", str(dest / n), Config=cfg)
        else:
            def one(n: str) -> None:
                shutil.copyfile(self.store_dir / n, dest / n)
        with ThreadPoolExecutor(min(FILE_CONC, len(names))) as pool:
            list(pool.map(one, names))


def populate(store: Store, names: list[str], size: int, block: bytes, extra: str) -> float:
    """Write the checkpoint through a ckptfs mount and sync it to the store (the objects then
    carry ckptfs's metadata and block checksums, as a real checkpoint's would); seconds."""
    t0 = time.perf_counter()
    staging = store.work / f"{store.kind}-writer-staging"
    with ckptfs_mount(store.work, f"{store.kind}-writer", store.config(staging, extra)) as m:
        for n in names:
            write_file(m.path / n, size, block)
        m.sync()
    shutil.rmtree(staging, ignore_errors=True)  # this node is gone
    return time.perf_counter() - t0


# -- one store ------------------------------------------------------------------------------


def restore_baseline(store: Store, names: list[str], total: int) -> dict[str, Any]:
    """One baseline restore, cold: fetch every object the plain way, then read the copies."""
    local = store.work / f"{store.kind}-local"
    shutil.rmtree(local, ignore_errors=True)
    drop_caches()
    t0 = time.perf_counter()
    store.baseline_fetch(names, local)
    fetch_s = time.perf_counter() - t0
    base_read = read_all([local / n for n in names])
    base_s = fetch_s + base_read.seconds
    what = "boto3 download_file" if store.kind == "s3" else "shutil.copyfile"
    log(f"{store.kind}: baseline {what} {fetch_s:.2f} s + read {base_read.seconds:.2f} s "
        f"= {total / base_s / 1e6:.0f} MB/s")
    return {"how": what, "fetch_s": fetch_s, "read": asdict(base_read), "total_s": base_s}


def restore_ckptfs(store: Store, names: list[str], total: int, extra: str,
                   then: Any = None) -> dict[str, Any]:
    """One ckptfs restore, cold: a FRESH mount (empty staging dir) reads every file;
    ``then(mount, paths)`` runs before the unmount."""
    kind = store.kind
    drop_caches()
    staging = store.work / f"{kind}-reader-staging"
    shutil.rmtree(staging, ignore_errors=True)
    t0 = time.perf_counter()
    with ckptfs_mount(store.work, f"{kind}-reader", store.config(staging, extra)) as m:
        mount_s = time.perf_counter() - t0
        paths = [m.path / n for n in names]
        fresh = read_all(paths, m.pid)
        # Untimed: a file read whole becomes a local copy (an fdatasync) in the background,
        # once the fetches pause (fetch.py), as a download's pages go to disk after it.
        deadline = time.monotonic() + 60
        while set(states := file_states(paths)) != {"committed"} and time.monotonic() < deadline:
            time.sleep(0.1)
        status = ckptfs_status(m.path)
        rss = m.peak_rss()
        log(f"{kind}: ckptfs fresh mount {mount_s:.2f} s + read {fresh.seconds:.2f} s "
            f"= {total / fresh.seconds / 1e6:.0f} MB/s (read only); states {set(states)}; "
            f"fetched {status.get('fetch', {}).get('bytes')} bytes; "
            f"daemon CPU {fresh.daemon_cpu_s:.1f} s")
        found = {"mount_s": mount_s, "read": asdict(fresh), "fetch": status.get("fetch"),
                 "states_after": states, "daemon_peak_rss": rss}
        if then is not None:
            found["then"] = then(m, paths)
    shutil.rmtree(staging, ignore_errors=True)
    return found


def run_store(store: Store, names: list[str], size: int, block: bytes, extra: str, reps: int,
              restore_reps: int, nulls: dict[str, Any] | None) -> dict[str, Any]:
    kind = store.kind
    total = size * len(names)
    log(f"{kind}: writing {len(names)} x {size / MiB:.0f} MiB through ckptfs and syncing it")
    populate_s = populate(store, names, size, block, extra)
    log(f"{kind}: populated in {populate_s:.1f} s")

    # 1. restore on a fresh node, side by side: baseline and ckptfs alternate (which goes
    # first alternates too), each cold; the median of the rounds is reported.
    local = store.work / f"{kind}-local"
    rounds: list[dict[str, Any]] = []
    for rep in range(restore_reps):
        one: dict[str, Any] = {}
        for side in (("baseline", "ckptfs") if rep % 2 == 0 else ("ckptfs", "baseline")):
            if side == "baseline":
                one["baseline"] = restore_baseline(store, names, total)
            else:
                one["ckptfs"] = restore_ckptfs(store, names, total, extra)
        ck = one["ckptfs"]
        one["ratio"] = one["baseline"]["total_s"] / ck["read"]["seconds"]
        one["ratio_incl_mount"] = (one["baseline"]["total_s"]
                                   / (ck["mount_s"] + ck["read"]["seconds"]))
        log(f"{kind}: restore round {rep + 1}: ckptfs / baseline {one['ratio']:.2f} "
            f"(incl. the mount {one['ratio_incl_mount']:.2f})")
        rounds.append(one)
    ratios = [r["ratio"] for r in rounds]
    mid = sorted(range(len(rounds)), key=lambda i: ratios[i])[len(rounds) // 2]
    result: dict[str, Any] = {"store": kind, "bytes": total, "files": len(names),
                              "populate_s": populate_s, "restore_rounds": rounds,
                              "restore_ratios": ratios,
                              "restore_ratios_incl_mount": [r["ratio_incl_mount"]
                                                            for r in rounds],
                              "baseline": rounds[mid]["baseline"],
                              "ckptfs_fresh": rounds[mid]["ckptfs"]}
    if nulls is not None:
        # 2. the second read, through one more fresh mount once it has read everything
        if not (local / names[0]).exists():
            store.baseline_fetch(names, local)
        restore_ckptfs(store, names, total, extra, then=lambda m, paths: result.update(
            second_read=second_read(m, paths, local, names, reps, nulls)))
    shutil.rmtree(local, ignore_errors=True)
    return result


def evict_fuse_cache(paths: list[Path]) -> None:
    """Drop the kernel's page cache of files on a FUSE mount (POSIX_FADV_DONTNEED on the FUSE
    inode): the next read goes to the daemon, whose own files stay in the page cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def second_read(m: CkptfsMount, paths: list[Path], local: Path, names: list[str],
                reps: int, nulls: dict[str, Any]) -> dict[str, Any]:
    """The same bytes again: ckptfs (now local) vs a plain dir vs the nullfs ceilings.

    The kernel keeps a FUSE file's page cache across opens here (a second ``open`` + read of
    an unchanged nullfs file sends no READ to the daemon), so a plain second read measures the
    kernel, not the filesystem. Three cases:
      cached  the FUSE page cache is warm (what a second read right after the first gets)
      daemon  the FUSE page cache is evicted (fadvise DONTNEED) before every read, the
              daemons' files and the plain dir stay cached: every byte goes through the daemon
      cold    the whole page cache is dropped before each configuration (disk-bound)
    """
    configs: dict[str, tuple[list[Path], int | None]] = {
        "plain": ([local / n for n in names], None),
        "nullfs": ([nulls["nullfs"].path / n for n in names], nulls["nullfs"].pid),
        "nullfs-pread": ([nulls["nullfs-pread"].path / n for n in names],
                         nulls["nullfs-pread"].pid),
        "ckptfs": (paths, m.pid),
    }
    cold: dict[str, Any] = {}
    for name in ("plain", "nullfs-pread", "ckptfs"):
        drop_caches()
        files, pid = configs[name]
        cold[name] = asdict(read_all(files, pid))
    order = list(configs)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        case: {name: [] for name in configs} for case in ("cached", "daemon")}
    leaked = {"nullfs": 0, "nullfs-pread": 0}  # READs that reached nullfs in timed cached reads
    for rep in range(reps):
        for name in order[rep % len(order):] + order[:rep % len(order)]:
            files, pid = configs[name]
            # The kernel drops a FUSE file's pages when it refreshes its attributes (after the
            # 10 s attribute timeout; measured on nullfs): the timed read follows its warm-up.
            read_all(files, pid)
            before = _nullfs_reads(nulls[name].path) if name in leaked else 0
            runs["cached"][name].append(asdict(read_all(files, pid)))
            if name in leaked:
                leaked[name] += _nullfs_reads(nulls[name].path) - before
    for name, (files, pid) in configs.items():
        read_all(files, pid)  # untimed: the daemons' files and the plain dir in the page cache
    reads1b = {k: _nullfs_reads(nulls[k].path) for k in ("nullfs", "nullfs-pread")}
    for rep in range(reps):
        for name in order[rep % len(order):] + order[:rep % len(order)]:
            files, pid = configs[name]
            if name != "plain":
                evict_fuse_cache(files)
            runs["daemon"][name].append(asdict(read_all(files, pid)))
    reads2 = {k: _nullfs_reads(nulls[k].path) for k in ("nullfs", "nullfs-pread")}
    total = runs["cached"]["plain"][0]["bytes"]
    medians = {case: {name: statistics.median(r["seconds"] for r in rs)
                      for name, rs in by_name.items()} for case, by_name in runs.items()}
    for case, med in medians.items():
        log(f"second read, {case}, MB/s: " + ", ".join(f"{n} {total / s / 1e6:.0f}"
                                                       for n, s in med.items()))
    return {"cold": cold, "runs": runs, "median_s": medians,
            "nullfs_read_requests": {
                # READs that reached nullfs during the timed cached reads (0: every cached
                # read was answered by the kernel) and the timed daemon reads
                "cached": leaked,
                "daemon": {k: reads2[k] - reads1b[k] for k in leaked},
                "daemon_mean_bytes": {k: (total * reps / (reads2[k] - reads1b[k])
                                          if reads2[k] > reads1b[k] else None) for k in leaked}}}


def _nullfs_reads(mnt: Path) -> int:
    stats = json.loads(os.getxattr(mnt, "user.nullfs.stats"))
    return int(stats.get("ops", {}).get("read", 0))


def setup_nullfs(stack: ExitStack, work: Path, names: list[str], size: int,
                 block: bytes) -> dict[str, Any]:
    """Two nullfs mounts holding files of the checkpoint's names and sizes."""
    null = stack.enter_context(nullfs_mount(work, "nullfs"))
    for n in names:
        os.close(os.open(null.path / n, os.O_WRONLY | os.O_CREAT, 0o644))
        os.truncate(null.path / n, size)  # reads answer zeros
    backing = work / "nullfs-pread-backing"
    backing.mkdir()
    pread = stack.enter_context(nullfs_mount(work, "nullfs-pread", "--backing-dir",
                                             str(backing)))
    for n in names:
        write_file(pread.path / n, size, block)
    return {"nullfs": null, "nullfs-pread": pread}


# -- the table ------------------------------------------------------------------------------


def summarize(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    total: int = r["bytes"]
    store = "S3 (SeaweedFS)" if r["store"] == "s3" else "file"

    def mbs(s: float) -> float:
        return total / s / 1e6

    b, f = r["baseline"], r["ckptfs_fresh"]
    fresh_s, mount_s = f["read"]["seconds"], f["mount_s"]
    rows = [
        (f"restore MB/s: {b['how']} + read / ckptfs fresh mount (read; incl. mount)",
         (f"{mbs(b['total_s']):.0f} ({b['fetch_s']:.1f} + {b['read']['seconds']:.1f} s) / "
          f"{mbs(fresh_s):.0f}; {mbs(fresh_s + mount_s):.0f}"), ""),
        ("restore throughput ckptfs / baseline (read only; incl. mount)",
         f"**{b['total_s'] / fresh_s:.2f}**; {b['total_s'] / (fresh_s + mount_s):.2f}",
         "≥ 1.0" if r["store"] == "s3" else "≥ 0.8"),
        ((f"restore ckptfs / baseline, each of {len(r['restore_ratios'])} alternating rounds "
         "(read only; incl. mount)"),
         ", ".join(f"{x:.2f}" for x in r["restore_ratios"]) + "; "
         + ", ".join(f"{x:.2f}" for x in r["restore_ratios_incl_mount"]), ""),
        (("restore: ckptfs mount ready s (`ckptfs mount` start to the mount answering), "
         "median round; each round"),
         f"{mount_s:.2f}; " + ", ".join(f"{x['ckptfs']['mount_s']:.2f}"
                                        for x in r["restore_rounds"]), ""),
    ]
    fetch = f.get("fetch") or {}
    if fetch.get("bytes") is not None:
        rows.append((("restore: fetched / file bytes, read() calls > 0.1 s (slowest), "
                      "daemon CPU s, peak RSS MB"),
                     (f"{fetch['bytes'] / total:.2f}, {f['read']['stalls']} "
                      f"({f['read']['slowest_call_s']:.2f} s), {f['read']['daemon_cpu_s']:.1f}, "
                      f"{f['daemon_peak_rss'] / 1e6:.0f}"), ""))
    if set(f["states_after"]) != {"committed"}:
        rows.append(("restore: states after the read", ", ".join(sorted(set(f["states_after"]))),
                     "!"))
    if f["read"]["bytes"] != total:
        rows.append(("restore: bytes read != bytes stored", f"{f['read']['bytes']} != {total}",
                     "!"))
    if "second_read" not in r:
        return [(f"{store}: {m}", v, t) for m, v, t in rows]
    s = r["second_read"]
    names = ("plain", "nullfs", "nullfs-pread", "ckptfs")
    for case, label in (("cached", "FUSE page cache warm"),
                        ("daemon", "FUSE page cache evicted, every byte via the daemon")):
        med = s["median_s"][case]
        leaked = s["nullfs_read_requests"]["cached"]["nullfs"] if case == "cached" else 0
        if leaked:  # the kernel dropped the pages anyway: this is not the cached case
            label += f" (NOT cached: {leaked} READs reached nullfs)"
        rows += [
            (f"second read, {label}, MB/s: plain / nullfs / nullfs-pread / ckptfs",
             " / ".join(f"{mbs(med[n]):.0f}" for n in names), ""),
            (f"second read, {case}: ckptfs / plain; FUSE read ceiling nullfs / plain",
             f"{med['plain'] / med['ckptfs']:.2f}; {med['plain'] / med['nullfs']:.2f}", ""),
            (f"second read, {case}: ckptfs / nullfs (of the ceiling); ckptfs / nullfs-pread",
             f"**{med['nullfs'] / med['ckptfs']:.2f}**; {med['nullfs-pread'] / med['ckptfs']:.2f}",
             "≥ 0.9"),
        ]
    req = s["nullfs_read_requests"]
    mean = req["daemon_mean_bytes"]["nullfs"]
    rows += [
        (("second read, daemon: daemon CPU s per GiB, nullfs / nullfs-pread / ckptfs; "
          "READ request size seen by nullfs"),
         " / ".join(f"{_median_cpu(s['runs']['daemon'][n]) / (total / 2**30):.2f}"
                    for n in ("nullfs", "nullfs-pread", "ckptfs"))
         + (f"; {mean / 1024:.0f} KiB" if mean else ""), ""),
        ("second read, cold (page cache dropped), MB/s: plain / nullfs-pread / ckptfs",
         " / ".join(f"{mbs(s['cold'][n]['seconds']):.0f}"
                    for n in ("plain", "nullfs-pread", "ckptfs"))
         + f"; ckptfs / plain {s['cold']['plain']['seconds'] / s['cold']['ckptfs']['seconds']:.2f}",
         ""),
    ]
    return [(f"{store}: {m}", v, t) for m, v, t in rows]


def _median_cpu(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["daemon_cpu_s"] or 0.0 for r in runs)


def run(b: Bench) -> dict[str, Any]:
    o = b.opts
    DROPPED["skip"] = o.q7_no_drop_caches or b.quick
    work = b.dir("q7")
    stores = ["s3", "file"] if o.q7_store == "both" else [o.q7_store]
    size = o.q7_mib * MiB // o.q7_files
    names = [f"shard_{i:02d}.distcp" for i in range(o.q7_files)]
    block = os.urandom(MiB)
    log(f"Q7: {o.q7_files} x {size / MiB:.0f} MiB; stores {', '.join(stores)}")
    results: dict[str, Any] = {}
    errors: list[str] = []
    summary: list[tuple[str, str, str]] = []
    with ExitStack() as stack:
        nulls = None if o.q7_restore_only else setup_nullfs(stack, work, names, size, block)
        for kind in stores:
            store = Store(kind, work)
            # --quick: the second read (the same code for either store) for the last only
            second = None if b.quick and kind != stores[-1] else nulls
            try:
                if kind == "s3":
                    store.s3 = b.s3
                    store.bucket = store.s3.new_bucket("restore")
                results[kind] = run_store(store, names, size, block, o.q7_ckptfs_config,
                                          o.q7_reps, o.q7_restore_reps, second)
                summary += summarize(results[kind])
            except Exception:  # noqa: BLE001 (one failed store must not hide the other)
                import traceback

                traceback.print_exc()
                results[kind] = {"error": traceback.format_exc()}
                errors.append(f"{kind}: {traceback.format_exc().strip().splitlines()[-1]}")
                summary.append((f"{kind}: FAILED", errors[-1][:160].replace("|", "/"), ""))
            finally:
                if store.s3 is not None and store.bucket:
                    try:
                        store.s3.empty_bucket(store.bucket)
                    except Exception as exc:  # noqa: BLE001 (the server may be what failed)
                        log(f"could not empty the bucket: {exc}")
                shutil.rmtree(store.store_dir, ignore_errors=True)
    dropped = bool(DROPPED["ok"])
    summary.append(("page cache dropped before each restore side and cold read",
                    "yes" if dropped else "NO: the restore and cold figures are not cold", ""))
    return {"title": TITLE, "stores": results, "files": o.q7_files, "bytes": size * o.q7_files,
            "reps": o.q7_reps, "page_cache_dropped": dropped, "errors": errors,
            "summary": summary}


def plot(ax: Any, r: dict[str, Any]) -> None:
    labels, base, ck = [], [], []
    with_mount: list[tuple[int, float]] = []
    for kind, s in r["stores"].items():
        if "error" in s:
            continue
        total = s["bytes"]
        labels.append(f"{kind}\nrestore")
        base.append(total / s["baseline"]["total_s"] / 1e6)
        fresh = s["ckptfs_fresh"]
        ck.append(total / fresh["read"]["seconds"] / 1e6)
        with_mount.append((len(labels) - 1,
                           total / (fresh["read"]["seconds"] + fresh["mount_s"]) / 1e6))
        if "second_read" not in s:
            continue
        med = s["second_read"]["median_s"]["daemon"]
        labels.append(f"{kind}\n2nd read (daemon)")
        base.append(total / med["nullfs"] / 1e6)
        ck.append(total / med["ckptfs"] / 1e6)
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], base, 0.4, label="baseline / nullfs ceiling")
    ax.bar([x + 0.2 for x in xs], ck, 0.4, label="ckptfs (read only)")
    # The restore with the mount's time (from `ckptfs mount` to ready): a black tick on the bar
    ax.scatter([x + 0.2 for x, _ in with_mount], [v for _, v in with_mount], marker="_",
               s=300, color="k", zorder=3, label="ckptfs incl. mount")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("MB/s")
    ax.set_title(f"Q7 restore and second read, {r['bytes'] / MiB:.0f} MiB", fontsize=9)
    ax.legend(fontsize=7)
