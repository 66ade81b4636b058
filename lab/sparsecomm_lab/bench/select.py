"""``sparsecomm bench select``: time and quality of every selector against torch.topk and one pass.

For each density, one input of ``n`` elements; every selector is called ``--repeat`` times after one
warm-up call and its median time reported, with its ratio to ``torch.topk(|x|, k)`` and to one
abs+compare pass (``torch.abs`` then ``torch.ge`` into preallocated buffers: the cheapest thing a
threshold selector can do in torch), its count and its quality (:func:`captured_mass`). The selectors
run on the scan implementation in use (:func:`sparsecomm.selection.scan.kernel`, the C kernel where
built); ``--scans`` adds, side by side, each selector's time on other implementations (by default the
pure-torch path that CUDA tensors and other dtypes take), and the row "fused scan" times the kernel's
bare pass (sum and max of ``|x|``, no candidates). ``--quality`` instead prints the quality table on
normal, Laplace, Student-t(3) data and on real gradients of a small MLP.

``--device cuda`` times on the GPU instead (the reproduction of RedSync's Fig. 3 and Shi et al.'s Fig. 6):
for every size of ``--sizes`` and every density, each selector's median time over ``--repeat`` calls
(synchronized: a selector's result is on the host's hands when it returns), its speed-up over
``torch.topk(|x|, k)`` on the same GPU, and its time in *memory passes*: one pass is one read of ``x``
at the bandwidth of a device-to-device copy of ``x`` (half the copy's time, as the copy reads and
writes ``x``), the least any selector must spend.

Threshold selectors are primed as after a previous step: ``fixed_threshold`` and ``scaled_threshold`` start at
the exact k-th largest magnitude of the previous input (timing: the same input; quality: an independent
draw of the same distribution, or the MLP's previous gradient).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from sparsecomm import selection as selectors
from sparsecomm.cli.table import markdown_table
from sparsecomm.selection import scan
from sparsecomm_lab.bench.common import configurations

HELP = "time and quality of the top-k / threshold selectors (vs torch.topk and one memory pass)"

_PRIMED_WITH_THRESHOLD = {"fixed_threshold": "threshold", "scaled_threshold": "initial_threshold"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=25_000_000, help="elements per input (default 25M)")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01],
                        help="k / n values (default 0.001 0.01)")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per selector; the median is shown")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads (default: the CPUs this process may use)")
    parser.add_argument("--selectors", nargs="+", default=None, help="names (default: all)")
    parser.add_argument("--scans", nargs="*", default=None, choices=["avx512", "avx2", "scalar", "torch"],
                        help="scan implementations timed beside the one in use (default: torch, when "
                             "the one in use is the C kernel)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: time the selectors on the GPU")
    parser.add_argument("--sizes", type=_size_list, default=None,
                        help="with --device cuda: comma-separated sizes (default 256K,1M,4M,16M,25M,64M,128M)")
    parser.add_argument("--summarize", metavar="FILE", default=None,
                        help="print, from the saved markdown output of a --device cuda run, each selector's "
                             "speed-up over torch.topk and its memory passes at the sizes of --sizes (a pivot "
                             "of the saved table; nothing is timed)")
    parser.add_argument("--quality", action="store_true",
                        help="print the quality table (normal, Laplace, Student-t(3), MLP gradients) instead")


_DEFAULT_GPU_SIZES = [1 << 18, 1 << 20, 1 << 22, 1 << 24, 25_000_000, 64_000_000, 128_000_000]


def _size_list(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = {"K": 1 << 10, "M": 1_000_000}.get(part[-1:], 1)
        sizes.append(int(float(part[:-1] if scale != 1 else part) * scale))
    return sizes


def _device_median_seconds(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    """Median wall time of ``fn`` with the device synchronized before and after each call."""
    fn()
    fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gpu_rows(args: argparse.Namespace, names: list[str]) -> list[dict[str, object]]:
    """Per size and density: torch.topk, one memory pass, and every selector on the GPU."""
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rows: list[dict[str, object]] = []
    for n in args.sizes or _DEFAULT_GPU_SIZES:
        x = torch.randn(n, generator=gen, device=device)
        copy = torch.empty_like(x)
        t_pass = _device_median_seconds(functools.partial(copy.copy_, x), args.repeat, device) / 2
        for density in args.densities:
            k = math.ceil(density * n)
            t_topk = _device_median_seconds(functools.partial(torch.topk, x.abs(), k, sorted=False), args.repeat,
                                            device)
            base = {"n": n, "density": density, "k": k}
            rows.append({**base, "selector": "torch.topk(x.abs())", "us": 1e6 * t_topk, "speed-up vs topk": 1.0,
                         "passes": t_topk / t_pass, "count": k, "quality": 1.0})
            rows.append({**base, "selector": "one memory pass", "us": 1e6 * t_pass,
                         "speed-up vs topk": t_topk / t_pass, "passes": 1.0, "count": "", "quality": ""})
            for name in names:
                sel = _make(name, x, k)
                result: list[Tensor] = []
                t = _device_median_seconds(functools.partial(_select_into, result, sel, x, k), args.repeat, device)
                indices = result[-1]
                rows.append({**base, "selector": name, "us": 1e6 * t, "speed-up vs topk": t_topk / t,
                             "passes": t / t_pass, "count": indices.numel(),
                             "quality": captured_mass(x, indices, k)})
        del x, copy
        torch.cuda.empty_cache()
    return rows


def summarize(path: str, sizes: list[int]) -> list[dict[str, object]]:
    """Pivot of a saved ``--device cuda`` table: per selector, "speed-up (passes)" per size and density."""
    columns: list[str] = []
    table: dict[str, dict[str, str]] = {}
    header: list[str] | None = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("| ") or line.startswith("| ---"):
                continue
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if header is None or cells[0] == "selector":
                header = cells
                continue
            row = dict(zip(header, cells, strict=True))
            if int(row["n"]) not in sizes:
                continue
            column = f"n={int(row['n']):,}, {float(row['density']):g}"
            if column not in columns:
                columns.append(column)
            speedup, passes = float(row["speed-up vs topk"]), float(row["passes"])
            table.setdefault(row["selector"], {})[column] = f"{speedup:.2f}x ({passes:.1f})"
    return [{"selector": name, **cells} for name, cells in table.items()]


def captured_mass(x: Tensor, indices: Tensor, k: int) -> float:
    """Quality of a selection: the L2 mass (sum of squares) of its ``k`` largest elements over that
    of the exact top-k. 1.0 means it holds a top-k set (up to ties); over-selection is not rewarded."""
    a = x.double().abs()
    best = torch.topk(a, k, sorted=False).values.square().sum()
    chosen = a[indices]
    kept = torch.topk(chosen, min(k, chosen.numel()), sorted=False).values.square().sum()
    return float(kept / best) if float(best) > 0 else 1.0


def _make(name: str, previous: Tensor, k: int) -> selectors.Selector:
    option = _PRIMED_WITH_THRESHOLD.get(name)
    if option is None:
        return selectors.make(name)
    kth = float(torch.topk(previous.abs(), k, sorted=False).values.min())
    return selectors.make(name, **{option: kth})


def _abs_compare_pass(x: Tensor, buf: Tensor, mask: Tensor) -> Tensor:
    """One pass over memory: |x| into ``buf``, then ``|x| >= 1`` into ``mask``."""
    return torch.ge(torch.abs(x, out=buf), 1.0, out=mask)


def _select_into(result: list[Tensor], sel: Callable[[Tensor, int], Tensor], x: Tensor, k: int) -> None:
    result.append(sel(x, k))


def _median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _speed_rows(args: argparse.Namespace, names: list[str], others: list[str]) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.n, generator=gen)
    rows = []
    for density in configurations(args.densities, "select", lambda d: f"density {d:g}"):
        k = math.ceil(density * args.n)
        t_topk = _median_seconds(functools.partial(torch.topk, x.abs(), k, sorted=False), args.repeat)
        buf, mask = torch.empty_like(x), torch.empty(args.n, dtype=torch.bool)
        t_pass = _median_seconds(functools.partial(_abs_compare_pass, x, buf, mask), args.repeat)
        rows.append({"selector": "torch.topk", "density": density, "k": k, "ms": 1e3 * t_topk,
                     "x topk": 1.0, "x pass": t_topk / t_pass, "count": k, "quality": 1.0})
        rows.append({"selector": "abs+compare pass", "density": density, "k": k, "ms": 1e3 * t_pass,
                     "x topk": t_pass / t_topk, "x pass": 1.0, "count": "", "quality": ""})
        if scan.kernel() != "torch":
            scratch = scan.Scratch()
            t_scan = _median_seconds(functools.partial(scratch.scan, x, math.inf, name="bench", check_finite=True),
                                     args.repeat)
            rows.append({"selector": f"fused scan ({scan.kernel()})", "density": density, "k": k,
                         "ms": 1e3 * t_scan, "x topk": t_scan / t_topk, "x pass": t_scan / t_pass, "count": "",
                         "quality": ""})
        for name in names:
            sel = _make(name, x, k)
            result: list[Tensor] = []
            t = _median_seconds(functools.partial(_select_into, result, sel, x, k), args.repeat)
            indices = result[-1]
            row = {"selector": name, "density": density, "k": k, "ms": 1e3 * t, "x topk": t / t_topk,
                   "x pass": t / t_pass, "count": indices.numel(), "quality": captured_mass(x, indices, k)}
            for other in others:
                sel = _make(name, x, k)
                with scan.use_kernel(other):
                    row[f"ms ({other} scan)"] = 1e3 * _median_seconds(functools.partial(sel, x, k), args.repeat)
            rows.append(row)
    return rows


def mlp_gradients(steps: int = 5, seed: int = 0) -> list[Tensor]:
    """Flat gradients of a 64-256-256-10 MLP on sklearn's digits, one per SGD step (no download)."""
    from sparsecomm.core.optional import require

    digits = require("sklearn.datasets", "the MLP gradients of bench select").load_digits()
    torch.manual_seed(seed)
    data = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    target = torch.tensor(digits.target)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        batch = slice(step * 128, (step + 1) * 128)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data[batch]), target[batch]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        opt.step()
    return grads


