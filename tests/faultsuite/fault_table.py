"""The fault table of docs/reliability.md (issue 23): real runs, printed as markdown.

    python tests/faultsuite/fault_table.py [amp] [detect] [checkpoint] [restart]

* ``amp``: GradScaler's scale under the sparse hook vs plain DDP on the same overflow pattern (an Inf
  in rank P-1's loss at steps 1, 3, 4 of 6), for topk, spardl, exdyna and P = 2, 4: the scale after
  every step, whether every overflow step moved no weight on any rank, the replicas equal.
* ``detect``: seconds from the moment a rank stops until the others (or the launcher) name it, for a
  stuck rank (sleeping before its next call) and a frozen one (SIGSTOP), under the hook, the
  synchronizer and the bare method, with the local launcher (``run_workers``, stall timeout 10 s) and
  under torchrun (process group timeout 10 s), P = 3, rank 2 the culprit.
* ``checkpoint``: rank P-1's checkpoint file replaced by one of a run with another seed; every rank's
  error on resume, P = 2, 4.
* ``restart``: tests/faultsuite/torchrun_restart.sh killed and uninterrupted; equal final models and
  residuals on every rank.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 10.0
OVERFLOW_STEPS = (1, 3, 4)


# ----------------------------------------------------------------------------------------------- amp
def _amp_worker(method: str, steps: int = 6):
    import sparsecomm

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    if method != "ddp":
        ddp.register_comm_hook(sparsecomm.SparseHookState(None, method, density=0.1), sparsecomm.hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1000)
    scales, still = [], True
    for step in range(steps):
        x = torch.randn(8, 20, generator=torch.Generator().manual_seed(step * 10 + rank))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ddp(x).float().pow(2).mean()
        if step in OVERFLOW_STEPS and rank == world - 1:
            loss = loss * float("inf")
        weights = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        if step in OVERFLOW_STEPS:
            still = still and all(torch.equal(a, p) for a, p in zip(weights, model.parameters(), strict=True))
    return scales, still, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def amp() -> None:
    from sparsecomm import run_workers

    print("| method | P | scale after each step (log2) | plain DDP's | overflow steps skipped on every rank "
          "| replicas equal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for P in (2, 4):
        reference = run_workers(P, _amp_worker, "ddp", timeout=300)[0][0]
        for method in ("topk", "spardl", "exdyna"):
            results = run_workers(P, _amp_worker, method, timeout=300)
            scales = results[0][0]
            same = all(r[0] == scales for r in results)
            log2 = " ".join(f"{int(torch.tensor(s).log2())}" for s in scales)
            ref = " ".join(f"{int(torch.tensor(s).log2())}" for s in reference)
            print(f"| {method} | {P} | {log2}{'' if same else ' (ranks differ)'} | {ref} | "
                  f"{'yes' if all(r[1] for r in results) else 'NO'} | "
                  f"{'yes' if all(torch.equal(r[2], results[0][2]) for r in results) else 'NO'} |", flush=True)


# -------------------------------------------------------------------------------------------- detect
def _detect_worker(path: str, how: str, kind: str, stamp: str):
    """Train a few steps; rank 2 stops (``kind``: stuck/frozen) at step 2. Returns this rank's outcome."""
    import sparsecomm

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if path == "hook":
        module = nn.parallel.DistributedDataParallel(model)
        module.register_comm_hook(sparsecomm.SparseHookState(None, "topk", density=0.1), sparsecomm.hook)
    else:
        module = model
    sync = sparsecomm.SparseSynchronizer(model, optimizer, "topk", density=0.1) if path == "synchronizer" else None
    method = sparsecomm.make_method("topk", density=0.1) if path == "method" else None
    for step in range(5):
        loss = module(torch.randn(8, 20)).pow(2).mean()
        if step == 2 and rank == 2:
            with open(stamp, "w") as handle:
                handle.write(repr(time.time()))
            if kind == "frozen":
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(600)
        start = time.time()
        try:
            optimizer.zero_grad()
            loss.backward()
            if sync is not None:
                sync.step()
            elif method is not None:
                method(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
                optimizer.step()
            else:
                optimizer.step()
        except Exception as exc:  # noqa: BLE001 - what this rank saw
            if how == "launcher":  # the launcher reports it (what the user sees)
                raise
            return f"{time.time() - start:.1f}", f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None, "finished"


def _stopped_at(stamp: str) -> float:
    with open(stamp) as handle:
        return float(handle.read())


def _detect_launcher(path: str, kind: str) -> str:
    from sparsecomm import WorkerError, run_workers

    stamp = tempfile.mktemp(prefix="sparsecomm-stop-")
    try:
        run_workers(3, _detect_worker, path, "launcher", kind, stamp, timeout=200, stall_timeout=TIMEOUT)
        return "not detected"
    except WorkerError as exc:
        seconds = time.time() - _stopped_at(stamp)
        return f"{seconds:.1f} s: {str(exc).splitlines()[0][:160]}"
    finally:
        if os.path.exists(stamp):
            os.unlink(stamp)


def _torchrun_main() -> None:
    """Entry point of one torchrun worker (argv: path kind stamp)."""
    import datetime

    torch.set_num_threads(1)
    path, kind, stamp = sys.argv[2:5]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    seconds, message = _detect_worker(path, "torchrun", kind, stamp)
    print(f"RESULT rank {dist.get_rank()} {time.time()!r} {message}", flush=True)
    os._exit(1 if seconds is not None else 0)


def _detect_torchrun(path: str, kind: str) -> str:
    stamp = tempfile.mktemp(prefix="sparsecomm-stop-")
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    try:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", __file__,
                              "_torchrun", path, kind, stamp], capture_output=True, text=True, timeout=300)
        found = [line.split(" ", 4) for line in out.stdout.splitlines() if line.startswith("RESULT")]
        if not found:
            return "not detected: " + out.stderr.strip().splitlines()[-1][:160]
        stopped = _stopped_at(stamp)
        parts = [f"rank {rank}: {float(when) - stopped:.1f} s" for _, _, rank, when, _ in found]
        return f"{', '.join(parts)}: {found[0][4][:160]}"
    finally:
        if os.path.exists(stamp):
            os.unlink(stamp)


