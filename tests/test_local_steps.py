"""LocalSteps: H inner steps, then the pseudo-gradient averaged by a sparsecomm method with error
feedback and an outer SGD step. At P = 1..8: the replicas are identical after every synchronization
and apart between them, the pseudo-gradient's residual keeps what was not sent, the outer step is
torch's SGD update, a run resumed mid-period is bit-identical to an uninterrupted one. H = 1 with
plain SGD inside is the per-step SparseSynchronizer; the dense mode with outer Nesterov is DiLoCo's
Algorithm 1 (the lab's ``diloco`` baseline); errors and timeouts reach every rank; the lab's
post-local SGD baseline averages every H steps after its warm-up; the example runs."""

import copy
import importlib.util
import io
import re
import time
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (an optimizer's first step imports it: once here, not in every forked worker)
import torch.distributed as dist
import torch.nn.functional as F
from sparsecomm_lab.diloco import local_label, local_synchronization
from torch import nn

import sparsecomm
from sparsecomm import LocalSteps, SparseSynchronizer, run_workers
from sparsecomm.methods.checks import NonFiniteGradientError
from sparsecomm.transport.agreement import AgreementError

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "local_steps.py"
GUIDE = Path(__file__).resolve().parent.parent / "docs" / "local-steps.md"


def _model(seed, dtype=torch.float32):
    """163 parameters: two weights (96, 48 elements) and two biases (16, 3)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def _loss(model, rank, step, dtype=torch.float32):
    generator = torch.Generator().manual_seed(7919 * step + rank)  # each rank its own data at each step
    x = torch.randn(8, 6, generator=generator, dtype=dtype)
    y = torch.randn(8, 3, generator=generator, dtype=dtype)
    return F.mse_loss(model(x), y)


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _group_params(local, group):
    return _flat([local.params[pid] for pid in group.ids])


# ---------------------------------------------------------------------------------------- invariants
def _trace(outer, H, periods):
    """Worker: a run under LocalSteps with two sparse groups and a dense one; per step the parameters,
    and per synchronization each group's pseudo-gradient, residual before and after, average,
    global parameters before and after."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = _model(seed=100 + rank)  # the replicas differ until the broadcast
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    local = LocalSteps(model, inner, "topka", density=0.1, local_steps=H, outer=outer,
                       bucket_elements=100, dense_below=20)
    pending = {}

    def before_sync(optimizer, args, kwargs):  # after the inner step that ends the period
        if local.inner_step == H - 1:
            pending["delta"] = [a - _group_params(local, g) for g, a in zip(local.groups, local.anchors, strict=True)]
            pending["old"] = [None if g.residual is None else g.residual.clone() for g in local.groups]
            pending["anchor"] = [a.clone() for a in local.anchors]

    inner.register_step_post_hook(before_sync)
    initial = _flat(model.parameters())
    records = []
    for step in range(H * periods):
        inner.zero_grad()
        _loss(model, rank, step).backward()
        local.step()
        record = {"params": _flat(model.parameters()), "calls": local.last_stats.calls}
        with local.global_model() as evaluated:  # the global parameters in place, the replica's back after
            assert torch.equal(_flat(evaluated.parameters()), _flat(local.global_parameters()))
        assert torch.equal(_flat(model.parameters()), record["params"])
        if local.last_stats.calls:
            record.update(pending, avg=[g.outbuf().clone() for g in local.groups],
                          new=[None if g.residual is None else g.residual.clone() for g in local.groups],
                          after=[a.clone() for a in local.anchors],
                          groups=[(len(g.ids), g.dense) for g in local.groups])
        records.append(record)
    return initial, records, (local.outer_lr, local.outer_momentum, local.error_decay)


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_replicas_agree_after_each_sync_the_residual_conserves_and_the_outer_step_is_sgd(P):
    outer, H, periods = ("sparseloco" if P % 2 else "nesterov"), 3, 3
    results = run_workers(P, _trace, outer, H, periods, timeout=120)
    lr, momentum, decay = results[0][2]
    assert (lr, momentum, decay) == ((1.0, 0.0, 0.95) if outer == "sparseloco" else (0.7, 0.9, 1.0))
    for initial, _, _ in results:
        assert torch.equal(initial, results[0][0])  # broadcast from rank 0
    buffers = None
    for step in range(H * periods):
        recs = [records[step] for _, records, _ in results]
        synced = (step + 1) % H == 0
        assert all(r["calls"] == (3 if synced else 0) for r in recs), [r["calls"] for r in recs]
        if not synced:
            if P > 1:  # local steps: each replica moved on its own data
                assert not torch.equal(recs[0]["params"], recs[1]["params"])
            continue
        first = recs[0]
        assert first["groups"] == [(1, False), (1, False), (2, True)]
        for rec in recs[1:]:
            assert torch.equal(rec["params"], first["params"])  # consistency, bit for bit
            for mine, theirs in zip(rec["avg"] + rec["after"], first["avg"] + first["after"], strict=True):
                assert torch.equal(mine, theirs)
        if buffers is None:
            buffers = [None] * len(first["avg"])
        for g, avg in enumerate(first["avg"]):
            avg = avg.double()
            given = sum(r["delta"][g].double() + (0 if r["old"][g] is None else decay * r["old"][g].double())
                        for r in recs)
            kept = sum(0 if r["new"][g] is None else r["new"][g].double() for r in recs)
            assert torch.allclose(given, P * avg + kept, rtol=1e-5, atol=1e-6), (step, g)
            if first["old"][g] is not None:  # top-k with error feedback: it sent some, kept the rest
                assert 0 < int((recs[0]["new"][g] == 0).sum()) < avg.numel()
            direction = avg
            if momentum:
                buffers[g] = avg.clone() if buffers[g] is None else momentum * buffers[g] + avg
                direction = avg + momentum * buffers[g]
            expected = first["anchor"][g].double() - lr * direction
            assert torch.allclose(first["after"][g].double(), expected, rtol=1e-5, atol=1e-6), (step, g)


# ---------------------------------------------------------------------------------------- resume
def _resume(H, steps, save_at, checkpoints=None):
    """Worker: AdamW inside, topka with error feedback, outer Nesterov; without ``checkpoints`` the
    uninterrupted run, which also saves its state before step ``save_at``; with them, a fresh process
    loads that state and runs the remaining steps."""
    torch.set_num_threads(1)
    rank, P = dist.get_rank(), dist.get_world_size()
    model = _model(seed=100 + rank)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    local = LocalSteps(model, inner, "topka", density=0.1, local_steps=H)
    refused = []
    start, saved = 0, None
    if checkpoints is not None:
        state = torch.load(io.BytesIO(checkpoints[rank]), weights_only=True)  # plain tensors and values
        if P > 1:
            other = torch.load(io.BytesIO(checkpoints[(rank + 1) % P]), weights_only=True)
            with pytest.raises(ValueError, match="each rank loads its own state") as error:
                local.load_state_dict(other["local"])
            refused.append(str(error.value))
        twin = _model(seed=0)
        elsewise = LocalSteps(twin, torch.optim.SGD(twin.parameters(), lr=0.1), "topka", density=0.2, local_steps=H)
        with pytest.raises(ValueError, match="saved with method") as error:
            elsewise.load_state_dict(state["local"])
        refused.append(str(error.value))
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])
        local.load_state_dict(state["local"])
        start = save_at
    for step in range(start, steps):
        if checkpoints is None and step == save_at:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": inner.state_dict(),
                        "local": local.state_dict()}, buffer)
            saved = buffer.getvalue()
        inner.zero_grad()
        _loss(model, rank, step).backward()
        local.step()
    return _flat(model.parameters()), saved, local.outer_steps, refused