def quality_inputs(n: int, seed: int) -> dict[str, tuple[Tensor, Tensor]]:
    """(previous, current) inputs per data source: two draws, or two consecutive MLP gradients."""
    gen = torch.Generator().manual_seed(seed)

    def laplace() -> Tensor:
        u = torch.rand(n, generator=gen, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12) - 0.5
        return (-torch.sign(u) * torch.log1p(-2 * u.abs())).float()

    def student() -> Tensor:
        return torch.distributions.StudentT(3.0).sample((n,)).float()

    grads = mlp_gradients(seed=seed)
    return {"normal": (torch.randn(n, generator=gen), torch.randn(n, generator=gen)),
            "laplace": (laplace(), laplace()), "student-t(3)": (student(), student()),
            "mlp-digits gradient": (grads[-2], grads[-1])}


def _quality_rows(args: argparse.Namespace, names: list[str]) -> list[dict[str, object]]:
    torch.manual_seed(args.seed)
    inputs = quality_inputs(args.n, args.seed)
    rows = []
    for name in names:
        for density in args.densities:
            row: dict[str, object] = {"selector": name, "density": density}
            for label, (previous, x) in inputs.items():
                k = math.ceil(density * x.numel())
                indices = _make(name, previous, k)(x, k)
                row[label] = captured_mass(x, indices, k)
                row[f"count/k {label.split()[0]}"] = indices.numel() / k
            rows.append(row)
    return rows


