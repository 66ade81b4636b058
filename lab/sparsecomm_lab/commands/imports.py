"""``sparsecomm imports``: check the import rule and draw the layer graph.

Reads the package's source (:mod:`sparsecomm_lab.imports`), prints every breach of the import rule
(exit status 1 when there is one) and the imports counted between packages. ``--mermaid`` prints the
graph as a Mermaid flowchart; ``--plot FILE.png`` draws it (docs/architecture.md shows that picture).
"""

from __future__ import annotations

import argparse
import os

HELP = "check the layer import rule and print or draw the package import graph"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mermaid", action="store_true", help="print the graph as a Mermaid flowchart")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the graph into a PNG file (needs matplotlib)")


def _package_root() -> str:
    import sparsecomm

    return os.path.dirname(os.path.abspath(sparsecomm.__file__))


def mermaid(edges: dict[tuple[str, str], int]) -> str:
    """A Mermaid flowchart: one subgraph per layer, top layer first, an arrow per importing pair."""
    from sparsecomm_lab.imports import groups_by_layer

    lines = ["flowchart TB"]
    for layer, names in reversed(list(groups_by_layer(edges).items())):
        lines.append(f"  subgraph {layer}")
        lines.extend(f"    {name.replace('.', '_')}[{name}]" for name in names)
        lines.append("  end")
    lines.extend(f"  {a.replace('.', '_')} --> {b.replace('.', '_')}" for a, b in sorted(edges))
    return "\n".join(lines)


def plot(edges: dict[tuple[str, str], int], path: str) -> None:
    """Draw the layers as rows (core at the bottom) and each import between packages as an arrow."""
    from sparsecomm.core.optional import require

    matplotlib = require("matplotlib", "--plot")

    from sparsecomm_lab.imports import LAYERS, groups_by_layer

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = groups_by_layer(edges)
    position: dict[str, tuple[float, float]] = {}
    for row, layer in enumerate(LAYERS):
        names = layers[layer]
        for column, name in enumerate(names):
            # rows zigzag sideways, so that an arrow passing a layer does not run through its box
            position[name] = ((column + 1) / (len(names) + 1) + 0.12 * (row % 3 - 1) / len(names), row)
    fig, ax = plt.subplots(figsize=(13, 7))
    for (a, b), count in sorted(edges.items()):
        (xa, ya), (xb, yb) = position[a], position[b]
        ax.annotate("", xy=(xb, yb), xytext=(xa, ya),
                    arrowprops={"arrowstyle": "->", "color": "0.55", "lw": 0.4 + 0.15 * min(count, 8),
                                "shrinkA": 14, "shrinkB": 14, "connectionstyle": "arc3,rad=0.08"})
    for name, (x, y) in position.items():
        label = name.split(".", 1)[1] if "." in name else name
        ax.text(x, y, label, ha="center", va="center", fontsize=8,
                bbox={"boxstyle": "round", "fc": "#e8eef7", "ec": "#4a6fa5"})
    for row, layer in enumerate(LAYERS):
        ax.text(-0.02, row, layer, ha="right", va="center", fontsize=11, weight="bold")
    ax.set_xlim(-0.15, 1.02)
    ax.set_ylim(-0.6, len(LAYERS) - 0.4)
    ax.axis("off")
    ax.set_title("sparsecomm: imports between packages (arrows point at the imported package)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from sparsecomm_lab.imports import layer_edges, scan_package, violations

    modules = scan_package(_package_root())
    breaches = violations(modules)
    edges = layer_edges(modules)
    if args.mermaid:
        print(mermaid(edges))
    elif not args.plot:
        for (a, b), count in sorted(edges.items()):
            print(f"{a} -> {b}: {count} import{'s' if count != 1 else ''}")
    if args.plot:
        plot(edges, args.plot)
        print(f"wrote {args.plot}")
    for line in breaches:
        print(f"breach: {line}")
    return 1 if breaches else 0
