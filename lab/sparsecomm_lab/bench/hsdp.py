"""``sparsecomm bench hsdp``: FSDP2 training steps whose replicas synchronize sparsely, against native HSDP
and FSDP2 alone, on emulated nodes.

The ranks form ``--replicas`` nodes of ``--shards`` ranks (``net="RxS:RATE"``, see
:mod:`sparsecomm.launch.netemu`): the ranks of a node share one rate-limited NIC and talk to each other
over its loopback. A replica is a node. Every worker trains, interleaved step by step (the order rotates
every step, a barrier before each step), one copy per configuration of the same MLP on the same batches,
with AdamW and gradient clipping:

* ``FSDP2 (all ranks)``: ``fully_shard`` over all ranks (1-D mesh): parameters all-gathered and
  gradients reduce-scattered across the nodes;
* ``native HSDP``: ``fully_shard`` on the 2-D mesh (replicate, shard): FSDP within a node, each shard
  all-reduced densely across the nodes;
* ``HSDP + METHOD``: FSDP2 within a node, each shard averaged across the nodes by ``METHOD`` at
  ``--density`` (:func:`sparsecomm.sparse_replicas`);
* ``no replica sync (floor)``: FSDP2 within a node and nothing across them (the replicas train apart):
  what a step costs without the replica dimension, the bound no replica synchronization can beat.

A row reports the median over the timed steps of the slowest rank's step time (forward, backward with
its communication, clipping, optimizer step), the training loss of the last step and the loss on one
held-out batch after the last step (means over the ranks), and the bytes each rank sends per step for
the replica synchronization: metered for the sparse methods, the ring all-reduce formula of its shard for
native HSDP (gloo's all-reduce runs inside the backend, where the meter cannot see it).

The model is an MLP whose square layers dominate its parameters (``--width`` x ``--width``, ``--depth``
of them, one FSDP module each) at a small batch, so that the replica all-reduce of its gradients, not
its arithmetic, is what a native HSDP step waits for on a slow link.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.launcher import run_workers
from sparsecomm.launch.netemu import LOOPBACK, parse_net, unavailable_reason
from sparsecomm.methods import MethodSpec, is_sparse
from sparsecomm.transport.collectives import ring_cost

HELP = "FSDP2 with sparse replica synchronization vs native HSDP and FSDP2 alone on emulated nodes"

FSDP_ALL, NATIVE, FLOOR = "FSDP2 (all ranks)", "native HSDP", "no replica sync (floor)"
INPUTS, OUTPUTS = 256, 16


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="replicas = emulated nodes (default 2)")
    parser.add_argument("--shards", type=int, default=2, help="ranks per replica = per node (default 2)")
    parser.add_argument("--rate", default="1gbit", help=f"each node's NIC rate, a tc rate, or {LOOPBACK} "
                        "(no emulation; default 1gbit)")
    parser.add_argument("--methods", type=_comma_list, default=["topka", "spardl"],
                        help="comma-separated sparse methods (default topka,spardl)")
    parser.add_argument("--density", type=float, default=0.01, help="density of the sparse methods (default 0.01)")
    parser.add_argument("--width", type=int, default=2048, help="width of the square layers (default 2048)")
    parser.add_argument("--depth", type=int, default=4, help="square layers, one FSDP module each (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank and step (default 8)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per configuration (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="of which untimed first (default 3)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (default 1e-3)")
    parser.add_argument("--out", default=None, help="folder to write result.md and result.json to")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")


def check(args: argparse.Namespace) -> None:
    """ValueError naming the first bad option."""
    for name in ("replicas", "shards", "width", "depth", "batch", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} must be >= 1")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"--warmup={args.warmup} must be >= 0 and below --steps={args.steps}")
    if not args.lr > 0:
        raise ValueError(f"--lr={args.lr} must be > 0")
    for name in args.methods:
        if not is_sparse(name):  # raises naming the known methods for an unknown one
            raise ValueError(f"--methods: {name!r} is not a sparse method")
        MethodSpec(name, {"density": args.density})  # a density outside (0, 1]: raises
    net = _net(args)
    if net is not None:
        parse_net(net, args.replicas * args.shards)


def _command(args: argparse.Namespace) -> str:
    """The command that repeats this run, every option spelled out."""
    options = [f"--replicas {args.replicas}", f"--shards {args.shards}", f"--rate {args.rate}",
               f"--methods {','.join(args.methods)}", f"--density {args.density:g}", f"--width {args.width}",
               f"--depth {args.depth}", f"--batch {args.batch}", f"--steps {args.steps}",
               f"--warmup {args.warmup}", f"--lr {args.lr:g}"]
    return "sparsecomm bench hsdp " + " ".join(options) + (f" --out {args.out}" if args.out else "")


def _net(args: argparse.Namespace) -> str | None:
    return None if args.rate == LOOPBACK else f"{args.replicas}x{args.shards}:{args.rate}"


class MLP(nn.Module):
    """INPUTS -> width, ``depth`` square layers (GELU, one FSDP module each), width -> OUTPUTS."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(INPUTS, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.out = nn.Linear(width, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _batch(generator: torch.Generator, batch: int, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch of the fixed random teacher ``y = tanh(x T)``."""
    x = torch.randn(batch, INPUTS, generator=generator)
    return x, torch.tanh(x @ teacher)


