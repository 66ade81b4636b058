"""`sparsecomm simulate`: predict each method's step time at worker counts one machine cannot hold.

Communication comes from each method's registered alpha-beta cost formula (the slowest of a few
ranks; for data-dependent sparse methods the formula's upper bound, or the traffic measured by
``calibrate``). With ``--profile`` (written by ``sparsecomm calibrate``) alpha and beta are the
fitted ones and the per-step work (selection, residual, decompression) measured on that device is
added; without it the prediction is the cost formula's time with the alpha and bandwidth given.
See :mod:`sparsecomm.simulator.model` for the model and docs/simulator.md for its validation.
"""

from __future__ import annotations

import json
import re
import sys

from ..simulator.model import Profile, UnknownMethodError, check_methods, faster_range, plot_projection, speedup_table
from .table import markdown_table

HELP = "predict per-step time of each method at large P (cost formulas + a calibrated profile)"

_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|ms|us|ns)?\s*$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*$", re.I)
DEFAULT_METHODS = "dense,ring,rabenseifner,spardl,topka,exdyna"


def parse_seconds(text: str) -> float:
    match = _TIME.match(text)
    if not match:
        raise ValueError(f"alpha={text!r} must be a time such as 50us, 1.5ms or 0.002")
    scale = {"s": 1.0, None: 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[match.group(2)]
    return float(match.group(1)) * scale


def parse_bandwidth(text: str) -> float:
    """'10gbit' -> seconds per byte."""
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"bandwidth={text!r} must be a rate in bits per second such as 1gbit or 100mbit")
    bits = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    return 8.0 / bits


def parse_workers(text: str) -> list[int]:
    try:
        workers = [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"--workers={text!r} must be comma-separated integers such as 8,16,32") from None
    if any(P < 1 for P in workers):
        raise ValueError(f"--workers={text!r}: every worker count must be >= 1")
    return workers


def add_model_arguments(parser, *, methods: str | None = DEFAULT_METHODS) -> None:
    """The options `simulate` and `advise` share."""
    if methods is not None:
        parser.add_argument("--methods", default=methods,
                            help="comma-separated methods, or 'all' (default: %(default)s)")
    parser.add_argument("--profile", default=None,
                        help="JSON profile from `sparsecomm calibrate` (fitted alpha/beta and measured work)")
    parser.add_argument("--alpha", default=None, help="latency per round, e.g. 50us (default: the profile's, "
                        "else 50us)")
    parser.add_argument("--bandwidth", default=None, help="link rate, e.g. 10gbit (default: the profile's, "
                        "else 10gbit)")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="ASSUMPTION: the workers compute this many times faster than the profiled device "
                        "(e.g. a GPU's memory bandwidth over this CPU's); divides the work term (default 1)")
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="fraction of communication that can hide behind backward (0..1, default 0)")
    parser.add_argument("--backward", default="0", help="backward time per step that can hide communication, "
                        "e.g. 80ms (default 0)")
    parser.add_argument("--formula-comm", action="store_true",
                        help="communication from the formulas alone at the target density: ignore the "
                        "profile's measured traffic and comm factors")
    parser.add_argument("--colocated", action="store_true",
                        help="the P workers share this machine's cores (as in the validation); default: "
                        "one device per worker")


def add_arguments(parser) -> None:
    parser.add_argument("--workers", "-P", default="8,16,32,64,128", help="comma-separated worker counts "
                        "(default: %(default)s)")
    parser.add_argument("--size", "-n", default="25M", help="gradient elements n (default: %(default)s)")
    parser.add_argument("--density", type=float, default=0.01, help="k = ceil(density * n) (default: %(default)s)")
    add_model_arguments(parser)
    parser.add_argument("--plot", default=None, help="write a PNG of step time and speed-up over dense against P")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    parser.add_argument("--long", action="store_true", help="one row per method and P (comm, work, step) instead "
                        "of one row per method")
    parser.add_argument("--step-compute", default=None,
                        help="the training step's own time, added to every method's (the step becomes compute + "
                        "synchronization): a time such as 95ms, or 'auto' for the profile's measured step "
                        "(calibrate --step)")
    parser.add_argument("--powersgd", default=None,
                        help="comma-separated PowerSGD ranks to project beside the methods (torch's hook: three "
                        "ring all-reduces of the sizes the profile's step records, plus its measured local work)")
    parser.add_argument("--steps-to-target", default=None,
                        help="steps to the target quality, to project the time to it: a number for every method, "
                        "or method=steps pairs (e.g. dense=1000,topka=1150,powersgd-r4=1300)")


