"""The fault table of docs/reliability.md: real runs, printed as markdown.

    python tests/faultsuite/fault_table.py [amp] [detect] [checkpoint] [restart] [world] [torn] [agreement]
                                           [resources] [outputs]

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
* ``world``: hook state saved at P = 4 loaded into 2 and 3 ranks (every old rank's state): the residuals'
  sum over ranks conserved, a step after it; the rank-0-saves habit, a single state into another size,
  residuals of the wrong shape, type or value.
* ``torn``: ``sparsecomm train`` killed (SIGKILL, rank 1) at three moments of an epoch's checkpoint,
  then ``--resume auto`` (tests/faultsuite/torn_checkpoint.py).
* ``agreement``: the synchronizer on models that differ across ranks; ``sparsecomm train`` under env://
  with ``--lr``, ``--epochs`` or ``--batch-size`` differing on one rank.
* ``resources``: threads and descriptors around 30 hook states; a rank with no hook, one state on two
  DDP models, the death of the rank hosting the store (tests/faultsuite/store_death.py).
* ``outputs``: commands whose output cannot be written; advise's inputs.
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
    from sparsecomm_lab import checkpoint as lab

    from sparsecomm import CheckpointManager

    try:
        lab.resume(CheckpointManager(directory), {}, required=True)
        return "resumed"
    except lab.CheckpointError as exc:
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
            name = os.path.join("step-000000000001", f"rank-{P - 1:05d}-of-{P:05d}.pt")
            shutil.copy(os.path.join(runs[1], name), os.path.join(runs[0], name))
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
            final = os.path.join("ck", "step-000000000004", f"rank-{rank:05d}-of-00002.pt")
            a = torch.load(os.path.join(tmp, "killed", final), weights_only=False)["state"]
            b = torch.load(os.path.join(tmp, "straight", final), weights_only=False)["state"]
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


# ------------------------------------------------------------------------------------------ world size
def _hooked(method: str, steps: int, states=None):
    """``steps`` DDP steps with the hook after loading ``states``: (this rank's state, its residuals right
    after the load, the error of the load or of a step)."""
    import sparsecomm

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 4)))
    state = sparsecomm.SparseHookState(None, method, density=0.1)
    model.register_comm_hook(state, sparsecomm.hook)
    loaded = None
    try:
        if states is not None:
            state.load_state_dict(states)
            loaded = {pid: r.clone() for pid, r in state.residuals().items()}
        gen = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(steps):
            model.zero_grad()
            model(torch.randn(8, 20, generator=gen)).pow(2).mean().backward()
    except Exception as exc:  # noqa: BLE001 - what this rank saw
        state.close()
        return None, None, f"{type(exc).__name__}: {exc}"
    saved = state.state_dict()
    state.close()
    from sparsecomm.integration.consistency import parameter_checksum

    saved["checksum"] = parameter_checksum(model.module)  # (the replicas' parameters, compared by the caller)
    return saved, loaded, None


def _total(residuals) -> torch.Tensor:
    return sum(torch.cat([r[pid] for pid in sorted(r)]).double() for r in residuals)


def world() -> None:
    """Hook state saved at P = 4 loaded into P' = 2 and 3 (every old rank's state, as a list); the
    residuals' sum over ranks before and after; one more step; then the rank-0-saves habit and a
    single state into another size."""
    from sparsecomm import run_workers

    print("| method | P -> P' | sum over ranks of the residuals (max abs. difference, element-wise) | "
          "next step | replicas |")
    print("| --- | --- | --- | --- | --- |")
    for method in ("topka", "spardl", "exdyna"):
        saved = [s for s, _, _ in run_workers(4, _hooked, method, 3, timeout=300)]
        before = _total([s["plan"]["residuals"] for s in saved])
        for new in (2, 3):
            resumed = run_workers(new, _hooked, method, 1, saved, timeout=300)
            errors = [e for _, _, e in resumed if e]
            if errors:
                print(f"| {method} | 4 -> {new} | - | {errors[0][:160]} | - |", flush=True)
                continue
            after = _total([loaded for _, loaded, _ in resumed])
            finals = [s for s, _, _ in resumed]
            error, scale = float((after - before).abs().max()), float(before.abs().sum())
            equal = len({s["checksum"] for s in finals}) == 1
            print(f"| {method} | 4 -> {new} | {error:.1e} (of {scale:.3g} in all) | ran (step {finals[0]['iter']}) | "
                  f"{'equal' if equal else 'DIFFER'} |", flush=True)
    saved = [s for s, _, _ in run_workers(3, _hooked, "topka", 2, timeout=300)]
    print("\n| mistake | every rank raised | the same message | message |")
    print("| --- | --- | --- | --- |")
    for label, P, given in (("rank 0's state loaded on every rank (P = 3)", 3, saved[0]),
                            ("one state of a 3-rank job loaded into 2 ranks", 2, saved[1])):
        messages = [e for _, _, e in run_workers(P, _hooked, "topka", 1, given, timeout=300)]
        print(f"| {label} | {'yes' if all(messages) else 'NO'} | {'yes' if len(set(messages)) == 1 else 'NO'} | "
              f"{messages[0]} |", flush=True)
    print("\n| rank 1's saved residual of parameter 0 | every rank raised | message |")
    print("| --- | --- | --- |")
    for label, value in (("tensor([123.])", torch.tensor([123.0])), ("the float 0.5", 0.5),
                         ("all NaN", torch.full((600,), float("nan")))):
        messages = run_workers(3, _load_corrupted, saved, value, timeout=300)
        print(f"| {label} | {'yes' if all(m != 'loaded' for m in messages) and len(set(messages)) == 1 else 'NO'} "
              f"| {messages[0]} |", flush=True)


def _load_corrupted(saved, value):
    import sparsecomm

    state = sparsecomm.SparseHookState(None, "topka", density=0.1)
    mine = saved[dist.get_rank()]
    if dist.get_rank() == 1:
        mine = {**mine, "plan": {**mine["plan"], "residuals": {**mine["plan"]["residuals"], 0: value}}}
    try:
        state.load_state_dict(mine)
        return "loaded"
    except Exception as exc:  # noqa: BLE001 - what this rank saw
        return f"{type(exc).__name__}: {exc}"
    finally:
        state.close()


# ------------------------------------------------------------------------------------------ torn
def torn() -> None:
    """sparsecomm train (mlp on digits, topk, P = 3, 3 epochs) with rank 1 killed (SIGKILL) at three
    moments of the epoch-2 checkpoint, then started again with --resume auto."""
    sys.path.insert(0, HERE)
    import torn_checkpoint

    print("| kill of rank 1, epoch 2's checkpoint | the launcher said | epochs held after the kill | "
          "--resume auto resumed from (per rank) | resumed run: epochs, replicas | final model vs uninterrupted |")
    print("| --- | --- | --- | --- | --- | --- |")
    for point in torn_checkpoint.POINTS:
        with tempfile.TemporaryDirectory() as tmp:
            r = torn_checkpoint.run_case(tmp, point)
        held = ", ".join(h[-2:].lstrip("0") for h in r["held"])
        final = "bit-identical" if r["equal_to_uninterrupted"] else "DIFFERS"
        print(f"| {point.replace('_', ' ')} | {r['died'][:90]} | {held} | "
              f"epoch {', '.join(map(str, r['resumed_from']))} | {r['resumed_epochs']}, "
              f"{'equal' if r['consistent'] else 'DIFFER'} | {final} |", flush=True)


# ------------------------------------------------------------------------------------------ agreement
def _synchronizer_models(kind: str):
    import sparsecomm

    torch.manual_seed(0)
    layers = [nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 4)]
    if dist.get_rank() == 1 and kind == "extra layer":
        layers += [nn.ReLU(), nn.Linear(4, 4)]
    if dist.get_rank() == 1 and kind == "same elements, other shapes":
        layers = [nn.Linear(30, 20), nn.ReLU(), nn.Linear(20, 6)]
    start = time.monotonic()
    try:
        sparsecomm.SparseSynchronizer(nn.Sequential(*layers), None, "topk", density=0.1)
        return "built", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - what this rank saw
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start


def _train_cli(P: int, odd: list[str], tmp: str) -> list[tuple[int, float, str]]:
    """``sparsecomm train`` as P env:// processes, rank 1 with the extra options ``odd``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs, start = [], time.time()
    for rank in range(P):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(P)}
        argv = [sys.executable, "-m", "sparsecomm", "train", "--model", "mlp", "--data", "digits", "--method", "topk",
                "--density", "0.1", "--epochs", "2", "--batch-size", "32", "--lr", "0.1", "--collective-timeout",
                str(TIMEOUT), "--runs-dir", os.path.join(tmp, f"runs{rank}"), *(odd if rank == 1 else [])]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        line = next((x for x in err.splitlines() if "error:" in x), err.strip().splitlines()[-1] if err.strip() else "")
        results.append((proc.returncode, time.time() - start, line))
    return results


