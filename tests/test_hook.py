"""The DDP communication hook: same gradients as plain DDP where it must, clear errors, checkpoints."""

import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm import available_methods, run_workers
from sparsecomm.integration.hook import SparseHookState, hook
from sparsecomm.methods import method_class

SPARSE_METHODS = [m for m in available_methods() if method_class(m).sparse]
CORE = ("spardl", "topka", "exdyna")  # resumption of the others runs with -m slow


def _maybe_slow(methods):
    return [m if m in CORE else pytest.param(m, marks=pytest.mark.slow) for m in methods]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 12, generator=gen), torch.randint(3, (5,), generator=gen)


def _hook_vs_ddp_grads(method: str, options: dict, steps: int):
    rank = dist.get_rank()
    plain = DDP(_model())
    hooked = DDP(_model())
    state = SparseHookState(None, method=method, **options)
    hooked.register_comm_hook(state, hook)
    diffs = []
    for step in range(steps):
        x, y = _batch(rank, step)
        for net in (plain, hooked):
            net.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
        diffs.append(max((a.grad - b.grad).abs().max().item()
                         for a, b in zip(plain.parameters(), hooked.parameters(), strict=False)))
        with torch.no_grad():  # move both models the same way so later steps see new weights
            for a, b in zip(plain.parameters(), hooked.parameters(), strict=False):
                a -= 0.1 * a.grad
                b -= 0.1 * a.grad
    return diffs, [p.grad.clone() for p in hooked.parameters()]


@pytest.mark.parametrize("P", [2, 3])
def test_dense_hook_equals_plain_ddp(P):
    results = run_workers(P, _hook_vs_ddp_grads, "dense", {}, 3)
    for diffs, _ in results:
        assert max(diffs) < 1e-6
    for _, grads in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][1], grads, strict=False))


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_sparse_hook_at_density_one_equals_plain_ddp(method):
    options = {"density": 1.0, "dense_below": 0, **method_class(method).exact_options}  # 0: the method, not
    results = run_workers(3, _hook_vs_ddp_grads, method, options, 3)                  # the small-tensor path
    for diffs, _ in results:
        assert max(diffs) < 1e-5, f"{method}: hook gradient differs from DDP's by {max(diffs):g}"
    for _, grads in results[1:]:  # consistency: bit for bit on every rank
        assert all(torch.equal(a, b) for a, b in zip(results[0][1], grads, strict=False))


BAD_OPTIONS = [
    ("no-such-method", {"density": 0.1}, "no-such-method"),
    ("SPARSE", {"density": 0.0}, "density=0.0"),
    ("SPARSE", {"density": 1.5}, "density=1.5"),
    ("SPARSE", {"density": 0.1, "bogus_option": 3}, "bogus_option"),
    ("dense", {"density": 0.1}, "density"),
    ("dense", {"dense_warmup_steps": -1}, "dense_warmup_steps"),
]


def _construct_all(cases):
    errors = []
    for method, options, _ in cases:
        try:
            SparseHookState(None, method=method, **options)
            errors.append(None)
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


@pytest.mark.skipif(not SPARSE_METHODS, reason="no sparse method registered yet")
def test_bad_options_fail_at_construction():
    cases = [(SPARSE_METHODS[0] if m == "SPARSE" else m, o, n) for m, o, n in BAD_OPTIONS]
    errors = run_workers(1, _construct_all, cases)[0]
    for (method, options, needle), error in zip(cases, errors, strict=False):
        assert error is not None and needle in error, (method, options, error)


def test_unknown_method_fails_without_process_group():
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        SparseHookState(None, method="nope")


def _bad_options_raise_before_backward():
    model = DDP(_model())
    try:
        model.register_comm_hook(SparseHookState(None, method=SPARSE_METHODS[0], density=2.0), hook)
    except ValueError as exc:
        return ("raised", str(exc), all(p.grad is None for p in model.parameters()))
    return ("no error",)


@pytest.mark.skipif(not SPARSE_METHODS, reason="no sparse method registered yet")
def test_bad_density_raises_before_first_backward():
    outcome = run_workers(2, _bad_options_raise_before_backward)[0]
    assert outcome[0] == "raised" and "density" in outcome[1] and outcome[2]


