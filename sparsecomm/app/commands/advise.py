"""`sparsecomm advise`: which method, density and options to use for a model on a cluster.

Every method at every candidate density is run through the simulator (:mod:`sparsecomm.app.simulator`,
the engine of ``sparsecomm simulate``): communication from its cost formula at the latency and bandwidth
given (or a profile's), plus the per-step work measured by ``sparsecomm calibrate`` when ``--profile``
is given. The recommendation is the fastest predicted method; its density is the largest candidate
whose predicted step is within ``--density-slack`` of that method's fastest (a lower density saves
time but costs accuracy: see docs/training.md). Each line says what the prediction rests on.

``--measure`` checks the advice on this machine (so the prediction takes the workers as colocated on
its cores, as ``--colocated``): every ranked method runs at its chosen density in one group of ``-P``
forked workers (on ``--net``, an emulated link, or loopback), interleaved: each round
calls every method once, in a rotated order, so that the load of a shared machine falls on all of them
alike. A method's measured time is its best round (the least of the slowest rank's call times: the call
least disturbed by other processes, the statistic ``calibrate`` fits the profile on); the median is
shown beside it. The advised method's time is compared with the measured fastest (docs/advise.md).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from ..report_table import markdown_table
from ..simulator import Prediction, UnknownMethodError, predict

HELP = "recommend a method, density and options for a model size, P and network (from the simulator)"


def add_arguments(parser) -> None:
    from .simulate import add_model_arguments

    what = parser.add_mutually_exclusive_group()
    what.add_argument("--params", default=None, help="model size in parameters, e.g. 25M or 340M")
    what.add_argument("--model", default=None, help="a model of sparsecomm's (its parameters are counted)")
    what.add_argument("--model-file", default=None, help="a saved model or state dict (torch.save); its "
                      "tensors' elements are counted")
    parser.add_argument("--data", default=None, help="with --model: the data set that sizes it (default: the "
                        "model's first)")
    parser.add_argument("--workers", "-P", type=int, default=8, help="worker count P (default: %(default)s)")
    parser.add_argument("--latency", default=None, help="latency per message, e.g. 50us (same as --alpha)")
    parser.add_argument("--densities", default="0.1,0.01,0.001",
                        help="candidate densities (default: %(default)s)")
    parser.add_argument("--density-slack", type=float, default=0.10,
                        help="take the largest density within this fraction of the method's fastest "
                        "(default: %(default)s)")
    parser.add_argument("--top", type=int, default=5, help="alternatives listed (default: %(default)s)")
    add_model_arguments(parser, methods="all")
    parser.add_argument("--measure", action="store_true", help="also run every ranked method here, interleaved, "
                        "and compare the advice with the measured fastest (implies --colocated: the measured "
                        "workers share this machine's cores)")
    parser.add_argument("--net", default=None, help="with --measure: the emulated link the workers measure on, a tc "
                        "rate such as 1gbit (default: loopback)")
    parser.add_argument("--rounds", type=int, default=5, help="with --measure: timed rounds (default: %(default)s)")


@dataclass(frozen=True)
class Advice:
    """The recommendation and the ranked alternatives (one per method, its chosen density)."""

    best: Prediction
    dense: Prediction
    ranked: list[Prediction]
    n: int


def count_parameters(args) -> int:
    """n from --params, --model (+ --data) or --model-file (ValueError when none or unusable)."""
    from ..bench.common import parse_count

    if args.params:
        return parse_count(args.params)
    if args.model:
        from ..data import load_dataset
        from ..models import MODEL_DATA, available_models, make_model

        if args.model not in available_models():
            raise ValueError(f"unknown model {args.model!r}; available: {', '.join(available_models())}")
        data = args.data or MODEL_DATA[args.model][0]
        model = make_model(args.model, load_dataset(data).info)
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    if args.model_file:
        return _count_saved(args.model_file)
    raise ValueError("give the model size: --params N, --model NAME or --model-file PATH")


def _count_saved(path: str) -> int:
    import torch

    try:
        obj: Any = torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError) as err:
        raise ValueError(f"--model-file {path!r} cannot be loaded by torch.load: {err}") from None
    if isinstance(obj, torch.nn.Module):
        return sum(p.numel() for p in obj.parameters() if p.requires_grad)

    def count(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() if x.is_floating_point() else 0
        if isinstance(x, dict):
            return sum(count(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(count(v) for v in x)
        return 0

    total = count(obj.get("model", obj) if isinstance(obj, dict) else obj)
    if total == 0:
        raise ValueError(f"--model-file {path!r} holds no floating-point tensors")
    return total


def advise(methods: list[str], P: int, n: int, densities: list[float], slack: float = 0.10,
           **kwargs: Any) -> Advice:
    """Rank methods by predicted step time at their chosen density (see the module docstring)."""
    from ...methods import is_sparse

    if not densities or any(not 0 < d <= 1 for d in densities):
        raise ValueError(f"densities {densities} must be fractions in (0, 1]")
    dense = predict("dense", P, n, 1.0, **kwargs)
    chosen = []
    for name in methods:
        if not is_sparse(name):
            chosen.append(predict(name, P, n, 1.0, **kwargs))
            continue
        options = [predict(name, P, n, d, **kwargs) for d in sorted(densities, reverse=True)]
        fastest = min(p.total_s for p in options)
        chosen.append(next(p for p in options if p.total_s <= (1 + slack) * fastest))
    ranked = sorted(chosen, key=lambda p: p.total_s)
    return Advice(ranked[0], dense, ranked, n)


def _measure_worker(plan: list[tuple[str, float]], n: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Every rank: each (method, density) of ``plan`` once per round, the order rotated by one each round,
    a barrier before each call; this rank's call times after ``warmup`` untimed rounds."""
    import torch
    import torch.distributed as dist

    from ...methods import MethodSpec

    gen = torch.Generator().manual_seed(7919 * dist.get_rank() + 1)
    base = torch.randn(n, generator=gen)
    work = torch.empty_like(base)
    built = {name: MethodSpec.at_density(name, d).build() for name, d in plan}
    times: dict[str, list[float]] = {name: [] for name, _ in plan}
    names = [name for name, _ in plan]
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            work.copy_(base)
            dist.barrier()
            start = time.perf_counter()
            built[name](work)
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def measure(ranked: list[Prediction], P: int, n: int, net: str | None, rounds: int, warmup: int = 1,
            timeout: float = 3600.0) -> dict[str, dict[str, float]]:
    """Method -> {"best", "median"} over rounds of the slowest rank's call time, all methods interleaved
    in one worker group."""
    from ..launcher import run_workers

    per_rank = run_workers(P, _measure_worker, [(p.method, p.density) for p in ranked], n, rounds, warmup,
                           net=net, timeout=timeout)
    out = {}
    for p in ranked:
        slowest = [max(r[p.method][i] for r in per_rank) for i in range(rounds)]
        out[p.method] = {"best": min(slowest), "median": statistics.median(slowest)}
    return out