def agreement() -> None:
    """The synchronizer on models that differ across ranks (P = 3, rank 1 differs), and sparsecomm train
    under env:// (3 ranks) with one option differing on rank 1."""
    from sparsecomm import run_workers

    print("| model on rank 1 | every rank raised | the same message | slowest rank, s | message |")
    print("| --- | --- | --- | --- | --- |")
    for kind in ("extra layer", "same elements, other shapes"):
        results = run_workers(3, _synchronizer_models, kind, timeout=120, stall_timeout=TIMEOUT)
        messages = [m for m, _ in results]
        print(f"| {kind} | {'yes' if all(m != 'built' for m in messages) else 'NO'} | "
              f"{'yes' if len(set(messages)) == 1 else 'NO'} | {max(t for _, t in results):.2f} | {messages[0]} |",
              flush=True)
    print("\n| option on rank 1 | exit status per rank | seconds to the last exit | rank 0's error |")
    print("| --- | --- | --- | --- |")
    for odd in (["--lr", "0.2"], ["--epochs", "3"], ["--batch-size", "64"]):
        with tempfile.TemporaryDirectory() as tmp:
            results = _train_cli(3, odd, tmp)
        print(f"| {' '.join(odd)} | {', '.join(str(code) for code, _, _ in results)} | "
              f"{max(t for _, t, _ in results):.1f} | {results[0][2]} |", flush=True)


