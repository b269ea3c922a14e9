"""Q1, training blocked time: a training loop that checkpoints with unmodified ``torch.save``.

Three ways to get the checkpoints onto one slow shared store (``--store-bw`` bytes/s, default
100 MB/s), and the floor of every two-stage design, measured in one run:

  direct     torch.save straight to the slow store (a FUSE filesystem, questions/nullfs.py
             with a backing directory, that accepts at most --store-bw bytes/s of writes)
  local      torch.save to a local directory and nothing else: what saving to the node's own
             disk costs on this machine (no way that writes locally first can block less)
  two-stage  hand-written: torch.save to a local directory, then a background thread copies
             the file to the same slow store (shutil.copyfileobj, 1 MiB buffers), one queue,
             one thread
  ckptfs     torch.save to a ckptfs mount whose warm tier is a local directory behind the
             fault wrapper with faults.bandwidth = --store-bw

The loop: ``--ckpts`` checkpoints, one every ``--every`` steps; a step is ``--step-s`` seconds
(a few small matmuls, then the host thread waits, as it does while a GPU computes) and changes
one tensor of the state dict (so every checkpoint is new data). The state dict is
transformer-like (common.make_state_dict), ``--q1-mib`` MiB. The defaults (1 GiB every
5 x 2.5 s) give the store time to take one checkpoint before the next (10.7 s at 100 MB/s),
as a sane training config would; with a shorter interval every background copy backs up.

Reported per way: blocked time (sum of the torch.save calls), loop wall time, and time to
full durability (loop start -> the last checkpoint is whole in the store: the end of the loop
for direct, the copy thread's last copy for two-stage, every file's ``user.ckptfs.state``
reading ``committed`` for ckptfs).

The store's bytes live in ``--store-dir``, by default on /dev/shm: a shared store writes to
its own disks, not the node's. The local disk of local, two-stage and ckptfs's staging is
``--local-dir`` (default: the work dir); ``--local-dir /dev/shm`` stands in for a local disk
much faster than the store, as NVMe is (on this VM a 1 GiB torch.save to the virtual disk takes
3.1-3.5 s while earlier checkpoints are being flushed, 1.1 s otherwise).

Fairness notes: faults.bandwidth is applied per uploaded file (it sleeps size/bandwidth, then
uploads), the slow store by a token bucket over all writes of the mount; with one file per
checkpoint and one copy at a time both mean "one stream at --store-bw". ckptfs's file tier
fsyncs what it stores; the slow store does not (that favours the baselines).
"""

from __future__ import annotations

import queue
import shutil
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from questions.common import (
    Bench,
    GiB,
    MiB,
    ckptfs_config,
    ckptfs_mount,
    error_cell,
    log,
    machine_busy_s,
    make_state_dict,
    slow_store,
    state_dict_bytes,
    sync_disk,
    tree_bytes,
)

TITLE = "Q1 training blocked time (torch.save every K steps, slow store)"
WAYS = ("direct", "local", "two-stage", "ckptfs")


def _step(seconds: float, x: Any, w: Any) -> Any:
    """One training step: a little real compute, then waiting out the rest of the step, as
    the host thread of a GPU job waits for the device (this machine has no GPU and 2 CPUs;
    burning a CPU for the whole step would mostly measure CPU contention)."""
    import torch

    end = time.perf_counter() + seconds
    for _ in range(8):
        x = torch.tanh(x @ w)
    time.sleep(max(0.0, end - time.perf_counter()))
    return x


def training_loop(sd: dict[str, Any], target_dir: Path, ckpts: int, every: int,
                  step_s: float, after_save: Any = None) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 256, generator=gen), torch.randn(256, 256, generator=gen) / 16
    first = next(iter(sd))
    saves: list[float] = []
    t0 = time.perf_counter()
    for step in range(1, ckpts * every + 1):
        x = _step(step_s, x, w)
        sd[first].add_(1.0)  # a new checkpoint, not the same bytes again
        if step % every == 0:
            path = target_dir / f"ckpt_step_{step}.pt"
            s0 = time.perf_counter()
            torch.save(sd, path)
            if after_save is not None:
                after_save(path)
            saves.append(time.perf_counter() - s0)
    return {"saves_s": saves, "blocked_s": sum(saves), "loop_s": time.perf_counter() - t0,
            "t0": t0}


