"""`sparsecomm bench simvalidate`: the simulator's predicted call time against measurement.

For each network: calibrate a profile at ``--calibrate-workers`` (forked workers, that network), then
time every method at each P and n and compare with :func:`sparsecomm.simulator.model.predict` from that
profile (workers colocated on this machine's cores). Results are appended to ``--results`` (JSON lines)
one (network, P, n) group at a time, so an interrupted run resumes where it stopped; the table and the
error summary are printed from everything in that file that matches the options.

This machine is shared, and a disturbed call is only ever slower: the measured figure of a point is
the least over its calls (each call: the slowest rank), and with ``--runs R`` the point is measured in
R separate worker groups (interleaved: every point of run r before run r+1) and the least over all of
them is kept. The profile is calibrated again before each run and the calibrations merged
(:func:`~sparsecomm.simulator.calibration.merge_records`: the least over all their calls), so calibration
and validation sample the machine's load over the same period. The spread between runs (run-to-run
noise) is printed with the error: it is the floor under which no model's error can be shown.

The report (printed, and written to ``--report`` as markdown for docs/simulator.md) opens with when
the points were measured, the command and the machine's load average at each group's start, and
gives each point's predicted communication and work, and (held-out points) whether it is within
25%.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from sparsecomm.cli.table import markdown_table

HELP = "validate the simulator: predicted against measured call time for every method, P and network"

log = logging.getLogger(__name__)


def add_arguments(parser) -> None:
    parser.add_argument("--workers", "-P", default="2,4,6,8",
                        help="comma-separated worker counts (default: %(default)s)")
    parser.add_argument("--size", "-n", default="1M", help="comma-separated gradient sizes (default: %(default)s)")
    parser.add_argument("--net", default="loopback,1gbit,100mbit",
                        help="comma-separated networks: loopback and/or tc rates (default: %(default)s)")
    parser.add_argument("--methods", default="all", help="comma-separated methods or 'all' (default: %(default)s)")
    parser.add_argument("--density", type=float, default=0.01, help="sparse methods' density (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per method (default: %(default)s)")
    parser.add_argument("--calibrate-workers", type=int, default=2,
                        help="P of the calibration run on each network (default: %(default)s)")
    parser.add_argument("--calibrate-sizes", default=None,
                        help="comma-separated sizes of the calibration run (default: the validated sizes)")
    parser.add_argument("--calibrate-repeat", type=int, default=None,
                        help="timed calls per method in the calibration run (default: twice --repeat)")
    parser.add_argument("--runs", type=int, default=1,
                        help="separate measurements of every point; the least is kept (default: %(default)s)")
    parser.add_argument("--results", default="simvalidate.jsonl",
                        help="JSON-lines file the measurements are appended to (resumed from) (default: %(default)s)")
    parser.add_argument("--profile-dir", default=".", help="where the per-network profiles are written/read "
                        "(default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker group")
    parser.add_argument("--report", default=None,
                        help="also write the report (markdown: when, command, load, table, summary) here")


def _validate_worker(methods, sizes, density, repeat):
    import torch.distributed as dist

    from sparsecomm.simulator.calibration import method_runs

    return {"P": dist.get_world_size(), "runs": method_runs(methods, sizes, density, repeat)}


def _load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def calibration_sizes(text: str | None, sizes: list[int]) -> list[int]:
    """The calibration run's sizes: ``text`` (comma-separated counts), else ``sizes``."""
    from sparsecomm_lab.bench.common import parse_count

    if text:
        return sorted({parse_count(s) for s in text.split(",")})
    return sorted(set(sizes))


#: what a method run of the calibration must have recorded for the current model
_TIMED = ("time_decompress", "time_agreement")


