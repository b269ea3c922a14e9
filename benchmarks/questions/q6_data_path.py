"""Q6, the node data path (FUSE passthrough, docs/PASSTHROUGH.md): how fast does one node
write and read its checkpoints?

R ranks (threads started together) each write a file in 8 MiB ``write(2)`` calls and close it,
then read it back in 8 MiB ``read(2)`` calls, in each place of ``--q6-places``:

  tmpfs  /dev/shm (standing in for NVMe: the plain directory and ckptfs's staging both there)
  disk   the local disk (``--workdir``; page cache, no fsync)

and, in each place, through

  plain      the directory itself
  ckptfs     a ckptfs mount with ``passthrough = "off"`` (the stock path: write_direct_io
             writes, cached reads, every byte through the Python daemon)
  ckptfs-pt  a ckptfs mount with ``passthrough = "on"``: the kernel serves reads and writes of
             wholly local files from the staging file (needs the pyfuse3 built by
             scripts/build_passthrough_fuse.sh in /opt/ckptfs-fuse/python, kernel 6.9+ and
             CAP_SYS_ADMIN; without them the cells say why, the rest of the question runs)
  stock, passthrough  with ``--q6-demo``: tests/passthrough_fs.py, a do-nothing mirror of a
             directory in stock mode and in passthrough mode (what FUSE itself allows, with
             no ckptfs logic)

The ckptfs mounts' warm tier (a directory in the same place) is held down
(``faults.down_file``) while the data path is measured, and each read-back waits until the
upload of the files just written was tried twice (each try reads the files for its checksums,
which on a 2-core machine would compete with the read being timed; ``--q6-no-settle`` reads at
once): this is what training blocks on, not the upload (Q3). Each cell is the best of ``--q6-repeat`` rounds; a round runs
every mode in turn (the order rotates), files deleted and sync(2) called (untimed) in between. Ratios are time / plain time.

Also, in the first place only:

- ``torch.save`` of a ``--q6-torch-mib`` (1 GiB) transformer-like state dict by one writer:
  plain vs ckptfs-pt vs ckptfs (best of the rounds);
- the fault-in read: a checkpoint of ``--q6-fault-mib`` in R files is written through ckptfs,
  synced to the store, and read by a **fresh node** (a new mount, empty staging dir), R readers
  in 8 MiB calls, with ``passthrough`` off and on (a file not wholly local is served by the
  daemon either way: the two must match; "no regression of the fault-in path"), against
  ``shutil.copyfile`` out of the store plus a read of the copies.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from questions.common import (
    REPO,
    Bench,
    CkptfsMount,
    MiB,
    ckptfs_config,
    ckptfs_mount,
    control,
    log,
    make_state_dict,
    process_cpu,
    state_dict_bytes,
    sync_disk,
    torch_save,
    wait_daemon_idle,
)

TITLE = "Q6 node data path: plain vs ckptfs passthrough vs ckptfs without"
BLOCK = 8 * MiB
CKPTFS_MODES = ("ckptfs", "ckptfs-pt")
DEMO_MODES = ("stock", "passthrough")
PREFIX = Path(os.environ.get("CKPTFS_FUSE_PREFIX", "/opt/ckptfs-fuse"))
TARGET = "≤ 1.1x"


def _demo() -> Any:
    """tests/passthrough_fs.py (the demo filesystem), imported from the repository root."""
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))
    import tests.passthrough_fs as demo

    return demo


def passthrough_missing() -> str:
    """Why ckptfs-pt cannot run here ("" when it can try)."""
    if not (PREFIX / "python" / "pyfuse3").exists():
        return (f"passthrough unavailable: {PREFIX}/python missing "
                "(scripts/build_passthrough_fuse.sh not built)")
    return ""


def status(mnt: Path) -> dict[str, Any]:
    """What ``ckptfs status --json`` prints for the mount (from this process: the settler
    polls it)."""
    info: dict[str, Any] = control().status(mnt)
    return info


@contextmanager
def data_mount(base: Path, name: str, passthrough: str) -> Iterator[CkptfsMount]:
    """A ckptfs mount over ``base`` whose warm tier (a directory beside it) is held down once
    mounted (the mount itself checks the store)."""
    down = base / f"{name}-down"
    down.unlink(missing_ok=True)
    cfg = ckptfs_config(base / f"{name}-staging", store_dir=base / f"{name}-store",
                        # Registered at mount: with the store held down, a node that
                        # registers at its first change would wait for the store there.
                        extra=f'passthrough = "{passthrough}"\nlog_level = "warning"\n'
                              'register_at_mount = true',
                        faults=f'down_file = "{down}"')
    (base / f"{name}-store").mkdir(parents=True, exist_ok=True)
    with ckptfs_mount(base, name, cfg) as m:
        down.touch()
        try:
            yield m
        finally:
            down.unlink(missing_ok=True)


def settler(mnt: Path, files: int) -> Callable[[], None]:
    """Wait until the upload of the files just closed has been tried twice (and failed: the
    store is down): each try's checksum pass reads every file once; after the second failure
    the next try is 1-3 s away (the uploader's backoff)."""
    seen = [status(mnt)["retries"]]

    def settle() -> None:
        deadline = time.monotonic() + 60
        while ((now := status(mnt)["retries"]) < seen[0] + 2 * files
               and time.monotonic() < deadline):
            time.sleep(0.05)
        seen[0] = now
    return settle


def ranks_at_once(n: int, fn: Callable[[int], Any]) -> float:
    """Run fn(rank) in n threads released together; seconds until the last one finished."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(n + 1)

    def run(rank: int) -> None:
        barrier.wait()
        try:
            fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def write_blocks(path: Path, size: int, block: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left:
            left -= os.write(fd, block[: min(BLOCK, left)])
    finally:
        os.close(fd)


def read_blocks(path: Path, size: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while chunk := os.read(fd, BLOCK):
            got += len(chunk)
    finally:
        os.close(fd)
    if got != size:
        raise RuntimeError(f"{path}: read {got} bytes, expected {size}")


def _cpu(pid: int | None) -> float:
    return sum(process_cpu(pid)) if pid else 0.0


def write_read(where: Path, ranks: int, size: int, block: bytes,
               settle: Callable[[], None] | None, pid: int | None = None) -> dict[str, float]:
    """Seconds to write, then to read back; the daemon's CPU seconds during each (pid)."""
    files = [where / f"rank{r}.bin" for r in range(ranks)]
    try:
        c0 = _cpu(pid)
        write = ranks_at_once(ranks, lambda r: write_blocks(files[r], size, block))
        c1 = _cpu(pid)
        if settle is not None:
            settle()
        c2 = _cpu(pid)
        read = ranks_at_once(ranks, lambda r: read_blocks(files[r], size))
        c3 = _cpu(pid)
        return {"write": write, "read": read, "daemon_cpu_write": c1 - c0,
                "daemon_cpu_read": c3 - c2}
    finally:
        for f in files:
            f.unlink(missing_ok=True)


def _requests(mode: str, path: Path) -> dict[str, Any]:
    try:
        if mode in DEMO_MODES:
            return dict(_demo().stats(path))
        return dict(status(path)["passthrough"])
    except Exception as exc:  # noqa: BLE001 (a counter is nice to have)
        return {"error": str(exc)}


def place_dirs(b: Bench) -> dict[str, Path]:
    return {"tmpfs": Path("/dev/shm"), "disk": b.opts.q6_disk_dir or b.work}


def run_place(b: Bench, place: str, root: Path, mib: int, block: bytes,
              first: bool, pt_missing: str) -> dict[str, Any]:
    o = b.opts
    size = mib * MiB
    modes = ["plain", *CKPTFS_MODES, *(DEMO_MODES if o.q6_demo else ())]
    need = max(o.q6_ranks) * size * (2 if first else 1) + (o.q6_torch_mib * MiB if first else 0)
    free = shutil.disk_usage(root).free
    if free < need * 1.2:
        raise RuntimeError(f"{root}: {free / 2**30:.1f} GiB free, this place needs "
                           f"{need * 1.2 / 2**30:.1f} GiB (lower --q6-mib)")
    base = Path(tempfile.mkdtemp(prefix="q6-", dir=root))
    out: dict[str, Any] = {"root": str(root), "base": str(base), "mib_per_rank": mib,
                           "unavailable": {},
                           "seconds": {}, "requests": {}}
    try:
        with ExitStack() as stack:
            where: dict[str, Path] = {"plain": base / "plain"}
            where["plain"].mkdir()
            pids: dict[str, int] = {}
            for mode in modes[1:]:
                if mode in ("ckptfs-pt", "passthrough") and pt_missing:
                    out["unavailable"][mode] = pt_missing
                    continue
                try:
                    if mode in CKPTFS_MODES:
                        m = stack.enter_context(data_mount(
                            base, f"{place}-{mode}", "on" if mode == "ckptfs-pt" else "off"))
                        where[mode], pids[mode] = m.path, m.pid
                        pt = status(m.path)["passthrough"]
                        if mode == "ckptfs-pt" and not pt.get("active"):
                            out["unavailable"][mode] = f"passthrough not active: {pt.get('reason')}"
                    else:
                        src = base / f"demo-{mode}-src"
                        src.mkdir()
                        where[mode] = base / f"demo-{mode}-mnt"
                        proc = stack.enter_context(_demo().demo_mount(src, where[mode],
                                                                      mode))
                        pids[mode] = proc.pid
                except Exception as exc:  # noqa: BLE001 (the cell says why, the rest runs)
                    reason = str(exc).strip().splitlines()
                    out["unavailable"][mode] = (reason[-1] if reason else repr(exc))[:200]
                    log(f"Q6 {place}: {mode} unavailable: {out['unavailable'][mode]}")
                    where.pop(mode, None)
            active = [m for m in modes if m in where]
            rounds: list[dict[str, Any]] = []
            out["rounds"] = rounds
            for ranks in o.q6_ranks:
                settle = {m: settler(where[m], ranks) for m in active
                          if m in CKPTFS_MODES and not o.q6_no_settle}
                best = {m: {"write": float("inf"), "read": float("inf")} for m in active}
                for rep in range(o.q6_repeat):
                    order = active[rep % len(active):] + active[:rep % len(active)]
                    for mode in order:
                        # No dirty pages of the previous round (the disk place's writeback
                        # would otherwise slow whichever mode comes next): untimed.
                        sync_disk()
                        t = write_read(where[mode], ranks, size, block, settle.get(mode),
                                       pids.get(mode))
                        log(f"Q6 {place} {ranks} ranks x {mib} MiB, round {rep}, {mode:>11}: "
                            f"write {t['write']:.3f} s, read {t['read']:.3f} s"
                            + (f" (daemon CPU {t['daemon_cpu_write']:.2f} / "
                               f"{t['daemon_cpu_read']:.2f} s)" if mode in pids else ""))
                        for op in ("write", "read"):
                            best[mode][op] = min(best[mode][op], t[op])
                        rounds.append({"ranks": ranks, "round": rep, "mode": mode, **t})
                out["seconds"][str(ranks)] = best
            for mode in active[1:]:
                out["requests"][mode] = _requests(mode, where[mode])
            if first:
                out["torch_save"] = torch_rounds(b, where, pids)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if first:
        out["fault_in"] = fault_in(b, root, pt_missing or out["unavailable"].get("ckptfs-pt", ""))
    return out


def torch_rounds(b: Bench, where: dict[str, Path], pids: dict[str, int]) -> dict[str, Any]:
    o = b.opts
    sd = make_state_dict(o.q6_torch_mib * MiB)
    nbytes = state_dict_bytes(sd)
    modes = [m for m in ("plain", "ckptfs-pt", "ckptfs") if m in where]
    best = {m: float("inf") for m in modes}
    for rep in range(o.q6_repeat):
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            path = where[mode] / "q6.pt"
            if mode in pids:
                wait_daemon_idle(pids[mode], max_wait=20.0)
            t, _ = torch_save(path, sd)
            path.unlink()
            if mode in pids:
                wait_daemon_idle(pids[mode], max_wait=20.0)
            best[mode] = min(best[mode], t)
            log(f"Q6 torch.save {nbytes / MiB:.0f} MiB, round {rep}, {mode:>9}: {t:.3f} s")
    del sd
    return {"bytes": nbytes, "seconds": best}


def fault_in(b: Bench, root: Path, pt_missing: str) -> dict[str, Any]:
    """A fresh node reads a checkpoint from the store: copyfile + read vs ckptfs, passthrough
    off and on (both fault in through the daemon)."""
    o = b.opts
    ranks = max(o.q6_ranks)
    size = o.q6_fault_mib * MiB // ranks
    names = [f"shard_{r}.distcp" for r in range(ranks)]
    base = Path(tempfile.mkdtemp(prefix="q6-fi-", dir=root))
    store = base / "store"
    block = os.urandom(BLOCK)
    best: dict[str, dict[str, float]] = {}
    fetched: dict[str, Any] = {}
    try:
        store.mkdir()
        with ckptfs_mount(base, "w", ckptfs_config(base / "w-staging", store_dir=store)) as m:
            for n in names:
                write_blocks(m.path / n, size, block)
            m.sync()
        shutil.rmtree(base / "w-staging", ignore_errors=True)  # the writing node is gone
        modes = ["plain", "ckptfs"] + ([] if pt_missing else ["ckptfs-pt"])
        local = base / "copy"
        for rep in range(o.q6_repeat):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                sync_disk()
                if mode == "plain":
                    local.mkdir()
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(ranks) as pool:
                        list(pool.map(lambda n: shutil.copyfile(store / n, local / n), names))
                    ranks_at_once(ranks, lambda r: read_blocks(local / names[r], size))
                    t = {"mount": 0.0, "read": time.perf_counter() - t0}
                    shutil.rmtree(local)
                else:
                    staging = base / f"{mode}-staging"
                    shutil.rmtree(staging, ignore_errors=True)
                    cfg = ckptfs_config(staging, store_dir=store, extra=(
                        f'passthrough = "{"on" if mode == "ckptfs-pt" else "off"}"\n'
                        'log_level = "warning"'))
                    t0 = time.perf_counter()
                    with ckptfs_mount(base, mode, cfg) as m:
                        t_mount = time.perf_counter() - t0
                        t_read = ranks_at_once(ranks, lambda r: read_blocks(m.path / names[r],
                                                                            size))
                        st = status(m.path)
                        fetched[mode] = {"fetch": st.get("fetch"),
                                         "passthrough": st.get("passthrough")}
                    shutil.rmtree(staging, ignore_errors=True)
                    t = {"mount": t_mount, "read": t_read}
                log(f"Q6 fault-in {ranks} x {size / MiB:.0f} MiB, round {rep}, {mode:>9}: "
                    f"read {t['read']:.3f} s (mount {t['mount']:.2f} s)")
                if mode not in best or t["read"] < best[mode]["read"]:
                    best[mode] = t
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"base": str(base), "files": ranks, "bytes": ranks * size, "seconds": best,
            "status": fetched,
            "unavailable": pt_missing}