def run_direct(b: Bench, sd: dict[str, Any], o: Any, bw: float,
               stores: Path, local: Path) -> dict[str, Any]:
    backing = stores / "direct"
    with slow_store(b.work, "q1-direct-store", bw, backing) as store:
        r = training_loop(sd, store, o.ckpts, o.every, o.step_s)
        r["durable_s"] = time.perf_counter() - r.pop("t0")
        r["store_bytes"] = tree_bytes(backing)
    return r


def run_local(b: Bench, sd: dict[str, Any], o: Any, bw: float,
              stores: Path, local: Path) -> dict[str, Any]:
    r = training_loop(sd, local, o.ckpts, o.every, o.step_s)
    r["durable_s"] = None  # never reaches the store
    r.pop("t0")
    r["store_bytes"] = 0
    return r


def run_two_stage(b: Bench, sd: dict[str, Any], o: Any, bw: float,
                  stores: Path, local: Path) -> dict[str, Any]:
    backing = stores / "two-stage"
    with slow_store(b.work, "q1-two-stage-store", bw, backing) as store:
        todo: queue.Queue[Path | None] = queue.Queue()
        done_at: list[float] = []

        def copier() -> None:
            while (path := todo.get()) is not None:
                # copyfileobj with 1 MiB buffers, not copyfile: sendfile(2) into a FUSE file
                # goes in small requests, a cost of our simulated store, not of the idea.
                with open(path, "rb") as src, open(store / path.name, "wb") as dst:
                    shutil.copyfileobj(src, dst, MiB)
                done_at.append(time.perf_counter())

        thread = threading.Thread(target=copier, name="ckpt-copier")
        thread.start()
        try:
            r = training_loop(sd, local, o.ckpts, o.every, o.step_s, after_save=todo.put)
        finally:
            todo.put(None)
            thread.join()
        r["durable_s"] = (done_at[-1] if done_at else time.perf_counter()) - r.pop("t0")
        r["store_bytes"] = tree_bytes(backing)
    return r


def run_ckptfs(b: Bench, sd: dict[str, Any], o: Any, bw: float,
               stores: Path, local: Path) -> dict[str, Any]:
    store = stores / "ckptfs"
    store.mkdir()
    cfg = ckptfs_config(local / "staging", store_dir=store, bandwidth=bw)
    with ckptfs_mount(b.work, "q1-ckptfs", cfg) as m:
        r = training_loop(sd, m.path, o.ckpts, o.every, o.step_s)
        m.wait_committed(sorted(m.path.glob("ckpt_step_*.pt")))
        r["durable_s"] = time.perf_counter() - r.pop("t0")
        r["daemon_peak_rss"] = m.peak_rss()
    r["store_bytes"] = tree_bytes(store)
    return r


def store_root(work: Path, nbytes: int) -> Path:
    """/dev/shm when it can hold the checkpoints of one way (and some), else the work dir."""
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and shutil.disk_usage(shm).free > 1.5 * nbytes + GiB:
            return shm
    except OSError:
        pass
    return work


