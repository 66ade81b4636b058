"""The CUDA path: selectors, methods, the hook and the synchronizer on CUDA tensors (`make test-gpu`).

Skipped without a CUDA GPU. Every test runs in forked workers (``run_workers``) so that the pytest
process never initializes CUDA (a forked child of a process that did cannot use the GPU):

* selectors: the same indices on CUDA as on the CPU, with the Triton scan in use; the threshold
  searches decided on the device (no fallback to the host's loop), with the residual's addition fused
  and with the device buffers reused from call to call; the packing and the decompression kernels
  give the CPU's bits;
* methods at P = 1 (NCCL) and P = 2 (gloo, which reads host memory only: the communicator stages
  CUDA tensors through host copies; NCCL refuses two ranks on one GPU): the invariants of every
  method (consistency, conservation, density 1 = dense, meter = formula) and results bit-identical
  to the CPU run;
* the DDP hook and the synchronizer train a small model on one GPU (P = 1, NCCL).
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # ask without initializing CUDA here

import pytest  # noqa: E402
import torch  # noqa: E402
from invariants import (  # noqa: E402
    assert_conserved,
    assert_consistent,
    assert_equals_dense,
    assert_traffic_matches,
    make_gradient,
)

from sparsecomm import available_methods, run_workers  # noqa: E402
from sparsecomm.methods import method_class  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

#: methods whose CUDA result may differ from the CPU's in the last bits: the count-sketch's table is
#: built by index_add_, which sums colliding entries with atomics in no fixed order on a GPU (every
#: rank still gets the same all-reduced table, so the ranks agree bit for bit)
ATOMIC_SUMS_ON_CUDA = {"s2reducer"}
SELECTOR_OPTIONS = {"fixed_threshold": "threshold", "scaled_threshold": "initial_threshold"}
N = 1003


def _selector(name: str, x: torch.Tensor, k: int):
    from sparsecomm import selection as selectors

    option = SELECTOR_OPTIONS.get(name)
    if option is None:
        return selectors.make(name)
    return selectors.make(name, **{option: float(torch.topk(x.abs(), k).values.min())})


def _selector_worker(name: str) -> list[tuple]:
    from sparsecomm.selection.scan import Scratch

    results = []
    for n in (100_003, 2_000_000):
        for density in (0.001, 0.01):
            x = make_gradient(n, 0, 0, seed=n, dtype=torch.float32)
            k = math.ceil(density * n)
            on_cpu = _selector(name, x, k)(x, k)
            x_gpu = x.cuda()
            on_gpu = _selector(name, x, k)(x_gpu, k)
            results.append((n, density, Scratch.uses_triton(x_gpu), on_gpu.device.type,
                            torch.sort(on_cpu).values, torch.sort(on_gpu.cpu()).values))
    return results


def _selector_names() -> list[str]:
    from sparsecomm import selection as selectors

    return selectors.available()


@pytest.mark.parametrize("name", _selector_names())
def test_selector_on_cuda_selects_what_the_cpu_selects(name):
    for n, density, triton_used, device, on_cpu, on_gpu in run_workers(1, _selector_worker, name, timeout=240)[0]:
        assert device == "cuda", f"{name}: result on {device}, not on the input's device"
        assert triton_used, "the Triton scan is not in use on this GPU (is Triton installed?)"
        assert torch.equal(on_cpu, on_gpu), (f"{name}, n={n}, density={density}: {on_gpu.numel()} indices on CUDA, "
                                             f"{on_cpu.numel()} on the CPU, "
                                             f"{len(set(on_cpu.tolist()) ^ set(on_gpu.tolist()))} differ")


#: the selectors whose whole search runs on the device (:mod:`sparsecomm.selection.triton_select`)
DEVICE_SEARCHES = ("exact_topk", "trimmed", "binary_search", "mstopk", "sampled_binary_search")
#: those with the residual's addition fused into their pass (``Selector.accumulate``)
FUSED = ("exact_topk", "binary_search", "mstopk", "sampled_binary_search", "fixed_threshold")


def _watch_fallbacks() -> list[str]:
    """Collects the selection modules' messages that a device search handed a call to the host."""
    import logging

    seen: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "host path" in record.getMessage():
                seen.append(record.getMessage())
    for module in ("sparsecomm.selection.exact", "sparsecomm.selection.search"):
        logger = logging.getLogger(module)
        logger.addHandler(Handler())
        logger.setLevel(logging.DEBUG)
    return seen


