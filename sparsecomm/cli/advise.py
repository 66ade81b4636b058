"""`sparsecomm advise`: which method, density and options to use for a model on a cluster.

Every method at every candidate density is run through the simulator (:mod:`sparsecomm.simulator.model`,
the engine of ``sparsecomm simulate``): communication from its cost formula at the latency and bandwidth
given (or a profile's), plus the per-step work measured by ``sparsecomm calibrate`` when ``--profile``
is given. Each line says what the prediction rests on. With a profile, a method it has no measured work
for is not ranked (the output names it): its prediction would leave out its work.

The recommendation is by time to quality, not by step time alone: each (method, density) is
checked against the time-to-quality campaigns (:mod:`sparsecomm.simulator.accuracy`, a table built from
the campaigns' records, benchmarks/campaign-*/summary.json), with the runs of ``--optimizer`` alone
when it is given (``adamw`` for transformers, ``sgd`` for CNNs), and of the workload ``--like`` names
when it is given (the campaign's model most like the user's; otherwise a candidate is judged by its worst
workload). A candidate whose every recipe there
lost more than ``--accuracy-tolerance`` (percent of DDP's loss, or accuracy points; beyond DDP's, or the
best PowerSGD rank's with ``--accuracy-reference powersgd``), or did not reach the target, is not
recommended, and the output names the faster candidates it passed over and why. The others are
ranked by predicted step time times their steps to the target over DDP's in the campaign (1 for exact
methods); candidates no campaign measured come after every measured one, marked "accuracy unknown".
The recipe that did best (e.g. the synchronizer with ``freeze_adam_variance``) is named. A method's
density is the largest candidate whose predicted time to quality is within ``--density-slack`` of that
method's fastest.

``--measure`` checks the advice on this machine (so the prediction takes the workers as colocated on
its cores, as ``--colocated``): every ranked method runs at its chosen density in one group of ``-P``
forked workers (on ``--net``, an emulated link, or loopback), interleaved: each round
calls every method once, in a rotated order, so that the load of a shared machine falls on all of them
alike. A method's measured time is its best round (the least of the slowest rank's call times: the call
least disturbed by other processes, the statistic ``calibrate`` fits the profile on); the median is
shown beside it. The advised method's time is compared with the measured fastest (benchmarks/advise).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from ..methods import dense_warmup
from ..simulator.accuracy import (
    TABLE_PATH,
    Assessment,
    assess,
    baselines_sooner,
    check_workload,
    load_table,
    measured_goals,
)
from ..simulator.model import Prediction, UnknownMethodError, predict
from .table import markdown_table

#: a method that computes the exact average (dense): it loses no accuracy
EXACT = Assessment(True, 1.0, "exact average")

HELP = "recommend a method, density and options for a model size, P and network (from the simulator)"


def add_arguments(parser) -> None:
    from .simulate import add_model_arguments

    what = parser.add_mutually_exclusive_group()
    what.add_argument("--params", default=None, help="model size in parameters, e.g. 25M or 340M")
    what.add_argument("--model-file", default=None, help="a saved model or state dict (torch.save); its "
                      "tensors' elements are counted")
    parser.add_argument("--workers", "-P", type=int, default=8, help="worker count P (default: %(default)s)")
    parser.add_argument("--latency", default=None, help="latency per message, e.g. 50us (same as --alpha)")
    parser.add_argument("--densities", default="0.1,0.01,0.001",
                        help="candidate densities (default: %(default)s)")
    parser.add_argument("--density-slack", type=float, default=0.10,
                        help="take the largest density within this fraction of the method's fastest "
                        "(default: %(default)s)")
    parser.add_argument("--top", type=int, default=5, help="alternatives listed (default: %(default)s)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default=None,
                        help="judge candidates by the campaign runs made with this optimizer (default: any)")
    parser.add_argument("--like", default=None, metavar="WORKLOAD",
                        help="judge candidates by this campaign workload alone, the one like your model (gpt: a "
                        "transformer, word-lstm: an embedding-heavy model, resnet: a CNN; default: every workload "
                        "that measured a candidate, the worst)")
    parser.add_argument("--accuracy-tolerance", type=float, default=1.0,
                        help="the quality a candidate may have lost in the campaign beyond the reference's: "
                        "percent of the loss, or accuracy points (default: %(default)s)")
    parser.add_argument("--accuracy-reference", choices=("powersgd", "ddp"), default="ddp",
                        help="what the loss is allowed beyond: the best PowerSGD rank's loss against DDP, or DDP "
                        "(default: %(default)s)")
    parser.add_argument("--accuracy-table", default=None,
                        help="the campaigns' accuracy table (default: the one shipped, built from "
                        "benchmarks/campaign-*/summary.json)")
    parser.add_argument("--by-step-time", action="store_true",
                        help="rank by predicted step time alone, without the campaign's accuracy")
    add_model_arguments(parser, methods="all")
    parser.add_argument("--measure", action="store_true", help="also run every ranked method here, interleaved, "
                        "and compare the advice with the measured fastest (implies --colocated: the measured "
                        "workers share this machine's cores)")
    parser.add_argument("--net", default=None, help="with --measure: the emulated link the workers measure on, a tc "
                        "rate such as 1gbit (default: loopback)")
    parser.add_argument("--rounds", type=int, default=5, help="with --measure: timed rounds (default: %(default)s)")


@dataclass(frozen=True)
class Advice:
    """The recommendation and the ranked alternatives (one per method, its chosen density), with
    each one's accuracy in the campaign (``accuracy``, by (method, density); empty when ranked by
    step time alone), the faster candidates passed over for their accuracy (``passed_over``) and the
    methods left unranked because the profile has no measured work for them (``unmeasured``)."""

    best: Prediction
    dense: Prediction
    ranked: list[Prediction]
    n: int
    accuracy: dict[tuple[str, float], Assessment] = field(default_factory=dict)
    passed_over: list[Prediction] = field(default_factory=list)
    unmeasured: list[str] = field(default_factory=list)

    def time_to_accuracy(self, p: Prediction) -> float:
        """Predicted step time times the epochs to target over DDP's (step time without the table)."""
        a = self.accuracy.get((p.method, p.density))
        return p.total_s * (a.steps_factor if a else 1.0)