@pytest.mark.parametrize("P", WORLD_SIZES)
def test_a_run_resumed_mid_period_in_fresh_processes_is_bit_identical(P):
    H, steps, save_at = 3, 11, 7  # saved after one inner step of the third period
    uninterrupted = run_workers(P, _resume, H, steps, save_at, timeout=120)
    checkpoints = [saved for _, saved, _, _ in uninterrupted]
    resumed = run_workers(P, _resume, H, steps, save_at, checkpoints, timeout=120)
    for (params, _, outer_steps, _), (again, _, outer_again, refused) in zip(uninterrupted, resumed, strict=True):
        assert outer_steps == outer_again == steps // H
        assert torch.equal(params, again)
        assert len(refused) == (2 if P > 1 else 1)


# ---------------------------------------------------------------------------------------- H = 1
def _h1_against_synchronizer(method, lr, steps):
    """Worker: the same replica trained by SparseSynchronizer (the gradient averaged every step) and
    by LocalSteps with H = 1, plain SGD inside and outer SGD at lr 1 (the pseudo-gradient lr * g
    averaged), in float64; returns the largest parameter and residual differences."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    options = {} if method == "dense" else {"density": 0.1}
    per_step = _model(seed=100 + rank, dtype=torch.float64)
    local_model = copy.deepcopy(per_step)
    synchronizer = SparseSynchronizer(per_step, torch.optim.SGD(per_step.parameters(), lr=lr), method, **options)
    local = LocalSteps(local_model, torch.optim.SGD(local_model.parameters(), lr=lr), method, local_steps=1,
                       outer="sgd", **options)
    gaps = []
    for step in range(steps):
        for model, runner in ((per_step, synchronizer), (local_model, local)):
            runner.optimizer.zero_grad()
            _loss(model, rank, step, torch.float64).backward()
            runner.step()
        ours, theirs = _flat(local_model.parameters()), _flat(per_step.parameters())
        gaps.append(float((ours - theirs).abs().max() / theirs.abs().max()))
    residual_gap = 0.0
    if synchronizer.methods[0].residual is not None:
        scaled = lr * synchronizer.methods[0].residual
        residual_gap = float((local.methods[0].residual - scaled).abs().max() / scaled.abs().max())
    return gaps, residual_gap, local.outer_steps


@pytest.mark.parametrize("P, method, lr", [(1, "topka", 0.5), (3, "topka", 0.1), (4, "topka", 0.5),
                                           (5, "spardl", 0.1), (3, "dense", 0.1)])
def test_one_local_step_with_plain_sgd_is_the_per_step_synchronizer(P, method, lr):
    steps = 12
    for gaps, residual_gap, outer_steps in run_workers(P, _h1_against_synchronizer, method, lr, steps, timeout=120):
        assert outer_steps == steps
        assert max(gaps) < 1e-12, gaps
        assert residual_gap < 1e-12


# ---------------------------------------------------------------------------------------- DiLoCo
INNER_LR, WEIGHT_DECAY = 0.01, 0.1


def _diloco_worker(H, outer_steps):
    """Worker: the lab's ``diloco`` baseline (LocalSteps, dense, outer Nesterov 0.7 / 0.9), AdamW inside."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = _model(seed=100 + rank, dtype=torch.float64)
    inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=WEIGHT_DECAY)
    sync = local_synchronization("diloco", model, inner, local_steps=H)
    initial = _flat(model.parameters())
    trace = []
    for step in range(H * outer_steps):
        inner.zero_grad()
        _loss(model, rank, step, torch.float64).backward()
        sync.step(epoch=0.0)
        if (step + 1) % H == 0:
            trace.append(_flat(model.parameters()))
    return initial, trace