def _profile_for(net: str | None, args, methods, sizes, rounds: int = 1):
    """The network's profile, calibrated ``rounds`` times (at different times) and merged: the file
    keeps the merged raw timings and how many calibrations they hold; a missing one is added."""
    from sparsecomm.simulator.calibration import calibrate, merge_records, profile_from_records
    from sparsecomm.simulator.model import Profile

    label = net or "loopback"
    repeat = args.calibrate_repeat or 2 * args.repeat
    path = Path(args.profile_dir) / (f"profile-{label}-{'-'.join(str(n) for n in sizes)}"
                                     f"-P{args.calibrate_workers}-r{repeat}.json")
    profile = Profile.load(path) if path.exists() else None
    if profile is not None and not all(key in run for run in profile.records[0]["runs"] for key in _TIMED):
        log.warning("%s was calibrated before decompression and the agreement were timed apart: calibrating "
                    "afresh", path)
        profile = None
    done = 0 if profile is None else int(profile.meta.get("calibrations", 1))
    while profile is None or done < rounds:
        new = calibrate(args.calibrate_workers, methods, sizes, args.density, net=net, repeat=repeat,
                        timeout=args.timeout)
        if profile is not None:
            if not profile.records:
                raise ValueError(f"{path} keeps no raw timings to merge with; remove it to calibrate afresh")
            new = profile_from_records(
                merge_records(profile.records, new.records), density=args.density, net=new.net,
                device=new.device, cores=new.cores, colocated=new.colocated, selectors=new.selectors,
                recv_element_s=new.recv_element_s, selector_fixed_s=new.selector_fixed_s,
                block_topk_s=new.block_topk_s,
                meta={**new.meta, "when": f"{profile.meta['when'].split(' .. ')[0]} .. {new.meta['when']}"})
        done += 1
        new.meta["calibrations"] = done
        new.save(path)
        profile = new
    return profile, path


def _measure_group(net, P, n, methods, args, profile, profile_path, run_index: int) -> list[dict[str, Any]]:
    from sparsecomm.launch.launcher import run_workers
    from sparsecomm.simulator.calibration import slowest_best
    from sparsecomm.simulator.model import predict

    load = os.getloadavg()[0]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    records = run_workers(P, _validate_worker, methods, [n], args.density, args.repeat, net=net,
                          timeout=args.timeout)
    rows = []
    for i, run in enumerate(records[0]["runs"]):
        measured = slowest_best(records, i)
        p = predict(run["method"], P, n, args.density, profile=profile)
        rows.append({"net": net or "loopback", "n": n, "P": P, "method": run["method"], "density": args.density,
                     "measured_s": measured, "predicted_s": p.total_s, "comm_s": p.comm_s, "work_s": p.work_s,
                     "profile": str(profile_path), "run": run_index, "calibrated_P": profile.meta["P"],
                     "calibrated_sizes": profile.meta["sizes"], "when": when, "load": load})
    return rows


def check(args) -> tuple[list[str], list[int], list[int], list[str | None]]:
    """(methods, worker counts, sizes, networks) of the options; ValueError naming a bad one."""
    from sparsecomm.cli.simulate import method_names, parse_workers
    from sparsecomm_lab.bench.common import check_density, parse_count, parse_networks

    methods = method_names(args.methods)
    workers = parse_workers(args.workers)
    sizes = [parse_count(s) for s in args.size.split(",")]
    check_density(args.density)
    if args.repeat < 1 or args.calibrate_workers < 1 or args.runs < 1:
        raise ValueError(f"--repeat={args.repeat}, --calibrate-workers={args.calibrate_workers} and "
                         f"--runs={args.runs} must be >= 1")
    nets = parse_networks(args.net)
    for P in workers + [args.calibrate_workers]:
        parse_networks(args.net, P)
    return methods, workers, sizes, nets