def model_kwargs(args) -> dict:
    """predict()'s keyword arguments from the shared options (ValueError on a bad one)."""
    profile = Profile.load(args.profile) if args.profile else None
    alpha = parse_seconds(args.alpha) if args.alpha else None
    beta = parse_bandwidth(args.bandwidth) if args.bandwidth else None
    if profile is None:
        alpha = parse_seconds("50us") if alpha is None else alpha
        beta = parse_bandwidth("10gbit") if beta is None else beta
    if not 0 <= args.overlap <= 1:
        raise ValueError(f"--overlap={args.overlap} must lie in [0, 1]")
    if args.compute_scale <= 0:
        raise ValueError(f"--compute-scale={args.compute_scale} must be positive")
    backward = parse_seconds(args.backward)
    return dict(profile=profile, alpha=alpha, beta=beta, colocated=args.colocated,
                compute_scale=args.compute_scale, overlap=args.overlap, backward_s=backward,
                use_comm_factor=not args.formula_comm)


def method_names(text: str) -> list[str]:
    from ..methods import available_methods

    return available_methods() if text.strip() == "all" else check_methods(text.split(","))


def pivot(rows: list[dict], methods: list[str], workers: list[int]) -> list[dict]:
    """One row per method: predicted step (ms) at each P, speed-up over dense at each P, crossover."""
    out = []
    for name in methods:
        mine = {r["P"]: r for r in rows if r["method"] == name}
        row: dict = {"method": name}
        for P in workers:
            row[f"P={P} ms"] = 1e3 * mine[P]["time_s"]
        for P in workers:
            row[f"P={P} x"] = f"{mine[P]['speedup']:.2f}"
        row["faster than dense (by >5%) at"] = "-" if name == "dense" else faster_range(rows, name)
        out.append(row)
    return out


def _steps_to_target(text: str, methods: list[str]) -> dict[str, float]:
    """``--steps-to-target``: one number for every method, or ``method=steps`` pairs (each method listed)."""
    if "=" not in text:
        steps = float(text)
        if steps <= 0:
            raise ValueError(f"--steps-to-target={text!r} must be positive")
        return dict.fromkeys(methods, steps)
    out = {}
    for pair in text.split(","):
        name, _, value = pair.partition("=")
        out[name.strip()] = float(value)
    missing = [name for name in methods if name not in out]
    if missing or any(v <= 0 for v in out.values()):
        raise ValueError(f"--steps-to-target needs a positive number of steps for every method; missing: "
                         f"{', '.join(missing) or 'none'}")
    return out