def run(b: Bench) -> dict[str, Any]:
    o = b.opts
    pt_missing = passthrough_missing()
    if pt_missing:
        log(f"Q6: {pt_missing}")
    block = os.urandom(BLOCK)
    dirs = place_dirs(b)
    places: dict[str, Any] = {}
    errors: list[str] = []
    for i, place in enumerate(o.q6_places):
        mib = o.q6_mib if place == "tmpfs" else o.q6_disk_mib
        try:
            places[place] = run_place(b, place, dirs[place], mib, block, i == 0, pt_missing)
        except Exception as exc:  # noqa: BLE001 (one place failing must not lose the other)
            import traceback

            traceback.print_exc()
            places[place] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            errors.append(f"{place}: {places[place]['error']}")
    return {"title": TITLE, "places": places, "ranks": o.q6_ranks, "repeat": o.q6_repeat,
            "settle": not o.q6_no_settle,
            "block": BLOCK, "passthrough_missing": pt_missing, "errors": errors,
            "summary": summarize(places, o)}


def _cell(t: float | None, nbytes: int) -> str:
    return "-" if t is None else f"{t:.3f} s ({nbytes / t / 2**30:.2f} GiB/s)"


def _ratio(t: float, plain: float, bold: bool) -> str:
    text = f"{t / plain:.2f}x"
    return f"**{text}**" if bold else text


