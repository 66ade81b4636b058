"""Local steps with sparse error-fed pseudo-gradients: each rank takes H optimizer steps on its own,
then the ranks average the pseudo-gradient (parameters at the last synchronization minus now) with a
sparsecomm method and take an outer step. The added lines are marked.

    torchrun --standalone --nproc-per-node 2 examples/local_steps.py                     # gloo on CPU
    torchrun --standalone --nproc-per-node 4 examples/local_steps.py --method dense --outer nesterov  # DiLoCo
    torchrun --standalone --nproc-per-node 4 examples/local_steps.py --outer sparseloco --local-steps 16

On GPUs the same script runs on NCCL (it picks the backend and device from CUDA's availability).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import sparsecomm


def train(method: str = "topka", density: float = 0.05, local_steps: int = 4, outer: str = "nesterov",
          steps: int = 40) -> tuple[list[float], int]:
    """Train a small MLP on synthetic data with AdamW inside; returns the losses and the number of
    synchronizations."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    options = {"density": density} if method != "dense" else {}
    # <- added: broadcasts the weights from rank 0, then synchronizes every local_steps steps
    local = sparsecomm.LocalSteps(model, optimizer, method, local_steps=local_steps, outer=outer, **options)

    generator = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own data
    losses, synchronizations = [], 0
    for _ in range(steps):
        x = torch.randn(16, 16, generator=generator).to(device)
        y = x[:, :4].sum(dim=1, keepdim=True).tanh()
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        local.step()  # <- instead of optimizer.step(): every local_steps-th also synchronizes
        synchronizations += local.last_stats.calls > 0
        losses.append(loss.item())
    return losses, synchronizations


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="topka", help="a name of sparsecomm.available_methods()")
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--outer", default="nesterov", choices=["nesterov", "sparseloco", "sgd"])
    args = parser.parse_args()
    losses, synchronizations = train(args.method, args.density, args.local_steps, args.outer)
    if dist.get_rank() == 0:
        print(f"{args.method} every {args.local_steps} steps ({args.outer}): loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}, {synchronizations} synchronizations")
    dist.destroy_process_group()
