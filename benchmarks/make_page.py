"""Write the pages made of benchmark results: docs/benchmarks.md from the benchmark folders (for each,
its title, what it measures, the command that produces it, the conditions its report states, and its
main tables, with a link to the folder); docs/campaign.md from the time-to-quality campaigns' reports
(``benchmarks/campaign-*``, in :data:`CAMPAIGNS`' order); and the README's headline, between its
``<!-- headline -->`` markers, from the transformer campaign's report. Run it after a benchmark's
result changed (``make benchmarks-page``); a test checks that the pages are up to date.

    python benchmarks/make_page.py
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (folder, indices of the report's markdown tables shown on the page), in the page's order
SECTIONS: list[tuple[str, str, list[tuple[str, list[int]]]]] = [
    ("Training: time to accuracy", "training", [
        ("demo", [0]), ("campaign-gpt", [2, 3]), ("campaign-gpt-local", [0, 1]), ("campaign-word-lstm", [0, 1]),
        ("campaign-resnet", [0, 1, 2, 3]), ("hsdp", [0])]),
    ("Work around communication", "work", [("step", [0]), ("select", [0]), ("memory", [0])]),
    ("Methods per call", "methods", [
        ("peers", []), ("spardl", [0]), ("sparse-allreduce", [0]), ("redsync", [1]), ("exdyna", [0]),
        ("methods", [1]), ("block-sparse", [0]), ("hierarchy", [0]), ("pto", [0]), ("datacache", [0]),
        ("collectives", [0]), ("agreement", [0])]),
    ("Training step under DDP", "ddp", [("ddp", [0])]),
    ("The simulator", "simulator", [("simulator", [0, 1]), ("advise", [0]), ("projection", [0]),
                                     ("projection-gpu", []), ("gpu", [])]),
    ("Reliability and the emulated network", "infra", [("faults", []), ("net", [0, 1]), ("launch", [0])]),
]

#: what the measurements above do not show, closing the page
LIMITS = ["## What these measurements do not show", "",
          "* **Other machines.** Every figure comes from one or two 2-core CPU machines, with P workers sharing",
          "  the cores and an emulated link; the work around communication depends on the machine's memory",
          "  (the per-step figures differ between an AVX-512 and an AVX2 machine). A GPU cluster is projected",
          "  from measured rates, not measured ([benchmarks/projection-gpu](../benchmarks/projection-gpu/)).",
          "* **Latency.** Only the link's rate is emulated (no `sch_netem` on the kernel used): no propagation",
          "  delay, jitter or loss. gloo costs about a millisecond per message on these machines, so methods",
          "  with many rounds lose on small gradients.",
          "* **GPUs.** No GPU measurement has been made on the current code ([benchmarks/gpu](../benchmarks/gpu/)).",
          "* **Large models and many workers.** The campaigns train models of 3-12M parameters on 4 workers;",
          "  beyond that the figures are the simulator's projections.", ""]

#: the campaign folders of docs/campaign.md, in its order (the first gives the README's headline)
CAMPAIGNS = ["campaign-gpt", "campaign-gpt-local", "campaign-word-lstm", "campaign-resnet"]
#: the network of the README's headline table
HEADLINE_NET = "1gbit"
HEADLINE = re.compile(r"(<!-- headline -->\n)(.*?)(<!-- end of headline -->)", re.S)

_TABLE = re.compile(r"(?:^\|.*\|\n)+", re.M)


def _section(text: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return match.group(1).strip() if match else ""


def _first_paragraph(text: str) -> str:
    body = text.split("\n", 1)[1] if text.startswith("# ") else text
    return body.strip().split("\n\n")[0].strip()


def _tables(text: str) -> list[str]:
    return [m.group(0).rstrip("\n") for m in _TABLE.finditer(text) if "| --- |" in m.group(0)]


def _relink(text: str, folder: Path) -> str:
    """``text``'s relative markdown links, written for ``folder``, rewritten for a page in docs/."""
    def fix(match: re.Match[str]) -> str:
        target = match.group(2)
        if re.match(r"[a-z]+:|#", target):
            return match.group(0)
        resolved = os.path.normpath(folder / target)
        return f"{match.group(1)}({os.path.relpath(resolved, ROOT / 'docs')}{'/' if target.endswith('/') else ''})"
    return re.sub(r"(\[[^\]]*\])\(([^)]+)\)", fix, text)