def check_against(result: Advice, measured: dict[str, float], tolerance: float = 0.10) -> dict[str, Any]:
    """The advised method's measured time against the measured fastest: within ``tolerance`` or not."""
    fastest = min(measured, key=measured.__getitem__)
    ratio = measured[result.best.method] / measured[fastest]
    return {"advised": result.best.method, "advised_s": measured[result.best.method], "fastest": fastest,
            "fastest_s": measured[fastest], "ratio": ratio, "ok": ratio <= 1 + tolerance}


def run(args) -> int:
    from .simulate import fail, method_names, model_kwargs

    try:
        if args.rounds < 1:
            raise ValueError(f"--rounds={args.rounds} must be >= 1")
        if args.measure:
            args.colocated = True  # the advice checked is the one for the workers measured here
        if args.net is not None:
            from ..netemu import parse_net

            parse_net(args.net, args.workers)
        if args.latency and args.alpha:
            raise ValueError("give --latency or --alpha, not both")
        args.alpha = args.alpha or args.latency
        methods = method_names(args.methods)
        densities = [float(d) for d in args.densities.split(",")]
        if args.workers < 1:
            raise ValueError(f"-P {args.workers} must be >= 1")
        n = count_parameters(args)
        kwargs = model_kwargs(args)
        result = advise(methods, args.workers, n, densities, args.density_slack, **kwargs)
    except (UnknownMethodError, ValueError) as err:
        return fail("advise", str(err))
    best, dense = result.best, result.dense
    profile = kwargs["profile"]
    print(f"model: {n:,} parameters; P={args.workers}; "
          + (f"profile {args.profile} ({profile.net})" if profile else "no profile (communication only)"))
    density = f"density {best.density:g}" if best.density < 1 else "dense"
    print(f"recommended: {best.method} ({density}, default options): predicted {1e3 * best.total_s:.1f} ms "
          f"per step vs DDP {1e3 * dense.total_s:.1f} ms ({dense.total_s / best.total_s:.2f}x)")
    print(f"rests on: {best.rests_on}")
    rows = [{"method": p.method, "density": p.density, "step (ms)": 1e3 * p.total_s, "comm (ms)": 1e3 * p.comm_s,
             "work (ms)": 1e3 * p.work_s, "vs DDP": dense.total_s / p.total_s} for p in result.ranked[:args.top]]
    print(markdown_table(rows, list(rows[0])))
    print("Predicted communication and sparsification time per step only: forward/backward compute is "
          "not included; lower densities save time but cost accuracy (docs/training.md).")
    if args.measure:
        measured = measure(result.ranked, args.workers, n, args.net, args.rounds)
        fastest = {name: m["best"] for name, m in measured.items()}
        rows = [{"method": p.method, "density": p.density, "predicted (ms)": 1e3 * p.total_s,
                 "measured best (ms)": 1e3 * fastest[p.method],
                 "measured median (ms)": 1e3 * measured[p.method]["median"]}
                for p in sorted(result.ranked, key=lambda p: fastest[p.method])]
        print(f"\nmeasured here: P={args.workers} forked workers on {args.net or 'loopback'}, {args.rounds} "
              f"interleaved rounds; time of a round: the slowest rank's call")
        print(markdown_table(rows, list(rows[0])))
        c = check_against(result, fastest)
        print(f"advised {c['advised']}: {1e3 * c['advised_s']:.1f} ms; measured fastest {c['fastest']}: "
              f"{1e3 * c['fastest_s']:.1f} ms; ratio {c['ratio']:.2f} "
              f"({'within' if c['ok'] else 'NOT within'} 10% of the fastest)")
    return 0
