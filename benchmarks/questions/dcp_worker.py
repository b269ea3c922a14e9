"""One rank of a timed torch.distributed.checkpoint save or load (Q4 of run_all.py).

    python benchmarks/questions/dcp_worker.py save --rank R --world 4 --init F --mib 1024 \
        --ckpt plain=/tmp/plain/step_1 --ckpt ckptfs=/mnt/ckptfs/step_1
    python benchmarks/questions/dcp_worker.py load --rank R --world 2 --init F --mib 1024 \
        --ckpt plain=/tmp/plain/step_1 --ckpt ckptfs=/mnt/ckptfs/step_1

gloo on CPU, rendezvous through a FileStore (``--init``, off the mount). The state dict: fp32
matrices of 4096 columns, --mib MiB in all, as DTensors sharded on dim 0 over a 1-D mesh of
``world`` ranks (save with 4 ranks and load with 2 reshards), plus a small plain tensor.
The clock of rank 0 runs from a barrier before ``dcp.save`` / ``dcp.load`` to a barrier after
it: the time every rank is blocked. Every ``--ckpt NAME=DIR`` is done in turn by the same
processes (so torch and the process group start once); rank 0 prints
``RESULT {"seconds": {NAME: s, ...}}``. The load checks
one row of every shard against the regenerated value (cheap, catches a wrong or empty read).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

COLS = 4096
ROWS_MAX = 4096  # 64 MiB per tensor at most


def shapes(mib: int) -> list[tuple[int, int]]:
    rows_total = max(8, mib * 1024 * 1024 // (4 * COLS))
    out = []
    while rows_total > 0:
        rows = min(ROWS_MAX, rows_total)
        out.append((max(rows, 8), COLS))
        rows_total -= rows
    return out


def value(i: int, shape: tuple[int, int]) -> torch.Tensor:
    # arange-based, cheap to make for GiBs, different in every tensor
    return (torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) + i * 0.5)


def one(a: argparse.Namespace, mesh: object, path: str) -> float:
    """Save or load one checkpoint at ``path``; seconds between the barriers around it."""
    sd = {}
    for i, shape in enumerate(shapes(a.mib)):
        full = value(i, shape) if a.mode == "save" else torch.full(shape, -7.0)
        sd[f"layer{i}.weight"] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    sd["step"] = torch.tensor(a.mib if a.mode == "save" else -1)
    dist.barrier()
    t0 = time.perf_counter()
    if a.mode == "save":
        dcp.save(sd, checkpoint_id=path)
    else:
        dcp.load(sd, checkpoint_id=path)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if a.mode == "load":
        for i, shape in enumerate(shapes(a.mib)):
            local = sd[f"layer{i}.weight"].to_local()
            want = distribute_tensor(value(i, shape), mesh, [Shard(0)],
                                     src_data_rank=None).to_local()
            if local.shape != want.shape or not torch.equal(local[:1], want[:1]):
                raise AssertionError(f"rank {a.rank}: layer{i} differs after load of {path}")
        if int(sd["step"]) != a.mib:
            raise AssertionError(f"rank {a.rank}: step is {int(sd['step'])} in {path}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--ckpt", action="append", required=True,
                   help="NAME=DIR, repeatable: saved (loaded) in this order, one after another")
    p.add_argument("--mib", type=int, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.abspath(a.init)}",
                            rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        mesh = init_device_mesh("cpu", (a.world,))
        times = {}
        for target in a.ckpt:  # one process group for every target: torch starts once
            name, path = target.split("=", 1)
            times[name] = one(a, mesh, path)
        if a.rank == 0:
            print(f"RESULT {json.dumps({'seconds': times})}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
