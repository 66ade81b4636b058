"""Sparse gradient synchronization in a PyTorch Lightning DDP run.

Run on one machine with two CPU processes (or on GPUs, one process per GPU):

    torchrun --nproc-per-node 2 examples/lightning_ddp.py

Lightning takes a DDP communication hook through ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``,
but registers it only when the root device is CUDA (``DDPStrategy._register_ddp_hooks`` in
lightning 2.x). On CPU it registers none and says nothing: the run is plain DDP. The callback below
registers the hook itself in ``on_train_start`` when Lightning did not, so the same script uses
sparse communication on CPU and on GPU. ``tests/test_examples.py`` checks both facts.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sparsecomm


class RegisterCommHookOnCPU(L.Callback):
    """Register ``hook`` on the DDP model at the start of training unless Lightning already did
    (it does so on CUDA only)."""

    def __init__(self, state, hook) -> None:
        self.state, self.hook = state, hook

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, DDPStrategy) and strategy.root_device.type != "cuda":
            strategy.model.register_comm_hook(self.state, self.hook)


class Regression(L.LightningModule):
    """A small MLP regression: enough parameters for sparsification to matter, quick on a CPU."""

    def __init__(self, width: int = 64, lr: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 1))
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def synthetic_data(samples: int = 256, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    y = (x[:, :4].sum(dim=1, keepdim=True)).tanh()
    return TensorDataset(x, y)


def train(method: str | None = "topka", density: float = 0.05, register_on_cpu: bool = True,
          max_steps: int = 20, hook=sparsecomm.hook) -> list[float]:
    """Train under ``DDPStrategy`` with ``method``'s comm hook (``None``: plain DDP); return this
    rank's losses. ``register_on_cpu=False`` leaves the hook to Lightning alone."""
    torch.manual_seed(0)
    model = Regression()
    callbacks = []
    if method is None:
        strategy = DDPStrategy()
    else:
        state = sparsecomm.SparseHookState(None, method=method, density=density)
        strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)
        if register_on_cpu:
            callbacks.append(RegisterCommHookOnCPU(state, hook))
    trainer = L.Trainer(accelerator="cpu", devices=int_env("LOCAL_WORLD_SIZE", 1),
                        num_nodes=int_env("GROUP_WORLD_SIZE", 1), strategy=strategy, callbacks=callbacks,
                        max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(synthetic_data(), batch_size=16)
    trainer.fit(model, loader)
    return model.losses


def int_env(name: str, default: int) -> int:
    import os

    return int(os.environ.get(name, default))


if __name__ == "__main__":
    losses = train()
    if int_env("RANK", 0) == 0:
        print(f"loss: first step {losses[0]:.4f}, last step {losses[-1]:.4f}")
