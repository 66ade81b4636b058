"""Cost model: registry, helpers and the alpha-beta fit."""

import pytest

from sparsecomm.core.cost import Cost, ceil_log2, chunk_sizes, fit_alpha_beta
from sparsecomm.methods import available_collective_costs, available_costs, available_methods, collective_cost, cost


def test_helpers():
    assert [ceil_log2(p) for p in range(1, 10)] == [0, 1, 2, 2, 3, 3, 3, 3, 4]
    assert chunk_sizes(10, 4) == [3, 3, 2, 2] and sum(chunk_sizes(1003, 7)) == 1003


def test_ring_formula_matches_textbook_when_divisible():
    c = cost("ring", P=4, n=1000, rank=2)
    assert c == Cost(6, 2 * 3 * 250 * 4, 2 * 3 * 250 * 4)
    assert c.time(alpha=1e-3, beta=1e-9) == pytest.approx(6e-3 + 6000e-9)


def test_registry_and_errors():
    assert available_costs() == available_methods()  # one formula per method, and only methods
    assert {"ring_allreduce", "rabenseifner_allreduce", "bruck_allgather", "tree_reduce"} <= set(
        available_collective_costs())
    assert set(available_collective_costs()).isdisjoint(available_methods())
    with pytest.raises(ValueError, match="unknown method cost formula 'nope'; available: .*ring"):
        cost("nope", P=2, n=10)
    with pytest.raises(ValueError, match="unknown method cost formula 'bruck_allgather'"):
        cost("bruck_allgather", P=2, n=10)
    assert collective_cost("ring_allreduce", P=4, n=1000, rank=2) == cost("ring", P=4, n=1000, rank=2)
    with pytest.raises(ValueError, match="invalid P=0"):
        cost("ring", P=0, n=10)


def test_fit_alpha_beta_recovers_parameters():
    alpha, beta = 2e-3, 1e-9
    samples = [(r, b, r * alpha + b * beta) for r, b in [(1, 1e6), (4, 1e6), (2, 8e6), (8, 3e7)]]
    a, b = fit_alpha_beta(samples)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError, match="at least two"):
        fit_alpha_beta(samples[:1])
