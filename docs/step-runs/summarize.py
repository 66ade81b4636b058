"""The median (min-max) over several `sparsecomm bench step` outputs of the figures the per-step goal names: at
P = 1 the passes outside communication ("non-comm"), at P = 4 and 8 the passes of decompression.

    python docs/step-runs/summarize.py docs/step-runs/step-*.md
"""

from __future__ import annotations

import statistics
import sys

NON_COMM, DECOMPRESS = 6, 5  # columns of the table `bench step` prints


def rows(paths: list[str]) -> dict[tuple[str, int, float], list[list[str]]]:
    """(method, P, density) -> the table's cells, one list per output."""
    found: dict[tuple[str, int, float], list[list[str]]] = {}
    for path in paths:
        with open(path) as output:
            for line in output:
                cells = [cell.strip() for cell in line.split("|")[1:-1]]
                if len(cells) == 12 and cells[1].isdigit():
                    found.setdefault((cells[0], int(cells[1]), float(cells[2])), []).append(cells)
    return found


def figure(runs: list[list[str]], column: int) -> str:
    values = [float(cells[column]) for cells in runs]
    return f"{statistics.median(values):g} ({min(values):g}-{max(values):g})"


def main(paths: list[str]) -> None:
    found = rows(paths)
    print(f"median (min-max) of {len(paths)} runs, in passes over the gradient (CPU time)\n")
    print("| method | density | P = 1: outside communication | P = 4: decompression | P = 8: decompression |")
    print("| --- | --- | --- | --- | --- |")
    for name, P, density in sorted(found, key=lambda key: (-key[2], key[0])):
        if P == 1:
            decompress = [figure(found[(name, workers, density)], DECOMPRESS) for workers in (4, 8)]
            print(f"| {name} | {density:g} | {figure(found[(name, 1, density)], NON_COMM)} "
                  f"| {decompress[0]} | {decompress[1]} |")


if __name__ == "__main__":
    main(sys.argv[1:])
