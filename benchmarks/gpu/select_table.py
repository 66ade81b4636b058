"""The selection table on one GPU: every selector, and the residual's addition fused into the scan,
against ``torch.topk(x.abs(), k)`` and one memory pass, at the sizes of docs/gpu.md.

    python3 benchmarks/gpu/select_table.py --sizes 25M,64M --densities 0.001,0.01 --repeat 20 \
        --json select.json > select.md

For each size and density: one normal input ``x`` (and for the fused rows a residual ``r`` and a
gradient ``g``); each row's median over ``--repeat`` calls, the device synchronized before and after
each (a selector's result is on the host's hands when it returns), in microseconds and in *memory
passes*: one pass is one read of ``x`` at the bandwidth of a device-to-device copy (half the copy's
time, which reads and writes ``x``). Rows:

* ``torch.topk(x.abs())`` and ``one memory pass``;
* every selector ``sel(x, k)`` (``fixed_threshold`` and ``scaled_threshold`` primed with the exact
  k-th magnitude, as after a previous step); ``device path`` says whether the call was decided on
  the device (no fallback to the host's search: the log of :mod:`sparsecomm.selection` is watched);
* ``+acc`` rows: ``sel.accumulate(r, g, k, dest=acc)``, error feedback's ``acc = r + g`` and the
  selection in one pipeline (reads ``r`` and ``g`` once, writes ``acc`` once: at least 3 passes),
  beside ``add+sel``: ``torch.add(r, g, out=acc)`` then ``sel(acc, k)``.

The table is markdown on stdout; ``--json`` writes the rows. ``--check`` first compares each
selector's indices on the GPU with the CPU's at a smaller size (1M elements). ``--device cpu`` (with
``TRITON_INTERPRET=1 SPARSECOMM_SCAN=triton``, tiny sizes) runs the same code on the CPU, to check the
script, not to time anything.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import statistics
import sys
import time

import torch

from sparsecomm import selection as selectors

PRIMED = {"fixed_threshold": "threshold", "scaled_threshold": "initial_threshold"}
FUSED = ("fixed_threshold", "exact_topk", "binary_search", "mstopk", "sampled_binary_search")


class _Fallbacks(logging.Handler):
    """Counts the selection modules' messages that a device search handed a call to the host."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "host path" in record.getMessage():
            self.count += 1


def _sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = {"K": 1 << 10, "M": 1_000_000}.get(part[-1:], 1)
        out.append(int(float(part[:-1] if scale != 1 else part) * scale))
    return out


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _median_seconds(fn, repeat: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeat):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _make(name: str, x: torch.Tensor, k: int) -> selectors.Selector:
    option = PRIMED.get(name)
    if option is None:
        return selectors.make(name)
    return selectors.make(name, **{option: float(torch.topk(x.abs(), k, sorted=False).values.min())})


def check(names: list[str]) -> list[str]:
    """The selectors whose GPU indices differ from the CPU's at 1M elements (empty: all agree)."""
    wrong = []
    gen = torch.Generator().manual_seed(1)
    for density in (0.001, 0.01):
        x = torch.randn(1_000_000, generator=gen)
        k = math.ceil(density * x.numel())
        for name in names:
            on_cpu = torch.sort(_make(name, x, k)(x, k)).values
            on_gpu = torch.sort(_make(name, x, k)(x.cuda(), k).cpu()).values
            if not torch.equal(on_cpu, on_gpu):
                wrong.append(f"{name} at density {density}")
    return wrong


