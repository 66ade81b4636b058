"""Reports comparing training runs: a markdown (optionally HTML) page with PNG plots.

:func:`write_report` reads run records (the JSON files :func:`sparsecomm.experiments.training.save_record`
writes) and produces, in one folder: ``accuracy_vs_time.png`` (test accuracy against training wall
time), ``time_breakdown.png`` (mean time per step split into compute / select / communicate /
decompress), ``density.png`` (actual density of the synchronized gradient per step) and
``report.md`` with the summary table (:func:`summary_rows`).

One report compares runs of one setting: the same model, data, worker count P and network
(:func:`group_key`). :func:`group_records` splits a mix into such groups, and :func:`write_report`
refuses a mix rather than title it after its first run.
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Sequence
from typing import Any

from sparsecomm.cli.table import markdown_table

__all__ = ["load_records", "summary_rows", "write_report", "group_key", "group_records", "group_slug", "PLOTS"]

PLOTS = ("accuracy_vs_time.png", "time_breakdown.png", "density.png")
_PHASES = (("time_compute", "compute"), ("time_select", "select"), ("time_comm", "communicate"),
           ("time_decompress", "decompress"))


def load_records(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Run records from JSON files (a folder stands for every ``*.json`` in it, sorted)."""
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".json"))
        else:
            files.append(path)
    if not files:
        raise ValueError(f"no run records (*.json) in {list(paths)}")
    records = []
    for file in files:
        with open(file) as handle:
            record = json.load(handle)
        if "history" not in record or "config" not in record:
            raise ValueError(f"{file} is not a sparsecomm run record (no 'history' / 'config')")
        record["_path"] = file
        records.append(record)
    return records


def group_key(record: dict[str, Any]) -> tuple[str, str, int, str]:
    """(model, data, P, network) of a run record: the setting one report compares methods in. The
    network is the record's network without its parenthesized detail."""
    cfg = record["config"]
    return cfg["model"], cfg["data"], int(cfg["workers"]), record["network"].split(" (")[0]


def group_records(records: Sequence[dict[str, Any]]) -> dict[tuple[str, str, int, str], list[dict[str, Any]]]:
    """The records split by :func:`group_key`, in order of first appearance."""
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(group_key(record), []).append(record)
    return groups


def group_slug(key: tuple[str, str, int, str]) -> str:
    """A shell-safe folder name for a group: ``cnn-digits-P4-emulated-1gbit-switch``."""
    model, data, P, network = key
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{model}-{data}-P{P}-{network}").strip("-")


