"""The method API: ``method(grad)`` returns a tensor the caller owns, ``out=`` writes into the caller's
tensor; a :class:`MethodSpec` resolves a method once; the grouping engine behind the synchronizer."""

import pickle
import weakref

import pytest
import torch
import torch.distributed as dist
from sparsecomm_lab.training import TrainConfig
from torch import nn

from sparsecomm import available_methods, make_method, run_workers
from sparsecomm.integration.schedule import MethodSchedule
from sparsecomm.integration.synchronizer import SparseSynchronizer
from sparsecomm.methods import MethodSpec, is_sparse, sparse_methods

N = 1003


def _gradient(step: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * dist.get_rank() + step))


def _fresh_and_out(name):
    """Two instances of the method get the same gradients: one returns fresh results, the other writes
    into one reused ``out=`` tensor (into which the caller also writes between calls)."""
    spec = MethodSpec.at_density(name, 0.3)
    fresh, reusing = spec.build(), spec.build()
    first = fresh(_gradient(0))
    kept = first.clone()
    second = fresh(_gradient(1))
    third = fresh(_gradient(2))
    probe = weakref.ref(fresh(_gradient(3)))  # allocated as the call began: the method keeps no reference
    buf = torch.empty(N)
    returned = [reusing(_gradient(0), out=buf) is buf]
    out_first = buf.clone()
    returned.append(reusing(_gradient(1), out=buf) is buf)
    out_second = buf.clone()
    buf.fill_(7.0)  # the caller's own write: the next call must still start from zeros
    returned.append(reusing(_gradient(2), out=buf) is buf)
    return {"first_kept": torch.equal(first, kept), "first_differs": not torch.equal(first, second),
            "distinct_storage": first.data_ptr() != second.data_ptr() != third.data_ptr(),
            "out_returned": all(returned), "out_first": torch.equal(out_first, first),
            "out_second": torch.equal(out_second, second), "out_third": torch.equal(buf, third),
            "not_retained": probe() is None}


@pytest.mark.parametrize("name", available_methods())
@pytest.mark.parametrize("P", [2, 3])
def test_results_are_the_callers_and_out_writes_the_same_values(name, P):
    for result in run_workers(P, _fresh_and_out, name, timeout=90):
        assert result == dict.fromkeys(result, True), f"{name}: {result}"


def _bad_out(kind):
    method = make_method("topka", density=0.1)
    grad = torch.ones(10)
    out = {"shape": torch.empty(11), "dtype": torch.empty(10, dtype=torch.float64), "alias": grad,
           "type": [0.0] * 10}[kind]
    try:
        method(grad, out=out)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("kind,needle", [("shape", "shape (10,)"), ("dtype", "torch.float64"),
                                         ("alias", "share memory"), ("type", "must be a torch.Tensor")])
def test_bad_out_is_named(kind, needle):
    message, = run_workers(1, _bad_out, kind)
    assert "topka: out=" in message and needle in message, message


# ---------------------------------------------------------------------------------------------- MethodSpec
def test_spec_checks_once_and_names_the_method():
    with pytest.raises(TypeError, match=r"spardl: unknown option 'bogus'; valid options: density, teams"):
        MethodSpec("spardl", {"density": 0.1, "bogus": 1})
    with pytest.raises(ValueError, match=r"method 'topka': density=1.5 must be a number in \(0, 1\]"):
        MethodSpec("topka", {"density": 1.5})
    with pytest.raises(ValueError, match="needs density"):
        MethodSpec("topka")
    with pytest.raises(ValueError, match="dense and takes no density"):
        MethodSpec("dense", {"density": 0.1})
    with pytest.raises(ValueError, match="unknown method 'nope'; available: "):
        MethodSpec("nope")
    with pytest.raises(ValueError, match="nonfinite='drop' must be one of"):
        MethodSpec("dense", {"nonfinite": "drop"})


def test_spec_knows_its_class_and_round_trips():
    spec = MethodSpec("spardl", {"density": 0.01, "teams": 2})
    assert spec.sparse and spec.cls.name == "spardl" and spec.density == 0.01 and spec.label() == "spardl@0.01"
    assert MethodSpec.from_dict(spec.to_dict()) == spec and pickle.loads(pickle.dumps(spec)) == spec
    assert hash(MethodSpec("spardl", {"teams": 2, "density": 0.01})) == hash(spec)
    assert spec.replace(density=0.1).density == 0.1 and spec.density == 0.01
    with pytest.raises(TypeError):
        spec.options["density"] = 0.5  # type: ignore[index]
    assert MethodSpec.at_density("dense", 0.3) == MethodSpec("dense")
    assert MethodSpec.of("topka", {"density": 0.5}) == MethodSpec("topka", {"density": 0.5})
    with pytest.raises(TypeError, match="put the options"):
        MethodSpec.of(spec, {"density": 0.5})
    assert sorted(sparse_methods()) == sorted(m for m in available_methods() if is_sparse(m))