def count_parameters(args) -> int:
    """n from --params or --model-file (ValueError when neither or unusable)."""
    from .options import parse_count

    if args.params is not None:
        n = parse_count(args.params)
        if n < 1:
            raise ValueError(f"--params {args.params} must be > 0 (the model's number of parameters, e.g. 25M)")
        return n
    if args.model_file:
        return _count_saved(args.model_file)
    raise ValueError("give the model size: --params N or --model-file PATH")


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
           accuracy_table: dict[str, Any] | None = None, tolerance: float = 1.0, reference: str = "ddp",
           optimizer: str | None = None, workload: str | None = None, **kwargs: Any) -> Advice:
    """Rank methods by predicted time to accuracy at their chosen density (the module docstring);
    without ``accuracy_table``, by predicted step time alone.

    With a profile (``kwargs["profile"]``), a method it has no measured work for is not ranked (it is
    listed in ``Advice.unmeasured``): its prediction would be its communication alone, without the
    selection and decompression every measured method carries, and so would win unfairly. Where the
    profile has none of the methods asked for, they are all ranked, on their formulas."""
    from ..methods import is_sparse

    if not densities or any(not 0 < d <= 1 for d in densities):
        raise ValueError(f"densities {densities} must be fractions in (0, 1]")
    dense = predict("dense", P, n, 1.0, **kwargs)
    accuracy: dict[tuple[str, float], Assessment] = {}

    def judged(p: Prediction) -> Prediction:
        if accuracy_table is not None:
            sparse = is_sparse(p.method)
            accuracy[(p.method, p.density)] = assess(accuracy_table, p.method, p.density if sparse else None,
                                                     tolerance, reference, optimizer, workload) if sparse else EXACT
        return p

    def score(p: Prediction) -> float:
        a = accuracy.get((p.method, p.density))
        return p.total_s * (a.steps_factor if a else 1.0)

    def rank_key(p: Prediction) -> tuple[bool, float]:
        a = accuracy.get((p.method, p.density))  # measured quality first, unknown after
        return (a is not None and a.ok is None, score(p))

    def acceptable(p: Prediction) -> bool:
        a = accuracy.get((p.method, p.density))
        return a is None or a.ok is not False

    profile = kwargs.get("profile")
    unmeasured = [name for name in methods if profile is not None and name not in profile.methods]
    if len(unmeasured) == len(methods):
        unmeasured = []  # nothing measured to compare with: rank them all on their formulas
    chosen, passed_over = [], []
    for name in methods:
        if name in unmeasured:
            continue
        if not is_sparse(name):
            chosen.append(judged(predict(name, P, n, 1.0, **kwargs)))
            continue
        options = [judged(predict(name, P, n, d, **kwargs)) for d in sorted(densities, reverse=True)]
        good = [p for p in options if acceptable(p)]
        # a density of known quality before one of unknown quality, as between methods
        measured = [p for p in good if (a := accuracy.get((p.method, p.density))) is not None and a.ok]
        good = measured or good
        fastest = min(score(p) for p in good) if good else math.inf
        passed_over += [p for p in options if not acceptable(p) and p.total_s < fastest]
        if good:
            chosen.append(next(p for p in good if score(p) <= (1 + slack) * fastest))
    ranked = sorted(chosen, key=rank_key)
    best = ranked[0] if ranked else dense
    passed_over = sorted((p for p in passed_over if p.total_s < score(best)), key=lambda p: p.total_s)
    return Advice(best, dense, ranked, n, accuracy, passed_over, unmeasured)


