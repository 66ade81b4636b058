"""The tables of compare_trees.sh: per method, the median over the rounds before and after, and the ratio."""
import contextlib
import glob
import statistics
import sys


def table(path, value):
    with open(path) as handle:
        lines = [line for line in handle if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(head, (c.strip() for c in line.strip().strip("|").split("|")), strict=False))
        with contextlib.suppress(KeyError, ValueError):
            rows[cells["method"]] = float(cells[value])
    return rows


def compare(work, kind, value, unit):
    sides = {side: [table(p, value) for p in sorted(glob.glob(f"{work}/{kind}-{side}-*.md"))]
             for side in ("before", "after")}
    print(f"| method | before {unit} | after {unit} | after / before |\n| --- | --- | --- | --- |")
    ratios = []
    for method in sorted(sides["before"][0]):
        b = statistics.median(r[method] for r in sides["before"] if method in r)
        a = statistics.median(r[method] for r in sides["after"] if method in r)
        ratios.append(a / b)
        print(f"| {method} | {b:.3g} | {a:.3g} | {a / b:.2f} |")
    print(f"\nmedian of after / before over the methods: {statistics.median(ratios):.3f}\n")


compare(sys.argv[1], "step", "whole call", "(passes, whole call)")
compare(sys.argv[1], "methods", "time (ms)", "(ms per call)")