class _Run:
    """One configuration in a worker: its model copy (same initial weights), sharding and optimizer."""

    def __init__(self, label: str, kind: str, method: str | None, args: argparse.Namespace, meshes: dict[str, Any]):
        from torch.distributed.fsdp import fully_shard

        import sparsecomm

        self.label, self.kind = label, kind
        torch.manual_seed(0)
        self.model = model = MLP(args.width, args.depth)
        self.parameters = sum(p.numel() for p in model.parameters())
        mesh = {"fsdp": meshes["world"], "native": meshes["hsdp"]}.get(kind, meshes["hsdp"]["shard"])
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.state = None
        if method is not None:
            self.state = sparsecomm.sparse_replicas(model, meshes["hsdp"], method, density=args.density)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        self.ring_bytes = 0
        if kind == "native":  # each rank all-reduces its shard over its replica group
            replica_group = meshes["hsdp"].get_group(0)
            shard_elements = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[attr-defined]  # a DTensor
            self.ring_bytes = ring_cost(P=dist.get_world_size(replica_group), n=shard_elements,
                                        rank=dist.get_rank(replica_group)).bytes_sent

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        dist.barrier()
        start = time.perf_counter()
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        seconds = time.perf_counter() - start
        sent = float(self.state.take_stats().bytes_sent) if self.state is not None else float(self.ring_bytes)
        return {"seconds": seconds, "loss": loss.item(), "bytes": sent}

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return nn.functional.mse_loss(self.model(x), y).item()


