"""FUSE passthrough vs the stock FUSE data path (issue 16), side by side in one run.

R ranks (threads, 8 MiB requests) each write a file of SIZE and close it, then read it back, in
these places, all on the same filesystem:

  plain        the directory itself (tmpfs, or the local disk with ``--disk``)
  stock        tests/passthrough_fs.py --mode stock: the stock pyfuse3, every READ/WRITE through
               the Python daemon (no writeback cache, no keep_cache)
  passthrough  tests/passthrough_fs.py --mode passthrough: the pyfuse3 built by
               scripts/build_passthrough_fuse.sh; the kernel serves I/O from the backing file
  ckptfs       ckptfs itself, ``passthrough = off`` (the stock path: write_direct_io writes,
               cached reads through the daemon), staging on the same filesystem
  ckptfs-pt    ckptfs with ``passthrough = on``

``--modes`` picks some (default: all five). The ckptfs mounts' warm tier is held "down"
(``faults.down_file``) while they are measured, and the read-back waits until the upload of the
files just written was tried (its checksum pass reads them; ``--no-settle`` reads at once):
this is the node's data path (training blocks on it); benchmarks/upload.py measures uploads.

Each cell is the best of ``--repeat`` rounds; a round runs plain, stock and passthrough in turn
(files deleted in between), so drift in the machine's load hits all three alike; ratios are time / plain
time (1.00x = plain speed). Read-back on plain and passthrough hits the page cache of the backing
file (on tmpfs that is the storage); the demo counts the requests that reached it, printed last.

    python benchmarks/passthrough.py                     # 1 and 4 ranks, 1 GiB each, tmpfs
    python benchmarks/passthrough.py --disk /var/tmp --size-mib 512 --ranks 4
    python benchmarks/passthrough.py --out benchmarks/results/passthrough.json
    python benchmarks/passthrough.py --modes plain ckptfs ckptfs-pt --size-mib 256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.passthrough_fs import build, demo_mount, stats

BLOCK = 8 << 20
MODES = ("plain", "stock", "passthrough", "ckptfs", "ckptfs-pt")
LABELS = {"plain": "plain", "stock": "stock FUSE", "passthrough": "passthrough",
          "ckptfs": "ckptfs", "ckptfs-pt": "ckptfs passthrough"}
CKPTFS = [sys.executable, "-m", "ckptfs"]


@contextlib.contextmanager
def ckptfs_mount(base: Path, mnt: Path, passthrough: str) -> Iterator[Path]:
    """A ckptfs mount whose staging is ``base``/staging, its store held down meanwhile."""
    staging, store, down = base / "staging", base / "store", base / "store-down"
    for d in (mnt, store):
        d.mkdir(parents=True, exist_ok=True)
    down.unlink(missing_ok=True)  # up for the mount's own check, down once mounted
    config = base / "ckptfs.toml"
    config.write_text(f'passthrough = "{passthrough}"\nlog_level = "warning"\n\n'
                      '[[tier]]\nname = "hot"\n\n[[tier]]\nname = "warm"\n'
                      f'url = "file://{store}"\n\n[tier.faults]\ndown_file = "{down}"\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([*CKPTFS, "mount", str(mnt), "--staging", str(staging),
                           "--config", str(config)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise SystemExit(f"ckptfs mount failed:\n{done.stdout}{done.stderr}")
    down.touch()
    try:
        yield mnt
    finally:
        down.unlink(missing_ok=True)
        subprocess.run([*CKPTFS, "umount", str(mnt), "--no-wait"], capture_output=True,
                       env=env, cwd=REPO, timeout=120, check=False)
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)


def ckptfs_settle(mnt: Path, files: int) -> Callable[[], None]:
    """Wait until the upload of the files just closed has been tried twice (and failed: the
    store is down): each attempt's checksum pass reads every file once, and on a small
    machine that would compete with the read-back being measured; after the second failure
    the next attempt is 1-3 s away (upload.py's backoff)."""
    def status() -> dict[str, Any]:
        done = subprocess.run([*CKPTFS, "status", str(mnt), "--json"], capture_output=True,
                              text=True, cwd=REPO, check=True)
        info: dict[str, Any] = json.loads(done.stdout)
        return info

    seen = [status()["retries"]]

    def settle() -> None:
        deadline = time.monotonic() + 60
        while (now := status()["retries"]) < seen[0] + 2 * files and time.monotonic() < deadline:
            time.sleep(0.05)
        seen[0] = now
    return settle


def ckptfs_requests(mnt: Path) -> dict[str, Any]:
    done = subprocess.run([*CKPTFS, "status", str(mnt), "--json"], capture_output=True,
                          text=True, cwd=REPO, check=False)
    try:
        info: dict[str, Any] = json.loads(done.stdout)["passthrough"]
    except (ValueError, KeyError):
        return {"error": done.stderr.strip()}
    return info


def _ranks(n: int, fn: Callable[[int], None]) -> float:
    """Run fn(rank) in n threads started together; seconds until the last one finished."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(n + 1)

    def run(rank: int) -> None:
        barrier.wait()
        try:
            fn(rank)
        except BaseException as e:  # noqa: BLE001 - reported below
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


def _write(path: Path, size: int) -> None:
    block = os.urandom(BLOCK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(size // BLOCK):
            os.write(fd, block)
    finally:
        os.close(fd)


def _read(path: Path, size: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while chunk := os.read(fd, BLOCK):
            got += len(chunk)
    finally:
        os.close(fd)
    assert got == size, (path, got, size)


def measure(where: Path, ranks: int, size: int,
            settle: Callable[[], None] | None = None) -> dict[str, float]:
    files = [where / f"rank{r}.bin" for r in range(ranks)]
    try:
        write = _ranks(ranks, lambda r: _write(files[r], size))
        if settle is not None:
            settle()
        return {"write": write, "read": _ranks(ranks, lambda r: _read(files[r], size))}
    finally:
        for f in files:
            f.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="per rank (default 1024)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--disk", type=Path, help="backing dir on this disk instead of /dev/shm")
    ap.add_argument("--out", type=Path, help="write every number here (JSON)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--no-settle", dest="settle", action="store_false",
                    help="ckptfs modes: read back at once, while the upload's checksum pass "
                    "may still read the files (by default the read waits for that attempt)")
    args = ap.parse_args()
    size = args.size_mib << 20
    modes = [m for m in MODES if m in args.modes or m == "plain"]

    done = build()
    if done.returncode != 0:
        raise SystemExit(f"build_passthrough_fuse.sh failed:\n{done.stderr}")

    base = Path(tempfile.mkdtemp(prefix="ptbench-", dir=args.disk or "/dev/shm"))
    mnt_base = Path(tempfile.mkdtemp(prefix="ptbench-mnt-"))
    results: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    try:
        for ranks in args.ranks:
            src = base / f"r{ranks}"
            src.mkdir()
            best = {m: {"write": float("inf"), "read": float("inf")} for m in modes}
            with contextlib.ExitStack() as stack:
                where = {"plain": src}
                for mode in modes:
                    if mode in ("stock", "passthrough"):
                        where[mode] = mnt_base / f"{mode}{ranks}"
                        stack.enter_context(demo_mount(src, where[mode], mode))
                    elif mode != "plain":
                        where[mode] = stack.enter_context(ckptfs_mount(
                            base / f"{mode}{ranks}", mnt_base / f"{mode}{ranks}",
                            "on" if mode == "ckptfs-pt" else "off"))
                settle = {m: ckptfs_settle(where[m], ranks) for m in modes
                          if m.startswith("ckptfs") and args.settle}
                # Rounds interleave the modes, so drift in the machine's load hits all alike.
                for _ in range(args.repeat):
                    for mode in modes:
                        for op, t in measure(where[mode], ranks, size,
                                             settle.get(mode)).items():
                            best[mode][op] = min(best[mode][op], t)
                for mode in modes:
                    if mode in ("stock", "passthrough"):
                        requests[f"{mode}, {ranks} ranks"] = stats(where[mode])
                    elif mode != "plain":
                        requests[f"{mode}, {ranks} ranks"] = ckptfs_requests(where[mode])
            results[str(ranks)] = best
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(mnt_base, ignore_errors=True)

    where = f"disk ({args.disk})" if args.disk else "tmpfs (/dev/shm)"
    gib = size / (1 << 30)
    print(f"\nFUSE passthrough, {where}, {args.size_mib} MiB per rank, 8 MiB requests, "
          f"best of {args.repeat}; kernel {platform.release()}\n")
    others = [m for m in modes if m != "plain"]
    print("| ranks | op | " + " | ".join(LABELS[m] for m in modes) + " | "
          + " | ".join(f"{LABELS[m]}/plain" for m in others) + " |")
    print("|---|---|" + "---|" * (len(modes) + len(others)))
    for ranks, row in results.items():
        for op in ("write", "read"):
            t = {m: row[m][op] for m in modes}
            cells = [f"{t[m]:.3f} s ({int(ranks) * gib / t[m]:.2f} GiB/s)" for m in modes]
            ratios = [f"{t[m] / t['plain']:.2f}x" for m in others]
            print(f"| {ranks} | {op} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    print("\nrequests that reached the daemons (cumulative per mount):")
    for k, v in requests.items():
        print(f"  {k}: {v}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "where": where, "size_mib": args.size_mib, "repeat": args.repeat,
            "kernel": platform.release(), "seconds": results, "daemon_requests": requests,
        }, indent=2))


if __name__ == "__main__":
    main()