def run(b: Bench) -> dict[str, Any]:
    o = b.opts
    bw = o.store_bw
    sd = make_state_dict(o.q1_mib * MiB)
    size = state_dict_bytes(sd)
    root = o.store_dir or store_root(b.work, o.ckpts * size)
    local_root = o.local_dir or b.work
    log(f"Q1: state dict {size / MiB:.0f} MiB, {o.ckpts} checkpoints every {o.every} steps "
        f"of {o.step_s} s, store {bw / 1e6:.0f} MB/s in {root}, local disk {local_root}")
    ways: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for way, fn in (("direct", run_direct), ("local", run_local),
                    ("two-stage", run_two_stage), ("ckptfs", run_ckptfs)):
        sync_disk()
        log(f"Q1: {way}")
        t0, busy0 = time.perf_counter(), machine_busy_s()
        stores = Path(tempfile.mkdtemp(prefix="ckptfs-q1-store-", dir=root))
        local = Path(tempfile.mkdtemp(prefix="ckptfs-q1-local-", dir=local_root))
        try:
            ways[way] = fn(b, sd, o, bw, stores, local)
        except Exception:  # noqa: BLE001 (the other ways' figures are still worth printing)
            errors[way] = traceback.format_exc()
            log(f"Q1: {way} FAILED:\n{errors[way]}")
            continue
        finally:
            shutil.rmtree(stores, ignore_errors=True)  # /dev/shm is memory
            shutil.rmtree(local, ignore_errors=True)
        # Noise gauge: CPUs busy on the whole machine (this loop included) meanwhile.
        ways[way]["machine_cpus_busy"] = (machine_busy_s() - busy0) / (time.perf_counter() - t0)
        durable = ways[way]["durable_s"]
        log(f"Q1: {way}: blocked {ways[way]['blocked_s']:.2f} s, durable after "
            + ("never" if durable is None else f"{durable:.2f} s"))

    def each(key: str, fmt: str = "{:.2f}") -> str:
        return " / ".join("FAILED" if w not in ways else "-" if ways[w][key] is None
                          else fmt.format(ways[w][key]) for w in WAYS)

    def ratio(key: str, a: str, b_: str, fmt: str = "{:.2f}") -> str:
        return fmt.format(ways[a][key] / ways[b_][key]) if a in ways and b_ in ways else "n/a"

    summary = [
        ("blocked s: direct / local / two-stage / ckptfs", each("blocked_s"), ""),
        ("durable after s: direct / local / two-stage / ckptfs", each("durable_s"), ""),
        ("bytes / store bandwidth, s (what direct cannot beat)",
         f"{o.ckpts * size / bw:.2f}", "(info)"),
        ("the store keeps its bytes in; the local disk (local, two-stage, ckptfs staging) is",
         f"{root}; {local_root}", "(info)"),
        ("machine CPUs busy during: direct / local / two-stage / ckptfs",
         each("machine_cpus_busy"), "(noise)"),
        ("blocked: ckptfs / direct",
         f"**{ratio('blocked_s', 'ckptfs', 'direct', '{:.3f}')}**", "≤ 0.2"),
        ("blocked: ckptfs / two-stage", f"**{ratio('blocked_s', 'ckptfs', 'two-stage')}**",
         "≤ 2.0"),
        ("blocked: local / direct (the floor of any two-stage design here)",
         ratio("blocked_s", "local", "direct", "{:.3f}"), "(info)"),
        ("blocked: ckptfs / local", ratio("blocked_s", "ckptfs", "local"), "(info)"),
        ("durable after: ckptfs / direct", ratio("durable_s", "ckptfs", "direct"), "(info)"),
        ("durable after: ckptfs / two-stage", ratio("durable_s", "ckptfs", "two-stage"),
         "(info)"),
    ]
    summary += [(f"{way} FAILED", error_cell(tb), "")
                for way, tb in errors.items()]
    out = {"title": TITLE, "state_dict_bytes": size, "ckpts": o.ckpts, "every": o.every,
           "step_s": o.step_s, "store_bw": bw, "store_dir": str(root), "local_dir": str(local_root), "ways": ways,
           "summary": summary}
    if errors:
        out["errors"] = errors  # run_all.py exits non-zero
    return out


def plot(ax: Any, r: dict[str, Any]) -> None:
    ways = list(r["ways"])
    blocked = [r["ways"][w]["blocked_s"] for w in ways]
    durable = [r["ways"][w]["durable_s"] or 0.0 for w in ways]
    xs = range(len(ways))
    ax.bar([x - 0.2 for x in xs], blocked, 0.4, label="blocked (sum of torch.save)")
    ax.bar([x + 0.2 for x in xs], durable, 0.4, label="durable in store after")
    ax.set_xticks(list(xs), ways)
    ax.set_ylabel("seconds")
    ax.set_title(f"Q1 {r['ckpts']} x torch.save {r['state_dict_bytes'] / MiB:.0f} MiB, "
                 f"store {r['store_bw'] / 1e6:.0f} MB/s", fontsize=9)
    ax.set_ylim(top=max(blocked + durable) * 1.3)  # room for the legend
    ax.legend(fontsize=7, loc="upper left")
