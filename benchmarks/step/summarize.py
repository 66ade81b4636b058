"""The median (min-max) over several `sparsecomm bench step` outputs of the figures that matter per step: at
P = 1 the passes outside communication ("non-comm") and error feedback's own floor ("EF floor"); at P = 4
and 8 the passes of decompression and of the residual's update. benchmarks/step/run.sh calls it on its runs:

    python benchmarks/step/summarize.py OUTPUT.md [OUTPUT.md ...]
"""

from __future__ import annotations

import statistics
import sys


def rows(paths: list[str]) -> dict[tuple[str, int, float], list[dict[str, str]]]:
    """(method, P, density) -> the table's cells by column name, one dict per output."""
    found: dict[tuple[str, int, float], list[dict[str, str]]] = {}
    for path in paths:
        header: list[str] = []
        with open(path) as output:
            for line in output:
                cells = [cell.strip() for cell in line.split("|")[1:-1]]
                if cells[:2] == ["method", "P"]:
                    header = cells
                elif header and len(cells) == len(header) and cells[1].isdigit():
                    row = dict(zip(header, cells, strict=True))
                    found.setdefault((row["method"], int(row["P"]), float(row["density"])), []).append(row)
    return found


def figure(runs: list[dict[str, str]], column: str) -> str:
    values = [float(cells[column]) for cells in runs if column in cells]
    if not values:
        return "-"
    return f"{statistics.median(values):g} ({min(values):g}-{max(values):g})"


def main(paths: list[str]) -> None:
    found = rows(paths)
    print("median (min-max) over the runs, in passes over the gradient (CPU time; EF floor: wall time)\n")
    print("| method | density | P = 1: outside communication | P = 1: EF floor | P = 4: decompression "
          "| P = 8: decompression | P = 4: residual | P = 8: residual |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, density in sorted({(key[0], key[2]) for key in found}, key=lambda key: (-key[1], key[0])):
        alone = found.get((name, 1, density), [])
        at = {(workers, column): figure(found.get((name, workers, density), []), column)
              for workers in (4, 8) for column in ("decompress", "residual")}
        print(f"| {name} | {density:g} | {figure(alone, 'non-comm')} | {figure(alone, 'EF floor')} "
              f"| {at[4, 'decompress']} | {at[8, 'decompress']} | {at[4, 'residual']} | {at[8, 'residual']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
