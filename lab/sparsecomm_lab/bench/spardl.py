"""``sparsecomm bench spardl``: SparDL with d = 1, 2, 4 and auto teams against the dense all-reduce.

One worker group (one ``run_workers`` call) per configuration and network, one after another in this
process tree. Per configuration: the slowest rank's median time per step, rank 0's split into
select / communicate / decompress, bytes sent per step (the meter: rank 0 and the largest rank)
against the cost model's bound and Table I, rounds, and the teams d actually used. ``auto`` first
runs its timed trial steps (``auto_trials`` per candidate d) as warm-up, so the timed steps use the
chosen d; with ``--alpha`` and ``--beta`` it picks d from the cost model instead.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.launcher import run_workers
from sparsecomm.launch.netemu import unavailable_reason
from sparsecomm.methods import cost
from sparsecomm.methods.spardl import table1_cost, team_candidates
from sparsecomm.simulator.calibration import time_method_in_worker
from sparsecomm_lab.bench.common import (
    add_common_arguments,
    check_common,
    check_density,
    configurations,
    network_label,
    summarize,
)

HELP = "SparDL (d = 1, 2, 4, auto teams) against dense all-reduce: time and bytes per step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, workers=8, size="25M", repeat=2)
    parser.add_argument("--density", type=float, default=0.01, help="SparDL density (default 0.01)")
    parser.add_argument("--teams", default=None,
                        help="comma-separated team counts d (divisors of P) and/or 'auto' "
                             "(default: those of 1, 2, 4 that divide P, and auto)")
    parser.add_argument("--sag", default="auto", choices=["auto", "recursive", "bruck"],
                        help="Spar-All-Gather variant for d > 1 (default auto: R-SAG for powers of 2)")
    parser.add_argument("--auto-trials", type=int, default=1,
                        help="timed trial steps per candidate d for teams=auto (default 1)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="seconds per round: with --beta, teams=auto picks d from the cost model")
    parser.add_argument("--beta", type=float, default=None, help="seconds per byte (see --alpha)")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense all-reduce row")


def _teams_list(text: str | None, P: int) -> list[Any]:
    """The team counts to run: ``text``'s, or by default 1, 2, 4 where they divide P, and auto."""
    if text is None:
        return [d for d in (1, 2, 4) if P % d == 0] + ["auto"]
    out: list[Any] = []
    for item in text.split(","):
        item = item.strip()
        if item == "auto":
            out.append("auto")
        elif item.isdigit() and int(item) >= 1 and P % int(item) == 0:
            out.append(int(item))
        else:
            raise ValueError(f"--teams: {item!r} must be 'auto' or a positive divisor of P={P}")
    return out


def check(args: argparse.Namespace) -> None:
    P, _, _ = check_common(args)
    if args.auto_trials < 1:
        raise ValueError(f"--auto-trials={args.auto_trials} must be >= 1")
    check_density(args.density)
    teams_list = _teams_list(args.teams, P)
    if args.sag == "recursive" and any(t != "auto" and t & (t - 1) for t in teams_list):
        raise ValueError(f"--sag=recursive needs power-of-2 team counts, got --teams={args.teams}")


def _row(net: str | None, label: str, summary: dict[str, Any], per_rank: list[dict[str, Any]],
         P: int, n: int, k: int, dense_seconds: float | None) -> dict[str, Any]:
    last = per_rank[0]["stats"][-1]
    teams, sag = last.get("teams", "-"), last.get("sag", "-")
    bound: float | str = "-"
    table: float | str = "-"
    if label != "dense":
        variant = "auto" if sag == "none" else sag
        bound = max(cost("spardl", P=P, n=n, k=k, rank=r, teams=teams, sag=variant).bytes_sent
                    for r in range(P)) / 1e6
        _, _, most = table1_cost(P, k, teams, variant)
        table = most * 4 / 1e6
    speedup = "-" if dense_seconds is None or label == "dense" else dense_seconds / summary["time_s"]
    return {
        "network": network_label(net), "method": label, "d used": teams, "SAG": sag,
        "time/step (s)": summary["time_s"],
        "speed-up vs dense": speedup,
        "select (s)": summary.get("time_select", 0.0), "comm (s)": summary.get("time_comm", 0.0),
        "decompress (s)": summary.get("time_decompress", 0.0),
        "MB sent rank 0": "gloo-internal" if label == "dense" else summary["bytes_sent"] / 1e6,
        "MB sent max rank": "gloo-internal" if label == "dense" else summary["max_bytes_sent"] / 1e6,
        "MB bound (model)": bound, "MB Table I": table, "rounds": summary.get("rounds", "-"),
    }


def run(args: argparse.Namespace) -> int:
    check(args)
    P, n, nets = check_common(args)
    teams_list = _teams_list(args.teams, P)
    if any(net is not None for net in nets) and unavailable_reason() is not None:
        print(f"Network emulation is unavailable here ({unavailable_reason()}); loopback only.\n")
        nets = [None]
    k = math.ceil(args.density * n)
    rows = []
    for net in configurations(nets, "spardl", network_label):
        dense_seconds = None
        if not args.no_dense:
            per_rank = run_workers(P, time_method_in_worker, "dense", {}, n, args.repeat, args.warmup,
                                   net=net, timeout=args.timeout)
            summary = summarize(per_rank)
            dense_seconds = summary["time_s"]
            rows.append(_row(net, "dense", summary, per_rank, P, n, k, None))
        for teams in teams_list:
            options: dict[str, Any] = {"density": args.density, "teams": teams, "sag": args.sag}
            warmup = args.warmup
            if teams == "auto":
                if args.alpha is not None and args.beta is not None:
                    options.update(alpha=args.alpha, beta=args.beta)
                else:
                    options["auto_trials"] = args.auto_trials
                    warmup = max(warmup, len(team_candidates(P, args.sag)) * args.auto_trials)
            per_rank = run_workers(P, time_method_in_worker, "spardl", options, n, args.repeat, warmup,
                                   net=net, timeout=args.timeout)
            label = f"spardl teams={teams}"
            rows.append(_row(net, label, summarize(per_rank), per_rank, P, n, k, dense_seconds))
    print(markdown_table(rows))
    print(f"\nP={P}, n={n}, density={args.density} (k={k}); time: median over {args.repeat} steps "
          f"(after {args.warmup} warm-up; auto: after its trial steps) of the slowest rank; split and "
          f"'MB sent rank 0' from rank 0; 'MB Table I' = 4k(P-1)/P elements (eq. 4) or the upper end of "
          f"eq. 7 / 10, 4 bytes each")
    return 0
