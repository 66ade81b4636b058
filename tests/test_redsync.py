"""RedSync: per-layer hybrid compression, ASQ, the packed message and equation (1), for P = 1..8."""

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from invariants import (
    assert_conserved,
    assert_consistent,
    assert_traffic_matches,
    make_gradient,
    trace_method,
)

from sparsecomm import WorkerError, make_method, run_workers
from sparsecomm.methods import cost
from sparsecomm.methods.redsync import (
    LayerPart,
    LayerSpec,
    equation1_seconds,
    equation2_seconds,
    pack_message,
    plan_layers,
    unpack_message,
)

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
N = 1003
# small (10, 93 <= 100), medium (300), large (600 > 500): every branch of the hybrid policy
LAYOUT = [(0, 10), (10, 600), (610, 300), (910, 93)]
POLICY = {"small_limit": 100, "large_limit": 500}
DENSITY = 0.02


def _k(numel):
    return min(numel, max(1, math.ceil(DENSITY * numel)))


def test_plan_follows_the_hybrid_policy():
    specs = plan_layers(LAYOUT, small="exact_topk", medium="trimmed", large="binary_search", quantize="asq",
                        unquantized_layers=(-1,), **POLICY)
    assert [(s.selector, s.quantized) for s in specs] == [
        ("exact_topk", True), ("binary_search", True), ("trimmed", True), ("exact_topk", False)]
    specs = plan_layers(LAYOUT, small="dense", medium="trimmed", large="sampled_binary_search",
                        quantize=None, unquantized_layers=(-1,), **POLICY)
    assert [(s.selector, s.quantized) for s in specs] == [
        ("dense", False), ("sampled_binary_search", False), ("trimmed", False), ("dense", False)]


@pytest.mark.parametrize("quantize", [None, "asq"])
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_redsync_consistent_conserved_traffic(P, quantize):
    options = {"density": DENSITY, "quantize": quantize, **POLICY}
    traces = run_workers(P, trace_method, "redsync", options, N, 3, 0, LAYOUT, timeout=90)
    assert_consistent(traces)
    assert_conserved(traces)
    # the planned figure bounds the meter (binary search counts in [k, 2k])
    assert_traffic_matches(traces, "redsync", n=N, layout=LAYOUT, **options)
    for step in range(3):
        sizes = [trace[step]["stats"]["message_bytes"] for trace in traces]
        for rank, trace in enumerate(traces):
            s = trace[step]["stats"]
            want = cost("redsync", P=P, n=N, rank=rank, message_bytes=sizes)
            assert (s["rounds"], s["bytes_sent"], s["bytes_recv"]) == (want.rounds, want.bytes_sent, want.bytes_recv)
            assert s["rounds"] == (P - 1).bit_length()


def test_unquantized_exact_selectors_traffic_is_exact():
    options = {"density": DENSITY, "small_limit": 100, "large_limit": 10**6}  # topk + trimmed only
    traces = run_workers(3, trace_method, "redsync", options, N, 2, 0, LAYOUT, timeout=60)
    expected = cost("redsync", P=3, n=N, layout=LAYOUT, **options)
    assert expected.exact
    assert_traffic_matches(traces, "redsync", n=N, layout=LAYOUT, **options)
    # message: 4 counts (int32) + sum k_l (int32 index + float32 value)
    assert traces[0][0]["stats"]["message_bytes"] == 4 * 4 + 8 * sum(_k(m) for _, m in LAYOUT)


def _asq_worker(n, steps, layout, options):
    method = make_method("redsync", **options)
    rank = dist.get_rank()
    records = []
    for step in range(steps):
        grad = make_gradient(n, rank, step)
        old = None if method.residual is None else method.residual.clone()
        out = method(grad.clone(), layout)
        records.append({"grad": grad, "old_residual": old, "out": out.clone(),  # valid until the next call
                        "new_residual": method.residual.clone(), "stats": dict(method.stats),
                        "sent": method.last_sent.clone()})
    return records


@pytest.mark.parametrize("P", [1, 3, 4])
def test_asq_sends_one_mean_per_layer_of_alternating_sign(P):
    options = {"density": DENSITY, "quantize": "asq", **POLICY}
    traces = run_workers(P, _asq_worker, N, 4, LAYOUT, options, timeout=60)
    assert_conserved(traces)
    for trace in traces:
        for step, rec in enumerate(trace):
            sign = 1 if step % 2 == 0 else -1
            assert rec["stats"]["asq_sign"] == sign
            acc = rec["grad"] + (0 if rec["old_residual"] is None else rec["old_residual"])
            shipped = acc - rec["new_residual"]  # what left this rank, per element
            sent = torch.zeros(N, dtype=torch.bool)
            sent[rec["sent"]] = True
            for i, (offset, numel) in enumerate(LAYOUT):
                layer = slice(offset, offset + numel)
                mask = sent[layer]
                vals, out_vals = acc[layer][mask], shipped[layer][mask]
                if i == len(LAYOUT) - 1:  # the output layer is never quantized: exact top-k values
                    assert torch.equal(out_vals, vals) and int(mask.sum()) == _k(numel)
                    continue
                count = int(mask.sum())
                assert _k(numel) <= count <= 2 * _k(numel)
                assert bool((vals * sign > 0).all()), "ASQ selects entries of one sign"
                mean = out_vals[0]
                assert torch.all(out_vals == mean), "one value (the mean) per layer"
                assert torch.allclose(mean * count, vals.sum(), rtol=1e-5, atol=1e-5)
                assert torch.all(shipped[layer][~mask] == 0)
                # the selected are the largest of their sign
                rest = acc[layer][~mask] * sign
                assert (vals * sign).min() >= rest.max()


