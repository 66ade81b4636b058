"""DGC training techniques: momentum correction and masking, local clipping, density warm-up, dense warm-up."""

import pytest
import torch

from sparsecomm import make_method, run_workers
from sparsecomm.integration.dgc import MomentumCorrection, clip_local_gradients, density_schedule


def test_momentum_correction_matches_hand_computed_example():
    mc = MomentumCorrection(0.9, hold_accumulation=True)
    v = mc.update(torch.tensor([1.0, -2.0, 0.5]))        # u = g, v = u
    assert torch.equal(v, torch.tensor([1.0, -2.0, 0.5]))
    mc.mask_(torch.tensor([1]))                            # index 1 was sent: u[1] = v[1] = 0
    assert torch.equal(mc.velocity, torch.tensor([1.0, 0.0, 0.5]))
    v = mc.update(torch.tensor([0.5, 1.0, -1.0]))
    # u = 0.9 * [1, 0, 0.5] + [0.5, 1, -1] = [1.4, 1.0, -0.55]; v = [1, 0, 0.5] + u = [2.4, 1.0, -0.05]
    assert torch.allclose(mc.velocity, torch.tensor([1.4, 1.0, -0.55]))
    assert torch.allclose(v, torch.tensor([2.4, 1.0, -0.05]))
    mc.mask_(torch.tensor([True, False, False]))
    assert torch.allclose(mc.velocity, torch.tensor([0.0, 1.0, -0.55]))
    assert torch.allclose(mc.accumulation, torch.tensor([0.0, 1.0, -0.05]))


def test_nesterov_accumulates_g_plus_m_u():
    mc = MomentumCorrection(0.5, nesterov=True)
    out = mc.update(torch.tensor([2.0, -4.0]))             # u = g; step = g + 0.5 u = 1.5 g
    assert torch.equal(out, torch.tensor([3.0, -6.0]))
    out = mc.update(torch.tensor([0.0, 2.0]))              # u = [1, 0]; step = [0.5, 2]
    assert torch.equal(out, torch.tensor([0.5, 2.0]))


def test_velocity_in_one_pass_by_tensor_or_by_pieces_equals_update():
    gen = torch.Generator().manual_seed(5)
    reference, whole, pieces = MomentumCorrection(0.9), MomentumCorrection(0.9), MomentumCorrection(0.9)
    for step in range(4):
        g = torch.randn(10, generator=gen)
        g[7:] = 0 if step == 2 else g[7:]  # the last piece missing (no .grad) at step 2
        expected = reference.update(g)
        assert torch.equal(whole.velocity_of(g.clone()), expected)
        parts = [(0, 3, g[:3].reshape(3, 1)), (3, 4, g[3:7]), (7, 3, None if step == 2 else g[7:])]
        assert torch.equal(pieces.velocity_of_pieces(torch.empty(10), parts), expected)
        assert torch.equal(whole.velocity, reference.velocity) and torch.equal(pieces.velocity, reference.velocity)
    before = reference.velocity.clone()
    pieces.velocity_of_pieces(torch.empty(10), [(0, 10, torch.ones(10))])
    pieces.undo_()                                          # a dropped step: u as before it
    assert torch.equal(pieces.velocity, before)
    with pytest.raises(ValueError, match="must cover the 10 elements"):
        pieces.velocity_of_pieces(torch.empty(10), [(0, 4, torch.ones(4))])
    with pytest.raises(ValueError, match="only without nesterov"):
        MomentumCorrection(0.9, nesterov=True).velocity_of(torch.ones(2))


def _with_method_vs_standalone(steps):
    """The residual of a method plays v: both ways give the same sent values, u and v."""
    method = make_method("topka", density=0.25)
    held, outer = MomentumCorrection(0.9, hold_accumulation=True), MomentumCorrection(0.9)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        g = torch.randn(8, generator=gen)
        out = method(outer.update(g))
        outer.mask_(method.last_sent)
        v = held.update(g)
        sent = torch.topk(v.abs(), 2).indices
        expected = torch.zeros(8)
        expected[sent] = v[sent]
        held.mask_(sent)
        assert torch.allclose(out, expected)
        assert torch.allclose(outer.velocity, held.velocity)
        assert torch.allclose(method.residual, held.accumulation)
    return True