def run(args) -> int:
    from sparsecomm_lab.bench.common import configurations, network_label

    methods, workers, sizes, nets = check(args)
    results = Path(args.results)
    for folder in (results.parent, Path(args.profile_dir)):
        folder.mkdir(parents=True, exist_ok=True)
    measured: dict[tuple, int] = {}
    for r in _load(results):
        key = (r["net"], r["n"], r["P"], r["method"])
        measured[key] = measured.get(key, 0) + 1
    calibrate_sizes = calibration_sizes(args.calibrate_sizes, sizes)
    for run in range(args.runs):
        for net in configurations(nets, f"simvalidate run {run + 1}", network_label):
            todo_net = [(n, P) for n in sizes for P in workers
                        if any(measured.get((net or "loopback", n, P, m), 0) <= run for m in methods)]
            if not todo_net:
                continue
            # calibrate again before every run: the calibration samples the machine's load as the runs do
            profile, profile_path = _profile_for(net, args, methods, calibrate_sizes, rounds=run + 1)
            for n, P in todo_net:
                todo = [m for m in methods if measured.get((net or "loopback", n, P, m), 0) <= run]
                log.warning("run %d: measuring %s, n=%d, P=%d: %d methods", run + 1, network_label(net), n, P,
                            len(todo))
                rows = _measure_group(net, P, n, todo, args, profile, profile_path, run)
                with results.open("a") as f:
                    for row in rows:
                        f.write(json.dumps(row) + "\n")
                for m in todo:
                    key = (net or "loopback", n, P, m)
                    measured[key] = measured.get(key, 0) + 1
    wanted = {(net or "loopback") for net in nets}
    rows = [r for r in _load(results) if r["net"] in wanted and r["n"] in sizes and r["P"] in workers
            and r["method"] in methods]
    rows = best_of_runs(repredict(rows))
    command = "sparsecomm bench simvalidate " + " ".join(shlex.quote(arg) for arg in sys.argv[3:]) \
        if sys.argv[1:3] == ["bench", "simvalidate"] else shlex.join(sys.argv)
    report = "\n\n".join([report_header(rows, command), validation_table(rows), advice_check(rows)])
    print(report)
    if args.report:
        Path(args.report).write_text(report + "\n")
    return 0


def report_header(rows: list[dict[str, Any]], command: str) -> str:
    """When the rows were measured (the first and last group's start), the 1-minute load average at
    the groups' starts, and the command, as markdown (rows measured before these were stored say so)."""
    stamped = [r for r in rows if "when" in r]
    if stamped:
        first, last = min(r["when"] for r in stamped), max(r["when"] for r in stamped)
        loads = [r["load"] for r in stamped]
        measured = (f"Measured {first}" + (f" .. {last}" if last != first else "")
                    + f"; 1-minute load average at the groups' starts {min(loads):.1f} .. {max(loads):.1f} "
                    f"(this machine: {os.cpu_count()} cores)")
    else:
        measured = "Measured before the date and load were stored with the points"
    if len(stamped) < len(rows):
        measured += f" ({len(rows) - len(stamped)} points without them)"
    return f"{measured}. Predictions from the model as of this report. Command:\n\n    {command}"


def best_of_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (network, n, P, method): the least measured time over its runs, with ``runs`` (how
    many) and ``spread`` (the largest over the least measured time, minus 1: run-to-run noise)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["net"], r["n"], r["P"], r["method"]), []).append(r)
    out = []
    for group in groups.values():
        best = min(group, key=lambda r: r["measured_s"])
        slowest = max(r["measured_s"] for r in group)
        out.append({**best, "runs": len(group), "spread": slowest / best["measured_s"] - 1})
    return out


def advice_check(rows: list[dict[str, Any]]) -> str:
    """Per (network, n, P): the method `advise` recommends from the profile against the measured fastest.

    The recommendation is :func:`sparsecomm.cli.advise.advise` over the measured methods at
    the measured density (the workers colocated, as measured)."""
    from sparsecomm.cli.advise import advise
    from sparsecomm.simulator.model import Profile

    table = []
    for key in sorted({(r["net"], r["n"], r["P"]) for r in rows}):
        group = {r["method"]: r for r in rows if (r["net"], r["n"], r["P"]) == key}
        if "dense" not in group:
            continue
        profile = Profile.load(next(iter(group.values()))["profile"])
        density = next(iter(group.values()))["density"]
        best = advise(sorted(group), key[2], key[1], [density], profile=profile, colocated=True).best
        fastest = min(group.values(), key=lambda r: r["measured_s"])
        ratio = group[best.method]["measured_s"] / fastest["measured_s"]
        table.append({"network": key[0], "n": key[1], "P": key[2], "advised": best.method,
                      "advised measured (ms)": 1e3 * group[best.method]["measured_s"],
                      "measured fastest": fastest["method"], "fastest (ms)": 1e3 * fastest["measured_s"],
                      "advised / fastest": f"{ratio:.2f}", "within 10%": "yes" if ratio <= 1.10 else "no"})
    if not table:
        return "(no groups with dense measured)"
    hits = sum(row["within 10%"] == "yes" for row in table)
    return markdown_table(table, list(table[0])) + f"\n\nadvice within 10% of the measured fastest: {hits}/{len(table)}"