def rows(sizes: list[int], densities: list[float], names: list[str], repeat: int, seed: int,
         device: str = "cuda") -> list[dict]:
    fallbacks = _Fallbacks()
    for module in ("sparsecomm.selection.exact", "sparsecomm.selection.search"):
        logger = logging.getLogger(module)
        logger.addHandler(fallbacks)
        logger.setLevel(logging.DEBUG)
    gen = torch.Generator(device=device).manual_seed(seed)
    out: list[dict] = []
    for n in sizes:
        vectors = {name: torch.randn(n, generator=gen, device=device) for name in ("x", "residual", "grad")}
        vectors["acc"] = torch.empty(n, device=device)
        copy = torch.empty(n, device=device)
        t_pass = _median_seconds(functools.partial(copy.copy_, vectors["x"]), repeat) / 2
        del copy
        for density in densities:
            out += _density_rows(vectors, density, names, repeat, t_pass, fallbacks)
        del vectors
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def _density_rows(vectors: dict[str, torch.Tensor], density: float, names: list[str], repeat: int, t_pass: float,
                  fallbacks: _Fallbacks) -> list[dict]:
    """The rows of one size and density (``vectors``: x, residual, grad and acc)."""
    x, residual, grad, acc = vectors["x"], vectors["residual"], vectors["grad"], vectors["acc"]
    n = x.numel()
    k = math.ceil(density * n)
    out: list[dict] = []

    def row(label: str, seconds: float, count: object = "", device: object = "", **extra: object) -> None:
        out.append({"n": n, "density": density, "k": k, "selector": label, "us": 1e6 * seconds,
                    "passes": seconds / t_pass, "count": count, "device path": device, **extra})
        print(f"  {label}: {1e6 * seconds:.1f} us, {seconds / t_pass:.2f} passes", file=sys.stderr, flush=True)

    t_topk = _median_seconds(functools.partial(torch.topk, x.abs(), k, sorted=False), repeat)
    row("torch.topk(x.abs())", t_topk, k)
    row("one memory pass", t_pass)
    for name in names:
        sel = _make(name, x, k)
        result: list[torch.Tensor] = []
        before = fallbacks.count
        seconds = _median_seconds(functools.partial(_select_into, result, sel, x, k), repeat)
        row(name, seconds, result[-1].numel(), fallbacks.count == before, **{"vs topk": t_topk / seconds})
    for name in FUSED:
        if name not in names:
            continue
        before = fallbacks.count
        t_fused = _median_seconds(functools.partial(_make(name, x, k).accumulate, residual, grad, k, dest=acc),
                                  repeat)
        row(f"{name} +acc", t_fused, "", fallbacks.count == before, **{"vs topk": t_topk / t_fused})
        row(f"{name} add+sel", _median_seconds(functools.partial(_add_then_select, _make(name, x, k), residual,
                                                                 grad, acc, k), repeat))
    return out


def _select_into(result: list[torch.Tensor], sel: selectors.Selector, x: torch.Tensor, k: int) -> None:
    result.append(sel(x, k))


def _add_then_select(sel: selectors.Selector, residual: torch.Tensor, grad: torch.Tensor, acc: torch.Tensor,
                     k: int) -> None:
    torch.add(residual, grad, out=acc)
    sel(acc, k)


def markdown(table: list[dict]) -> str:
    columns = ["n", "density", "selector", "us", "passes", "vs topk", "count", "device path"]
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    for r in table:
        cells = []
        for c in columns:
            v = r.get(c, "")
            cells.append(f"{v:.1f}" if c == "us" else f"{v:.2f}" if isinstance(v, float) and c != "density" else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_sizes, default=_sizes("25M,64M"))
    parser.add_argument("--densities", type=lambda s: [float(d) for d in s.split(",")], default=[0.001, 0.01])
    parser.add_argument("--selectors", default="all")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--check", action="store_true", help="compare the GPU's indices with the CPU's first")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("select_table: needs a CUDA GPU (or --device cpu to check the script)", file=sys.stderr)
        return 2
    names = selectors.available() if args.selectors == "all" else args.selectors.split(",")
    if args.check and args.device == "cuda":
        wrong = check(names)
        print(f"check at 1M: {'every selector agrees with the CPU' if not wrong else 'DIFFER: ' + ', '.join(wrong)}",
              file=sys.stderr, flush=True)
    table = rows(args.sizes, args.densities, names, args.repeat, args.seed, args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (script check, no timing meaning)"
    print(f"{device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print(markdown(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "rows": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