def test_train_config_and_schedule_take_specs():
    config = TrainConfig(method=MethodSpec("spardl", {"density": 0.05, "teams": 2}))
    assert (config.method, config.density, config.method_options) == ("spardl", 0.05, {"teams": 2})
    assert config.method_spec() == MethodSpec("spardl", {"density": 0.05, "teams": 2})
    assert config.method_spec("dense") == MethodSpec("dense")
    schedule = MethodSchedule(MethodSpec("topka", {"density": 0.2}), ((2, "dense"), (4, "hitopk")))
    assert [schedule.method_at(e) for e in range(5)] == ["topka"] * 2 + ["dense"] * 2 + ["hitopk"]
    assert schedule.spec_at(0) == MethodSpec("topka", {"density": 0.2})
    assert schedule.spec_at(4, density=0.1) == MethodSpec("hitopk", {"density": 0.1})
    assert str(schedule) == "0:topka,2:dense,4:hitopk"


def _density_set_through_the_api():
    method = make_method("topka", density=0.1)
    method.set_density(0.5)
    method(torch.ones(100))
    try:
        method.set_density(0.0)
        return method.stats.selected, "no error"
    except ValueError as exc:
        return method.stats.selected, str(exc)


def test_density_changes_through_the_method_and_is_checked():
    (selected, message), = run_workers(1, _density_set_through_the_api)
    assert selected == 50 and "method 'topka': density=0.0 must be a number in (0, 1]" in message


# ---------------------------------------------------------------------------------------------- the engine
def _training(steps, resume_at, options):
    """``steps`` steps of a synchronizer with several buckets; with ``resume_at``, its state is
    pickled after that many steps and loaded into a new synchronizer, which goes on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = SparseSynchronizer(model, opt, "topka", bucket_elements=30, density=0.2, dense_warmup_steps=1, **options)
    out_tensors = {group.index: group.outbuf().data_ptr() for group in sync.engine.groups}
    for step in range(steps):
        if step == resume_at:
            saved = pickle.dumps((sync.state_dict(), opt.state_dict()))
            sync = SparseSynchronizer(model, opt, "topka", bucket_elements=30, density=0.2, dense_warmup_steps=1,
                                      broadcast_parameters=False, **options)
            state, opt_state = pickle.loads(saved)
            sync.load_state_dict(state)
            opt.load_state_dict(opt_state)
            out_tensors = {group.index: group.outbuf().data_ptr() for group in sync.engine.groups}
        opt.zero_grad()
        gen = torch.Generator().manual_seed(10 * dist.get_rank() + step)
        x, y = torch.randn(4, 6, generator=gen), torch.randint(3, (4,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        sync.step()
    reused = out_tensors == {group.index: group.outbuf().data_ptr() for group in sync.engine.groups}
    dense_groups = sum(group.dense for group in sync.engine.groups)
    return [p.detach().clone() for p in model.parameters()], len(sync.buckets), reused, dense_groups


@pytest.mark.parametrize("options", [{}, {"dense_below": 10}])
def test_synchronizer_resumes_exactly_with_several_buckets(options):
    uninterrupted = run_workers(2, _training, 5, None, options)
    resumed = run_workers(2, _training, 5, 3, options)
    for (params_a, buckets, reused, dense), (params_b, _, reused_b, _) in zip(uninterrupted, resumed, strict=True):
        assert buckets >= 2 and reused and reused_b
        assert dense == (1 if options else 0)
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))


def test_nested_phase_timers_book_every_second_once(monkeypatch):
    """A phase timed inside another (SparDL's selections inside the agreement steps that carry its
    messages, timed as the comm) stops the outer one's clock: each second is booked to one phase."""
    from sparsecomm.methods import base

    clock = iter([0.0, 1.0, 3.0, 4.0, 10.0, 11.0])  # enter comm, enter select, leave, enter, leave, leave comm
    monkeypatch.setattr(base.time, "perf_counter", lambda: next(clock))
    times: dict[str, float] = {}
    running: list = []
    with base.PhaseTimer(times, "comm", running):
        with base.PhaseTimer(times, "select", running):
            pass
        with base.PhaseTimer(times, "select", running):
            pass
    assert times == {"comm": 1.0 + 1.0 + 1.0, "select": 2.0 + 6.0} and running == []