def _make(options):
    make_method("redsync", **options)


def test_bad_options_are_refused():
    with pytest.raises(WorkerError, match="sampled_binary_search.*cannot be used with quantize='asq'"):
        run_workers(1, _make, {"density": 0.01, "quantize": "asq", "large": "sampled_binary_search"},
                    timeout=30)
    with pytest.raises(WorkerError, match="quantize='sign' must be None or 'asq'"):
        run_workers(1, _make, {"density": 0.01, "quantize": "sign"}, timeout=30)


def _bad_layout():
    method = make_method("redsync", density=0.1)
    return method(torch.ones(10), [(0, 4), (5, 5)])


def test_layout_with_gaps_is_refused():
    with pytest.raises(WorkerError, match=r"layout covers 9 of the n=10 elements"):
        run_workers(1, _bad_layout, timeout=30)


@st.composite
def _messages(draw):
    n_layers = draw(st.integers(1, 5))
    specs, parts, offset = [], [], 0
    for _ in range(n_layers):
        numel = draw(st.integers(1, 40))
        kind = draw(st.sampled_from(["dense", "sparse", "quantized"]))
        spec = LayerSpec(offset, numel, "dense" if kind == "dense" else "topk", kind == "quantized")
        if kind == "dense":
            part = LayerPart(None, torch.tensor(draw(st.lists(st.floats(-1e3, 1e3, width=32),
                                                              min_size=numel, max_size=numel))))
        else:
            local = draw(st.lists(st.integers(0, numel - 1), unique=True, max_size=numel))
            n_vals = 1 if kind == "quantized" else len(local)
            vals = draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=n_vals, max_size=n_vals))
            part = LayerPart(torch.tensor(local, dtype=torch.int64) + offset, torch.tensor(vals))
        specs.append(spec)
        parts.append(part)
        offset += numel
    return specs, parts


@settings(max_examples=60, deadline=None)
@given(_messages(), st.sampled_from([torch.int32, torch.int64]))
def test_packed_message_round_trips(message, index_type):
    specs, parts = message
    counts, indices, values = pack_message(specs, parts, index_type)
    assert counts.dtype == torch.int32 and indices.dtype == index_type
    # the bytes that travel: one contiguous payload, as Communicator.exchange_many sends it
    payload = torch.cat([t.view(torch.uint8) for t in (counts, indices, values)])
    sizes = [t.numel() * t.element_size() for t in (counts, indices, values)]
    dtypes = (torch.int32, index_type, values.dtype)
    c, i, v = (p.clone().view(dt) for p, dt in zip(payload.split(sizes), dtypes, strict=True))
    back = unpack_message(specs, c, i, v)
    for spec, part, got in zip(specs, parts, back, strict=False):
        assert torch.equal(got.values, part.values)
        if spec.dense:
            assert got.indices is None
        else:
            assert torch.equal(got.indices.long(), part.indices)


def test_unpack_rejects_inconsistent_lengths():
    specs = [LayerSpec(0, 5, "topk", False)]
    with pytest.raises(ValueError, match="counts account for 2 indices"):
        unpack_message(specs, torch.tensor([2], dtype=torch.int32), torch.arange(3), torch.zeros(2))


def test_equations_1_and_2():
    # P = 8, 25M float32, 0.1% density, 8 bytes per selected element, alpha = 1 ms, 1 Gbit/s
    beta = 8 / 1e9
    m = 25_000 * 8
    assert equation1_seconds(8, m, 1e-3, beta) == pytest.approx(3e-3 + 7 * m * beta)
    assert equation2_seconds(8, 25_000_000, 1e-3, beta) == pytest.approx(6e-3 + 2 * 7 / 8 * 1e8 * beta)
    dense = cost("rabenseifner", P=8, n=25_000_000, rank=0)  # the middle two rounds are one: one alpha less
    assert dense.time(1e-3, beta) == pytest.approx(equation2_seconds(8, 25_000_000, 1e-3, beta) - 1e-3)


def _resume(n, layout):
    options = {"density": 0.05, "small_limit": 100, "large_limit": 500}  # layer 600: sampled search
    first, second = make_method("redsync", **options), make_method("redsync", **options)
    grads = [make_gradient(n, 0, step) for step in range(4)]
    for g in grads[:2]:
        first(g.clone(), layout)
    second.load_state_dict(first.state_dict())
    assert first.extra_state()["selectors"][1]["threshold"] is not None
    return all(torch.equal(first(g.clone(), layout), second(g.clone(), layout)) for g in grads[2:])


def test_state_dict_resumes_residual_and_selector_state():
    assert run_workers(1, _resume, N, LAYOUT, timeout=60) == [True]
