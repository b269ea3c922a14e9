"""Q3, upload and restore throughput vs raw boto3, against one S3 endpoint: SeaweedFS on
loopback (the run's server, ``weed mini``; a real S3 server, which the earlier moto was not).

Upload (the method of the former benchmarks/upload.py, folded in here): --q3-files files,
--q3-mib MiB in all.
  boto3   ``upload_file``, one thread per file, 4 files at once, 16 MiB parts x 4 per file
          (ckptfs's defaults: upload_concurrency 4, part_size 16 MiB, part_concurrency 4)
  ckptfs  the files are staged with the store down (faults.down_file), unmounted without
          waiting; the clock runs from the remount (``ckptfs mount``) until every file's
          ``user.ckptfs.state`` reads ``committed``. The mount's own time (until it answers)
          is reported too: the uploads start during it, so "after the mount" is a lower bound

Restore of the checkpoint just uploaded:
  boto3   ``download_file`` of every key to a local dir, 4 files at once
  ckptfs  a fresh mount (empty staging dir) over the populated prefix; 4 readers read the files
          in 1 MiB read() calls; the clock runs from the mount to the last byte read.
This measures whatever the read path does today (whole-file fault-in or range fetches): it
gets faster as the read path improves, with no change here.

torch.save under upload load (also from upload.py): on one mount over the same bucket,
``torch.save`` of a --q3-torch-mib MiB state dict (8 fp32 tensors) with the uploader idle
(after ``ckptfs sync``) vs 0.5 s after a --q3-mib MiB file was closed (its upload in flight),
--q3-reps rounds, medians; target busy / idle <= 1.2.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from questions.common import (
    Bench,
    MiB,
    ckptfs_config,
    ckptfs_mount,
    log,
    read_file,
    sync_disk,
)

TITLE = "Q3 upload and restore throughput vs raw boto3 (S3 on SeaweedFS)"
PART, PART_CONC, FILE_CONC = 16 * MiB, 4, 4


def ckptfs_upload(b: Bench, files: list[Path], bucket: str) -> tuple[float, float, int]:
    """Seconds from the remount to every file committed, of them the mount's own, and the
    daemon's peak RSS."""
    down = b.work / "q3-store-down"
    # Registered at mount: a node registers before its first change otherwise, and with the
    # store down that first write would wait for it (docs/SEMANTICS.md, "Many nodes").
    cfg_down = ckptfs_config(b.work / "q3-up-staging", s3=b.s3, bucket=bucket,
                             extra="register_at_mount = true",
                             faults=f'down_file = "{down}"')
    with ckptfs_mount(b.work, "q3-up", cfg_down) as m:
        down.touch()  # after the mount: the mount checks the store
        for p in files:
            with open(p, "rb") as src, open(m.path / p.name, "wb") as dst:
                shutil.copyfileobj(src, dst, MiB)
        m.umount(wait=False)
    down.unlink()
    sync_disk()
    cfg = ckptfs_config(b.work / "q3-up-staging", s3=b.s3, bucket=bucket)
    t0 = time.perf_counter()
    with ckptfs_mount(b.work, "q3-up", cfg) as m:
        mount_s = time.perf_counter() - t0
        m.wait_committed([m.path / p.name for p in files])
        elapsed = time.perf_counter() - t0
        rss = m.peak_rss()
    return elapsed, mount_s, rss