def check(args: argparse.Namespace) -> None:
    unknown = sorted(set(args.selectors or []) - set(selectors.available()))
    if unknown:
        raise ValueError(f"unknown selector(s) {unknown}; available: {', '.join(selectors.available())}")
    if args.n < 1 or args.repeat < 1 or args.threads < 1:
        raise ValueError(f"--n={args.n}, --repeat={args.repeat} and --threads={args.threads} must be >= 1")
    if not all(0 < d <= 1 for d in args.densities):
        raise ValueError(f"--densities={args.densities} must lie in (0, 1]")


def run(args: argparse.Namespace) -> int:
    check(args)
    torch.set_num_threads(args.threads)
    names = args.selectors or selectors.available()
    if args.summarize:
        print(f"speed-up over torch.topk (memory passes), from {args.summarize}")
        print(markdown_table(summarize(args.summarize, args.sizes or [25_000_000, 64_000_000])))
        return 0
    if args.device != "cpu":
        if not torch.cuda.is_available() or torch.device(args.device).type != "cuda":
            raise ValueError(f"--device={args.device!r}: only 'cpu' and 'cuda' are supported, and 'cuda' needs a "
                             "CUDA build of torch and a GPU (none here)")
        from sparsecomm.selection import triton_scan
        print(f"selection time on {torch.cuda.get_device_name(args.device)}, float32 N(0,1), median of "
              f"{args.repeat} synchronized calls, torch {torch.__version__}, scan: "
              f"{'triton' if triton_scan.installed() else 'torch passes (Triton not installed)'}")
        print(markdown_table(_gpu_rows(args, names), ["selector", "n", "density", "k", "us", "speed-up vs topk",
                                                      "passes", "count", "quality"]))
        return 0
    if args.quality:
        print(f"quality (captured top-k L2 mass), n = {args.n} (MLP gradient: its own length), "
              f"threads = {torch.get_num_threads()}")
        print(markdown_table(_quality_rows(args, names)))
        return 0
    others = args.scans if args.scans is not None else (["torch"] if scan.kernel() != "torch" else [])
    others = [other for other in others if other != scan.kernel()]
    print(f"selection time, n = {args.n}, float32 N(0,1), median of {args.repeat} calls, "
          f"threads = {torch.get_num_threads()}, torch {torch.__version__}, scan: {scan.kernel()}"
          + (f" (beside: {', '.join(others)})" if others else ""))
    columns = ["selector", "density", "k", "ms", "x topk", "x pass", "count", "quality"]
    print(markdown_table(_speed_rows(args, names, others), columns + [f"ms ({o} scan)" for o in others]))
    return 0
