"""TopkDSA (SparCML's dynamic sparse all-reduce): invariants for P = 1..8 in both variants, traffic
within its formula, and the dense switch where the formula puts it (disjoint supports make the
formula exact, so the meter must equal it to the byte)."""

import math

import pytest
import torch
from invariants import assert_conserved, assert_consistent, assert_traffic_matches, trace_method

from sparsecomm import make_method, run_workers
from sparsecomm.methods import cost
from sparsecomm.transport.sparse_stream import dense_switch_count, dense_switch_step

N = 1003


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "split_allgather"])
def test_topkdsa_invariants(P, algorithm):
    options = {"density": 0.05, "algorithm": algorithm}
    traces = run_workers(P, trace_method, "topkdsa", options, N, 2, timeout=60)
    assert_consistent(traces)
    assert_conserved(traces)
    k = math.ceil(0.05 * N)
    assert_traffic_matches(traces, "topkdsa", n=N, k=k, algorithm=algorithm)
    for trace in traces:
        assert all(rec["stats"]["algorithm"] == algorithm for rec in trace)
        # every selected pair is sent whole: the residual holds exactly the n - k others
        assert all(int((rec["new_residual"] == 0).sum()) >= k for rec in trace)


def _disjoint_call(n, k, algorithm, dtype):
    """One call where rank r's top-k is exactly [r k, (r+1) k): the supports are disjoint."""
    rank = torch.distributed.get_rank()
    grad = 0.01 * torch.randn(n, generator=torch.Generator().manual_seed(rank))
    grad[rank * k:(rank + 1) * k] = 10.0 + torch.arange(k, dtype=torch.float32)
    method = make_method("topkdsa", density=k / n, algorithm=algorithm)
    out = method(grad.to(dtype))
    return {"out": out, "kinds": method.stats["sent_representation"], "sent": method.stats.bytes_sent,
            "recv": method.stats.bytes_recv, "rounds": method.stats.rounds}


# With P k <= n disjoint pairs the streams a rank sends reach the break-even (n s_val / (s_idx + s_val)
# pairs) only where it is low enough: fp16 values (n/3 pairs) in the doubling steps of P = 8, fp32
# (n/2) in the result handed back to a folded rank of P = 6. Expected: first dense step of rank `who`.
CASES = [
    (8, torch.float16, 7, {30: None, 60: None, 100: 2, 125: 2}),
    (6, torch.float32, 1, {50: None, 80: None, 100: 2}),
]


@pytest.mark.parametrize("P, dtype, who, expected", CASES)
def test_dense_switch_happens_where_the_formula_predicts(P, dtype, who, expected):
    n = 1000
    itemsize = torch.tensor([], dtype=dtype).element_size()
    assert dense_switch_count(n, 1, itemsize) == n * itemsize // (4 + itemsize) + 1
    seen = {}
    for k in expected:
        results = run_workers(P, _disjoint_call, n, k, "recursive_doubling", dtype, timeout=60)
        for rank, res in enumerate(results):
            want = cost("topkdsa", P=P, n=n, k=k, rank=rank, itemsize=itemsize, algorithm="recursive_doubling",
                        disjoint=True)
            assert want.exact
            assert (res["rounds"], res["sent"], res["recv"]) == (want.rounds, want.bytes_sent, want.bytes_recv)
            predicted = dense_switch_step([k] * P, n, rank, 1, itemsize)
            observed = next((i for i, kind in enumerate(res["kinds"]) if kind == "dense"), None)
            assert observed == predicted, (k, rank, res["kinds"])
        seen[k] = next((i for i, kind in enumerate(results[who]["kinds"]) if kind == "dense"), None)
        support = torch.zeros(n, dtype=torch.bool)
        support[:P * k] = True
        assert torch.equal(results[0]["out"] != 0, support)
    assert seen == expected


def test_auto_picks_split_allgather_for_dense_results():
    from sparsecomm.methods.topkdsa import resolve_algorithm

    assert resolve_algorithm("auto", 8, 1000, 10) == "recursive_doubling"
    assert resolve_algorithm("auto", 8, 1000, 100) == "split_allgather"
    assert resolve_algorithm("auto", 2, 1000, 900) == "recursive_doubling"
    with pytest.raises(ValueError, match="algorithm='ring' must be one of"):
        resolve_algorithm("ring", 8, 1000, 10)
