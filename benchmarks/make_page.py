"""Write docs/benchmarks.md from the benchmark folders: for each, its title, what it measures, the
command that produces it, the conditions its report states, and its main tables, with a link to
the folder. Run it after a benchmark's result changed (``make benchmarks-page``); a test checks
that the page is up to date.

    python benchmarks/make_page.py [OUT]        # default docs/benchmarks.md
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (folder, indices of the report's markdown tables shown on the page), in the page's order
SECTIONS: list[tuple[str, str, list[tuple[str, list[int]]]]] = [
    ("Training: time to accuracy", "training", [
        ("demo", [0, 1]), ("campaign-lstm", [0, 1]), ("campaign-fashion", [0, 1]), ("campaign-methods", [0]),
        ("recipe", [0]), ("lr-sweep", [1])]),
    ("Work around communication", "work", [("step", [0]), ("select", [0]), ("memory", [0])]),
    ("Methods per call", "methods", [
        ("peers", []), ("spardl", [0]), ("sparse-allreduce", [0]), ("redsync", [1]), ("exdyna", [0]),
        ("methods", [1]), ("block-sparse", [0]), ("hierarchy", [0]), ("pto", [0]), ("datacache", [0]),
        ("collectives", [0]), ("agreement", [0])]),
    ("Training step under DDP", "ddp", [("ddp", [0])]),
    ("The simulator", "simulator", [("simulator", [0, 1]), ("advise", [0]), ("projection", [0]),
                                     ("projection-gpu", [])]),
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
          "* **The per-call comparison with the public codes** is to be rerun as the median of interleaved",
          "  runs on a quiet machine ([benchmarks/peers](../benchmarks/peers/)).",
          "* **Transformers and AdamW.** The campaigns train an LSTM and a CNN with momentum SGD; a result",
          "  for the optimizer transformer users run is not part of them yet.", ""]

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


def main(argv: list[str]) -> int:
    target = Path(argv[0]) if argv else ROOT / "docs" / "benchmarks.md"
    target.write_text(page())
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
