"""Stage-2 benchmark: ckptfs upload throughput vs raw boto3, and torch.save under upload load.

Everything is measured side by side in one run against the same S3 endpoint (moto's server in
its own process on 127.0.0.1), and printed as ratios. Nothing is asserted: this machine is
shared and noisy; run it twice if a number looks odd.

1. Upload throughput: N checkpoint files (2 GiB in all; --quick: 256 MiB)
   (a) raw boto3 ``upload_file``, one thread per file, ``upload_concurrency`` files at once,
       same part size and per-file part concurrency as ckptfs;
   (b) ckptfs: the files are staged (mount, write, ``umount --no-wait``), then the clock runs
       from remount to the end of ``ckptfs sync``.
   Target: (b) >= 90% of (a).
2. ``torch.save`` blocked time of a 1 GiB state dict (--quick: 128 MiB) while a previous 2 GiB
   checkpoint is uploading vs with an idle uploader. Target: within 1.2x.

Usage: python benchmarks/upload.py [--quick] [--json benchmarks/results/upload.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MiB = 1024 * 1024
CKPTFS = [sys.executable, "-m", "ckptfs"]
os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def client(endpoint: str):  # type: ignore[no-untyped-def]
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


def run(*args: str | os.PathLike[str]) -> None:
    subprocess.run([*CKPTFS, *map(str, args)], check=True, stdin=subprocess.DEVNULL)


def write_config(path: Path, staging: Path, bucket: str, endpoint: str, part_size: int,
                 part_concurrency: int, upload_concurrency: int) -> None:
    path.write_text(
        f'staging_dir = "{staging}"\n'
        f"upload_concurrency = {upload_concurrency}\n"
        '[[tier]]\nname = "hot"\n'
        f'[[tier]]\nname = "warm"\nurl = "s3://{bucket}/run"\n'
        f'endpoint_url = "{endpoint}"\npart_size = {part_size}\n'
        f"part_concurrency = {part_concurrency}\n"
    )


def make_files(directory: Path, count: int, size: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(MiB)
    files = []
    for i in range(count):
        path = directory / f"shard_{i:02d}.distcp"
        with open(path, "wb") as f:
            for _ in range(size // MiB):
                f.write(block)
        files.append(path)
    return files


def raw_boto3(files: list[Path], endpoint: str, bucket: str, part_size: int,
              part_concurrency: int, upload_concurrency: int) -> float:
    from boto3.s3.transfer import TransferConfig

    s3 = client(endpoint)
    config = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                            max_concurrency=part_concurrency)
    start = time.perf_counter()
    with ThreadPoolExecutor(upload_concurrency) as pool:
        list(pool.map(lambda p: s3.upload_file(str(p), bucket, f"raw/{p.name}", Config=config),
                      files))
    return time.perf_counter() - start


def ckptfs_upload(files: list[Path], work: Path, endpoint: str, bucket: str, part_size: int,
                  part_concurrency: int, upload_concurrency: int) -> float:
    mnt, staging, cfg = work / "mnt", work / "staging", work / "ckptfs.toml"
    mnt.mkdir(parents=True, exist_ok=True)
    write_config(cfg, staging, bucket, endpoint, part_size, part_concurrency,
                 upload_concurrency)
    down = work / "down"
    # Stage the files with the store marked down, leave them queued, then time the drain.
    cfg_down = work / "down.toml"
    cfg_down.write_text(cfg.read_text() + f'faults = {{ down_file = "{down}" }}\n')
    run("mount", mnt, "-c", cfg_down)
    down.touch()
    try:
        for p in files:
            shutil.copyfile(p, mnt / p.name)
    finally:
        run("umount", mnt, "--no-wait")
    down.unlink()
    start = time.perf_counter()
    run("mount", mnt, "-c", cfg)
    try:
        run("sync", mnt)
        return time.perf_counter() - start
    finally:
        run("umount", mnt)


def torch_save_blocked(work: Path, endpoint: str, bucket: str, state_mib: int, busy_mib: int,
                       part_size: int) -> tuple[list[float], list[float]]:
    import torch

    mnt, staging, cfg = work / "tmnt", work / "tstaging", work / "t.toml"
    mnt.mkdir(parents=True, exist_ok=True)
    write_config(cfg, staging, bucket, endpoint, part_size, 4, 4)
    state = {f"w{i}": torch.randn(state_mib * MiB // 4 // 8) for i in range(8)}
    idle, busy = [], []
    run("mount", mnt, "-c", cfg)
    try:
        for rep in range(3):
            run("sync", mnt)
            t0 = time.perf_counter()
            torch.save(state, mnt / f"idle_{rep}.pt")
            idle.append(time.perf_counter() - t0)
            run("sync", mnt)
            with open(mnt / f"big_{rep}.pt", "wb") as f:
                block = os.urandom(MiB)
                for _ in range(busy_mib):
                    f.write(block)
            time.sleep(0.5)  # the upload of big_N is in flight now
            t0 = time.perf_counter()
            torch.save(state, mnt / f"busy_{rep}.pt")
            busy.append(time.perf_counter() - t0)
        run("sync", mnt)
    finally:
        run("umount", mnt)
    return idle, busy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" /
                        "upload.json")
    args = parser.parse_args()
    total_mib = 256 if args.quick else 2048
    count = 8
    part_size, part_concurrency, upload_concurrency = 16 * MiB, 4, 4
    moto, endpoint = start_moto()
    work = Path(tempfile.mkdtemp(prefix="ckptfs-bench-upload-"))
    results: dict[str, object] = {"quick": args.quick, "total_mib": total_mib}
    try:
        s3 = client(endpoint)
        files = make_files(work / "src", count, total_mib * MiB // count)
        raw_times, ck_times = [], []
        for rep in range(2 if args.quick else 3):
            bucket = f"bench-{rep}"
            s3.create_bucket(Bucket=bucket)
            raw_times.append(raw_boto3(files, endpoint, bucket, part_size, part_concurrency,
                                       upload_concurrency))
            ck_times.append(ckptfs_upload(files, work / f"ck{rep}", endpoint, bucket,
                                          part_size, part_concurrency, upload_concurrency))
        raw, ck = statistics.median(raw_times), statistics.median(ck_times)
        results.update(raw_boto3_s=raw_times, ckptfs_s=ck_times,
                       raw_mb_s=total_mib * MiB / raw / 1e6, ckptfs_mb_s=total_mib * MiB / ck / 1e6,
                       upload_ratio=raw / ck)
        s3.create_bucket(Bucket="bench-torch")
        state_mib, busy_mib = (128, 256) if args.quick else (1024, 2048)
        idle, busy = torch_save_blocked(work, endpoint, "bench-torch", state_mib, busy_mib,
                                        part_size)
        results.update(torch_idle_s=idle, torch_busy_s=busy,
                       torch_busy_ratio=statistics.median(busy) / statistics.median(idle))
    finally:
        moto.send_signal(signal.SIGTERM)
        moto.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n## ckptfs stage-2 benchmark ({'quick' if args.quick else 'full'}, "
          f"{total_mib} MiB in {count} files, part {part_size // MiB} MiB x {part_concurrency}, "
          f"{upload_concurrency} files at once)\n")
    print("| measurement | value | target |")
    print("|---|---|---|")
    print(f"| raw boto3 upload_file | {results['raw_mb_s']:.0f} MB/s | |")
    print(f"| ckptfs upload (remount -> sync done) | {results['ckptfs_mb_s']:.0f} MB/s | |")
    print(f"| ckptfs / raw boto3 | {results['upload_ratio']:.2f} | >= 0.90 |")
    print(f"| torch.save {state_mib} MiB, idle uploader | {statistics.median(idle):.2f} s | |")
    print(f"| torch.save {state_mib} MiB, {busy_mib} MiB uploading | "
          f"{statistics.median(busy):.2f} s | |")
    print(f"| busy / idle | {results['torch_busy_ratio']:.2f} | <= 1.2 |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