def _train_steps(method: str, steps: int, state_blob=None, params=None):
    """A few hooked DDP steps; returns the parameters and the pickled hook state."""
    rank = dist.get_rank()
    model = _model()
    if params is not None:
        with torch.no_grad():
            for p, saved in zip(model.parameters(), params, strict=False):
                p.copy_(saved)
    net = DDP(model)
    state = SparseHookState(None, method=method, density=0.1) if state_blob is None else pickle.loads(state_blob)
    net.register_comm_hook(state, hook)
    start = 0 if state_blob is None else state.iter
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        net.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.1 * p.grad
    return [p.detach().clone() for p in net.parameters()], pickle.dumps(state), state.iter


@pytest.mark.parametrize("method", _maybe_slow(SPARSE_METHODS))
def test_pickled_state_resumes_exactly(method):
    straight = run_workers(2, _train_steps, method, 6)
    first = run_workers(2, _train_steps, method, 3)
    resumed = [run_workers(2, _resume_rank, method, [r[0] for r in first], [r[1] for r in first])]
    for rank in range(2):
        params, _, iters = resumed[0][rank]
        assert iters == 6
        assert all(torch.equal(a, b) for a, b in zip(params, straight[rank][0], strict=False))


def _resume_rank(method, params_per_rank, blobs_per_rank):
    rank = dist.get_rank()
    return _train_steps(method, 3, blobs_per_rank[rank], params_per_rank[rank])


def _warmup_stats():
    net = DDP(_model())
    state = SparseHookState(None, method=SPARSE_METHODS[0], density=0.05, dense_warmup_steps=2, dense_below=0)
    net.register_comm_hook(state, hook)
    seen = []
    for step in range(4):
        x, y = _batch(dist.get_rank(), step)
        net.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        stats = state.take_stats()
        seen.append((stats["warmup"], stats["density"]))
    return seen


@pytest.mark.skipif(not SPARSE_METHODS, reason="no sparse method registered yet")
def test_dense_warmup_then_sparse():
    seen = run_workers(2, _warmup_stats)[0]
    assert [w for w, _ in seen] == [True, True, False, False]
    assert seen[0][1] == 1.0 and seen[3][1] < 0.5


def _big_model_rebuild(granularity: str):
    """A 1.4 MB model with find_unused_parameters: DDP starts with a 1 MiB first bucket, so two buckets.
    Step 1's loss is multiplied by zero, so all it synchronizes is step 0's residual."""
    torch.manual_seed(0)
    net = DDP(nn.Sequential(nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 10)), find_unused_parameters=True)
    state = SparseHookState(None, method=SPARSE_METHODS[0], density=0.01, granularity=granularity)
    seen = set()

    def counting_hook(state, bucket):
        seen.add(bucket.index())
        return hook(state, bucket)

    net.register_comm_hook(state, counting_hook)
    record = []
    for step, scale in enumerate((1.0, 0.0)):
        gen = torch.Generator().manual_seed(dist.get_rank() * 10 + step)
        net.zero_grad()
        loss = nn.functional.cross_entropy(net(torch.randn(4, 600, generator=gen)),
                                           torch.randint(10, (4,), generator=gen))
        (scale * loss).backward()
        record.append({"buckets": len(seen),
                       "residual_sum": sum(float(r.double().sum()) for r in state.residuals().values()),
                       "out_sum": sum(float(p.grad.double().sum()) for p in net.parameters())})
    return record


@pytest.mark.skipif(not SPARSE_METHODS, reason="no sparse method registered yet")
@pytest.mark.parametrize("granularity", ["bucket", "model"])
def test_rebuilt_buckets_keep_their_residuals(granularity):
    P = 2
    records = run_workers(P, _big_model_rebuild, granularity)
    assert records[0][1]["buckets"] >= 2  # several DDP buckets
    given = sum(r[0]["residual_sum"] for r in records)          # step 0's residuals, all ranks
    accounted = P * records[0][1]["out_sum"] + sum(r[1]["residual_sum"] for r in records)
    assert abs(given) > 1e-3 and abs(given - accounted) < 1e-6 * max(1.0, abs(given))


@pytest.mark.parametrize("options, message", [
    ({"method": "topk", "density": 2.0}, "density=2.0 must be a number in"),
    ({"method": "topk"}, "needs density="),
    ({"method": "dense", "density": 0.1}, "is dense and takes no density"),
    ({"method": "spardl", "density": 0.1, "tems": 2}, "spardl: unknown option 'tems'; valid options:"),
    ({"method": "topk", "density": 0.1, "nonfinite": "ignore"}, "nonfinite='ignore' must be one of"),
])
def test_options_are_checked_before_the_process_group_exists(options, message):
    """Issue 23, item 6: no process group here; the error comes at construction, not at the first backward."""
    assert not dist.is_initialized()
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        SparseHookState(None, **options)
