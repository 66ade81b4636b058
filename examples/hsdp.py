"""An FSDP2 training script whose replicas synchronize with a sparse method (HSDP with a sparse
replica dimension): the one added line is marked.

    torchrun --standalone --nproc-per-node 4 examples/hsdp.py                 # 2 replicas x 2 shards, gloo
    torchrun --standalone --nproc-per-node 6 examples/hsdp.py --replicas 3 --method spardl --density 0.01
    torchrun --standalone --nproc-per-node 4 examples/hsdp.py --method none   # native HSDP, for comparison

Each replica shards the model over its ranks with ``fully_shard(..., mesh=mesh["shard"])`` (FSDP2
within a node); ``sparsecomm.sparse_replicas`` averages each shard's gradient over the replicas (across
nodes) with the method. AdamW, gradient clipping on the sharded parameters and bf16 mixed precision
(reduced in fp32) run as they would under FSDP2 alone. On GPUs the same script runs on NCCL.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import sparsecomm


class Model(nn.Module):
    """An input layer, a stack of residual MLP blocks (one FSDP module each) and an output layer."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def train(method: str | None = "topka", density: float = 0.05, steps: int = 20, replicas: int = 2,
          bf16: bool = False) -> list[float]:
    """Train the model on synthetic data for ``steps`` steps; ``method=None`` is native HSDP (a 2-D
    mesh). Returns this rank's losses."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    cuda = dist.get_backend() == "nccl"  # a gloo group (run_workers) trains on the CPU
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    if world % replicas:
        raise ValueError(f"--replicas={replicas} must divide the world size {world}")
    device = torch.device("cuda" if cuda else "cpu")
    mesh = init_device_mesh(device.type, (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Model().to(device)
    shard_mesh = mesh if method is None else mesh["shard"]  # native HSDP shards on the 2-D mesh
    policy = MixedPrecisionPolicy()
    if bf16:  # bf16 compute, gradients reduced in fp32; the model's output (only) back in fp32 for the loss
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh, mp_policy=policy)
    root_policy = MixedPrecisionPolicy(policy.param_dtype, policy.reduce_dtype, output_dtype=torch.float32)
    fully_shard(model, mesh=shard_mesh, mp_policy=root_policy)
    if method is not None:
        sparsecomm.sparse_replicas(model, mesh, method, density=density)  # <- added
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    generator = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own data
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=generator).to(device)
        y = x[:, :4].sum(dim=1, keepdim=True).tanh()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # each shard's gradient: reduce-scattered in the replica, then sparse across replicas
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="topka", help="a name of sparsecomm.available_methods(), or none")
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=2, help="replicas (the rest of the ranks shard)")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters, gradients reduced in fp32")
    args = parser.parse_args()
    losses = train(None if args.method == "none" else args.method, args.density, args.steps, args.replicas,
                   args.bf16)
    if dist.get_rank() == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {args.steps} steps")
    dist.destroy_process_group()
