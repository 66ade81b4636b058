"""Sparse gradient synchronization in a Hugging Face Accelerate training loop.

Run on one machine with two CPU processes (or with ``accelerate launch``, one process per GPU):

    torchrun --nproc-per-node 2 examples/accelerate_ddp.py

Accelerate's own option for communication hooks, ``DistributedDataParallelKwargs(comm_hook=...)``,
takes only a ``DDPCommunicationHookType`` (fp16, bf16, PowerSGD): it has no place for a custom
hook (accelerate 1.x, ``utils/dataclasses.py``). But in a multi-process run ``accelerator.prepare``
returns the model wrapped in torch's ``DistributedDataParallel``, and torch's
``register_comm_hook`` on it takes any hook. Register it after ``prepare`` and before the first
backward, as below. ``tests/test_examples.py`` checks that the hook runs every step and changes the
result against plain DDP.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import sparsecomm


def synthetic_data(samples: int = 256, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    y = (x[:, :4].sum(dim=1, keepdim=True)).tanh()
    return TensorDataset(x, y)


def train(method: str | None = "topka", density: float = 0.05, steps: int = 20,
          hook=sparsecomm.hook) -> list[float]:
    """Train a small MLP with ``method``'s comm hook (``None``: plain DDP); return this rank's losses."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(synthetic_data(), batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if method is not None:
        if not isinstance(model, DistributedDataParallel):
            raise RuntimeError("a comm hook needs a multi-process run: launch with torchrun or accelerate launch")
        model.register_comm_hook(sparsecomm.SparseHookState(None, method=method, density=density), hook)

    losses: list[float] = []
    while len(losses) < steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses


if __name__ == "__main__":
    losses = train()
    if Accelerator().is_main_process:
        print(f"loss: first step {losses[0]:.4f}, last step {losses[-1]:.4f}")
