"""Sparse replica synchronization under FSDP2 (``sparsecomm.sparse_replicas``): the invariants over
the replica group, density 1 against native HSDP, AdamW with clipping on the DTensor parameters,
mixed precision, gradient accumulation, an exact resume, bad input and the example.

Each layout runs in one ``run_workers`` call (module-scoped fixtures) that records everything; the
tests read the records. The model shards unevenly (13 rows over 2 or 3 shards: padded shards),
holds a frozen parameter (left out of the reduce-scatter), and uses its root's parameters first in
forward, so that the root's group is reduced from FSDP's final backward callback.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from invariants import assert_conserved, assert_consistent, assert_traffic_matches
from torch import nn

import sparsecomm
from sparsecomm import run_workers

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS = 4          # steps of the traced run
SAVE_AFTER = 2     # the checkpoint of the resume test is written after this many steps
DENSITY = 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.frozen = nn.Parameter(torch.linspace(-1, 1, 13), requires_grad=False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(13, 13), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(13, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.frozen
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    x = torch.randn(6, 7, generator=generator)
    return x, x[:, :3].tanh()


def _sharded(mesh, *, native: bool = False, seed: int = 0, policy=None) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = Net()
    shard_mesh = mesh if native else mesh["shard"]
    policy = policy or MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    return model


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, micro: int = 1) -> float:
    x, y = _batch(step)
    total = 0.0
    for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
        model.set_requires_gradient_sync(i == micro - 1)  # accumulate locally until the last micro-batch
        loss = nn.functional.mse_loss(model(xs).float(), ys) / micro  # bf16 outputs under mixed precision
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # on the DTensor grads; small: it clips
    optimizer.step()
    optimizer.zero_grad()
    return total


def _local(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02, weight_decay=0.1)


def _record_calls(state: sparsecomm.SparseReplicaState, records: list[list[dict[str, Any]]]) -> None:
    """Wrap each group's hook: records[group] gets, per call, what went in and came out."""
    for index, shard_group in enumerate(state.shard_groups):
        def hook(output: torch.Tensor, index: int = index) -> None:
            group = state.engine.groups[index]
            grad, old = output.clone(), group.residual.clone()
            state._reduce(index, output)
            records[index].append({"grad": grad, "old_residual": old, "out": output.clone(),
                                   "new_residual": group.residual.clone(), "stats": dict(group.method.stats)})
        shard_group.module.set_all_reduce_hook(hook)


