"""One rank of a torch.distributed.checkpoint (DCP) save or load, for the real-mount tests.

Run as its own process, one per rank (see ``run_ranks`` in tests/test_torch_mount.py)::

    python tests/dcp_worker.py save --rank R --world 4 --init /tmp/x/filestore --ckpt /mnt/step_1
    python tests/dcp_worker.py load --rank R --world 2 --init /tmp/x/filestore2 --ckpt /mnt/step_1

Process group: gloo on CPU, rendezvous through a FileStore (``file://`` init method, a fresh
file off the mount per group). The state dict is described by ``SPEC`` and generated from a seed,
so the loader (and the test process) can rebuild the expected values without the checkpoint.

``save`` shards every DTensor with its save placement over a 1-D mesh of ``world`` ranks.
``load`` starts from a state dict of the same structure filled with sentinel values and sharded
with the *load* placement over a mesh of ``world`` ranks (resharding), loads the checkpoint into
it, checks every value against the regenerated original and prints one line
``RESULT <json>`` with the sha256 of every loaded value, which the test compares to its own.
Any mismatch raises, so the process exits non-zero.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

# name -> (global shape, dtype, placement when saving, placement when loading).
# About 78 MiB in all. Uneven sizes on purpose (1001 rows, 1030 columns): shards of unequal
# length, and a load placement that differs from the save placement forces a real reshard.
SPEC: dict[str, tuple[tuple[int, ...], torch.dtype, Placement, Placement]] = {
    "model.embed.weight": ((8192, 2048), torch.float32, Shard(0), Shard(1)),
    "model.layers.0.attn.weight": ((1001, 2048), torch.float32, Shard(0), Shard(0)),
    "model.layers.0.mlp.weight": ((2048, 1030), torch.bfloat16, Shard(1), Shard(0)),
    "model.norm.weight": ((2048,), torch.float32, Replicate(), Shard(0)),
}
# Plain (non-DTensor) tensors, the same on every rank: DCP writes them once.
PLAIN: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "optim.exp_avg_sq": ((3, 4096), torch.int64),
    "optim.step": ((), torch.int64),
}


def full_tensor(name: str, seed: int) -> torch.Tensor:
    """The global value of tensor ``name`` for checkpoint ``seed`` (deterministic)."""
    names = sorted([*SPEC, *PLAIN])
    g = torch.Generator().manual_seed(seed * 1000 + names.index(name))
    shape, dtype = (SPEC[name][:2] if name in SPEC else PLAIN[name])
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


def extra_value(seed: int) -> dict[str, Any]:
    """Non-tensor entries (DCP pickles them as bytes items)."""
    return {"epoch": seed % 97, "run": f"run-{seed}-\u00e9", "lrs": [0.1 * seed, 1e-5]}


def digest(t: torch.Tensor) -> str:
    """sha256 over dtype, shape and the raw bytes of ``t``."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def expected_digests(seed: int) -> dict[str, str]:
    out = {name: digest(full_tensor(name, seed)) for name in [*SPEC, *PLAIN]}
    out["extra"] = hashlib.sha256(json.dumps(extra_value(seed), sort_keys=True).encode()).hexdigest()
    return out


def build_state_dict(mesh: Any, seed: int, *, for_load: bool) -> dict[str, Any]:
    sd: dict[str, Any] = {"model": {}, "optim": {}}
    for name, (shape, dtype, save_pl, load_pl) in SPEC.items():
        if for_load:
            value = torch.full(shape, -7, dtype=dtype)  # sentinel: must be overwritten
            placement = load_pl
        else:
            value = full_tensor(name, seed)
            placement = save_pl
        # src_data_rank=None: every rank slices its shard locally, no scatter.
        dt = distribute_tensor(value, mesh, [placement], src_data_rank=None)
        group, key = name.split(".", 1)
        sd[group][key] = dt
    for name, (shape, dtype) in PLAIN.items():
        value = torch.full(shape, -7, dtype=dtype) if for_load else full_tensor(name, seed)
        group, key = name.split(".", 1)
        sd[group][key] = value
    sd["extra"] = (
        {"epoch": -1, "run": "", "lrs": [0.0, 0.0]} if for_load else extra_value(seed)
    )
    return sd


def check_loaded(sd: dict[str, Any], mesh: Any, seed: int, rank: int) -> dict[str, str]:
    """Compare every loaded value with the regenerated original; return digests of full values."""
    got: dict[str, str] = {}
    for name, (_shape, _dtype, _save_pl, load_pl) in SPEC.items():
        group, key = name.split(".", 1)
        dt = sd[group][key]
        assert isinstance(dt, DTensor), f"{name}: loaded value is {type(dt)}, not a DTensor"
        assert tuple(dt.placements) == (load_pl,), f"{name}: placements {dt.placements}"
        full = full_tensor(name, seed)
        want_local = distribute_tensor(full, mesh, [load_pl], src_data_rank=None).to_local()
        local = dt.to_local()
        if not torch.equal(local, want_local):
            bad = (local != want_local).sum().item() if local.shape == want_local.shape else "shape"
            raise AssertionError(f"rank {rank}: local shard of {name} differs ({bad} elements)")
        gathered = dt.full_tensor()  # collective: every rank runs this in the same order
        if not torch.equal(gathered, full):
            raise AssertionError(f"rank {rank}: full value of {name} differs")
        got[name] = digest(gathered)
    for name in PLAIN:
        group, key = name.split(".", 1)
        value = sd[group][key]
        if not torch.equal(value, full_tensor(name, seed)):
            raise AssertionError(f"rank {rank}: plain tensor {name} differs")
        got[name] = digest(value)
    if sd["extra"] != extra_value(seed):
        raise AssertionError(f"rank {rank}: extra differs: {sd['extra']!r}")
    got["extra"] = hashlib.sha256(json.dumps(sd["extra"], sort_keys=True).encode()).hexdigest()
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True, help="FileStore path (off the mount, unused yet)")
    p.add_argument("--ckpt", required=True, help="checkpoint directory")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.abspath(args.init)}", rank=args.rank,
        world_size=args.world, timeout=datetime.timedelta(seconds=120),
    )
    try:
        mesh = init_device_mesh("cpu", (args.world,))
        if args.mode == "save":
            sd = build_state_dict(mesh, args.seed, for_load=False)
            dcp.save(sd, checkpoint_id=args.ckpt)
            print(f"RESULT {json.dumps({'rank': args.rank, 'saved': True})}", flush=True)
        else:
            sd = build_state_dict(mesh, args.seed, for_load=True)
            dcp.load(sd, checkpoint_id=args.ckpt)
            got = check_loaded(sd, mesh, args.seed, args.rank)
            print(f"RESULT {json.dumps({'rank': args.rank, 'digests': got})}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
