"""The examples in examples/ run and do what their docs say: P = 2 gloo workers, a tiny model.

The Lightning and Accelerate tests skip, with the reason, when the framework is not installed
(``pip install '.[examples]'``).
"""

import importlib.util
from pathlib import Path

import pytest
import torch

import sparsecomm
from sparsecomm import run_workers

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS = 12
N_CUSTOM = 1003  # not divisible by any P > 1 tested


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_hook_calls = 0


def counting_hook(state, bucket):
    """sparsecomm's hook, counting its calls in this worker."""
    global _hook_calls
    _hook_calls += 1
    return sparsecomm.hook(state, bucket)


def _train(example, options):
    global _hook_calls
    _hook_calls = 0
    losses = _load(example).train(hook=counting_hook, **options)
    return losses, _hook_calls


def test_ddp_hook_example_runs_the_hook_every_step():
    plain = run_workers(2, _train, "ddp_hook", dict(method=None, steps=STEPS), timeout=60)
    sparse = run_workers(2, _train, "ddp_hook", dict(method="topka", density=0.05, steps=STEPS), timeout=60)
    for (losses, calls), (plain_losses, plain_calls) in zip(sparse, plain, strict=True):
        assert plain_calls == 0
        assert calls >= STEPS
        assert losses[0] == plain_losses[0]
        assert losses[1:] != plain_losses[1:]
        assert losses[-1] < losses[0]


def _trace_custom_method(options, steps, k):
    """Worker: register "randk" in this process only, trace it, and evaluate its cost formula."""
    import torch.distributed as dist
    from invariants import trace_method

    _load("custom_method")
    P, rank = dist.get_world_size(), dist.get_rank()
    expected = sparsecomm.cost("randk", P=P, n=N_CUSTOM, k=k, rank=rank)
    traces = trace_method("randk", options, N_CUSTOM, steps)
    return traces, (expected.rounds, expected.bytes_sent, expected.bytes_recv, expected.exact)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
def test_the_custom_method_example_keeps_every_invariant(P):
    from invariants import assert_conserved, assert_consistent, assert_equals_dense

    k = 51  # ceil(0.05 * 1003)
    results = run_workers(P, _trace_custom_method, {"density": 0.05}, 3, k, timeout=60)
    traces = [trace for trace, _ in results]
    assert_consistent(traces)
    assert_conserved(traces)
    for trace, (rounds, sent, received, exact) in results:  # traffic = the cost formula, exactly
        assert exact
        for record in trace:
            stats = record["stats"]
            assert (stats["rounds"], stats["bytes_sent"], stats["bytes_recv"]) == (rounds, sent, received)
            assert stats["selected"] == k
    full = run_workers(P, _trace_custom_method, {"density": 1.0}, 2, N_CUSTOM, timeout=60)
    assert_equals_dense([trace for trace, _ in full])
    assert "randk" not in sparsecomm.available_methods()  # registered in the workers only


def _gathering_method(carried: bool):
    """Worker: "eftopk" (examples/gathering_method.py) traced, its cost formula, whether its first
    message rode on the call's checks, and topka's outputs on the same gradients. ``carried=False``:
    this rank's checks carry no payload (as on NCCL)."""
    import torch.distributed as dist
    from invariants import trace_method

    from sparsecomm.transport import control

    _load("gathering_method")
    if not carried:
        control.carries_blocks = lambda comm: False  # this worker process only
    P, rank, k = dist.get_world_size(), dist.get_rank(), 51
    expected = sparsecomm.cost("eftopk", P=P, n=N_CUSTOM, k=k, rank=rank)
    traces = trace_method("eftopk", {"density": 0.05}, N_CUSTOM, 3)
    reference = trace_method("topka", {"density": 0.05}, N_CUSTOM, 3)
    same = all(torch.equal(a["out"], b["out"]) for a, b in zip(traces, reference, strict=True))
    return traces, (expected.rounds, expected.bytes_sent, expected.bytes_recv), \
        traces[-1]["stats"].get("gathered_in_agreement", 0), same


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
def test_a_method_that_hands_the_runner_its_first_message_keeps_every_invariant(P):
    """examples/gathering_method.py: the invariants, traffic = formula, the same bits as topka, and its
    all-gather carried by the call's checks on gloo with no line of its own about it, or sent
    by its own ``send`` where the checks carry nothing, with the same bits."""
    from invariants import assert_conserved, assert_consistent

    for carried in (True, False):
        results = run_workers(P, _gathering_method, carried, timeout=60)
        traces = [trace for trace, _, _, _ in results]
        assert_consistent(traces)
        assert_conserved(traces)
        for trace, formula, gathered, same in results:
            assert same
            assert gathered == (1 if carried else 0)
            for record in trace:
                stats = record["stats"]
                assert (stats["rounds"], stats["bytes_sent"], stats["bytes_recv"]) == formula


@pytest.fixture(scope="module")
def lightning_example():
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install '.[examples]')")
    plain = run_workers(2, _train, "lightning_ddp", dict(method=None, max_steps=STEPS), timeout=60)
    return plain


def test_lightning_ddp_strategy_alone_registers_no_hook_on_cpu(lightning_example):
    # Lightning's DDPStrategy(ddp_comm_hook=...) registers the hook on CUDA only: on CPU the hook is
    # never called and the run is bit for bit plain DDP. The example's docs say so; this checks it.
    plain = lightning_example
    strategy_only = run_workers(2, _train, "lightning_ddp", dict(method="topka", register_on_cpu=False,
                                max_steps=STEPS), timeout=60)
    for (losses, calls), (plain_losses, _) in zip(strategy_only, plain, strict=True):
        assert calls == 0
        assert losses == plain_losses


def test_lightning_example_registers_the_hook_on_train_start(lightning_example):
    plain = lightning_example
    sparse = run_workers(2, _train, "lightning_ddp", dict(method="topka", density=0.05, max_steps=STEPS), timeout=60)
    for (losses, calls), (plain_losses, _) in zip(sparse, plain, strict=True):
        assert len(losses) == STEPS
        assert calls >= STEPS  # at least one bucket per step went through the hook
        assert losses[0] == plain_losses[0]  # the same first batch and weights ...
        assert losses[1:] != plain_losses[1:]  # ... then the sparse average moved the weights elsewhere
        assert losses[-1] < losses[0]


def test_accelerate_example_runs_the_hook_every_step():
    pytest.importorskip("accelerate", reason="Hugging Face Accelerate is not installed (pip install '.[examples]')")
    plain = run_workers(2, _train, "accelerate_ddp", dict(method=None, steps=STEPS), timeout=60)
    sparse = run_workers(2, _train, "accelerate_ddp", dict(method="topka", density=0.05, steps=STEPS), timeout=60)
    for (losses, calls), (plain_losses, plain_calls) in zip(sparse, plain, strict=True):
        assert plain_calls == 0
        assert calls >= STEPS
        assert losses[0] == plain_losses[0]
        assert losses[1:] != plain_losses[1:]
        assert losses[-1] < losses[0]



def _adamw(options):
    return _load("adamw_transformer").train(**options)


def test_adamw_transformer_example_learns_with_the_recipe_and_its_dense_twin():
    sparse = run_workers(2, _adamw, dict(density=0.05, steps=40, warmup=10), timeout=120)
    dense = run_workers(2, _adamw, dict(steps=40, warmup=10, sparse=False), timeout=120)
    for losses in (sparse[0], dense[0]):
        assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5  # it learns
    assert sparse[0][:10] == dense[0][:10]  # the same dense warm-up
    assert sparse[0][10:] != dense[0][10:]  # then the method differs
