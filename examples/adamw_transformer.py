"""AdamW with sparse synchronization: a small transformer trained with the synchronizer's recipe for
Adam (the second moment frozen after a dense warm-up, the gradient preconditioned by it before
selection, DGC momentum correction in that space). The lines that differ from a plain loop are marked.

    torchrun --standalone --nproc-per-node 2 examples/adamw_transformer.py
    torchrun --standalone --nproc-per-node 4 examples/adamw_transformer.py --density 0.01 --steps 200
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import sparsecomm


def train(density: float = 0.05, steps: int = 30, warmup: int = 10, sparse: bool = True) -> list[float]:
    """Train a 2-layer transformer on a synthetic copy task; ``sparse=False`` averages densely with the
    same optimizer (the recipe's dense twin). Returns the losses."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    vocab, width, length = 64, 32, 16
    embed = nn.Embedding(vocab, width)
    layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=64, batch_first=True, norm_first=True)
    model = nn.ModuleDict({"embed": embed, "blocks": nn.TransformerEncoder(layer, num_layers=2),
                           "head": nn.Linear(width, vocab)}).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sync = sparsecomm.SparseSynchronizer(                                          # <- added
        model, optimizer, method="topka" if sparse else "dense", dense_warmup_steps=warmup,
        dense_warmup_dtype=torch.bfloat16, freeze_adam_variance=True,
        momentum_correction=0.9 if sparse else None, clip_norm=1.0, **({"density": density} if sparse else {}))
    generator = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own data
    losses = []
    for _ in range(steps):
        tokens = torch.randint(vocab, (8, length), generator=generator).to(device)
        logits = model["head"](model["blocks"](model["embed"](tokens)))
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1))  # learn to copy
        optimizer.zero_grad()
        loss.backward()
        sync.step()                                                                # <- instead of optimizer.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    losses = train(args.density, args.steps)
    if dist.get_rank() == 0:
        print(f"topka at density {args.density} with the AdamW recipe: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()
