"""FUSE passthrough vs the stock FUSE data path (issue 16), side by side in one run.

R ranks (threads, 8 MiB requests) each write a file of SIZE and close it, then read it back, in
three places over the same backing directory:

  plain        the directory itself (tmpfs, or the local disk with ``--disk``)
  stock        tests/passthrough_fs.py --mode stock: the stock pyfuse3, every READ/WRITE through
               the Python daemon (no writeback cache, no keep_cache): ckptfs's path today
  passthrough  tests/passthrough_fs.py --mode passthrough: the pyfuse3 built by
               scripts/build_passthrough_fuse.sh; the kernel serves I/O from the backing file

Each cell is the best of ``--repeat`` rounds; a round runs plain, stock and passthrough in turn
(files deleted in between), so drift in the machine's load hits all three alike; ratios are time / plain
time (1.00x = plain speed). Read-back on plain and passthrough hits the page cache of the backing
file (on tmpfs that is the storage); the demo counts the requests that reached it, printed last.

    python benchmarks/passthrough.py                     # 1 and 4 ranks, 1 GiB each, tmpfs
    python benchmarks/passthrough.py --disk /var/tmp --size-mib 512 --ranks 4
    python benchmarks/passthrough.py --out benchmarks/results/passthrough.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.passthrough_fs import build, demo_mount, stats

BLOCK = 8 << 20
MODES = ("plain", "stock", "passthrough")


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


def measure(where: Path, ranks: int, size: int) -> dict[str, float]:
    files = [where / f"rank{r}.bin" for r in range(ranks)]
    try:
        return {"write": _ranks(ranks, lambda r: _write(files[r], size)),
                "read": _ranks(ranks, lambda r: _read(files[r], size))}
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
    args = ap.parse_args()
    size = args.size_mib << 20

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
            best = {m: {"write": float("inf"), "read": float("inf")} for m in MODES}
            with contextlib.ExitStack() as stack:
                where = {"plain": src}
                for mode in ("stock", "passthrough"):
                    where[mode] = mnt_base / f"{mode}{ranks}"
                    stack.enter_context(demo_mount(src, where[mode], mode))
                # Rounds interleave the three, so drift in the machine's load hits all alike.
                for _ in range(args.repeat):
                    for mode in MODES:
                        for op, t in measure(where[mode], ranks, size).items():
                            best[mode][op] = min(best[mode][op], t)
                for mode in ("stock", "passthrough"):
                    requests[f"{mode}, {ranks} ranks"] = stats(where[mode])
            results[str(ranks)] = best
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(mnt_base, ignore_errors=True)

    where = f"disk ({args.disk})" if args.disk else "tmpfs (/dev/shm)"
    gib = size / (1 << 30)
    print(f"\nFUSE passthrough, {where}, {args.size_mib} MiB per rank, 8 MiB requests, "
          f"best of {args.repeat}; kernel {platform.release()}\n")
    print("| ranks | op | plain | stock FUSE | passthrough | stock/plain | passthrough/plain |")
    print("|---|---|---|---|---|---|---|")
    for ranks, row in results.items():
        for op in ("write", "read"):
            t = {m: row[m][op] for m in MODES}
            cells = [f"{t[m]:.3f} s ({int(ranks) * gib / t[m]:.2f} GiB/s)" for m in MODES]
            print(f"| {ranks} | {op} | {' | '.join(cells)} | {t['stock'] / t['plain']:.2f}x "
                  f"| {t['passthrough'] / t['plain']:.2f}x |")
    print("\nrequests that reached the demo daemon (cumulative per mount):")
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