# ------------------------------------------------------------------------------------------ resources
def resources() -> None:
    """Threads and file descriptors of one process around 30 hook states (P = 2, each on a DDP model
    with one backward), closed or dropped; then the usage mistakes' messages."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE)))
    import test_hook_resources as hr

    from sparsecomm import run_workers

    print("| rank | threads, fds at the start | after 30 states closed | after 30 states dropped (gc) | "
          "a state after destroying another's group by hand |")
    print("| --- | --- | --- | --- | --- |")
    for rank, r in enumerate(run_workers(2, hr._thirty_states, timeout=600)):
        after = "trained a step" if r["after_destroy"] == 1 else "FAILED"
        print(f"| {rank} | {r['start'][0]}, {r['start'][1]} | {r['closed'][0]}, {r['closed'][1]} | "
              f"{r['collected'][0]}, {r['collected'][1]} | {after} |")
    print("\n| mistake | what the ranks said |")
    print("| --- | --- |")
    message, _ = run_workers(2, hr._missing_hook, timeout=120, stall_timeout=TIMEOUT)[0]
    print(f"| rank 1 registers no hook (timeout {TIMEOUT:g} s), rank 0 | RankStalledError: {message} |")
    messages = run_workers(2, hr._shared_state, timeout=120)
    same = "(the same on every rank) " if len(set(messages)) == 1 else ""
    print(f"| one SparseHookState on two DDP models, every rank | {same}{messages[0]} |")
    sys.path.insert(0, HERE)
    import store_death

    results = store_death.run(3)
    survivors = {text for rank, _, text in results if rank > 0}
    print(f"| rank 0 (hosting the env:// store) dies; ranks 1, 2 after {max(s for _, s, _ in results):.1f} s | "
          f"{'(the same on both) ' if len(survivors) == 1 else ''}{sorted(survivors)[0]} |", flush=True)


# ------------------------------------------------------------------------------------------ outputs
def outputs() -> None:
    """Commands whose output cannot be written (a path under a regular file), and advise's inputs."""
    with tempfile.TemporaryDirectory() as tmp:
        blocker = os.path.join(tmp, "a-file")
        with open(blocker, "w") as handle:
            handle.write("x")
        bad = os.path.join(blocker, "out")
        cases = [
            ["calibrate", "--workers", "2", "--size", "1M", "--out", bad],
            ["train", "--model", "mlp", "--data", "digits", "--workers", "2", "--runs-dir", bad],
            ["train", "--model", "mlp", "--data", "digits", "--workers", "2", "--checkpoint-dir", bad],
            ["demo", "--out", bad],
            ["advise", "--params", "25M", "--workers", "1"],
            ["advise", "--params", "0"],
        ]
        print("| command | exit status | workers started | what it said |")
        print("| --- | --- | --- | --- |")
        for argv in cases:
            out = subprocess.run([sys.executable, "-m", "sparsecomm", "-v", *argv], capture_output=True, text=True,
                                 timeout=600)
            said = [line for line in (out.stderr + out.stdout).splitlines() if line.strip()]
            started = "yes" if any("calibrating" in line or "training" in line for line in said) else "no"
            shown = " ".join(argv).replace(tmp, "...")
            print(f"| sparsecomm {shown} | {out.returncode} | {started} | {said[-1].replace(tmp, '...')} |", flush=True)



PARTS = {"amp": amp, "detect": detect, "checkpoint": checkpoint, "restart": restart, "world": world, "torn": torn,
         "agreement": agreement, "resources": resources, "outputs": outputs}

if __name__ == "__main__":
    if sys.argv[1:2] == ["_torchrun"]:
        _torchrun_main()
    else:
        torch.set_num_threads(1)
        for part in sys.argv[1:] or list(PARTS):
            print(f"\n### {part}\n", flush=True)
            PARTS[part]()
