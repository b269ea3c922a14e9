"""A small, unmodified PyTorch training loop that checkpoints with plain torch.save.

Nothing here knows about ckptfs: point --ckpt-dir at a ckptfs mount and every checkpoint lands
on local NVMe at once, then goes to the shared store in the background.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width),
        nn.ReLU(), nn.Linear(args.width, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start_step = 0
    latest = os.path.join(args.ckpt_dir, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            name = f.read().strip()
        state = torch.load(os.path.join(args.ckpt_dir, name), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start_step = state["step"]
        print(f"resumed from {name} at step {start_step}")

    for step in range(start_step + 1, args.steps + 1):
        x = torch.randn(64, args.width)
        y = torch.randint(0, 10, (64,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every == 0:
            name = f"ckpt_step_{step:06d}.pt"
            t0 = time.perf_counter()
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            torch.save(state, os.path.join(args.ckpt_dir, name))
            with open(latest + ".tmp", "w") as f:
                f.write(name)
            os.replace(latest + ".tmp", latest)
            blocked = time.perf_counter() - t0
            size = os.path.getsize(os.path.join(args.ckpt_dir, name))
            print(f"step {step}: loss {loss.item():.3f}, saved {name} "
                  f"({size / 2**20:.1f} MiB) in {blocked:.2f}s")


if __name__ == "__main__":
    main()