def _measure_worker(plan: list[tuple[str, float]], n: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Every rank: each (method, density) of ``plan`` once per round, the order rotated by one each round,
    a barrier before each call; this rank's call times after ``warmup`` untimed rounds. A method with
    a dense warm-up (:func:`~sparsecomm.methods.dense_warmup`) is built without it: the calls measured are those the
    prediction is of."""
    import torch
    import torch.distributed as dist

    from ..methods import MethodSpec

    gen = torch.Generator().manual_seed(7919 * dist.get_rank() + 1)
    base = torch.randn(n, generator=gen)
    work = torch.empty_like(base)
    built = {name: MethodSpec.at_density(name, d, **({"warmup_steps": 0} if dense_warmup(name) else {})).build()
             for name, d in plan}
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
    from ..launch.launcher import run_workers

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
        from ..launch.netemu import emulated_net, parse_net

        args.net = emulated_net(args.net)
        if args.net is not None:
            parse_net(args.net, args.workers)
        if args.latency and args.alpha:
            raise ValueError("give --latency or --alpha, not both")
        if args.like and args.by_step_time:
            raise ValueError(f"--like {args.like} judges quality, which --by-step-time does not use: give one")
        args.alpha = args.alpha or args.latency
        methods = method_names(args.methods)
        densities = [float(d) for d in args.densities.split(",")]
        if args.workers < 1:
            raise ValueError(f"-P {args.workers} must be >= 1")
        table = None if args.by_step_time else load_table(args.accuracy_table or TABLE_PATH)
        if table is not None:
            check_workload(table, args.like)  # before a model file is read
        n = count_parameters(args)
        if args.workers == 1:  # nothing is exchanged: every method costs nothing, and no ratio exists
            print(f"model: {n:,} parameters; P=1: a single worker exchanges no gradients, so no method saves "
                  "anything; train without DDP (or with it: at P=1 its all-reduce is a copy)")
            return 0
        kwargs = model_kwargs(args)
        result = advise(methods, args.workers, n, densities, args.density_slack, accuracy_table=table,
                        tolerance=args.accuracy_tolerance, reference=args.accuracy_reference,
                        optimizer=args.optimizer, workload=args.like, **kwargs)
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
    if result.unmeasured:
        print(f"not ranked: {', '.join(result.unmeasured)}: the profile has no measured work for "
              f"{'it' if len(result.unmeasured) == 1 else 'them'} (a prediction would be communication alone); "
              f"measure with: sparsecomm calibrate --methods {','.join(result.unmeasured)} ...")
    if dense_warmup(best.method):
        print(f"note: {best.method} makes its first {dense_warmup(best.method)} calls dense all-reduces "
              f"(warmup_steps, as in its paper); the prediction is of the calls after them")
    if table is not None:
        verdict = result.accuracy[(best.method, best.density)]
        print(f"quality in the campaigns ({', '.join(table['sources'])}; tolerance {args.accuracy_tolerance:g} "
              f"beyond {'the best PowerSGD rank' if args.accuracy_reference == 'powersgd' else 'DDP'}"
              + (f"; {args.optimizer} runs" if args.optimizer else "")
              + (f"; workload {args.like}" if args.like else "; every workload, the worst") + "): "
              + ("ACCURACY UNKNOWN: " if verdict.ok is None else "") + verdict.note)
        if verdict.recipe:
            print(f"recipe: {verdict.recipe} (docs/choosing-a-method.md)")
        for line in baselines_sooner(table, args.like):
            print(f"note: {line}")
        for line in measured_goals(table, args.like) if args.like else []:
            print(f"measured: {line}")
        for p in result.passed_over:
            print(f"not recommended: {p.method} at density {p.density:g}, predicted {1e3 * p.total_s:.1f} ms per "
                  f"step, lost more than the tolerance in the campaign: {result.accuracy[(p.method, p.density)].note}")
    rows = []
    for p in result.ranked[:args.top]:
        row: dict[str, Any] = {"method": p.method, "density": p.density, "step (ms)": 1e3 * p.total_s,
                               "comm (ms)": 1e3 * p.comm_s, "work (ms)": 1e3 * p.work_s,
                               "vs DDP": dense.total_s / p.total_s}
        if table is not None:
            verdict = result.accuracy[(p.method, p.density)]
            row.update({"steps to target x DDP": verdict.steps_factor,
                        "time to quality vs DDP": dense.total_s / result.time_to_accuracy(p),
                        "quality": "unknown" if verdict.ok is None else "within tolerance"})
        rows.append(row)
    print(markdown_table(rows, list(rows[0])))
    print("Predicted communication and sparsification time per step only: forward/backward compute is "
          "not included" + ("; time to quality multiplies it by the steps to the target over DDP's in the "
                            "campaign." if table is not None else
                            "; lower densities save time but cost accuracy (docs/choosing-a-method.md)."))
    if args.measure:
        # the candidates passed over for their accuracy are measured too (one density each), but the
        # advice is checked against the fastest of those it may recommend
        ranked = {p.method for p in result.ranked}
        extra = list({p.method: p for p in reversed(result.passed_over) if p.method not in ranked}.values())
        measured = measure(result.ranked + extra, args.workers, n, args.net, args.rounds)
        fastest = {name: m["best"] for name, m in measured.items()}
        rows = [{"method": p.method, "density": p.density, "predicted (ms)": 1e3 * p.total_s,
                 "measured best (ms)": 1e3 * fastest[p.method],
                 "measured median (ms)": 1e3 * measured[p.method]["median"],
                 "recommendable": "yes" if p.method in ranked else "no (accuracy)"}
                for p in sorted(result.ranked + extra, key=lambda p: fastest[p.method])]
        warm = [p.method for p in result.ranked + extra if dense_warmup(p.method)]
        print(f"\nmeasured here: P={args.workers} forked workers on {args.net or 'loopback'}, {args.rounds} "
              f"interleaved rounds; time of a round: the slowest rank's call"
              + (f"; {', '.join(warm)} without the dense warm-up (warmup_steps=0)" if warm else ""))
        print(markdown_table(rows, list(rows[0])))
        c = check_against(result, {name: t for name, t in fastest.items() if name in ranked})
        print(f"advised {c['advised']}: {1e3 * c['advised_s']:.1f} ms; measured fastest {c['fastest']}: "
              f"{1e3 * c['fastest_s']:.1f} ms; ratio {c['ratio']:.2f} "
              f"({'within' if c['ok'] else 'NOT within'} 10% of the fastest)")
    return 0
