"""`sparsecomm bench pto`: LARS with and without PTO (Shi et al., section 5.4) on ResNet-50's tensors.

Every rank holds the same 161 tensors of ResNet-50's shapes (25.6M parameters) and the same random
gradients, as after an all-reduce. Timed, per P, median over calls of the slowest rank:

* the layer-wise trust ratios of eq. (11) computed by every rank (local) and by PTO (each rank its
  share of the layers, then an all-gather of the scalars);
* the all-gather alone (PTO on the same shares with an op that costs nothing), beside its formula;
* a whole ``LARS.step`` (momentum 0.9) without and with PTO.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from sparsecomm.cli.table import markdown_table
from sparsecomm.integration.lars import LARS
from sparsecomm.integration.pto import parallel_apply, pto_cost
from sparsecomm.launch.launcher import run_workers
from sparsecomm.transport.comm import Communicator

HELP = "LARS trust ratios and step time with and without PTO on ResNet-50's 161 tensors (section 4.2)"


def resnet50_shapes(classes: int = 1000) -> list[tuple[int, ...]]:
    """The parameter shapes of ResNet-50 in module order: 53 convolutions, 53 batch norms (weight and
    bias), the classifier (weight and bias) -- 161 tensors, 25.6M elements for 1000 classes."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if block == 0:
                shapes += [(4 * width, inplanes, 1, 1), (4 * width,), (4 * width,)]
            inplanes = 4 * width
    return shapes + [(classes, 2048), (classes,)]


def _timed(fn, repeat: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def _bench_worker(repeat: int, warmup: int) -> dict[str, Any]:
    comm = Communicator()
    gen = torch.Generator().manual_seed(0)  # the same tensors on every rank
    params = [torch.randn(shape, generator=gen) for shape in resnet50_shapes()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    out: dict[str, Any] = {}
    for label, opt_comm in (("local", None), ("pto", comm)):
        opt = LARS(params, lr=0.1, momentum=0.9, weight_decay=5e-5, trust_coefficient=0.001, comm=opt_comm)
        out[f"ratios_{label}"] = _timed(opt.trust_ratios, repeat, warmup)
        out[f"step_{label}"] = _timed(opt.step, repeat, warmup)
        del opt
    items = [(p, p.grad) for p in params]
    mark = comm.meter.snapshot()
    out["gather"] = _timed(lambda: parallel_apply(lambda _: torch.zeros(()), items, comm), repeat, warmup)
    traffic = comm.meter.since(mark)
    calls = repeat + warmup
    out["meter"] = (traffic.rounds // calls, traffic.bytes_sent // calls)
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--workers", default="4,8", help="comma-separated worker counts P (default 4,8)")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per worker group")


def check(args) -> None:
    from sparsecomm.cli.simulate import parse_workers

    if any(P < 2 for P in parse_workers(args.workers)):
        raise ValueError(f"--workers={args.workers}: PTO distributes over at least 2 workers")
    if args.repeat < 1 or args.warmup < 0:
        raise ValueError(f"--repeat={args.repeat} must be >= 1 and --warmup={args.warmup} >= 0")


def run(args) -> int:
    check(args)
    shapes = resnet50_shapes()
    costs = [int(torch.Size(s).numel()) for s in shapes]
    rows = []
    from sparsecomm.cli.simulate import parse_workers
    from sparsecomm_lab.bench.common import configurations

    for P in configurations(parse_workers(args.workers), "pto", lambda P: f"P={P}"):
        per_rank = run_workers(P, _bench_worker, args.repeat, args.warmup, timeout=args.timeout)

        def median_ms(key: str, per_rank=per_rank) -> float:
            return 1e3 * statistics.median(max(r[key][i] for r in per_rank) for i in range(args.repeat))

        model = pto_cost(P=P, n=len(shapes), rank=0, costs=costs)
        rows.append({
            "P": P, "tensors": len(shapes), "params (M)": sum(costs) / 1e6,
            "ratios local (ms)": median_ms("ratios_local"), "ratios PTO (ms)": median_ms("ratios_pto"),
            "speed-up": median_ms("ratios_local") / median_ms("ratios_pto"),
            "all-gather (ms)": median_ms("gather"),
            "all-gather rounds (meter/model)": f"{per_rank[0]['meter'][0]}/{model.rounds}",
            "all-gather B sent rank 0 (meter/model)": f"{per_rank[0]['meter'][1]}/{model.bytes_sent}",
            "LARS step local (ms)": median_ms("step_local"), "LARS step PTO (ms)": median_ms("step_pto"),
        })
    print(markdown_table(rows))
    print(f"\nmedian of {args.repeat} calls (after {args.warmup} warm-up) of the slowest rank, each call after a "
          "barrier; ratios = eq. (11) for every layer; all-gather = PTO with a no-op (its communication alone); "
          "step = LARS.step with momentum 0.9; float32, gloo, loopback")
    return 0