def _worker(args: argparse.Namespace, configs: list[tuple[str, str, str | None]]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    meshes = {"world": init_device_mesh("cpu", (dist.get_world_size(),)),
              "hsdp": init_device_mesh("cpu", (args.replicas, args.shards), mesh_dim_names=("replicate", "shard"))}
    runs = [_Run(label, kind, method, args, meshes) for label, kind, method in configs]
    teacher = torch.randn(INPUTS, OUTPUTS, generator=torch.Generator().manual_seed(12345)) / INPUTS ** 0.5
    generator = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own batches
    records: dict[str, list[dict[str, float]]] = {run.label: [] for run in runs}
    for step in range(args.steps):
        x, y = _batch(generator, args.batch, teacher)
        shift = step % len(runs)
        for run in runs[shift:] + runs[:shift]:
            records[run.label].append(run.step(x, y))
    held_out = _batch(torch.Generator().manual_seed(54321), 256, teacher)  # the same on every rank
    evaluation = {run.label: run.evaluate(*held_out) for run in runs}
    return {"records": records, "eval": evaluation, "parameters": runs[0].parameters}


def _configs(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    sparse = [(f"HSDP + {name} (density {args.density:g})", "sparse", name) for name in args.methods]
    return [(FSDP_ALL, "fsdp", None), (NATIVE, "native", None), *sparse, (FLOOR, "floor", None)]


def _rows(per_rank: list[dict[str, Any]], configs: list[tuple[str, str, str | None]],
          warmup: int) -> list[dict[str, Any]]:
    rows = []
    native = None
    for label, kind, _ in configs:
        steps = range(warmup, len(per_rank[0]["records"][label]))
        seconds = statistics.median(max(r["records"][label][i]["seconds"] for r in per_rank) for i in steps)
        if kind == "native":
            native = seconds
        sent = statistics.median(statistics.mean(r["records"][label][i]["bytes"] for r in per_rank) for i in steps)
        rows.append({
            "configuration": label,
            "step time (s)": seconds,
            "x native HSDP": None,
            "final train loss": statistics.mean(r["records"][label][-1]["loss"] for r in per_rank),
            "held-out loss": statistics.mean(r["eval"][label] for r in per_rank),
            "replica sync MB sent/rank/step": "-" if kind in ("fsdp", "floor") else sent / 1e6,
        })
    for row in rows:
        row["x native HSDP"] = native / row["step time (s)"] if native else None
    return rows


def run(args: argparse.Namespace) -> int:
    check(args)
    net = _net(args)
    if net is not None:
        reason = unavailable_reason()
        if reason is not None:
            raise SystemExit(f"bench hsdp needs emulated nodes, unavailable here: {reason} (or --rate {LOOPBACK})")
    configs = _configs(args)
    P = args.replicas * args.shards
    load_start = os.getloadavg()[0]
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"{os.cpu_count()} CPUs, load average (1 min) {load_start:.2f} at the start", flush=True)
    per_rank = run_workers(P, _worker, args, configs, net=net, timeout=args.timeout)
    rows = _rows(per_rank, configs, args.warmup)
    load_end = os.getloadavg()[0]
    command = _command(args)
    notes = (f"{args.replicas} replicas x {args.shards} shards ({P} ranks) on "
             f"{'loopback (no emulated link)' if net is None else f'emulated nodes, one {args.rate} NIC per node'}; "
             f"MLP of {per_rank[0]['parameters'] / 1e6:.2f}M parameters ({args.depth} x {args.width}^2), batch "
             f"{args.batch} per rank, AdamW lr {args.lr:g}, clip 1.0; {args.steps} steps, the first {args.warmup} "
             "untimed; step time: median over the timed steps of the slowest rank; losses: means over the ranks; "
             "replica MB: metered for the sparse methods, the ring all-reduce formula for native HSDP; "
             f"{os.cpu_count()} CPUs, load average {load_start:.2f} at the start, {load_end:.2f} at the end.")
    table = markdown_table(rows)
    print()
    print(table)
    print()
    print(notes)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        date = started.strftime("%Y-%m-%d %H:%M UTC")
        (out / "result.md").write_text(f"# sparsecomm bench hsdp\n\n`{command}` ({date})\n\n{table}\n\n{notes}\n")
        (out / "result.json").write_text(json.dumps({
            "command": command, "date": date, "torch": torch.__version__, "cpus": os.cpu_count(),
            "load_average": [load_start, load_end], "args": {k: v for k, v in vars(args).items()
                                                             if isinstance(v, (int, float, str, list, type(None)))},
            "parameters": per_rank[0]["parameters"], "rows": rows,
            "per_rank": [{"records": r["records"], "eval": r["eval"]} for r in per_rank],
        }, indent=1) + "\n")
        print(f"\nwritten: {out / 'result.md'}, {out / 'result.json'}")
    return 0