def detect() -> None:
    print(f"| path | culprit | local launcher (stall timeout {TIMEOUT:g} s) | torchrun (timeout {TIMEOUT:g} s) |")
    print("| --- | --- | --- | --- |")
    for path in ("hook", "synchronizer", "method"):
        for kind in ("stuck", "frozen"):
            print(f"| {path} | {kind} | {_detect_launcher(path, kind)} | {_detect_torchrun(path, kind)} |", flush=True)


# ---------------------------------------------------------------------------------------- checkpoint
def _resume_messages(directory: str):
    from sparsecomm_lab.checkpoint import CheckpointError, resume_checkpoint

    try:
        resume_checkpoint(directory, {})
        return "resumed"
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"


def checkpoint() -> None:
    import shutil

    from sparsecomm_lab.training import TrainConfig, train

    from sparsecomm import run_workers

    print("| P | every rank raised | the same message | message |")
    print("| --- | --- | --- | --- |")
    for P in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            runs = {}
            for seed in (0, 1):
                runs[seed] = os.path.join(tmp, f"seed{seed}")
                train(TrainConfig(model="mlp", data="digits", method="topk", density=0.1, workers=P, epochs=1,
                                  batch_size=32, seed=seed, model_options={"hidden": [16]},
                                  checkpoint_dir=runs[seed], timeout=300))
            shutil.copy(os.path.join(runs[1], f"rank{P - 1}.pt"), os.path.join(runs[0], f"rank{P - 1}.pt"))
            messages = run_workers(P, _resume_messages, runs[0], timeout=120)
            raised = all(m.startswith("CheckpointError") for m in messages)
            message = messages[0].replace(tmp, "...")
            print(f"| {P} | {'yes' if raised else 'NO'} | {'yes' if len(set(messages)) == 1 else 'NO'} | "
                  f"{message} |", flush=True)


# ------------------------------------------------------------------------------------------- restart
def restart() -> None:
    script = os.path.join(HERE, "torchrun_restart.sh")
    with tempfile.TemporaryDirectory() as tmp:
        outputs = {}
        for name, kill in (("killed", "1"), ("straight", "0")):
            with socket.socket() as sock:
                sock.bind(("localhost", 0))
                port = sock.getsockname()[1]
            start = time.time()
            out = subprocess.run(["bash", script, os.path.join(tmp, name), str(port), kill], capture_output=True,
                                 text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
            outputs[name] = (out.stdout.strip().replace("\n", "; "), time.time() - start)
        with open(os.path.join(tmp, "killed", "out.log")) as handle:
            log = handle.read()
        equal = []
        for rank in (0, 1):
            a = torch.load(os.path.join(tmp, "killed", "ck", f"rank{rank}.pt"), weights_only=False)
            b = torch.load(os.path.join(tmp, "straight", "ck", f"rank{rank}.pt"), weights_only=False)
            same_model = all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
            ra, rb = a["sync"]["plan"]["residuals"], b["sync"]["plan"]["residuals"]
            same_res = ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in rb)
            equal.append(f"rank {rank}: epoch {a['epoch']}, model {'equal' if same_model else 'DIFFERS'}, "
                         f"residuals {'equal' if same_res else 'DIFFER'}")
        print("| run | torchrun output | wall s | restarts seen | final checkpoints vs uninterrupted |")
        print("| --- | --- | --- | --- | --- |")
        print(f"| kill -9 of rank 1 mid-epoch 2 | {outputs['killed'][0]} | {outputs['killed'][1]:.0f} | "
              f"{log.count('training mlp on digits') - 1} | {'; '.join(equal)} |")
        print(f"| uninterrupted | {outputs['straight'][0]} | {outputs['straight'][1]:.0f} | 0 | reference |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["_torchrun"]:
        _torchrun_main()
    else:
        torch.set_num_threads(1)
        for part in sys.argv[1:] or ["amp", "detect", "checkpoint", "restart"]:
            print(f"\n### {part}\n", flush=True)
            {"amp": amp, "detect": detect, "checkpoint": checkpoint, "restart": restart}[part]()