def _search_worker(name: str) -> list[tuple]:
    """One selector instance called on several inputs in turn (its device buffers reused), plain and
    with the residual's addition: (what, on the CPU, on CUDA) per call, and the fallbacks seen."""
    fallbacks = _watch_fallbacks()
    results = []
    reused = name not in SELECTOR_OPTIONS  # a primed threshold is made for its input
    cpu_sel = gpu_sel = None
    for call, (n, density) in enumerate(((2_000_000, 0.001), (2_000_000, 0.01), (3_000_001, 0.001),
                                         (2_000_000, 0.001))):
        x = make_gradient(n, 0, call, seed=n, dtype=torch.float32)
        k = math.ceil(density * n)
        if cpu_sel is None or gpu_sel is None or not reused:
            cpu_sel, gpu_sel = _selector(name, x, k), _selector(name, x, k)
        results.append((f"call {call}", torch.sort(cpu_sel(x, k)).values,
                        torch.sort(gpu_sel(x.cuda(), k).cpu()).values))
    if name in FUSED:
        residual, grad = make_gradient(2_000_000, 0, 7), make_gradient(2_000_000, 1, 7)
        k = 2000
        cpu_sel, gpu_sel = _selector(name, residual + grad, k), _selector(name, residual + grad, k)
        for call in range(3):
            acc_cpu, acc_gpu = torch.empty_like(residual), torch.empty_like(residual).cuda()
            r_gpu, g_gpu = residual.cuda(), grad.cuda()
            picked_cpu = cpu_sel.accumulate(residual, grad, k, dest=acc_cpu)
            picked_gpu = gpu_sel.accumulate(r_gpu, g_gpu, k, dest=acc_gpu)
            results.append((f"fused {call} indices", torch.sort(picked_cpu).values,
                            torch.sort(picked_gpu.cpu()).values))
            results.append((f"fused {call} acc", acc_cpu, acc_gpu.cpu()))
            results.append((f"fused {call} residual kept", residual, r_gpu.cpu()))
            grad = grad * 1.01
    return results + [("fallbacks", fallbacks, [])]


def _searches_worker(names: list[str]) -> dict[str, list[tuple]]:
    return {name: _search_worker(name) for name in names}


def test_selectors_on_cuda_decide_on_the_device_and_match_the_cpu():
    """One worker for all (a CUDA context each would cost more than the checks)."""
    names = sorted(set(DEVICE_SEARCHES) | set(FUSED))
    for name, results in run_workers(1, _searches_worker, names, timeout=300)[0].items():
        *pairs, (_, fallbacks, _) = results
        for what, on_cpu, on_gpu in pairs:
            assert torch.equal(on_cpu, on_gpu), f"{name}, {what}: CUDA differs from the CPU"
        if name in DEVICE_SEARCHES:
            assert not fallbacks, f"{name}: the device search handed calls to the host: {fallbacks}"


def _graph_worker(name: str) -> list[tuple]:
    """One selector called again and again on the same tensors with new contents (the pipeline's
    CUDA graph captured at the second call, replayed after): (what, on the CPU, on CUDA) per call,
    and whether a graph was kept."""
    fallbacks = _watch_fallbacks()
    n, k = 2_000_000, 2000
    x_gpu, residual_gpu, grad_gpu = (torch.empty(n, device="cuda") for _ in range(3))
    cpu_sel, gpu_sel = _selector(name, torch.ones(8), 1), _selector(name, torch.ones(8), 1)
    cpu_acc, gpu_acc = _selector(name, torch.ones(8), 1), _selector(name, torch.ones(8), 1)
    out = []
    for call in range(4):
        x, residual, grad = (make_gradient(n, rank, call) for rank in range(3))
        x_gpu.copy_(x)
        residual_gpu.copy_(residual)
        grad_gpu.copy_(grad)
        out.append((f"call {call}", torch.sort(cpu_sel(x, k)).values, torch.sort(gpu_sel(x_gpu, k).cpu()).values))
        picked_cpu = cpu_acc.accumulate(residual, grad, k)
        picked_gpu = gpu_acc.accumulate(residual_gpu, grad_gpu, k)
        out.append((f"fused call {call}", torch.sort(picked_cpu).values, torch.sort(picked_gpu.cpu()).values))
        out.append((f"fused call {call} sum", residual, residual_gpu.cpu()))
    kept = bool(gpu_sel._scratch.device_buffers.graphs)
    return out + [("fallbacks", fallbacks, kept)]