def _save(model, optimizer, state, directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    torch.save(state.state_dict(), f"{directory}/sparsecomm-rank{dist.get_rank()}.pt")


def _load(model, optimizer, state, directory: str, rank: int | None = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    checkpoint = {"model": model_state, "optim": optim_state}
    dcp.load(checkpoint, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optim"])
    rank = dist.get_rank() if rank is None else rank
    state.load_state_dict(torch.load(f"{directory}/sparsecomm-rank{rank}.pt"))


def _raises(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def layout_worker(replicas: int, shards: int, method: str, directory: str, extras: bool) -> dict[str, Any]:
    """Everything one layout checks, in one worker (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    out: dict[str, Any] = {"replica_rank": mesh.get_local_rank(0), "shard_rank": mesh.get_local_rank(1)}

    # density 1 against native HSDP: AdamW, clipping, two micro-batches
    for name, native in (("native", True), ("density1", False)):
        model = _sharded(mesh, native=native)
        if not native:
            sparsecomm.sparse_replicas(model, mesh, method, density=1.0)
        optimizer = _adamw(model)
        out[f"{name}_losses"] = [_step(model, optimizer, step, micro=2) for step in range(3)]
        out[f"{name}_params"] = _full(model)

    # the traced run: invariants per call, a checkpoint after SAVE_AFTER steps
    model = _sharded(mesh)
    state = sparsecomm.sparse_replicas(model, mesh, method, density=DENSITY)
    records: list[list[dict[str, Any]]] = [[] for _ in state.shard_groups]
    _record_calls(state, records)
    optimizer = _adamw(model)
    shards_per_step = []
    for step in range(STEPS):
        if step == SAVE_AFTER:
            _save(model, optimizer, state, directory)
        _step(model, optimizer, step)
        shards_per_step.append(_local(model))
    out.update(records=records, shards=shards_per_step, iter=state.iter, n=[g.n for g in state.engine.groups],
               residuals={name: r.clone() for name, r in state.residuals().items()},
               residual_dtypes=[str(g.residual.dtype) for g in state.engine.groups], repr=repr(state))

    # the resumed run: fresh objects (other initial weights), the checkpoint, the same batches
    model = _sharded(mesh, seed=1)
    optimizer = _adamw(model)
    state = sparsecomm.sparse_replicas(model, mesh, method, density=DENSITY)
    _load(model, optimizer, state, directory)
    for step in range(SAVE_AFTER, STEPS):
        _step(model, optimizer, step)
    out.update(resumed_shards=_local(model), resumed_iter=state.iter,
               resumed_residuals={name: r.clone() for name, r in state.residuals().items()})
    if not extras:
        return out

    # a rank that loads another rank's file: every rank raises, before anything is loaded
    other = (dist.get_rank() + 1) % dist.get_world_size() if dist.get_rank() == 0 else None
    out["wrong_file"] = _raises(_load, model, optimizer, state, directory, rank=other)

    # bf16 parameters, gradients reduce-scattered in bf16: the replica reduction runs in fp32
    model = _sharded(mesh, policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    state = sparsecomm.sparse_replicas(model, mesh, method, density=DENSITY)
    optimizer = _adamw(model)
    out["bf16_losses"] = [_step(model, optimizer, step) for step in range(2)]
    out.update(bf16_shards=_local(model), bf16_residual_dtypes=[str(g.residual.dtype) for g in state.engine.groups])

    # bad input: one clear error each, before anything runs
    out["errors"] = {
        "native HSDP": _raises(sparsecomm.sparse_replicas, _sharded(mesh, native=True), mesh, method, density=0.1),
        "1-D mesh": _raises(sparsecomm.sparse_replicas, model, mesh["shard"], method, density=0.1),
        "no FSDP": _raises(sparsecomm.sparse_replicas, Net(), mesh, method, density=0.1),
        "twice": _raises(sparsecomm.sparse_replicas, model, mesh, method, density=0.1),
        "density": _raises(sparsecomm.sparse_replicas, _sharded(mesh), mesh, method, density=1.5),
        "method": _raises(sparsecomm.sparse_replicas, _sharded(mesh), mesh, "nosuch", density=0.1),
    }
    out["example_losses"] = _load_example().train(method=method, density=0.1, steps=8, replicas=replicas)
    return out


def _load_example():
    spec = importlib.util.spec_from_file_location("example_hsdp", EXAMPLES / "hsdp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("hsdp-2x2"))
    return run_workers(4, layout_worker, 2, 2, "topka", directory, True, timeout=240)


@pytest.fixture(scope="module")
def three_by_two(tmp_path_factory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("hsdp-3x2"))
    return run_workers(6, layout_worker, 3, 2, "spardl", directory, False, timeout=300)


LAYOUTS = [("two_by_two", 2, 2, "topka"), ("three_by_two", 3, 2, "spardl")]


def _by_shard(results: list[dict[str, Any]], shards: int) -> list[list[dict[str, Any]]]:
    """The ranks' results per shard, each list in replica order."""
    columns: list[list[dict[str, Any]]] = [[] for _ in range(shards)]
    for result in sorted(results, key=lambda r: r["replica_rank"]):
        columns[result["shard_rank"]].append(result)
    return columns


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{r}x{s}" for _, r, s, _ in LAYOUTS])
def test_invariants_over_the_replica_group(layout, request):
    fixture, replicas, shards, method = layout
    results = request.getfixturevalue(fixture)
    for column in _by_shard(results, shards):
        assert len(column) == replicas
        groups = len(column[0]["records"])
        assert groups == 3  # the root and two blocks
        for g in range(groups):
            traces = [result["records"][g] for result in column]
            assert all(len(trace) == STEPS for trace in traces)  # one call per step and group
            assert_consistent(traces)
            assert_conserved(traces)
            n = column[0]["n"][g]
            assert_traffic_matches(traces, method, n, math.ceil(DENSITY * n))
            assert all(record["stats"]["nnz_out"] < n for trace in traces for record in trace)  # it did sparsify
        # each shard identical on every replica after every step (AdamW, clipping)
        for result in column[1:]:
            for mine, first in zip(result["shards"], column[0]["shards"], strict=True):
                assert all(torch.equal(a, b) for a, b in zip(mine, first, strict=True))
    assert all(result["iter"] == STEPS for result in results)
    assert results[0]["residual_dtypes"] == ["torch.float32"] * 3


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{r}x{s}" for _, r, s, _ in LAYOUTS])
def test_density_one_is_native_hsdp(layout, request):
    """Density 1 averages what native HSDP averages: the same parameters after three AdamW steps with
    clipping and two micro-batches, to float tolerance (the sparse method sums the replicas' values
    in its own order; with two replicas the sum is one addition either way, bit-identical)."""
    fixture, replicas, _, _ = layout
    for result in request.getfixturevalue(fixture):
        for sparse, native in zip(result["density1_params"], result["native_params"], strict=True):
            if replicas == 2:
                assert torch.equal(sparse, native)
            else:
                torch.testing.assert_close(sparse, native, rtol=1e-5, atol=1e-6)
        assert result["density1_losses"] == pytest.approx(result["native_losses"], rel=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{r}x{s}" for _, r, s, _ in LAYOUTS])
def test_resume_is_exact(layout, request):
    """Model and optimizer through torch.distributed.checkpoint, residuals per rank: the resumed run
    (other initial weights before loading) ends bit-identical to the uninterrupted one."""
    fixture, *_ = layout
    for result in request.getfixturevalue(fixture):
        assert result["resumed_iter"] == STEPS
        assert all(torch.equal(a, b) for a, b in zip(result["resumed_shards"], result["shards"][-1], strict=True))
        assert result["residuals"].keys() == result["resumed_residuals"].keys() == {"", "blocks.0", "blocks.1"}
        for name, residual in result["residuals"].items():
            assert torch.equal(result["resumed_residuals"][name], residual)
            assert residual.abs().sum() > 0


def test_a_wrong_state_file_raises_on_every_rank(two_by_two):
    messages = [result["wrong_file"] for result in two_by_two]
    assert "saved with rank=1, this rank has rank=0" in messages[0]
    assert all("another rank cannot load its state" in m for m in messages[1:])


def test_bf16_parameters_reduce_in_fp32(two_by_two):
    for result in two_by_two:
        assert result["bf16_residual_dtypes"] == ["torch.float32"] * 3
        assert all(math.isfinite(loss) for loss in result["bf16_losses"])
    for column in _by_shard(two_by_two, 2):
        assert all(torch.equal(a, b) for a, b in zip(column[0]["bf16_shards"], column[1]["bf16_shards"], strict=True))


def test_bad_input_raises_a_clear_error(two_by_two):
    for result in two_by_two:
        errors = result["errors"]
        assert "2-D mesh (native HSDP)" in errors["native HSDP"]
        assert "mesh must be a 2-D DeviceMesh" in errors["1-D mesh"]
        assert "has no FSDP module" in errors["no FSDP"]
        assert "already has an all-reduce hook" in errors["twice"]
        assert "density=1.5" in errors["density"]
        assert "nosuch" in errors["method"]


def test_the_example_trains(two_by_two):
    for result in two_by_two:
        losses = result["example_losses"]
        assert len(losses) == 8 and losses[-1] < losses[0]


# -- the measurement command (sparsecomm bench hsdp) ---------------------------------------------------------

@pytest.mark.slow
def test_bench_hsdp_writes_its_table_and_json(tmp_path, capsys):
    import json

    from sparsecomm.cli import main

    assert main(["bench", "hsdp", "--rate", "loopback", "--width", "32", "--depth", "2", "--batch", "4",
                 "--steps", "3", "--warmup", "1", "--methods", "topka", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    labels = [row["configuration"] for row in result["rows"]]
    assert labels == ["FSDP2 (all ranks)", "native HSDP", "HSDP + topka (density 0.01)", "no replica sync (floor)"]
    rows = {row["configuration"]: row for row in result["rows"]}
    # the first step is the same model on the same batch for every configuration
    first = {label: result["per_rank"][0]["records"][label][0]["loss"] for label in labels}
    assert len(set(first.values())) == 1
    assert 0 < rows["HSDP + topka (density 0.01)"]["replica sync MB sent/rank/step"] \
        < rows["native HSDP"]["replica sync MB sent/rank/step"]
    assert "| native HSDP |" in (tmp_path / "result.md").read_text()
    assert "sparsecomm bench hsdp" in result["command"]


def test_bench_hsdp_refuses_bad_input(capsys):
    from sparsecomm.cli import main

    for argv, message in ((["--warmup", "5", "--steps", "3"], "--warmup=5 must be >= 0 and below --steps=3"),
                          (["--methods", "dense"], "--methods: 'dense' is not a sparse method"),
                          (["--density", "2"], "density=2"),
                          (["--rate", "1gbps"], "1gbps")):
        assert main(["bench", "hsdp", *argv]) == 2
        assert message in capsys.readouterr().err


# -- on a GPU (make test-gpu): one replica of one shard over NCCL ---------------------------------------------

def cuda_worker() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def build(policy, mesh, sparse: bool):
        torch.manual_seed(0)
        model = Net().cuda()
        for block in model.blocks:
            fully_shard(block, mesh=mesh["shard"] if sparse else mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh["shard"] if sparse else mesh, mp_policy=policy)
        return model

    def train(model):
        optimizer = _adamw(model)
        generator = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(3):
            x = torch.randn(6, 7, generator=generator).cuda()
            loss = (model(x).float() - x[:, :3].tanh()).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("replicate", "shard"))
    out: dict[str, Any] = {}
    for label, policy in (("fp32", MixedPrecisionPolicy()),
                          ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16))):
        model = build(policy, mesh, sparse=True)
        state = sparsecomm.sparse_replicas(model, mesh, "topka", density=0.2)
        train(model)
        saved = state.state_dict()
        again = sparsecomm.sparse_replicas(build(policy, mesh, sparse=True), mesh, "topka", density=0.2)
        again.load_state_dict(saved)
        out[label] = {"residuals": [(r.device.type, r.dtype) for r in state.residuals().values()],
                      "iter": state.iter, "reloaded": all(torch.equal(again.residuals()[name], r)
                                                          for name, r in state.residuals().items())}
    model = build(MixedPrecisionPolicy(), mesh, sparse=True)
    sparsecomm.sparse_replicas(model, mesh, "topka", density=1.0)
    out["density1"] = train(model)
    out["fsdp2"] = train(build(MixedPrecisionPolicy(), init_device_mesh("cuda", (1,)), sparse=False))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")
def test_on_cuda_over_nccl():
    """Residuals on the GPU in fp32 (bf16 parameters too), a state that reloads, and density 1 over one
    replica equal to FSDP2 alone."""
    out = run_workers(1, cuda_worker, backend="nccl", timeout=240)[0]
    for label in ("fp32", "bf16"):
        assert out[label]["residuals"] == [("cuda", torch.float32)] * 3
        assert out[label]["iter"] == 3 and out[label]["reloaded"]
    assert out["density1"] == out["fsdp2"]