def repredict(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with ``predicted_s`` (and its ``comm_s``, ``work_s``) recomputed from each row's
    profile file as it is now (the model or the profile may have changed since the measurement; rows
    whose profile is gone keep theirs)."""
    from sparsecomm.simulator.model import Profile, predict

    profiles: dict[str, Profile | None] = {}
    out = []
    for r in rows:
        path = r["profile"]
        if path not in profiles:
            profiles[path] = Profile.load(path) if Path(path).exists() else None
        profile = profiles[path]
        if profile is not None:
            p = predict(r["method"], r["P"], r["n"], r["density"], profile=profile)
            r = {**r, "predicted_s": p.total_s, "comm_s": p.comm_s, "work_s": p.work_s}
        out.append(r)
    return out


def held_out(row: dict[str, Any]) -> bool | None:
    """Whether a measured point is held out: both its P and its n other than the calibration's
    (None for rows measured before the calibration's P and sizes were stored with them)."""
    if "calibrated_P" not in row:
        return None
    return row["P"] != row["calibrated_P"] and row["n"] not in row["calibrated_sizes"]


def validation_table(rows: list[dict[str, Any]], tolerance: float = 0.25) -> str:
    """Markdown table of predicted (and its communication and work), measured and relative error,
    whether each point is held out and within ``tolerance``, and the error summary lines (and, for
    held-out points, how many are within ``tolerance`` and which are not)."""
    table = []
    for r in sorted(rows, key=lambda r: (r["net"], r["n"], r["method"], r["P"])):
        error = (r["predicted_s"] - r["measured_s"]) / r["measured_s"]
        out = held_out(r)
        table.append({"network": r["net"], "n": r["n"], "method": r["method"], "P": r["P"],
                      "predicted (ms)": 1e3 * r["predicted_s"], "pred. comm (ms)": 1e3 * r["comm_s"],
                      "pred. work (ms)": 1e3 * r["work_s"], "measured (ms)": 1e3 * r["measured_s"],
                      "rel. error": f"{100 * error:+.0f}%",
                      "held out": "?" if out is None else "yes" if out else "no",
                      f"within {100 * tolerance:.0f}%": "yes" if abs(error) <= tolerance else "no"})
    if not table:
        return "(no results)"
    errors = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]
    worst = max(rows, key=lambda r: abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"])
    lines = [markdown_table(table, list(table[0])), "",
             f"{len(rows)} points; median |relative error| {100 * statistics.median(errors):.1f}%, "
             f"worst {100 * max(errors):.0f}% ({worst['method']}, P={worst['P']}, n={worst['n']}, {worst['net']})"]
    for net in sorted({r["net"] for r in rows}):
        mine = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows if r["net"] == net]
        lines.append(f"- {net}: median {100 * statistics.median(mine):.1f}%, worst {100 * max(mine):.0f}% "
                     f"over {len(mine)} points")
    outside = [abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows if held_out(r)]
    if outside:
        within = sum(e <= tolerance for e in outside)
        missed = sorted(f"{r['method']} (P={r['P']}, n={r['n']}, {r['net']})" for r in rows if held_out(r)
                        and abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] > tolerance)
        lines.append(f"- held out (P and n both other than the calibration's): median "
                     f"{100 * statistics.median(outside):.1f}%, worst {100 * max(outside):.0f}%; within "
                     f"{100 * tolerance:.0f}%: {within}/{len(outside)}"
                     + (f"; outside: {', '.join(missed)}" if missed else ""))
    repeated = [r for r in rows if r.get("runs", 1) > 1]
    if repeated:
        lines.append(f"run-to-run noise (slowest run over the least, {len(repeated)} points measured "
                     f"{min(r['runs'] for r in repeated)}+ times): median "
                     f"{100 * statistics.median(r['spread'] for r in repeated):.0f}%")
    return "\n".join(lines)