def _step_rows(args, rows: list[dict], workers: list[int], kwargs: dict) -> list[str]:
    """Add the step's compute (``--step-compute``), PowerSGD's rows (``--powersgd``) and the time to the
    target (``--steps-to-target``) to ``rows`` (the speed-ups then over dense's step); returns the names
    of the rows added."""
    from ..simulator.model import powersgd_seconds

    profile = kwargs["profile"]
    step = (profile.meta.get("step") or {}) if profile is not None else {}
    compute = 0.0
    if args.step_compute == "auto":
        if "step_s" not in step:
            raise ValueError("--step-compute auto: the profile records no step (calibrate --step FILE)")
        compute = float(step["step_s"])
    elif args.step_compute:
        compute = parse_seconds(args.step_compute)
    added = []
    if args.powersgd:
        alpha = kwargs["alpha"] if kwargs["alpha"] is not None else profile.alpha
        beta = kwargs["beta"] if kwargs["beta"] is not None else profile.beta
        for rank in args.powersgd.split(","):
            figures = (step.get("powersgd") or {}).get(rank.strip())
            if figures is None:
                raise ValueError(f"--powersgd {rank}: the profile records no PowerSGD rank {rank} (calibrate --step)")
            name = f"powersgd-r{rank.strip()}"
            added.append(name)
            for P in workers:
                comm, local = powersgd_seconds(P, figures, alpha, beta, float(figures.get("local_s", 0.0)))
                local /= kwargs["compute_scale"]
                rows.append({"method": name, "P": P, "time_s": comm + local, "comm_s": comm, "work_s": local,
                             "speedup": 1.0, "rests_on": f"PowerSGD rank {rank}: three ring all-reduces by the "
                             "formula, local work measured"})
    for row in rows:
        row["sync_s"] = row["time_s"]
        row["time_s"] += compute
        row["compute_s"] = compute
    for P in workers:
        dense = next(r["time_s"] for r in rows if r["method"] == "dense" and r["P"] == P) if any(
            r["method"] == "dense" for r in rows) else None
        for row in rows:
            if row["P"] == P and dense is not None:
                row["speedup"] = dense / row["time_s"] if row["time_s"] > 0 else float("inf")
    if args.steps_to_target:
        steps = _steps_to_target(args.steps_to_target, sorted({r["method"] for r in rows}))
        for row in rows:
            row["steps_to_target"] = steps[row["method"]]
            row["to_target_s"] = steps[row["method"]] * row["time_s"]
    return added


def fail(command: str, message: str) -> int:
    print(f"sparsecomm {command}: error: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    from .options import parse_count

    try:
        methods = method_names(args.methods)
        workers = parse_workers(args.workers)
        n = parse_count(args.size)
        if not 0 < args.density <= 1:
            raise ValueError(f"--density={args.density} must lie in (0, 1]")
        kwargs = model_kwargs(args)
        rows = speedup_table(methods, workers, n, args.density, **kwargs)
        extra = _step_rows(args, rows, workers, kwargs)
        methods = methods + extra
    except (UnknownMethodError, ValueError) as err:
        return fail("simulate", str(err))
    if args.long:
        table = [{"method": r["method"], "P": r["P"], "comm (ms)": 1e3 * r["comm_s"], "work (ms)": 1e3 * r["work_s"],
                  "step (ms)": 1e3 * r["time_s"], "speed-up vs dense": r["speedup"]} for r in rows]
    else:
        table = pivot(rows, methods, workers)
    if args.step_compute or args.powersgd or args.steps_to_target:
        print("PROJECTION from measured rates and the cost formulas, not a measurement of a cluster: "
              + ("each step = the measured step without synchronization + the method's synchronization"
                 if args.step_compute else "synchronization only") + "\n")
    print(markdown_table(table, list(table[0])))
    if args.steps_to_target:
        print("\ntime to the target (s): steps to the target x the projected step\n")
        target = [{"method": name, **{f"P={P} s": next(r["to_target_s"] for r in rows if r["method"] == name
                                                      and r["P"] == P) for P in workers}} for name in methods]
        print(markdown_table(target, list(target[0])))
    profile = kwargs["profile"]
    source = f"profile {args.profile} ({profile.net}; work measured on {profile.device})" if profile else "given"
    alpha = kwargs["alpha"] if kwargs["alpha"] is not None else profile.alpha
    beta = kwargs["beta"] if kwargs["beta"] is not None else profile.beta
    print(f"\nn={n}, density={args.density:g}, alpha={alpha * 1e6:.1f} us, "
          f"beta={beta * 1e9:.3f} ns/byte ({source})")
    if args.compute_scale != 1.0:
        print(f"ASSUMPTION: compute {args.compute_scale:g}x faster than the profiled device")
    parts = dict.fromkeys(part for r in rows for part in r["rests_on"].split("; "))
    print("rests on: " + "; ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        where = "colocated on this machine" if args.colocated else "one device per worker"
        plot_projection(rows, args.plot, title=f"n={n}, density={args.density:g}, alpha={alpha * 1e6:.0f} us, "
                        f"{8 / beta / 1e9:g} Gbit/s, {where}, compute x{args.compute_scale:g} ({source})")
        print(f"plot: {args.plot}")
    return 0