def _graphs_worker(names: list[str]) -> dict[str, list[tuple]]:
    return {name: _graph_worker(name) for name in names}


def test_device_searches_replayed_as_cuda_graphs_match_the_cpu():
    names = ["exact_topk", "trimmed", "binary_search", "mstopk"]
    for name, results in run_workers(1, _graphs_worker, names, timeout=300)[0].items():
        *pairs, (_, fallbacks, kept) = results
        for what, on_cpu, on_gpu in pairs:
            assert torch.equal(on_cpu, on_gpu), f"{name}, {what}: CUDA differs from the CPU"
        assert not fallbacks, fallbacks
        assert kept, f"{name}: no CUDA graph was kept (SPARSECOMM_CUDA_GRAPHS=0, or the capture failed)"


def _kernels_worker() -> list[tuple]:
    from sparsecomm.selection.scan import take_and_clear
    from sparsecomm.transport import merge

    gen = torch.Generator().manual_seed(5)
    out = []
    x = torch.randn(1_000_003, generator=gen)
    idx = torch.randperm(x.numel(), generator=gen)[:20_000]
    on_cpu, on_gpu = x.clone(), x.cuda()
    out.append(("take_and_clear values", on_cpu.index_select(0, idx), take_and_clear(on_gpu, idx.cuda()).cpu()))
    on_cpu.index_fill_(0, idx, 0)
    out.append(("take_and_clear rest", on_cpu, on_gpu.cpu()))
    n = 2_000_003
    for P, keep_sign in ((8, False), (3, True), (1, False)):
        chunks = [torch.sort(torch.randperm(n, generator=gen)[:20_000 + 37 * p]).values for p in range(P)]
        values = [torch.randn(c.numel(), generator=gen) for c in chunks]
        values[0][::5] = -0.0
        cpu_out, gpu_out = torch.zeros(n), torch.full((n,), 7.0).cuda()
        merge.average_into(cpu_out, chunks, values, P, keep_sign=keep_sign)
        stale, _ = merge.average_sorted_into(gpu_out, [c.cuda() for c in chunks], [v.cuda() for v in values], P,
                                             stale="all", keep_sign=keep_sign)
        out.append((f"average P={P} keep_sign={keep_sign}", cpu_out.view(torch.int32), gpu_out.cpu().view(torch.int32)))
        again, _ = merge.average_sorted_into(gpu_out, [c.cuda() for c in chunks[:1]], [v.cuda() for v in values[:1]],
                                             1, stale=stale)
        cpu_again = torch.zeros(n)
        merge.average_into(cpu_again, chunks[:1], values[:1], 1)
        out.append((f"average again after P={P}", cpu_again.view(torch.int32), gpu_out.cpu().view(torch.int32)))
    return out


def test_packing_and_decompression_kernels_on_cuda_give_the_cpu_bits():
    for what, on_cpu, on_gpu in run_workers(1, _kernels_worker, timeout=240)[0]:
        assert torch.equal(on_cpu, on_gpu), f"{what}: CUDA differs from the CPU"


def _full_density_options(name: str) -> dict:
    cls = method_class(name)
    return {"density": 1.0, **cls.exact_options} if cls.sparse else {}


def _sparse_options(name: str) -> dict:
    return {"density": 0.05} if method_class(name).sparse else {}


def _method_worker(name: str, options: dict, device: str, steps: int = 2) -> list[dict]:
    import torch.distributed as dist

    from sparsecomm.methods import make_method

    rank = dist.get_rank()
    method = make_method(name, **options)
    records = []
    for step in range(steps):
        grad = make_gradient(N, rank, step)
        old = None if method.residual is None else method.residual.detach().cpu().clone()
        out = method(grad.to(device))
        records.append({"grad": grad, "old_residual": old, "out": out.cpu().clone(), "device": out.device.type,
                        "new_residual": None if method.residual is None else method.residual.detach().cpu().clone(),
                        "stats": dict(method.stats)})
    return records


