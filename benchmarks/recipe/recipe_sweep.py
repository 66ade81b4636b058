"""The recipe sweep of benchmarks/recipe at the campaign's budget (3 epochs, the cosine schedule): TopkA
under the DDP hook or DGC momentum correction at several learning rates and densities, on loopback
(the network does not change a run's trajectory; only its times, which this sweep does not report).

    python benchmarks/recipe/recipe_sweep.py run --seeds 0,1,2 [NAME ...]     # train (records under --out)
    python benchmarks/recipe/recipe_sweep.py table                          # the markdown table of the records

NAME is a key of CONFIGS (default: all); a run whose record exists is skipped. The table gives, per
configuration and seed, the metric after the budget and the step at which the target was first
reached (evaluated every 5 steps), and the median over the seeds run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from typing import Any

from sparsecomm.cli.table import markdown_table
from sparsecomm_lab import campaign

#: name: (workload, method, density, campaign recipe, TrainConfig overrides)
CONFIGS: dict[str, tuple[str, str, float, str, dict[str, Any]]] = {
    "lstm-topka-hook": ("lstm", "topka", 0.01, "hook", {}),
    "lstm-topka-mc-lr2": ("lstm", "topka", 0.01, "mc", {"lr": 2.0}),
    "lstm-topka-mc-lr3": ("lstm", "topka", 0.01, "mc", {"lr": 3.0}),
    "lstm-topka-mc-lr4": ("lstm", "topka", 0.01, "mc", {"lr": 4.0}),
    "lstm-topka-mc-lr3-clip0.5": ("lstm", "topka", 0.01, "mc", {"lr": 3.0, "clip_norm": 0.5}),
    "lstm-topka-mc-lr4-clip0.5": ("lstm", "topka", 0.01, "mc", {"lr": 4.0, "clip_norm": 0.5}),
    "lstm-topka-mc-lr5-clip0.5": ("lstm", "topka", 0.01, "mc", {"lr": 5.0, "clip_norm": 0.5}),
    "lstm-topka-mc-warmup-lr3": ("lstm", "topka", 0.01, "mc-warmup", {"lr": 3.0}),
    "lstm-topka-mc-lr3-d0.02": ("lstm", "topka", 0.02, "mc", {"lr": 3.0}),
    "lstm-topka-mc-lr3-d0.005": ("lstm", "topka", 0.005, "mc", {"lr": 3.0}),
    "lstm-topka-mc-lr3-d0.0025": ("lstm", "topka", 0.0025, "mc", {"lr": 3.0}),
    "lstm-topka-mc-lr3-d0.001": ("lstm", "topka", 0.001, "mc", {"lr": 3.0}),
    "fashion-topka-hook-d0.02": ("fashion", "topka", 0.02, "hook", {}),
    "fashion-topka-hook-warmup": ("fashion", "topka", 0.01, "warmup", {}),
    "fashion-topka-mc-lr0.02": ("fashion", "topka", 0.01, "mc", {"lr": 0.02}),
    "fashion-topka-mc-lr0.03": ("fashion", "topka", 0.01, "mc", {"lr": 0.03}),
    "fashion-topka-mc-lr0.05": ("fashion", "topka", 0.01, "mc", {"lr": 0.05}),
    "fashion-topka-mc-lr0.02-d0.005": ("fashion", "topka", 0.005, "mc", {"lr": 0.02}),
}


def run(names: list[str], seeds: list[int], out: str) -> None:
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    for seed in seeds:
        for name in names:
            workload, method, density, recipe, overrides = CONFIGS[name]
            campaign.run_campaign([campaign.RunSpec(workload, None, method, density, recipe=recipe, seed=seed)],
                                  os.path.join(out, name), {"workers": 4, **overrides}, echo=print)


def table(out: str) -> str:
    rows = []
    for name, (workload, _, density, recipe, overrides) in CONFIGS.items():
        finals, steps = {}, {}
        for path in sorted(glob.glob(os.path.join(out, name, "**", "*.json"), recursive=True)):
            with open(path) as handle:
                record = json.load(handle)
            spec = campaign.WORKLOADS[record["campaign"]["workload"]]
            seed = record["campaign"]["seed"]
            history = record["history"]
            finals[seed] = campaign.metric_of(history[-1], spec.metric)
            _, epochs = campaign.time_and_epochs_to_target(history, spec.metric, spec.target)
            steps[seed] = None if epochs is None else round(epochs * record["steps_per_epoch"])
        if not finals:
            continue
        reached = [s for s in steps.values() if s is not None]
        rows.append({"configuration": name, "workload": workload, "density": density, "recipe": recipe,
                     "options": json.dumps(overrides) if overrides else "",
                     "seeds": ",".join(map(str, sorted(finals))),
                     "metric after 3 epochs, per seed": " / ".join(f"{finals[s]:.2f}" for s in sorted(finals)),
                     "median": round(statistics.median(finals.values()), 2),
                     "step reaching the target, per seed": " / ".join(str(steps[s]) for s in sorted(steps)),
                     "median step": statistics.median(reached) if len(reached) == len(steps) else "-"})
    return markdown_table(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["run", "table"])
    parser.add_argument("names", nargs="*", help="configurations (default: all)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--out", default="runs/recipe3", help="run records (default runs/recipe3)")
    args = parser.parse_args()
    if args.action == "run":
        run(args.names or list(CONFIGS), [int(s) for s in args.seeds.split(",")], args.out)
    else:
        print(table(args.out))