def summarize(places: dict[str, Any], o: Any) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    for place, p in places.items():
        if "error" in p:
            rows.append((f"{place}: FAILED", p["error"].replace("|", "/"), ""))
            continue
        for mode, why in p["unavailable"].items():
            rows.append((f"{place}: {mode}", f"not measured: {why.replace('|', '/')}", ""))
        size = p["mib_per_rank"] * MiB
        for ranks, best in p["seconds"].items():
            modes = list(best)
            others = [m for m in modes if m != "plain"]
            for op in ("write", "read"):
                nbytes = int(ranks) * size
                what = "write" if op == "write" else "read back"
                label = f"{place}, {ranks} ranks x {p['mib_per_rank']} MiB, {what}: "
                rows.append((label + " / ".join(modes),
                             " / ".join(_cell(best[m][op], nbytes) for m in modes), ""))
                ratios = "; ".join(_ratio(best[m][op], best["plain"][op], m == "ckptfs-pt")
                                   for m in others)
                target = (f"ckptfs-pt {TARGET}" if place == "tmpfs" and int(ranks) == 4
                          and "ckptfs-pt" in others else "")
                label = f"{place}, {ranks} ranks, {what}: time / plain, "
                rows.append((label + "; ".join(others), ratios, target))
        for ranks in p["seconds"]:
            cpu = {}
            for m in ("ckptfs", "ckptfs-pt", *DEMO_MODES):
                rs = [r for r in p.get("rounds", []) if r["mode"] == m and r["ranks"] == int(ranks)]
                if rs:
                    cpu[m] = (statistics.median(r["daemon_cpu_write"] for r in rs),
                              statistics.median(r["daemon_cpu_read"] for r in rs))
            if cpu:
                label = f"{place}, {ranks} ranks: daemon CPU s during write / read back (median), "
                rows.append((label + "; ".join(cpu),
                             "; ".join(f"{w:.2f} / {r:.2f}" for w, r in cpu.values()), ""))
        reqs = p["requests"].get("ckptfs-pt", {}).get("requests")
        if reqs is not None:
            rows.append((f"{place}: READ / WRITE requests that reached the ckptfs-pt daemon",
                         f"{reqs.get('read')} / {reqs.get('write')}", "0 / 0"))
        ts = p.get("torch_save")
        if ts:
            best = ts["seconds"]
            modes = list(best)
            others = [m for m in modes if m != "plain"]
            label = f"{place}: torch.save {ts['bytes'] / MiB:.0f} MiB, one writer: "
            rows.append((label + " / ".join(modes),
                         " / ".join(_cell(best[m], ts["bytes"]) for m in modes), ""))
            rows.append((f"{place}: torch.save time / plain, " + "; ".join(others),
                         "; ".join(_ratio(best[m], best["plain"], m == "ckptfs-pt")
                                   for m in others),
                         f"ckptfs-pt {TARGET}" if "ckptfs-pt" in best else ""))
        fi = p.get("fault_in")
        if fi:
            best = fi["seconds"]
            others = [m for m in best if m != "plain"]
            label = (f"{place}: fault-in, fresh node, {fi['files']} files, "
                     f"{fi['bytes'] / MiB:.0f} MiB, read (mount apart): copyfile + read / ")
            rows.append((label + " / ".join(others),
                         " / ".join(_cell(best[m]["read"], fi["bytes"]) for m in best), ""))
            if "ckptfs-pt" in best and "ckptfs" in best:
                rows.append((f"{place}: fault-in, ckptfs-pt / ckptfs time (no regression)",
                             _ratio(best["ckptfs-pt"]["read"], best["ckptfs"]["read"], True),
                             "≈ 1.0"))
            elif fi["unavailable"]:
                rows.append((f"{place}: fault-in, ckptfs-pt", "not measured", ""))
    return rows


def plot(ax: Any, r: dict[str, Any]) -> None:
    labels: list[str] = []
    cells: list[dict[str, float]] = []
    for place, p in r["places"].items():
        for ranks, best in p.get("seconds", {}).items():
            for op in ("write", "read"):
                labels.append(f"{place}\n{ranks}r {op}")
                cells.append({m: best[m][op] / best["plain"][op] for m in best if m != "plain"})
    modes = list(dict.fromkeys(m for c in cells for m in c))
    width = 0.8 / max(1, len(modes))
    for i, m in enumerate(modes):
        ax.bar([j + (i - (len(modes) - 1) / 2) * width for j in range(len(labels))],
               [c.get(m, 0.0) for c in cells], width, label=m)
    ax.axhline(1.1, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=6)
    ax.set_ylabel("time / plain (1.0 = plain speed)")
    ax.set_title(f"Q6 node data path, best of {r['repeat']}", fontsize=9)
    ax.legend(fontsize=7)