def _algorithm_1(initial, P, H, outer_steps):
    """DiLoCo (Douillard et al. 2023), Algorithm 1, transcribed: k = P workers, each with its own
    AdamW; at each outer step every worker starts from theta^(t-1), takes H inner steps on its own
    data, delta_i = theta^(t-1) - theta_i; Delta = (1/k) sum_i delta_i; theta^(t) = OuterOpt(theta^(t-1),
    Delta) with OuterOpt torch's SGD with Nesterov momentum (lr 0.7, momentum 0.9)."""
    theta = _model(seed=0, dtype=torch.float64)
    torch.nn.utils.vector_to_parameters(initial, theta.parameters())
    outer_opt = torch.optim.SGD(theta.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    workers = [copy.deepcopy(theta) for _ in range(P)]
    inner_opts = [torch.optim.AdamW(w.parameters(), lr=INNER_LR, weight_decay=WEIGHT_DECAY) for w in workers]
    trace = []
    for t in range(outer_steps):
        deltas = []
        for i, (worker, inner_opt) in enumerate(zip(workers, inner_opts, strict=True)):
            with torch.no_grad():
                for mine, start in zip(worker.parameters(), theta.parameters(), strict=True):
                    mine.copy_(start)
            for h in range(H):
                inner_opt.zero_grad()
                _loss(worker, i, t * H + h, torch.float64).backward()
                inner_opt.step()
            deltas.append([start.detach() - mine.detach() for start, mine in zip(theta.parameters(),
                                                                                  worker.parameters(), strict=True)])
        for j, param in enumerate(theta.parameters()):
            param.grad = sum(delta[j] for delta in deltas) / P
        outer_opt.step()
        trace.append(_flat(theta.parameters()))
    return trace


def test_the_dense_mode_with_outer_nesterov_is_dilocos_algorithm_1_step_by_step():
    P, H, outer_steps = 3, 4, 4
    results = run_workers(P, _diloco_worker, H, outer_steps, timeout=120)
    expected = _algorithm_1(results[0][0], P, H, outer_steps)
    for _, trace in results:
        assert len(trace) == outer_steps
        for t, (ours, theirs) in enumerate(zip(trace, expected, strict=True)):
            assert torch.equal(ours, results[0][1][t])
            assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-14), (t, (ours - theirs).abs().max())
    assert not torch.allclose(expected[0], results[0][0])  # the outer steps moved the parameters