def entry(name: str, tables: list[int]) -> str:
    folder = ROOT / "benchmarks" / name
    readme = (folder / "README.md").read_text()
    report = (folder / "report.md").read_text()
    title = readme.splitlines()[0].lstrip("# ").strip()
    command = re.search(r"```sh\n(.*?)```", _section(readme, "Command"), re.S)
    found = _tables(report)
    parts = [f"### {title}", "", _relink(_first_paragraph(readme), folder), ""]
    if command:
        parts += ["```sh", command.group(1).rstrip(), "```", ""]
    current = _relink(_section(readme, "Current result"), folder)
    parts += [f"**Current result** ([benchmarks/{name}](../benchmarks/{name}/)): {current}", ""]
    if tables:
        parts += ["Conditions, from the report: " + _first_paragraph(report).replace("\n", " "), ""]
    for i in tables:
        parts += [found[i], ""]
    return "\n".join(parts)


def page() -> str:
    out = ["# Benchmarks", "",
           "Every measurement of the project, each produced by the command shown and stored with its current",
           "result in a folder of `benchmarks/` (a README with the command, a report with the date and the",
           "machine's conditions, and the run's records where it keeps them). Rerunning a benchmark replaces its",
           "result; earlier results are in the repository's history. This page shows each one's main tables; the",
           "folder holds the rest. It is generated by `benchmarks/make_page.py` (`make benchmarks-page`).", "",
           "Times on the 2-core machines these ran on are noisy: compare the ratios within one report, which",
           "were measured side by side, and read the conditions each report states. Bytes and rounds come from",
           "the traffic meter and are exact.", ""]
    out += [f"- [{title}](#{anchor})" for title, anchor, _ in SECTIONS] + [""]
    for title, anchor, entries in SECTIONS:
        out += [f'<a id="{anchor}"></a>', "", f"## {title}", ""]
        out += [entry(name, tables) for name, tables in entries]
    out += LIMITS
    return "\n".join(out).rstrip() + "\n"


def _report(name: str) -> str:
    return (ROOT / "benchmarks" / name / "report.md").read_text()


def time_breakdown(summary: dict, net: str) -> dict[str, str] | None:
    """Why the recommended arm's time to the target is what it is on ``net``, from a campaign's
    ``summary.json``: its time over the limit is the product of three factors, its steps to the target
    over DDP's, its main step over the floor's, and its time over those steps at its main step (the
    dense warm-up's slower steps); and its x limit had its main step been no slower than the floor's.
    None where its median seed does not reach the target or a step time is missing."""
    arms = summary["arms"]
    mine, floor = arms[summary["workload"]["recommended"]], arms.get("floor")
    ddp_steps = summary.get("ddp_steps_to_target")
    if floor is None or not ddp_steps or net not in mine["step_s"] or net not in floor["step_s"]:
        return None
    taken = mine.get("by_network", {}).get(net, mine)  # a dense_fallback policy: the branch taken on net
    steps = statistics.median([math.inf if v is None else v for v in taken["steps_to_target"].values()] or [math.inf])
    if steps == math.inf:
        return None
    warm_s, main_s = mine["step_s"][net]["warmup"], mine["step_s"][net]["main"]
    floor_s = floor["step_s"][net]["main"]
    in_warmup = min(steps, mine["options"].get("dense_warmup_steps") or 0) if warm_s is not None else 0
    time = in_warmup * (warm_s or 0.0) + (steps - in_warmup) * main_s
    # an exchange that costs nothing: no main step slower than the floor's
    free = in_warmup * (warm_s or 0.0) + (steps - in_warmup) * min(main_s, floor_s)
    factors = {"x steps": steps / ddp_steps, "x step": main_s / floor_s, "x warm-up": time / (steps * main_s)}
    return {"network": net, "steps to target": f"{steps:g}", "DDP's steps": f"{ddp_steps:g}",
            "x steps": f"{factors['x steps']:.2f}", "main step ms": f"{1e3 * main_s:.0f}",
            "floor ms": f"{1e3 * floor_s:.0f}", "x step": f"{factors['x step']:.2f}",
            "warm-up": f"{in_warmup:g} steps at {1e3 * (warm_s or 0.0):.0f} ms" if in_warmup else "none",
            "x warm-up": f"{factors['x warm-up']:.2f}", "x limit": f"{math.prod(factors.values()):.2f}",
            "x limit, main step at the floor's": f"{free / (ddp_steps * floor_s):.2f}"}


