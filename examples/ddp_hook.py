"""A plain DDP training script with sparse gradient synchronization: the one added line is marked.

    torchrun --standalone --nproc-per-node 2 examples/ddp_hook.py            # gloo on CPU
    torchrun --standalone --nproc-per-node 4 examples/ddp_hook.py --method spardl --density 0.01

On GPUs the same script runs on NCCL (it picks the backend and device from CUDA's availability).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm


def train(method: str | None = "topka", density: float = 0.05, steps: int = 20, hook=sparsecomm.hook) -> list[float]:
    """Train a small MLP on synthetic data under DDP; ``method=None`` is plain DDP. Returns the losses."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    cuda = dist.get_backend() == "nccl"  # a gloo group (e.g. sparsecomm.run_workers) trains on the CPU
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).to(device),
                device_ids=[device] if cuda else None)
    if method is not None:
        model.register_comm_hook(sparsecomm.SparseHookState(None, method=method, density=density), hook)  # <- added
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own data
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 16, generator=generator).to(device)
        y = x[:, :4].sum(dim=1, keepdim=True).tanh()
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # the hook averages each gradient bucket with the sparse method
        optimizer.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="topka", help="a name of sparsecomm.available_methods()")
    parser.add_argument("--density", type=float, default=0.05)
    args = parser.parse_args()
    losses = train(args.method, args.density)
    if dist.get_rank() == 0:
        print(f"{args.method} at density {args.density}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()
