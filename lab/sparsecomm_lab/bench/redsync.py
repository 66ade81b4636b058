"""`sparsecomm bench redsync`: RedSync (with and without ASQ) and TopkA against dense all-reduce on a
gradient laid out as a real model's layers (VGG-16's 32 tensors scaled to n), time split into
select / communicate / decompress, and the metered bytes against RedSync's equation (1)."""

from __future__ import annotations

import statistics

from sparsecomm.cli.table import markdown_table
from sparsecomm.core.cost import ceil_log2
from sparsecomm.launch.launcher import run_workers
from sparsecomm.methods import cost
from sparsecomm.simulator.calibration import time_method_in_worker
from sparsecomm_lab.bench.common import (
    add_common_arguments,
    check_common,
    check_density,
    configurations,
    network_label,
    summarize,
)

HELP = "RedSync / RedSync+ASQ / TopkA vs dense on VGG-16's layer sizes: time split and bytes vs equation (1)"

#: parameter tensors of VGG-16 (ImageNet, 138,357,544 parameters), weights and biases in order
VGG16_LAYERS: tuple[int, ...] = (
    1728, 64, 36864, 64, 73728, 128, 147456, 128, 294912, 256, 589824, 256, 589824, 256,
    1179648, 512, 2359296, 512, 2359296, 512, 2359296, 512, 2359296, 512, 2359296, 512,
    102760448, 4096, 16777216, 4096, 4096000, 1000)


def scaled_layout(n: int, sizes: tuple[int, ...] = VGG16_LAYERS) -> list[tuple[int, int]]:
    """(offset, numel) of ``sizes`` scaled to sum to ``n`` (each at least 1; the largest layer absorbs
    the rounding)."""
    total = sum(sizes)
    scaled = [max(1, round(s * n / total)) for s in sizes]
    largest = scaled.index(max(scaled))
    scaled[largest] += n - sum(scaled)
    if scaled[largest] < 1:
        raise ValueError(f"n={n} is too small to hold {len(sizes)} layers")
    layout, offset = [], 0
    for m in scaled:
        layout.append((offset, m))
        offset += m
    return layout


def add_arguments(parser) -> None:
    add_common_arguments(parser, workers=8, size="25M", repeat=3)
    parser.add_argument("--density", type=float, default=0.001, help="selected fraction per layer (default 0.001)")
    parser.add_argument("--methods", default="dense,topka,redsync,redsync-asq",
                        help="comma-separated: dense, topka, redsync, redsync-asq")


def _method(label: str, density: float) -> tuple[str, dict]:
    if label == "dense":
        return "dense", {}
    if label == "topka":
        return "topka", {"density": density}
    if label == "redsync":
        return "redsync", {"density": density}
    if label == "redsync-asq":
        return "redsync", {"density": density, "quantize": "asq"}
    raise ValueError(f"unknown method {label!r}: use dense, topka, redsync, redsync-asq")


def _median_over_calls(per_rank: list[dict], key: str) -> float:
    return statistics.median(statistics.mean(r["stats"][i][key] for r in per_rank)
                             for i in range(len(per_rank[0]["stats"])))


def check(args) -> None:
    _, n, _ = check_common(args)
    check_density(args.density)
    scaled_layout(n)
    for label in args.methods.split(","):
        _method(label.strip(), args.density)


def run(args) -> int:
    check(args)
    P, n, nets = check_common(args)
    layout = scaled_layout(n)
    rows = []
    for net, label in configurations([(net, label) for net in nets for label in args.methods.split(",")],
                                     "redsync", lambda c: f"{c[1]} on {network_label(c[0])}"):
        name, options = _method(label.strip(), args.density)
        per_rank = run_workers(P, time_method_in_worker, name, options, n, args.repeat, args.warmup,
                               0, layout, net=net, timeout=args.timeout)
        s = summarize(per_rank)
        row = {"network": network_label(net), "method": label, "time (ms)": 1e3 * s["time_s"]}
        for phase in ("select", "comm", "decompress"):
            row[f"{phase} (ms)"] = 1e3 * _median_over_calls(per_rank, f"time_{phase}")
        if "message_bytes" not in per_rank[0]["stats"][0]:  # a dense method
            model = cost("rabenseifner", P=P, n=n, rank=0)  # eq. (2)'s bytes; its rounds are 2 lg p
            row.update({"MB sent/rank (meter)": "n/a (inside gloo)", "MB sent/rank (model)": model.bytes_sent / 1e6,
                        "model": "eq. (2)", "rounds": 2 * ceil_log2(P)})
        else:
            last = [r["stats"][-1]["message_bytes"] for r in per_rank]
            for rank, r in enumerate(per_rank):
                replay = cost(name, P=P, n=n, rank=rank, message_bytes=last)
                got = (r["stats"][-1]["rounds"], r["stats"][-1]["bytes_sent"])
                if got != (replay.rounds, replay.bytes_sent):
                    raise RuntimeError(f"{label}: rank {rank} metered (rounds, bytes) {got}, replay of "
                                         f"the all-gather schedule {(replay.rounds, replay.bytes_sent)}")
            row.update({"MB sent/rank (meter)": _median_over_calls(per_rank, "bytes_sent") / 1e6,
                        "MB sent/rank (model)": (P - 1) * _median_over_calls(per_rank, "message_bytes") / 1e6,
                        "model": "eq. (1)", "rounds": per_rank[0]["stats"][-1]["rounds"]})
            row["selected/rank"] = round(_median_over_calls(per_rank, "selected"))
        rows.append(row)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print(markdown_table(rows, columns))
    print(f"\nP={P}, n={n} float32 in {len(layout)} layers (VGG-16 scaled), density {args.density}; median of "
          f"{args.repeat} calls (after {args.warmup} warm-up) of the slowest rank; phase times and "
          f"meter bytes are means over ranks (comm includes waiting for the slowest rank's selection). "
          f"Model: eq. (1) = (P-1) x mean message bytes (D averaged over ranks), eq. (2) = Rabenseifner's "
          f"2(P-1)/P x 4n. Every rank's meter equals the replay of the all-gather schedule on the ranks' "
          f"real message sizes (checked).")
    return 0