def breakdown_block(name: str) -> list[str]:
    """The markdown of :func:`time_breakdown` for campaign folder ``name`` on each of its networks."""
    summary = json.loads((ROOT / "benchmarks" / name / "summary.json").read_text())
    rows = [row for goal in summary["goals"] for row in [time_breakdown(summary, goal["network"])] if row]
    if not rows:
        return []
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row[key] for key in header) + " |" for row in rows]
    return [f"**Where the recommended arm's time goes** ({summary['workload']['recommended']}, its median seed; "
            "from `summary.json`): `x limit` = `x steps` (its steps to the target over DDP's) x `x step` (its "
            "step over the floor's) x `x warm-up` (its time over those steps at its main step: the dense "
            "warm-up's slower steps). `x limit, main step at the floor's`: its x limit had no step after the "
            "warm-up cost more than the floor's (an exchange free and hidden), its steps and warm-up as "
            "measured: the most a faster exchange alone could win.", "", *lines, ""]


def campaign_page() -> str:
    """docs/campaign.md: every campaign's report, its headings one level down, its links rewritten."""
    out = ["# The time-to-quality campaigns", "",
           "Each campaign trains one workload to DDP's quality under every configuration it compares, on a",
           "learning-rate grid shared by all of them, and composes each configuration's time to the target from",
           "its steps to the target and its step time on emulated links (the protocol:",
           "[training.md](training.md#the-time-to-quality-campaign)). Below, each campaign's current report, as",
           "`sparsecomm campaign --workload W` wrote it into `benchmarks/campaign-W/` (with its command, date and",
           "load), and after it, from its `summary.json`, where the recommended arm's time goes. The command",
           "writes each run's record into the folder's `runs/`, which git keeps. This page is generated",
           "by `benchmarks/make_page.py` (`make benchmarks-page`).", ""]
    out += [f"- [{name}](#{name})" for name in CAMPAIGNS] + [""]
    for name in CAMPAIGNS:
        folder = ROOT / "benchmarks" / name
        body = _relink(_report(name), folder)
        body = re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", body, flags=re.M)
        out += [f'<a id="{name}"></a>', "", body.strip(), "", *breakdown_block(name)]
    return "\n".join(out).rstrip() + "\n"


def headline() -> str:
    """The README's headline: the transformer campaign's table and goals on :data:`HEADLINE_NET`."""
    name = CAMPAIGNS[0]
    report = _report(name)
    section = _section(report, HEADLINE_NET)
    tables = _tables(section + "\n")
    first = _first_paragraph(report).replace("\n", " ")
    rows = "\n".join(line for line in tables[0].splitlines() if "(exploration)" not in line)
    return "\n".join([
        f"*[benchmarks/{name}](benchmarks/{name}/report.md): {first} On an emulated {HEADLINE_NET} link, each",
        "arm at its best learning rate of the shared grid; steps and time to the target: median over the seeds",
        "(range; [seeds that reached it / seeds]); `x limit`: the time over the floor's step x DDP's steps to",
        "the target. The report also gives 100 Mbit/s, the grid, the density explorations and the check of",
        "the composition by full runs:*", "",
        rows, "", "The recommended arm against the project's goals:", "", tables[1], "", *breakdown_block(name)])


def readme(text: str) -> str:
    """``text`` (the README) with its headline block regenerated."""
    if not HEADLINE.search(text):
        raise SystemExit("README.md has no <!-- headline --> ... <!-- end of headline --> block")
    return HEADLINE.sub(lambda m: m.group(1) + headline() + m.group(3), text)


def main(argv: list[str]) -> int:
    (ROOT / "docs" / "benchmarks.md").write_text(page())
    (ROOT / "docs" / "campaign.md").write_text(campaign_page())
    path = ROOT / "README.md"
    path.write_text(readme(path.read_text()))
    print("wrote docs/benchmarks.md, docs/campaign.md and README.md's headline")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
