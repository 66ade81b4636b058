"""`sparsecomm bench ddp`: training step time under DDP with the sparse hook, against plain DDP and
torch's PowerSGD hook.

Every worker trains one wide MLP (>= 10M parameters by default) per configuration, all of them
alive at once, and takes one step of each configuration in turn (the order rotates every step) with
a barrier before each, so the configurations share the machine's load alike. A row reports, over the
timed steps, the median of the slowest rank's step time (forward, backward and DDP's wait, optimizer
step), the method's own seconds and the part of them that ran while backward still computed
(``Stats.hidden_time``, only the sparse hook measures it), and the bytes each rank sends per step:
metered for the sparse methods, the ring all-reduce formula (the hook's dense calls included) for
plain DDP's and PowerSGD's all-reduces, which run inside gloo.

Configurations are run in groups of ``--per-group`` (memory), and every group also runs plain DDP
and the no-synchronization floor: the ``x DDP`` and ``x floor`` columns divide by the DDP and floor
steps of the same group, measured interleaved with it.

The floor ("no sync (floor)") is the same model, batch and P workers under DDP with torch's no-op
comm hook (``noop_hook``: each bucket's local gradient is handed back unchanged, nothing is
exchanged). It keeps everything a comm hook's step pays besides the exchange (DDP's reducer and
buckets, forward, backward, optimizer), so no method that synchronizes through the hook can be
faster: ``x floor`` is how far a method is from the physical limit of a data-parallel step on this
machine. (``no_sync()`` would also skip the reducer's bucket work, a floor no hook can reach.)
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import is_sparse, sparse_methods
from sparsecomm.transport.collectives import ring_cost
from sparsecomm_lab.bench.common import network_label, parse_networks

HELP = ("DDP training step time: the no-synchronization floor, plain DDP, PowerSGD rank 2/4 and every sparse "
        "method through the hook")

#: the no-synchronization configuration's label (DDP with torch's no-op comm hook)
FLOOR_LABEL = "no sync (floor)"

POWERSGD_NOTE = ("PowerSGD runs with one bucket (bucket_cap_mb=1000): torch's powerSGD_hook aborts on gloo "
                 "with two or more buckets (torch 2.13)")


def add_arguments(parser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=4, help="worker count P (default 4)")
    parser.add_argument("--net", default="loopback,1gbit",
                        help="comma-separated networks: loopback and/or tc rates (default loopback,1gbit)")
    parser.add_argument("--methods", default="",
                        help="comma-separated sparse methods (default: every sparse method)")
    parser.add_argument("--density", type=float, default=0.01, help="sparse density (default 0.01)")
    parser.add_argument("--granularity", default="bucket",
                        help="comma-separated hook granularities to run: bucket and/or model (default bucket)")
    parser.add_argument("--powersgd-ranks", default="2,4", help="PowerSGD ranks ('' for none; default 2,4)")
    parser.add_argument("--width", type=int, default=2048, help="hidden width of the MLP (default 2048)")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers (default 3: 10.5M parameters)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step (default 64)")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per configuration (default 7)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3, >= 3)")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0,
                        help="DDP's bucket_cap_mb for DDP and the sparse hook (default 4; PowerSGD: one bucket)")
    parser.add_argument("--dense-below", type=int, default=0, help="the hook's dense_below (default 0)")
    parser.add_argument("--per-group", type=int, default=4,
                        help="configurations per worker group besides DDP (default 4; memory)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker group")


def make_mlp(width: int, depth: int, inputs: int = 512, classes: int = 10) -> nn.Sequential:
    """inputs -> width (x depth, ReLU) -> inputs -> classes; 10.5M parameters at 2048 x 3."""
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers += [nn.Linear(width, inputs), nn.ReLU(), nn.Linear(inputs, classes)]
    return nn.Sequential(*layers)


def powersgd_elements(model: nn.Module, rank: int) -> int:
    """Elements PowerSGD all-reduces per step: P and Q factors of every matrix it compresses
    (rows x rank, cols x rank) plus the tensors it leaves uncompressed (vectors, and matrices whose
    compression rate rows*cols / ((rows+cols)*rank) is below its ``min_compression_rate`` of 2)."""
    total = 0
    for param in model.parameters():
        if param.dim() < 2:
            total += param.numel()
            continue
        rows, cols = param.shape[0], param[0].numel()
        compressed = (rows + cols) * rank
        total += compressed if rows * cols >= 2 * compressed else param.numel()
    return total


def _configs(args) -> list[dict[str, Any]]:
    names = [m.strip() for m in args.methods.split(",") if m.strip()] or \
        sparse_methods()
    for name in names:
        if not is_sparse(name):
            raise ValueError(f"--methods: {name!r} is not a sparse method")
    configs: list[dict[str, Any]] = []
    for rank in (int(r) for r in args.powersgd_ranks.split(",") if r.strip()):
        configs.append({"label": f"PowerSGD rank {rank}", "kind": "powersgd", "rank": rank})
    for granularity in (g.strip() for g in args.granularity.split(",")):
        for name in names:
            label = name if granularity == "bucket" else f"{name} (model)"
            configs.append({"label": label, "kind": "sparse", "method": name, "granularity": granularity})
    return configs


class _Run:
    """One configuration inside a worker: its own model copy, DDP wrapper, hook and optimizer."""

    def __init__(self, config: dict[str, Any], width: int, depth: int, density: float, bucket_cap_mb: float,
                 dense_below: int) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        from sparsecomm.integration.hook import SparseHookState, hook

        torch.manual_seed(0)
        self.config = config
        model = make_mlp(width, depth)
        self.n = sum(p.numel() for p in model.parameters())
        cap = 1000 if config["kind"] == "powersgd" else bucket_cap_mb
        self.net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap, gradient_as_bucket_view=True)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.01)
        self.state: Any = None
        self.modelled_elements = 0
        if config["kind"] == "powersgd":
            self.state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=config["rank"],
                                                start_powerSGD_iter=2, random_seed=0)
            self.net.register_comm_hook(self.state, powersgd.powerSGD_hook)
            self.modelled_elements = powersgd_elements(model, config["rank"])
        elif config["kind"] == "sparse":
            self.state = SparseHookState(None, config["method"], density=density,
                                         granularity=config["granularity"], dense_below=dense_below)
            self.net.register_comm_hook(self.state, hook)
        elif config["kind"] == "nosync":
            from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

            self.net.register_comm_hook(None, noop_hook)
        else:
            self.modelled_elements = self.n

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        dist.barrier()
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(self.net(x), y).backward()
        self.opt.step()
        seconds = time.perf_counter() - start
        P, rank = dist.get_world_size(), dist.get_rank()
        if self.config["kind"] != "sparse":
            sent = 0.0 if self.config["kind"] == "nosync" else \
                ring_cost(P=P, n=self.modelled_elements, rank=rank, itemsize=4).bytes_sent
            return {"seconds": seconds, "bytes": sent, "method": float("nan"), "hidden": float("nan")}
        stats = self.state.take_stats()
        return {"seconds": seconds, "bytes": stats.bytes_sent, "method": stats.time_total,
                "hidden": stats.hidden_time, "dense_calls": stats.dense_calls, "fallback": stats.dense_fallback}


def _worker(configs: list[dict[str, Any]], width: int, depth: int, batch: int, density: float,
            warmup: int, steps: int, bucket_cap_mb: float, dense_below: int) -> dict[str, Any]:
    rank = dist.get_rank()
    runs = [_Run(c, width, depth, density, bucket_cap_mb, dense_below) for c in configs]
    records: dict[str, list[dict[str, float]]] = {c["label"]: [] for c in configs}
    gen = torch.Generator().manual_seed(rank)
    for step in range(warmup + steps):
        x, y = torch.randn(batch, 512, generator=gen), torch.randint(10, (batch,), generator=gen)
        shift = step % len(runs)
        for run in runs[shift:] + runs[:shift]:
            figures = run.step(x, y)
            if step >= warmup:
                records[run.config["label"]].append(figures)
    for run in runs:
        if run.config["kind"] == "sparse":
            run.state.close()
    return {"n": runs[0].n, "records": records}


def _median_slowest(per_rank: list[dict[str, Any]], label: str, key: str) -> float:
    steps = len(per_rank[0]["records"][label])
    return statistics.median(max(r["records"][label][i][key] for r in per_rank) for i in range(steps))


def _median_mean(per_rank: list[dict[str, Any]], label: str, key: str) -> float:
    steps = len(per_rank[0]["records"][label])
    return statistics.median(statistics.mean(r["records"][label][i][key] for r in per_rank) for i in range(steps))


def run(args) -> int:
    if args.warmup < 3:
        raise ValueError(f"--warmup={args.warmup}: needs >= 3 (PowerSGD compresses from its step 2 on)")
    configs = _configs(args)
    ddp = {"label": "DDP", "kind": "ddp"}
    floor = {"label": FLOOR_LABEL, "kind": "nosync"}
    groups = [configs[i:i + args.per_group] for i in range(0, len(configs), args.per_group)] or [[]]
    rows, notes, n = [], set(), 0
    for net in parse_networks(args.net):
        for group in groups:
            per_rank = run_workers(args.workers, _worker, [floor, ddp] + group, args.width, args.depth, args.batch,
                                   args.density, args.warmup, args.steps, args.bucket_cap_mb, args.dense_below,
                                   net=net, timeout=args.timeout)
            n = per_rank[0]["n"]
            reference = _median_slowest(per_rank, "DDP", "seconds")
            floor_s = _median_slowest(per_rank, FLOOR_LABEL, "seconds")
            for config in ([floor, ddp] if group is groups[0] else []) + group:
                label = config["label"]
                seconds = _median_slowest(per_rank, label, "seconds")
                row: dict[str, Any] = {"network": network_label(net), "configuration": label,
                                       "step (ms)": 1e3 * seconds, "floor in group (ms)": 1e3 * floor_s,
                                       "x floor": seconds / floor_s, "DDP in group (ms)": 1e3 * reference,
                                       "x DDP": seconds / reference,
                                       "MB sent/rank/step": _median_mean(per_rank, label, "bytes") / 1e6}
                if config["kind"] == "sparse":
                    method = _median_mean(per_rank, label, "method")
                    hidden = _median_mean(per_rank, label, "hidden")
                    row.update({"method (ms)": 1e3 * method, "hidden (%)": 100 * hidden / method if method else 0.0,
                                "bytes": "metered"})
                    if any(rec.get("fallback") for r in per_rank for rec in r["records"][label]):
                        notes.add(f"{label}: one node, dense fallback (stats.dense_fallback)")
                else:
                    row.update({"method (ms)": "", "hidden (%)": "",
                                "bytes": "none" if config["kind"] == "nosync" else "ring formula"})
                rows.append(row)
            print(f"done: {network_label(net)}, {', '.join(c['label'] for c in group)}", file=sys.stderr, flush=True)
    columns = ["network", "configuration", "step (ms)", "x floor", "floor in group (ms)", "x DDP",
               "DDP in group (ms)", "method (ms)", "hidden (%)", "MB sent/rank/step", "bytes"]
    print(markdown_table(rows, columns))
    print(f"\nP={args.workers}, MLP {n / 1e6:.1f}M parameters (width {args.width}, depth {args.depth}), batch "
          f"{args.batch}/rank, density {args.density}; median over {args.steps} interleaved steps (after "
          f"{args.warmup}) of the slowest rank. x floor: against the no-synchronization step (DDP with torch's "
          f"no-op hook: nothing exchanged) in the same worker group; x DDP: against DDP there. hidden: the "
          f"method's seconds that ran before DDP handed over its last bucket (behind backward). DDP and "
          f"sparse hooks: bucket_cap_mb={args.bucket_cap_mb:g}, hook dense_below={args.dense_below}. {POWERSGD_NOTE}.")
    for note in sorted(notes):
        print(f"Note: {note}.")
    return 0