def _one_setting(records: Sequence[dict[str, Any]]) -> None:
    keys = list(group_records(records))
    if len(keys) > 1:
        settings = "; ".join(f"{m} on {d}, P={P}, {net}" for m, d, P, net in keys)
        raise ValueError(f"one report compares runs of one model, data, P and network; these runs mix {len(keys)} "
                         f"settings ({settings}): report each group apart (group_records)")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summary_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: accuracy, time per step and its split, bytes per step, density, time to target."""
    rows = []
    for rec in records:
        epochs = rec["epochs"]
        densities = [e["density"] for e in epochs if e.get("density") is not None]
        target = rec["config"].get("target_accuracy")
        ttt = rec.get("time_to_target")
        rows.append({
            "method": rec["label"],
            "final acc %": rec["final_accuracy"],
            "best acc %": max(h["test_accuracy"] for h in rec["history"]),
            "epochs": len(epochs),
            "train time s": rec["history"][-1]["train_time"],
            "ms/step": 1e3 * _mean([e["time_per_step"] for e in epochs]),
            **{f"{name} ms": 1e3 * _mean([e[key] for e in epochs]) for key, name in _PHASES},
            "kB sent/step": _mean([e["bytes_per_step"] for e in epochs]) / 1e3,
            "density": _mean(densities) if densities else "-",
            (f"time to {target:g}% s" if target is not None else "time to target s"):
                ("not reached" if ttt is None else ttt) if target is not None else "-",
        })
    return rows


def _plot(records: Sequence[dict[str, Any]], outdir: str) -> list[str]:
    from sparsecomm.core.optional import require

    matplotlib = require("matplotlib", "the report's plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in records]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # type: ignore[attr-defined]  # a ListedColormap
    for rec, label in zip(records, labels, strict=False):
        ax.plot([h["train_time"] for h in rec["history"]], [h["test_accuracy"] for h in rec["history"]],
                marker="o", markersize=3, label=label)
    target = records[0]["config"].get("target_accuracy")
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}%")
    ax.set_xlabel("training wall time (s, evaluation excluded)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(_title(records, "accuracy against time"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, outdir, PLOTS[0]))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    bottom = [0.0] * len(records)
    for key, name in _PHASES:
        values = [1e3 * _mean([e[key] for e in rec["epochs"]]) for rec in records]
        ax.bar(range(len(records)), values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=False)]
    ax.set_xticks(range(len(records)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("mean time per step (ms)")
    ax.set_title(_title(records, "where a step's time goes"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, outdir, PLOTS[1]))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # type: ignore[attr-defined]  # a ListedColormap
    for rec, label in zip(records, labels, strict=False):
        points = [(s["step"], s["density"]) for s in rec["steps"] if s.get("density") is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], label=label, linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("actual density (non-zeros of the averaged gradient / n)")
    ax.set_title(_title(records, "density of the synchronized gradient"))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, outdir, PLOTS[2]))
    plt.close("all")
    return written


def _title(records: Sequence[dict[str, Any]], what: str) -> str:
    _one_setting(records)
    cfg = records[0]["config"]
    return f"{what}: {cfg['model']} on {cfg['data']}, P={cfg['workers']}, {records[0]['network'].split(' (')[0]}"


def _save(fig, outdir: str, name: str) -> str:
    path = os.path.join(outdir, name)
    fig.savefig(path, dpi=110)
    return path


def write_report(records: Sequence[dict[str, Any]], outdir: str, html_too: bool = False,
                 title: str = "sparsecomm training report", command: str | None = None) -> dict[str, str]:
    """Write the plots and ``report.md`` (and ``report.html``) into ``outdir``; returns their paths.
    ``records`` must share one setting (:func:`group_key`): ValueError otherwise."""
    _one_setting(records)
    os.makedirs(outdir, exist_ok=True)
    plots = _plot(records, outdir)
    table = markdown_table(summary_rows(records))
    cfg = records[0]["config"]
    lines = [f"# {title}", "",
             f"{cfg['model']} on {cfg['data']}, P = {cfg['workers']} workers, network: {records[0]['network']}, "
             f"{cfg['epochs']} epochs, batch {cfg['batch_size']} per worker, lr {cfg['lr']}, seed {cfg['seed']}; "
             f"host {records[0]['host']['hostname']} ({records[0]['host']['cpus']} CPUs), "
             f"torch {records[0]['host']['torch']}.",
             ""]
    if command:
        lines += ["Command:", "", f"    {command}", ""]
    lines += [table, "", "Time per step is measured on rank 0; compute is the step time outside the "
              "method (forward, backward, optimizer, bucket copies; for the torch baselines ddp and powersgd, "
              "whose hooks sparsecomm does not time, it includes their communication); "
              "select / communicate / decompress come "
              "from the method's own timers. Bytes are what rank 0 sent, from the traffic meter (for the "
              "backend's native all-reduce: the ring model figure).", ""]
    for path in plots:
        name = os.path.basename(path)
        lines += [f"![{name}]({name})", ""]
    lines += ["Runs:", ""] + [f"- `{r['_path']}`" for r in records if "_path" in r]
    md_path = os.path.join(outdir, "report.md")
    with open(md_path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    out = {"markdown": md_path, **{os.path.basename(p): p for p in plots}}
    if html_too:
        html_path = os.path.join(outdir, "report.html")
        body = [f"<h1>{html.escape(title)}</h1>", f"<pre>{html.escape(table)}</pre>"]
        body += [f'<img src="{os.path.basename(p)}" alt="{os.path.basename(p)}">' for p in plots]
        with open(html_path, "w") as handle:
            handle.write("<!doctype html><meta charset='utf-8'><title>" + html.escape(title) + "</title>"
                         + "\n".join(body))
        out["html"] = html_path
    return out