def test_momentum_correction_with_a_residual_keeping_method():
    assert run_workers(1, _with_method_vs_standalone, 5, timeout=30) == [True]


def test_mask_before_update_and_bad_momentum_raise():
    with pytest.raises(RuntimeError, match="before update"):
        MomentumCorrection(0.9).mask_(torch.tensor([0]))
    with pytest.raises(ValueError, match=r"momentum=1.0 must be a number in \[0, 1\)"):
        MomentumCorrection(1.0)


@pytest.mark.parametrize("held", [False, True])
def test_undo_takes_back_the_last_update_bit_for_bit_without_new_buffers(held):
    mc = MomentumCorrection(0.9, hold_accumulation=held)
    mc.update(torch.tensor([1.0, -2.0, 0.5]))
    mc.mask_(torch.tensor([1]))
    mc.update(torch.tensor([0.25, 3.0, -1.0]))
    before = (mc.velocity.clone(), None if mc.accumulation is None else mc.accumulation.clone())
    buffers = {mc.velocity.data_ptr(), *(() if mc.accumulation is None else (mc.accumulation.data_ptr(),))}
    mc.update(torch.tensor([float("nan"), 1.0, float("inf")]))  # a step that is then dropped
    mc.undo_()
    assert torch.equal(mc.velocity, before[0])
    assert before[1] is None or torch.equal(mc.accumulation, before[1])
    mc.update(torch.tensor([1.0, 1.0, 1.0]))
    mc.undo_()
    assert torch.equal(mc.velocity, before[0])
    with pytest.raises(RuntimeError, match="needs an update"):
        mc.undo_()  # only the last update can be taken back
    mc.update(torch.tensor([1.0, 1.0, 1.0]))
    used = {mc.velocity.data_ptr(), *(() if mc.accumulation is None else (mc.accumulation.data_ptr(),))}
    assert len(buffers | used) == 2 * len(buffers)  # two buffers per tensor, swapped: none allocated per step
    expected = MomentumCorrection(0.9, hold_accumulation=held)
    for grad in ([1.0, -2.0, 0.5], [0.25, 3.0, -1.0], [1.0, 1.0, 1.0]):
        expected.update(torch.tensor(grad))
        if grad[0] == 1.0 and grad[1] == -2.0:
            expected.mask_(torch.tensor([1]))
    assert torch.equal(mc.velocity, expected.velocity)


def test_state_dict_round_trip():
    mc = MomentumCorrection(0.9, hold_accumulation=True)
    mc.update(torch.tensor([1.0, 2.0]))
    other = MomentumCorrection(0.1)
    other.load_state_dict(mc.state_dict())
    assert other.momentum == 0.9 and torch.equal(other.velocity, mc.velocity)
    assert torch.equal(other.update(torch.zeros(2)), mc.update(torch.zeros(2)))


def test_local_clipping_scales_threshold_by_inverse_sqrt_world_size():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])                       # norm 5
    norm = clip_local_gradients([p], max_norm=4.0, world_size=4)   # threshold 4 / 2 = 2
    assert norm == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(2.0, rel=1e-5)
    p.grad = torch.tensor([0.3, 0.4])
    clip_local_gradients([p], max_norm=4.0, world_size=4)  # under the threshold: untouched
    assert torch.equal(p.grad, torch.tensor([0.3, 0.4]))
    with pytest.raises(ValueError, match="world_size=0"):
        clip_local_gradients([p], 1.0, 0)


def test_density_schedule_is_dgc_exponential_warmup():
    got = [density_schedule(e, 0.001, warmup_epochs=4) for e in range(6)]
    assert got == pytest.approx([0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001])
    assert density_schedule(1.7, 0.001) == pytest.approx(0.0625)  # fractional epochs: floor
    assert density_schedule(0, 0.5) == 0.5                          # never below the target
    with pytest.raises(ValueError, match="target=0 must be a density"):
        density_schedule(0, 0)