def _check_method(name: str, P: int, backend: str) -> None:
    for options in (_full_density_options(name), _sparse_options(name)):
        on_gpu = run_workers(P, _method_worker, name, options, "cuda", backend=backend, timeout=240)
        on_cpu = run_workers(P, _method_worker, name, options, "cpu", timeout=240)
        assert all(record["device"] == "cuda" for trace in on_gpu for record in trace), f"{name}: result left the GPU"
        assert_consistent(on_gpu)
        if options == _full_density_options(name):  # at density < 1: as on the CPU, checked below
            assert_equals_dense(on_gpu)
            if method_class(name).has_residual:
                assert_conserved(on_gpu)
        for step, (gpu, cpu) in enumerate(zip(on_gpu[0], on_cpu[0], strict=True)):
            same = (torch.allclose(gpu["out"], cpu["out"], rtol=1e-5, atol=1e-6) if name in ATOMIC_SUMS_ON_CUDA
                    else torch.equal(gpu["out"], cpu["out"]))
            assert same, (
                f"{name} {options} P={P}, step {step}: CUDA result differs from the CPU's "
                f"(max {float((gpu['out'] - cpu['out']).abs().max()):g})")
            assert gpu["stats"]["bytes_sent"] == cpu["stats"]["bytes_sent"], f"{name}: traffic differs from the CPU's"


@pytest.mark.parametrize("name", available_methods())
def test_method_on_cuda_at_P1_matches_the_cpu(name):
    _check_method(name, 1, "nccl")


@pytest.mark.parametrize("name", available_methods())
def test_method_on_cuda_at_P2_over_gloo_matches_the_cpu(name):
    _check_method(name, 2, "gloo")


@pytest.mark.parametrize("name", ["ring", "rabenseifner"])
def test_dense_traffic_on_cuda_equals_the_cost_formula(name):
    traces = run_workers(2, _method_worker, name, {}, "cuda", timeout=120)
    assert_traffic_matches(traces, name, n=N)


def _train_worker(kind: str, method: str) -> list[float]:
    import torch.distributed as dist
    from torch import nn

    from sparsecomm import SparseHookState, SparseSynchronizer, hook

    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    data = torch.randn(256, 32, device=device)
    target = (data[:, :4].sum(1) > 0).long() + 2 * (data[:, 4:8].sum(1) > 0).long()
    losses = []
    if kind == "hook":
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(SparseHookState(None, method, density=0.1), hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(60):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(data), target)
            loss.backward()
            opt.step()
            losses.append(float(loss))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sync = SparseSynchronizer(model, opt, method, density=0.1)
        for _ in range(60):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(data), target)
            loss.backward()
            sync.step()
            losses.append(float(loss))
    assert dist.get_world_size() == 1
    return losses


@pytest.mark.parametrize("kind", ["hook", "synchronizer"])
@pytest.mark.parametrize("method", ["topka", "spardl", "redsync"])
def test_training_on_one_gpu_lowers_the_loss(kind, method):
    losses = run_workers(1, _train_worker, kind, method, backend="nccl", timeout=240)[0]
    assert losses[-1] < 0.7 * losses[0], f"{kind}/{method}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def _dense_warmup_worker() -> tuple[list[bool], float, float]:
    import torch.distributed as dist
    from torch import nn

    from sparsecomm import SparseHookState, hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()
    ddp = nn.parallel.DistributedDataParallel(model)
    state = SparseHookState(None, "topka", density=0.1, dense_warmup_steps=4)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randn(64, 32, generator=gen).cuda()
    target = (data[:, :4].sum(1) > 0).long()
    went, losses = [], []
    for _ in range(8):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(data), target)
        loss.backward()
        opt.step()
        went.append(state._native)
        losses.append(float(loss))
    state.close()
    return went, losses[0], losses[-1]


@pytest.mark.parametrize("backend, P", [("nccl", 1), ("gloo", 2)])
def test_the_hooks_dense_warm_up_on_cuda_goes_to_the_backend_where_it_takes_device_buckets(backend, P):
    """NCCL takes CUDA buckets as they are: the warm-up goes straight to its all-reduce; gloo reads host
    memory only, so the warm-up stays on the engine's path, which stages through the host."""
    results = run_workers(P, _dense_warmup_worker, backend=backend, timeout=240)
    for went, first, last in results:
        assert went == ([False, True, True, True] if backend == "nccl" else [False] * 4) + [False] * 4
        assert last < first