def make_files(directory: Path, count: int, size: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(MiB)
    files = []
    for i in range(count):
        path = directory / f"shard_{i:02d}.distcp"
        with open(path, "wb") as f:
            f.writelines(block for _ in range(size // MiB))
        files.append(path)
    return files


def raw_boto3(b: Bench, files: list[Path], bucket: str) -> float:
    """boto3 ``upload_file`` of every file, FILE_CONC at once, ckptfs's part settings."""
    from boto3.s3.transfer import TransferConfig

    s3 = b.s3.client()
    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                            max_concurrency=PART_CONC)
    start = time.perf_counter()
    with ThreadPoolExecutor(FILE_CONC) as pool:
        list(pool.map(lambda p: s3.upload_file(str(p), bucket, f"raw/{p.name}", Config=config),
                      files))
    return time.perf_counter() - start


def torch_under_upload(b: Bench, bucket: str) -> dict[str, Any]:
    """torch.save blocked time with the uploader idle vs with a big upload in flight."""
    import torch

    o = b.opts
    state = {f"w{i}": torch.randn(o.q3_torch_mib * MiB // 4 // 8) for i in range(8)}
    block = os.urandom(MiB)
    idle: list[float] = []
    busy: list[float] = []
    cfg = ckptfs_config(b.work / "q3-torch-staging", s3=b.s3, bucket=bucket,
                        prefix="torch")
    with ckptfs_mount(b.work, "q3-torch", cfg) as m:
        for rep in range(o.q3_reps):
            m.sync()
            t0 = time.perf_counter()
            torch.save(state, m.path / f"idle_{rep}.pt")
            idle.append(time.perf_counter() - t0)
            m.sync()
            with open(m.path / f"big_{rep}.bin", "wb") as f:
                f.writelines(block for _ in range(o.q3_mib))
            time.sleep(0.5)  # the upload of big_N is in flight now
            t0 = time.perf_counter()
            torch.save(state, m.path / f"busy_{rep}.pt")
            busy.append(time.perf_counter() - t0)
            log(f"Q3 torch.save {o.q3_torch_mib} MiB, round {rep}: idle {idle[-1]:.2f} s, "
                f"uploading {busy[-1]:.2f} s")
        m.sync()
    return {"idle_s": idle, "busy_s": busy, "state_mib": o.q3_torch_mib,
            "busy_mib": o.q3_mib}


def boto3_download(b: Bench, bucket: str, names: list[str]) -> float:
    from boto3.s3.transfer import TransferConfig

    s3 = b.s3.client()
    dest = b.dir("q3-download")
    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                            max_concurrency=PART_CONC)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(FILE_CONC) as pool:
        list(pool.map(lambda n: s3.download_file(bucket, f"run/{n}", str(dest / n),
                                                 Config=config), names))
    elapsed = time.perf_counter() - t0
    shutil.rmtree(dest)
    return elapsed


def ckptfs_restore(b: Bench, bucket: str,
                   names: list[str]) -> tuple[float | None, float, int, int, str]:
    """Seconds from mount to the last byte read (None: could not read), of them the mount's
    own, bytes read, daemon peak RSS, and why it could not read."""
    cfg = ckptfs_config(b.work / "q3-restore-staging", s3=b.s3, bucket=bucket)
    t0 = time.perf_counter()
    with ckptfs_mount(b.work, "q3-restore", cfg) as m:
        mount_s = time.perf_counter() - t0
        try:
            with ThreadPoolExecutor(FILE_CONC) as pool:
                total = sum(pool.map(lambda n: read_file(m.path / n), names))
        except OSError as exc:  # a ckptfs whose fresh mount does not see the store yet
            return None, mount_s, 0, m.peak_rss(), f"{type(exc).__name__}: {exc.strerror}"
        elapsed = time.perf_counter() - t0
        rss = m.peak_rss()
    return elapsed, mount_s, total, rss, ""


def run(b: Bench) -> dict[str, Any]:
    o = b.opts
    total = o.q3_mib * MiB
    files = make_files(b.work / "q3-src", o.q3_files, total // o.q3_files)
    names = [p.name for p in files]
    size = sum(p.stat().st_size for p in files)
    bucket = b.s3.new_bucket("q3")
    log(f"Q3: upload {size / MiB:.0f} MiB in {len(files)} files: raw boto3")
    sync_disk()
    raw_up = raw_boto3(b, files, bucket)
    b.s3.empty_bucket(bucket)
    log(f"Q3: raw boto3 {raw_up:.2f} s; ckptfs upload")
    ck_up, up_mount, up_rss = ckptfs_upload(b, files, bucket)
    shutil.rmtree(b.work / "q3-src")
    log(f"Q3: ckptfs upload {ck_up:.2f} s (mount {up_mount:.2f} s); boto3 download_file")
    sync_disk()
    raw_down = boto3_download(b, bucket, names)
    log(f"Q3: boto3 download {raw_down:.2f} s; ckptfs restore through a fresh mount")
    sync_disk()
    ck_down, down_mount, got, down_rss, why = ckptfs_restore(b, bucket, names)
    log(f"Q3: ckptfs restore: {why or f'{ck_down:.2f} s ({got} bytes read)'} "
        f"(mount {down_mount:.2f} s)")
    b.s3.empty_bucket(bucket)
    log("Q3: torch.save with the uploader idle vs uploading")
    under = torch_under_upload(b, bucket)
    b.s3.empty_bucket(bucket)

    def mbs(t: float) -> float:
        return size / t / 1e6

    summary = [
        ("upload MB/s: boto3 / ckptfs (incl. remount; after it)",
         f"{mbs(raw_up):.0f} / {mbs(ck_up):.0f}; {mbs(ck_up - up_mount):.0f}", ""),
        ("upload throughput ckptfs / boto3 (incl. remount; after it); remount s",
         f"**{raw_up / ck_up:.2f}**; {raw_up / (ck_up - up_mount):.2f}; {up_mount:.2f}",
         "≥ 1.0"),
    ]
    if ck_down is None:
        summary.append(("restore MB/s: boto3 download_file / ckptfs fresh mount",
                        f"{mbs(raw_down):.0f} / not readable ({why})", ""))
    else:
        summary += [
            ("restore MB/s: boto3 download_file / ckptfs fresh mount (incl. mount; after it)",
             f"{mbs(raw_down):.0f} / {mbs(ck_down):.0f}; {mbs(ck_down - down_mount):.0f}", ""),
            ("restore throughput ckptfs / boto3 (incl. mount; after it); mount s",
             (f"**{raw_down / ck_down:.2f}**; {raw_down / (ck_down - down_mount):.2f}; "
             f"{down_mount:.2f}"), "≥ 1.0 (Q7: side by side)"),
        ]
    summary.append(("daemon peak RSS MB: upload / restore",
                    f"{up_rss / 1e6:.0f} / {down_rss / 1e6:.0f}", ""))
    idle_s, busy_s = statistics.median(under["idle_s"]), statistics.median(under["busy_s"])
    summary += [
        (f"torch.save {under['state_mib']} MiB s: uploader idle / "
         + f"{under['busy_mib']} MiB uploading", f"{idle_s:.2f} / {busy_s:.2f}", ""),
        ("torch.save blocked, uploading / idle", f"**{busy_s / idle_s:.2f}**", "≤ 1.2"),
    ]
    if ck_down is not None and got != size:
        summary.append(("restore: bytes read != bytes stored", f"{got} != {size}", "!"))
    return {"title": TITLE, "bytes": size, "files": len(files), "part_size": PART,
            "part_concurrency": PART_CONC, "file_concurrency": FILE_CONC,
            "upload_s": {"boto3": raw_up, "ckptfs": ck_up}, "upload_mount_s": up_mount,
            "restore_s": {"boto3": raw_down, "ckptfs": ck_down}, "restore_mount_s": down_mount,
            "restore_bytes_read": got,
            "restore_error": why, "torch_under_upload": under,
            "daemon_peak_rss": {"upload": up_rss, "restore": down_rss}, "summary": summary}


def plot(ax: Any, r: dict[str, Any]) -> None:
    size = r["bytes"]
    labels = ["upload\nboto3", "upload\nckptfs", "restore\nboto3", "restore\nckptfs"]
    ck_restore = r["restore_s"]["ckptfs"]
    vals = [size / r["upload_s"]["boto3"] / 1e6, size / r["upload_s"]["ckptfs"] / 1e6,
            size / r["restore_s"]["boto3"] / 1e6, size / ck_restore / 1e6 if ck_restore else 0]
    if not ck_restore:
        labels[3] = "restore\nckptfs: n/a"
    ax.bar(range(4), vals, color=["C0", "C1", "C0", "C1"])
    ax.set_xticks(range(4), labels, fontsize=8)
    ax.set_ylabel("MB/s")
    ax.set_title(f"Q3 {size / MiB:.0f} MiB in {r['files']} files, S3 on SeaweedFS "
                 "(ckptfs incl. mount)", fontsize=9)