# ---------------------------------------------------------------------------------------- errors
def _nonfinite(bad_rank):
    """Worker: a NaN in one rank's parameters before the second synchronization; then repaired."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = _model(seed=100 + rank)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    local = LocalSteps(model, inner, "topka", density=0.1, local_steps=2, outer="sparseloco")
    for step in range(3):
        inner.zero_grad()
        _loss(model, rank, step).backward()
        local.step()
    before = [t.clone() for t in local.anchors] + [local.methods[0].residual.clone()]
    params = _flat(model.parameters())
    inner.zero_grad()
    _loss(model, rank, 3).backward()
    if rank == bad_rank:
        model[0].weight.grad[0, 0] = float("nan")
    message = ""
    try:
        local.step()
    except NonFiniteGradientError as error:
        message = str(error)
    after = [t.clone() for t in local.anchors] + [local.methods[0].residual.clone()]
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True)) and local.outer_steps == 1
    with torch.no_grad():  # repair: back to the parameters before the step, and synchronize
        torch.nn.utils.vector_to_parameters(params, model.parameters())
    local.synchronize()
    return message, unchanged, _flat(model.parameters()), local.outer_steps


def test_a_nonfinite_pseudo_gradient_raises_on_every_rank_and_changes_nothing():
    results = run_workers(3, _nonfinite, 1, timeout=90)
    for message, unchanged, params, outer_steps in results:
        assert "NaN/Inf in the pseudo-gradient (the parameters) of rank 1" in message, message
        assert unchanged
        assert outer_steps == 2
        assert torch.equal(params, results[0][2])


def _out_of_step():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = _model(seed=100 + rank)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    local = LocalSteps(model, inner, "topka", density=0.1, local_steps=2)
    try:
        for step in range(2):
            inner.zero_grad()
            _loss(model, rank, step).backward()
            if rank == 0 and step == 1:
                local.synchronize()  # rank 0 ends its period one inner step early
            local.step()
    except AgreementError as error:
        return str(error)
    return "no error"


def test_ranks_at_different_inner_steps_raise_the_same_error_on_every_rank():
    for message in run_workers(3, _out_of_step, timeout=90):
        assert "not at the same point of training" in message and "inner_steps" in message, message


def _stuck(stuck_rank):
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = _model(seed=100 + rank)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    local = LocalSteps(model, inner, "topka", density=0.1, local_steps=2)
    inner.zero_grad()
    _loss(model, rank, 0).backward()
    local.step()
    if rank == stuck_rank:
        time.sleep(14)  # alive but never synchronizes, past the 4 s timeout and the naming
        return "stuck", 0.0
    start = time.monotonic()
    try:
        local.step()
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return f"{type(error).__name__}: {error}", time.monotonic() - start
    return "finished", 0.0


@pytest.mark.slow
def test_a_rank_that_never_synchronizes_is_named_within_the_timeout():
    results = run_workers(3, _stuck, 2, timeout=90, stall_timeout=4)
    for message, waited in results[:2]:
        assert "RankStalledError" in message and "rank(s) [2] stopped participating" in message, message
        assert waited < 4 + 8, waited
    assert results[2][0] == "stuck"


@pytest.mark.parametrize("method, kwargs, error, message", [
    ("topka", dict(local_steps=0), ValueError, "local_steps=0 must be an integer >= 1"),
    ("topka", dict(local_steps=2, outer="adam"), ValueError, "outer='adam' must be one of"),
    ("topka", dict(local_steps=2, outer_lr=0), ValueError, "outer_lr=0 must be a finite number > 0"),
    ("topka", dict(local_steps=2, outer="sparseloco", outer_momentum=0.9), ValueError, "has no outer momentum"),
    ("topka", dict(local_steps=2, outer_momentum=0.0), ValueError, "outer='nesterov' needs outer_momentum"),
    ("topka", dict(local_steps=2, outer="sgd", outer_momentum=1.0), ValueError, "outer_momentum=1.0 must be"),
    ("topka", dict(local_steps=2, error_decay=0.0), ValueError, "error_decay=0.0 must be a number in (0, 1]"),
    ("dense", dict(local_steps=2, outer="sparseloco"), ValueError, "method 'dense' keeps none"),
    ("topka", dict(local_steps=2, nonfinite="skip"), ValueError, "nonfinite='skip'"),
    ("topka", dict(local_steps=2, bucket_elements=0), ValueError, "bucket_elements=0"),
    ("topka", dict(local_steps=2, density=2.0), ValueError, "density=2.0"),
    ("nope", dict(local_steps=2), ValueError, "nope"),
])
def test_bad_options_raise_a_clear_error_before_anything_is_communicated(method, kwargs, error, message):
    model = nn.Linear(3, 2)
    kwargs = {"density": 0.1, **kwargs} if method == "topka" else kwargs
    with pytest.raises(error, match=re.escape(message)):
        LocalSteps(model, torch.optim.SGD(model.parameters(), lr=0.1), method, **kwargs)


def test_the_inner_optimizer_must_be_an_optimizer():
    model = nn.Linear(3, 2)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        LocalSteps(model, None, "topka", density=0.1, local_steps=2)


# ---------------------------------------------------------------------------------------- lab and example
def _post_local_sgd(H, warmup, steps):
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = _model(seed=100 + rank)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = local_synchronization("postlocalsgd", model, inner, local_steps=H, warmup_steps=warmup)
    trace = []
    for step in range(steps):
        inner.zero_grad()
        _loss(sync.module, rank, step).backward()
        assert sync.step(epoch=0.0).calls == 0
        trace.append(_flat(model.parameters()))
    return trace, sync.state_dict()


def test_the_post_local_sgd_baseline_is_ddp_during_warmup_then_averages_every_h_steps():
    H, warmup, steps = 3, 2, 9
    results = run_workers(3, _post_local_sgd, H, warmup, steps, timeout=90)
    for step in range(steps):
        averaged = step < warmup or (step - warmup) % H == 0
        same = [torch.allclose(trace[step], results[0][0][step], rtol=0, atol=1e-6) for trace, _ in results[1:]]
        assert all(same) if averaged else not any(same), (step, same)
    assert results[0][1] == {"averager_step": steps, "hook_iter": warmup}  # the hook counts the warm-up only


def test_the_lab_labels_and_refusals():
    assert local_label("diloco", 16) == "diloco-H16"
    assert local_label("topka", 4, "sparseloco") == "topka-H4-sparseloco"
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="only post-local SGD has synchronous warm-up steps"):
        local_synchronization("topka", model, torch.optim.SGD(model.parameters(), lr=0.1), local_steps=2,
                              warmup_steps=3)
    with pytest.raises(ValueError, match="no outer optimizer options"):
        local_synchronization("postlocalsgd", model, torch.optim.SGD(model.parameters(), lr=0.1), local_steps=2,
                              outer_lr=0.5)


def _example(options):
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("example_local_steps", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train(**options)


def test_the_example_trains_and_synchronizes_every_h_steps():
    steps, H = 24, 4
    for losses, synchronizations in run_workers(2, _example, dict(steps=steps, local_steps=H), timeout=90):
        assert synchronizations == steps // H
        assert sum(losses[-H:]) < sum(losses[:H])


def _guide_snippet(local_steps, steps):
    torch.set_num_threads(1)
    code = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S).group(1)
    namespace = {"__name__": "local_steps_guide"}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    return namespace["train"](local_steps=local_steps, steps=steps)


def test_the_guides_snippet_runs():
    for loss, outer_steps, bytes_sent in run_workers(2, _guide_snippet, 4, 8, timeout=90):
        assert outer_steps == 2 and bytes_sent > 0 and loss > 0


def test_local_steps_is_exported():
    assert sparsecomm.LocalSteps is LocalSteps and "LocalSteps" in sparsecomm.__all__
