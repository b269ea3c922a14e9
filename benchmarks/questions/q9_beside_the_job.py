"""Q9, the upload beside the job: does stage 2 slow a checkpoint burst, and how soon does the
store hold the checkpoint?

Two parts, each in ``--q9-reps`` rounds whose order rotates (ratios of one round are side by
side; the table shows medians and every round).

**Burst** (the default configuration: uploads running as files close; the warm tier a
directory on the local disk, the work dir; the plain directory and ckptfs's staging on
tmpfs, ``/dev/shm``, standing in for NVMe): ``--q9-ranks`` (4) threads released together each
write a ``--q9-mib`` (256) MiB file in 8 MiB ``write(2)``s and close it, then read it back at
once; then one writer ``torch.save``s a ``--q9-torch-mib`` (1 GiB) state dict. Modes:

  plain          the tmpfs directory itself
  ckptfs         a mount with ``passthrough = "auto"`` and the upload's yield gate at its
                 defaults (ckptfs/engine/yieldgate.py: ``upload_settle``, ``upload_hold_max``)
  ckptfs-nogate  the same with ``upload_hold_max = "0s"``: uploads start as files close (what
                 ckptfs did before the gate)
  ckptfs-baseline  with ``--q9-baseline DIR``: the ckptfs package of another checkout at its
                 defaults, ``passthrough = "auto"`` (e.g. the code before the gate: the same
                 figures "today", measured beside these)

Before each mode's round the previous uploads are finished (``sync``, untimed) and
``sync(2)`` is called. Then, separately, the **time to the store**: the ranks write again and
the clock runs from the last close until every file reads ``committed``
(``user.ckptfs.state``, polled every 10 ms: no ``sync``, which would open the gate) -- what a
reader of the store waits for.

**Stage 2 on S3** (SeaweedFS, the run's server): ``--q9-ranks`` files of ``--q9-mib`` MiB
written at once through a mount whose staging is on the local disk (warm tier the S3
prefix), clock from the last close until ``ckptfs sync`` returns (on the control socket), and
until every file reads committed; against the same files written at once to a plain directory
on the same disk and then ``upload_file``d by boto3 (4 at once, 16 MiB parts x 4: ckptfs's
defaults), clock from the last close. Fresh page-cache state each time: the files are written
anew before each side, dirty, as a job leaves them.

Targets: write and read back <= 1.1x plain; ``torch.save`` <= 1.05x; ckptfs's S3
throughput from the last close >= 1.0x boto3; the time to the store, ckptfs beside
ckptfs-nogate (grows by no more than the settle).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from questions.common import (
    Bench,
    CkptfsMount,
    MiB,
    ckptfs_config,
    ckptfs_mount,
    log,
    make_state_dict,
    state_dict_bytes,
    sync_disk,
    torch_save,
)
from questions.q6_data_path import BLOCK, ranks_at_once, read_blocks, write_blocks

TITLE = "Q9 the upload beside the job: burst on tmpfs with uploads running; stage 2 on S3"
MODES = ("plain", "ckptfs", "ckptfs-nogate")
PART, PART_CONC, FILE_CONC = 16 * MiB, 4, 4


def write_ranks(paths: list[Path], size: int, block: bytes) -> tuple[float, float]:
    """All ranks write at once: (seconds, time.perf_counter() of the last close)."""
    closes: list[float] = []

    def one(rank: int) -> None:
        write_blocks(paths[rank], size, block)
        closes.append(time.perf_counter())

    secs = ranks_at_once(len(paths), one)
    return secs, max(closes)


def wait_committed(paths: list[Path], poll: float = 0.01, timeout: float = 600.0) -> float:
    """time.perf_counter() once every path reads committed."""
    deadline = time.monotonic() + timeout
    for p in paths:
        while os.getxattr(p, "user.ckptfs.state") != b"committed":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{p} not committed within {timeout:.0f} s")
            time.sleep(poll)
    return time.perf_counter()


BASELINE = "ckptfs-baseline"


def burst_modes(r: dict[str, Any] | None = None, baseline: Path | None = None
                ) -> tuple[str, ...]:
    """The burst's modes: MODES, and the baseline's if asked for (or in the results ``r``)."""
    if baseline is not None or (r is not None and any(
            x["mode"] == BASELINE for x in r["burst"]["rounds"])):
        return (*MODES, BASELINE)
    return MODES


@contextmanager
def burst_mounts(b: Bench, base: Path, store: Path) -> Iterator[dict[str, CkptfsMount]]:
    mounts: dict[str, CkptfsMount] = {}
    with ExitStack() as stack:
        for mode in burst_modes(baseline=b.opts.q9_baseline)[1:]:
            extra = 'passthrough = "auto"\nlog_level = "warning"'
            if mode == "ckptfs-nogate":
                extra += '\nupload_hold_max = "0s"'
            cfg = ckptfs_config(base / f"{mode}-staging", store_dir=store / mode, extra=extra)
            src = b.opts.q9_baseline.resolve() if mode == BASELINE else None
            mounts[mode] = stack.enter_context(ckptfs_mount(base, mode, cfg, src=src))
        yield mounts


def burst(b: Bench) -> dict[str, Any]:
    o = b.opts
    size = o.q9_mib * MiB
    block = os.urandom(BLOCK)
    base = Path(tempfile.mkdtemp(prefix="q9-", dir="/dev/shm"))
    store = b.dir("q9-store")
    rounds: list[dict[str, Any]] = []
    sd = make_state_dict(o.q9_torch_mib * MiB)
    try:
        modes = burst_modes(baseline=o.q9_baseline)
        with burst_mounts(b, base, store) as mounts:
            where = {"plain": base / "plain", **{m: mounts[m].path for m in modes[1:]}}
            where["plain"].mkdir()
            for rep in range(o.q9_reps):
                turn = rep % len(modes)
                order = list(modes[turn:] + modes[:turn])
                for mode in order:
                    m = mounts.get(mode)
                    paths = [where[mode] / f"rank{r}.bin" for r in range(o.q9_ranks)]
                    if m:
                        m.sync()
                    sync_disk()
                    w, _ = write_ranks(paths, size, block)
                    # Read back at once, as a restart on this node would.
                    r = ranks_at_once(len(paths), lambda i, ps=paths: read_blocks(ps[i], size))
                    if m:
                        m.sync()
                    for p in paths:
                        p.unlink()
                    if m:
                        m.sync()
                    sync_disk()
                    pt = where[mode] / "q9.pt"
                    ts, _ = torch_save(pt, sd)
                    if m:
                        m.sync()
                    pt.unlink()
                    to_store = None
                    if m:
                        m.sync()
                        sync_disk()
                        _, last = write_ranks(paths, size, block)
                        to_store = wait_committed(paths) - last
                        for p in paths:
                            p.unlink()
                        m.sync()
                    rounds.append({"round": rep, "mode": mode, "write": w, "read": r,
                                   "torch_save": ts, "to_store": to_store})
                    log(f"Q9 burst round {rep} {mode:>13}: write {w:.3f} s, read {r:.3f} s, "
                        f"torch.save {ts:.3f} s"
                        + (f", last close to stored {to_store:.3f} s" if to_store else ""))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    return {"rounds": rounds, "ranks": o.q9_ranks, "mib": o.q9_mib,
            "torch_bytes": state_dict_bytes(sd)}


def s3_stage2(b: Bench) -> dict[str, Any]:
    o = b.opts
    from boto3.s3.transfer import TransferConfig

    size = o.q9_mib * MiB
    block = os.urandom(BLOCK)
    bucket = b.s3.new_bucket("q9")
    s3 = b.s3.client()
    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                            max_concurrency=PART_CONC)
    plain = b.dir("q9-s3-plain")
    rounds: list[dict[str, Any]] = []
    cfg = ckptfs_config(b.work / "q9-s3-staging", s3=b.s3, bucket=bucket,
                        extra='log_level = "warning"')
    with ckptfs_mount(b.work, "q9-s3", cfg) as m:
        for rep in range(o.q9_reps):
            for side in (("boto3", "ckptfs") if rep % 2 == 0 else ("ckptfs", "boto3")):
                m.sync()
                b.s3.empty_bucket(bucket)
                sync_disk()
                if side == "boto3":
                    paths = [plain / f"shard_{r}.distcp" for r in range(o.q9_ranks)]
                    _, last = write_ranks(paths, size, block)
                    with ThreadPoolExecutor(FILE_CONC) as pool:
                        list(pool.map(lambda p: s3.upload_file(
                            str(p), bucket, f"raw/{p.name}", Config=config), paths))
                    row = {"round": rep, "side": side, "sync": time.perf_counter() - last}
                else:
                    paths = [m.path / f"shard_{r}.distcp" for r in range(o.q9_ranks)]
                    _, last = write_ranks(paths, size, block)
                    m.sync()
                    synced = time.perf_counter()
                    committed = wait_committed(paths)
                    row = {"round": rep, "side": side, "sync": synced - last,
                           "committed": committed - last}
                for p in paths:
                    p.unlink()
                rounds.append(row)
                log(f"Q9 S3 round {rep} {side:>6}: last close to stored {row['sync']:.3f} s")
        m.sync()
    b.s3.empty_bucket(bucket)
    shutil.rmtree(plain, ignore_errors=True)
    return {"rounds": rounds, "bytes": o.q9_ranks * size}


def run(b: Bench) -> dict[str, Any]:
    log(f"Q9: load average {os.getloadavg()[0]:.2f}")
    res: dict[str, Any] = {"title": TITLE, "loadavg_start": os.getloadavg()}
    parts = b.opts.q9_parts
    if "burst" in parts:
        res["burst"] = burst(b)
    if "s3" in parts:
        res["s3"] = s3_stage2(b)
    res["loadavg_end"] = os.getloadavg()
    res["summary"] = summarize(res)
    return res


def _med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summarize(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    if "burst" in r:
        rows += _burst_rows(r)
    if "s3" in r:
        rows += _s3_rows(r)
    return rows


def _burst_rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    br = r["burst"]["rounds"]
    modes = burst_modes(r)
    by = {m: [x for x in br if x["mode"] == m] for m in modes}
    n = r["burst"]["ranks"]
    for key, what, target in (("write", f"{n} ranks write", "≤ 1.1x"),
                              ("read", f"{n} ranks read back", "≤ 1.1x"),
                              ("torch_save", "torch.save", "≤ 1.05x")):
        plain = _med(by["plain"], key)
        cells = []
        for mode in modes[1:]:
            per = [x[key] / p[key] for x, p in zip(by[mode], by["plain"])]
            each = ", ".join(f"{v:.2f}" for v in per)
            cells.append(f"{mode} **{_med(by[mode], key) / plain:.2f}x** ({each})")
        title = f"burst on tmpfs, uploads running: {what} / plain (rounds); plain {plain:.2f} s"
        rows.append((title, "; ".join(cells), target))
    each = ", ".join(f"{a['to_store']:.2f}/{c['to_store']:.2f}"
                     for a, c in zip(by["ckptfs"], by["ckptfs-nogate"]))
    gated, free = _med(by["ckptfs"], "to_store"), _med(by["ckptfs-nogate"], "to_store")
    rows.append(("burst: last close to every file committed, s: ckptfs / ckptfs-nogate",
                 f"**{gated:.2f}** / {free:.2f} (rounds {each})", "grows by ≤ the settle"))
    if BASELINE in by:
        each = ", ".join(f"{a['to_store']:.2f}/{c['to_store']:.2f}"
                         for a, c in zip(by["ckptfs"], by[BASELINE]))
        rows.append(("burst: last close to every file committed, s: ckptfs / ckptfs-baseline",
                     f"**{gated:.2f}** / {_med(by[BASELINE], 'to_store'):.2f} (rounds {each})",
                     "grows by ≤ the settle"))
    return rows


def _s3_rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    s3 = r["s3"]["rounds"]
    ck = [x for x in s3 if x["side"] == "ckptfs"]
    bo = [x for x in s3 if x["side"] == "boto3"]
    mb = r["s3"]["bytes"] / 1e6
    ratios = [b_["sync"] / c["sync"] for c, b_ in zip(ck, bo)]
    rates = (f"{mb / _med(bo, 'sync'):.0f} / {mb / _med(ck, 'sync'):.0f} "
             f"({mb / _med(ck, 'committed'):.0f})")
    title = "S3 stage 2 from the last close, MB/s: boto3 / ckptfs sync returned (all committed)"
    rows.append((title, rates, ""))
    rows.append(("S3 stage 2 throughput ckptfs / boto3 from the last close (rounds)",
                 f"**{statistics.median(ratios):.2f}** ({', '.join(f'{v:.2f}' for v in ratios)})",
                 "≥ 1.0"))
    return rows


def plot(ax: Any, r: dict[str, Any]) -> None:
    if "burst" not in r:
        ax.axis("off")
        return
    br = r["burst"]["rounds"]
    keys = ("write", "read", "torch_save")
    modes = burst_modes(r)
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        vals = [_med([x for x in br if x["mode"] == mode], k) for k in keys]
        ax.bar([j + i * width for j in range(3)], vals, width=width, label=mode)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(3)], list(keys), fontsize=8)
    ax.set_ylabel("seconds (median)")
    ax.set_title("Q9 burst on tmpfs with uploads running", fontsize=9)
    ax.legend(fontsize=7)
