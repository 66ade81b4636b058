"""Measuring a :class:`~sparsecomm.simulator.model.Profile`: links, the native all-reduce, selectors,
decompression and each method's per-step work, on this machine (forked workers, loopback or an
emulated ``net``) or on a cluster (this process one rank under ``torchrun``).

Links: ring and Rabenseifner all-reduce of several sizes, timed per call (the slowest rank), each
sample ``(rounds, bytes sent, seconds)`` from the collective's cost formula; alpha and beta by least
squares (:func:`sparsecomm.core.cost.fit_alpha_beta`), and by the same fit on each call's process CPU
time the CPU a message and a byte moved cost. With nodes (``LOCAL_WORLD_SIZE`` below the world size)
the same is done inside each node ("intra") and across nodes, one rank per node ("inter"); otherwise
the one fit is "intra" (every link here is the same kind).

Methods: each method's call at density d, its wall time minus its own ``time_comm`` is its work,
split by the method's own timers (:class:`~sparsecomm.methods.Stats`) into decompression
(``time_decompress``: the received entries merged into the output, per byte of its sweep), the
agreement (``extra["time_agreement"]``, per round) and the rest (selection, residual, compression:
work over the n gradient elements); the metered bytes over the formula's are its traffic factor;
its ``time_comm`` over the formula's time under the fitted alpha and beta is its comm factor (what
the formula's rounds leave out: size headers and separate index and value messages, per-call setup).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..core.cost import fit_alpha_beta
from ..methods import MethodSpec, cost, dense_warmup, is_sparse
from ..methods.base import selection_count
from .model import (
    Profile,
    agreement_rounds,
    comm_contention,
    decompress_bytes,
    fit_work,
    layout_options,
    touched_entries,
)

__all__ = ["calibrate", "calibrate_local", "local_worker", "local_profile", "calibration_worker", "fit_links",
           "measure_selectors", "measure_selector_fixed",
           "profile_from_records", "refit", "merge_records", "method_runs", "time_method_in_worker", "slowest_best",
           "split_work",
           "LINK_SIZES"]

log = logging.getLogger(__name__)

#: element counts of the link-fitting all-reduces
LINK_SIZES = (1_000, 4_000, 16_000, 64_000, 250_000, 1_000_000, 2_000_000)
_LINK_ALGORITHMS = ("ring", "rabenseifner")


def _time_collective(comm, algorithm: str, n: int, repeat: int) -> tuple[float, float]:
    """(wall, CPU) seconds of this rank's best call (the least wall time, after a barrier) of one
    all-reduce of n elements; the CPU time is this process's (``time.process_time``: its own thread
    and the backend's I/O threads), what P colocated workers share the cores for."""
    import torch.distributed as dist

    from ..transport.collectives import allreduce

    x = torch.ones(n)
    times = []
    for i in range(repeat + 1):
        dist.barrier()
        cpu, start = time.process_time(), time.perf_counter()
        if algorithm == "native":
            comm.native_all_reduce(x.clone())
        else:
            allreduce(comm, x, algorithm)
        if i:
            times.append((time.perf_counter() - start, time.process_time() - cpu))
    return min(times)


def _link_samples(comm, kind: str, sizes: Sequence[int], repeat: int) -> list[dict[str, Any]]:
    out = []
    for n in sizes:
        for algorithm in _LINK_ALGORITHMS:
            seconds, cpu = _time_collective(comm, algorithm, n, repeat)
            c = cost(algorithm, P=comm.size, n=n, rank=comm.rank)
            out.append({"kind": kind, "algorithm": algorithm, "P": comm.size, "n": n, "rounds": c.rounds,
                        "bytes": c.bytes_sent, "bytes_recv": c.bytes_recv, "seconds": seconds, "cpu": cpu})
    return out


def calibration_worker(methods: Sequence[str], sizes: Sequence[int], density: float, repeat: int,
                       link_sizes: Sequence[int] = LINK_SIZES, local_size: int | None = None,
                       link_kind: str = "intra", device: str = "cpu") -> dict[str, Any]:
    """Runs in every rank: link, native all-reduce and method timings (this rank's figures).

    ``link_kind`` names the links when the ranks are not split into nodes (forked workers: "intra").
    ``device`` holds the methods' gradients (``"cuda"``: the work measured is the GPU's; the links are
    timed as they are either way).
    """
    import torch.distributed as dist

    from ..transport.comm import Communicator
    from ..transport.topology import resolve_local_size
    comm = Communicator()
    P = comm.size
    links: list[dict[str, Any]] = []
    if P > 1:
        L = resolve_local_size(P, local_size)
        if 1 < L < P:
            node, cross = comm.split(P // L)
            links += _link_samples(node, "intra", link_sizes, repeat)
            links += _link_samples(cross, "inter", link_sizes, repeat)
        else:
            links += _link_samples(comm, link_kind, link_sizes, repeat)
    dense = []
    for n in sorted(set(link_sizes) | set(sizes)):
        seconds, _ = _time_collective(comm, "native", n, repeat)
        c = cost("dense", P=P, n=n, rank=comm.rank)
        dense.append({"n": n, "rounds": c.rounds, "bytes": c.bytes_sent, "seconds": seconds})
    runs = method_runs(methods, sizes, density, repeat, device=device)
    dist.barrier()
    return {"rank": comm.rank, "P": P, "links": links, "dense": dense, "runs": runs}


def time_method_in_worker(name: str, options: dict[str, Any], n: int, repeat: int, warmup: int,
                          seed: int = 0, layout: Sequence | None = None,
                          grad_fn=None, device: str = "cpu") -> dict[str, Any]:
    """Worker function: build the method, run warm-up and timed calls on a fixed gradient.

    Returns this rank's per-call wall times (each call starts after a barrier) and process CPU times
    (``cpu``: every thread of the process, gloo's included), the calls' stats,
    whether the method agreed after its selection's scan (``agreement_folded``: no pass of its own),
    what of its own rode on the agreement (``agreement_ride``) and the name of its selector
    (``selector``, "" when it has none of its own).
    The gradient and result buffers are allocated once (the result goes ``out=``, as in the
    DDP hook and the synchronizer); each call gets a fresh copy of the gradient made before the clock
    starts. On a CUDA ``device`` the clock stops after the device has finished the call.
    """
    import torch.distributed as dist

    from ..methods import make_method

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    base = (torch.randn(n, generator=gen) if grad_fn is None else grad_fn(n, rank)).to(device)
    work, result = torch.empty_like(base), torch.empty_like(base)
    on_gpu = work.is_cuda
    method = make_method(name, **options)
    times, cpu, stats = [], [], []
    for i in range(warmup + repeat):
        work.copy_(base)
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        method(work, layout, out=result)
        if on_gpu:
            torch.cuda.synchronize(work.device)
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if i >= warmup:
            times.append(elapsed)
            cpu.append(elapsed_cpu)
            stats.append(method.stats)
    folded = method.accumulates and work.device.type == "cpu"
    selector = getattr(getattr(method, "selector", None), "name", "")
    if getattr(method, "samples_threshold", False):  # its threshold estimated from a sample, every call
        selector = SAMPLED_THRESHOLD
    return {"times": times, "cpu": cpu, "stats": stats, "agreement_folded": folded, "selector": selector,
            "agreement_ride": agreement_ride(stats)}


def agreement_ride(stats: Sequence[Any]) -> str:
    """What of a method's own rode on its calls' agreement (:mod:`sparsecomm.methods.runner`):
    ``"gather"`` (its all-gather), ``"ride"`` (SparDL's Spar-Reduce-Scatter) or ``""``."""
    extras = [s.extra for s in stats]
    if any(e.get("gathered_in_agreement") for e in extras):
        return "gather"
    return "ride" if any(e.get("rode_agreement") for e in extras) else ""


def method_runs(methods: Sequence[str], sizes: Sequence[int], density: float, repeat: int,
                warmup: int = 1, device: str = "cpu") -> list[dict[str, Any]]:
    """Runs in every rank: each method's call times and process CPU times, its timers (``time_comm``,
    ``time_select``, ``time_decompress``, the agreement's) and bytes at each size (this rank).
    A method whose first calls are dense by default (:func:`~sparsecomm.methods.dense_warmup`:
    Ok-Topk's ``warmup_steps``) is built without them: what the model predicts, and the validation
    measures, are the calls after its warm-up (with it, every timed call of Ok-Topk was a dense
    all-reduce, its traffic 50x its formula's)."""
    runs = []
    for n in sizes:
        for name in methods:
            options = dict(MethodSpec.at_density(name, density,
                                                 **({"warmup_steps": 0} if dense_warmup(name) else {})).options)
            result = time_method_in_worker(name, options, n, repeat, warmup, device=device)
            stats = result["stats"]
            runs.append({"method": name, "n": n, "times": result["times"], "cpu": result["cpu"],
                         "time_comm": [s.time_comm for s in stats],
                         "time_agreement": [s.extra.get("time_agreement", 0.0) for s in stats],
                         "agreement_folded": result["agreement_folded"], "selector": result["selector"],
                         "agreement_ride": result["agreement_ride"],
                         "time_select": [s.time_select for s in stats],
                         "time_decompress": [s.time_decompress for s in stats],
                         "bytes_sent": max(s.bytes_sent for s in stats),
                         "bytes_per_call": [s.bytes_sent for s in stats]})
    return runs


def fit_links(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """kind -> {"alpha", "beta"} from every rank's link samples (the slowest rank's time per sample),
    and where the samples carry the CPU time, ``cpu_round_s`` and ``cpu_byte_s``: the CPU seconds a
    message and a byte moved (sent or received) cost a process, by the same least squares."""
    slowest: dict[tuple, dict[str, Any]] = {}
    for record in records:
        for s in record["links"]:
            key = (s["kind"], s["algorithm"], s["n"])
            if key not in slowest or s["seconds"] > slowest[key]["seconds"]:
                slowest[key] = s
    out = {}
    for kind in sorted({key[0] for key in slowest}):
        samples = [(s["rounds"], s["bytes"], s["seconds"]) for key, s in slowest.items() if key[0] == kind]
        alpha, beta = fit_alpha_beta(samples)
        out[kind] = {"alpha": alpha, "beta": beta, "samples": len(samples)}
        mine = [s for key, s in slowest.items() if key[0] == kind]
        if all("cpu" in s for s in mine):
            out[kind]["cpu_round_s"], out[kind]["cpu_byte_s"] = fit_alpha_beta(
                [(s["rounds"], s["bytes"] + s["bytes_recv"], s["cpu"]) for s in mine])
    return out


def _fit_dense(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    by_n: dict[int, dict[str, Any]] = {}
    for record in records:
        for s in record["dense"]:
            if s["n"] not in by_n or s["seconds"] > by_n[s["n"]]["seconds"]:
                by_n[s["n"]] = s
    samples = [(s["rounds"], s["bytes"], s["seconds"]) for s in by_n.values()]
    largest = by_n[max(by_n)]
    out = {"rate_gbit": 8 * 4 * largest["n"] / largest["seconds"] / 1e9, "at_n": largest["n"]}
    if records[0]["P"] > 1 and len(samples) >= 2:
        out["alpha"], out["beta"] = fit_alpha_beta(samples)
    return out


def slowest_best(records: Sequence[dict[str, Any]], i: int) -> float:
    """Best (least) over calls of the slowest rank's wall time of run ``i``: the call least disturbed by
    other processes on a shared machine (calibration and validation both use it)."""
    calls = len(records[0]["runs"][i]["times"])
    return min(max(r["runs"][i]["times"][c] for r in records) for c in range(calls))


def _fit_methods(records: Sequence[dict[str, Any]], density: float, links: dict[str, dict[str, float]],
                 dense: dict[str, float], contention: float = 1.0, net: str = "loopback",
                 colocated: bool = True, device: str = "cpu",
                 selector_fixed: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Per method and size, estimators of the undisturbed call (this machine is shared; a disturbed
    call is only ever slower, so the least over calls is the estimate):

    * total: :func:`slowest_best`, the statistic the validation measures;
    * work: for each rank the least over calls of its wall time less its own ``time_comm`` (a rank's
      ``time_comm`` includes waiting for its peers' work, its own selection and decompression do not),
      then the largest over ranks (the critical rank); comm: total less work;
    * decompression: the same estimator on ``time_decompress``, fitted per byte of the blocked
      sweep's memory traffic (``d1``, ``d0``: :func:`~.simulator.decompress_bytes` of the entries the
      rank touches, its own k and the P x k or so it receives), on a GPU ``device`` (no sweep: one
      ``index_add_`` per chunk) per entry touched (:func:`~.simulator.touched_entries`), or per
      gradient element for a dense method;
    * agreement: the least over calls and over ranks of the agreement's time (where recorded: the
      rank that arrives last waits least, so its time is the messages' own), per agreement round
      (``agreement_round_s``; :func:`~.simulator.agreement_rounds` at this P). A method that agrees
      after its selection's scan (``agreement_folded``) spends it all on the rounds (none at all when
      its all-gather rides on the agreement: its time is then the method's comm; where SparDL's
      Spar-Reduce-Scatter rides on it, ``agreement_ride`` "ride", the rounds it agrees apart at other P
      are costed at the folded methods' median per round); one that agrees
      first also makes a pass over the gradient (its finiteness count), so its rounds are costed at
      the folded methods' median per round and the rest stays with the selection, per element;
    * selection: work less decompression and the agreement's rounds, fitted per gradient element
      (``s1``, ``s0``); calibrated at one size, ``s0`` is the fixed part of the method's selector
      (``selector_fixed``: :func:`measure_selector_fixed`, where the run names its selector);
    * CPU: for each rank the least over calls of its process CPU time (every thread: gloo's copies
      and wake-ups as well as the method's work), then the mean over ranks (the cores do every
      rank's: a rank that does more, CLT-k's leader, does not stand for the others), fitted per gradient
      element (``cpu1``, ``cpu0``; where the calibration recorded it, at two sizes or more: at one
      size the CPU's fixed part per call, gloo's threads and the messages' set-up, would be scaled with
      n): what the cores must do for one rank's call, the model's cores'
      estimate (:func:`~.model.cores_seconds`);
    * traffic factor: metered bytes over the formula's (data-dependent counts: the measured density),
      the bytes of the median call (each call's largest over ranks; the calls of a data-dependent
      method vary, ExDyna's threshold controller's around its formula from call to call, and the
      least call, which the estimators and the validation take, is not the one that sent the most,
      so the median stands for them);
    * comm factor: comm, with ``contention`` (:func:`~.simulator.comm_contention` at this P) divided
      out, over the formula's time of the slowest rank under the fitted link (the native all-reduce's
      for dense) alpha and beta at the measured traffic: what the formula's rounds leave out (size
      headers, index and value messages sent apart, per-call setup)."""
    _check_per_call(records)
    P = records[0]["P"]
    link = links.get("inter", links.get("intra", {"alpha": 0.0, "beta": 0.0}))
    per: dict[str, list[tuple[int, float, float, float, float]]] = {}
    decompress: dict[str, dict[int, tuple[float, float]]] = {}  # n -> (sweep bytes, seconds)
    agreement: dict[str, dict[int, float]] = {}
    folded: dict[str, bool] = {}
    ride: dict[str, str] = {}  # what of the method's own rode on its agreement ("gather", "ride", "")
    cpu: dict[str, dict[int, float]] = {}  # n -> a rank's CPU per call (least over calls, mean over ranks)
    selectors = {run["method"]: run.get("selector", "") for run in records[0]["runs"]}
    for i, run in enumerate(records[0]["runs"]):
        name, n = run["method"], run["n"]
        k = selection_count(density, n) if is_sparse(name) else 0
        layout = layout_options(name, P, net, colocated)  # the workers' node layout
        total = slowest_best(records, i)
        own = max(min(t - c for t, c in zip(r["runs"][i]["times"], r["runs"][i]["time_comm"], strict=True))
                  for r in records)
        work = min(max(0.0, own), total)
        seconds = min(work, max(min(r["runs"][i]["time_decompress"]) for r in records))
        units = (decompress_bytes if device == "cpu" else touched_entries)(name, P, n, k, density, layout)
        decompress.setdefault(name, {})[n] = (units, seconds)
        if "cpu" in run:  # the process CPU per call, where the workers could read it
            cpu.setdefault(name, {})[n] = statistics.mean(min(r["runs"][i]["cpu"]) for r in records)
        if "time_agreement" in run:
            # the rank that arrives last waits least: its agreement is the messages' own cost (the others'
            # wait for it is imbalance of the work before, which stays with that work)
            agreement.setdefault(name, {})[n] = min(work, min(min(r["runs"][i]["time_agreement"]) for r in records))
            folded[name] = bool(run.get("agreement_folded"))
            ride[name] = run.get("agreement_ride", "")
        comm = (total - work) / contention
        # the slowest rank's bytes, the median call
        sent = statistics.median(max(r["runs"][i]["bytes_per_call"][c] for r in records)
                                 for c in range(len(run["bytes_per_call"])))
        costs = [cost(name, P=P, n=n, k=k, rank=r, density=density, **layout) for r in range(P)]
        formula = max(c.bytes_sent for c in costs)
        traffic = sent / formula if formula else 1.0
        a, b = (dense["alpha"], dense["beta"]) if name == "dense" and "alpha" in dense else (link["alpha"],
                                                                                              link["beta"])
        modelled = max(c.rounds * a + traffic * c.bytes_sent * b for c in costs)
        comm_factor = comm / modelled if modelled > 0 else 1.0
        per.setdefault(name, []).append((n, work, traffic, comm_factor, comm))
    out = {}
    rounds = agreement_rounds(P)
    # a method whose all-gather rides on the agreement records none of its own (0 s: it is its comm)
    folded_rates = [seconds / rounds for name, by_n in agreement.items() if folded[name] and rounds
                    for seconds in by_n.values() if seconds > 0]
    for name, samples in per.items():
        w1, w0 = fit_work([(n, w) for n, w, *_ in samples])
        out[name] = {"w1": w1, "w0": w0, "traffic_factor": statistics.mean(s[2] for s in samples),
                     "comm_factor": statistics.mean(s[3] for s in samples),
                     "P": P, "density": density, "sizes": sorted({s[0] for s in samples}),
                     "work_s": {str(s[0]): s[1] for s in samples}, "comm_s": {str(s[0]): s[4] for s in samples}}
        if len(cpu.get(name, {})) > 1:  # at one size a fixed part per call cannot be told from the rest
            cpu1, cpu0 = fit_work(list(cpu[name].items()))
            out[name].update(cpu1=cpu1, cpu0=cpu0, cpu_s={str(n): seconds for n, seconds in cpu[name].items()})
        round_s = None
        in_work = rounds  # the agreement's rounds timed apart from the comm at this P
        if name in agreement and rounds:
            measured = agreement[name]
            if ride[name] == "ride":
                # SparDL's messages ride on the agreement: the whole agreement is timed as its comm here, and
                # at other P (not powers of two) it agrees apart: costed at the folded methods' rate per round
                round_s = statistics.median(folded_rates) if folded_rates else None
                in_work = 0
            elif folded[name]:
                round_s = statistics.mean(measured.values()) / rounds
            elif folded_rates:
                round_s = min(statistics.median(folded_rates), min(measured.values()) / rounds)
        if round_s is not None:
            out[name]["agreement_round_s"] = round_s
            if ride.get(name):
                out[name]["agreement_ride"] = ride[name]
        out[name].update(split_work([(n, w) for n, w, *_ in samples], decompress[name],
                                    None if round_s is None else {n: round_s * in_work for n, *_ in samples},
                                    unit="byte" if device == "cpu" else "entry",
                                    fixed=(selector_fixed or {}).get(selectors.get(name, ""), 0.0)))
    return out


def split_work(work: Sequence[tuple[int, float]], decompress: dict[int, tuple[float, float]],
               agreement: dict[int, float] | None = None, unit: str = "byte", fixed: float = 0.0) -> dict[str, Any]:
    """The per-element coefficients of a method's work: ``d1`` seconds per ``unit`` of the
    decompression ("byte" of its sweep's memory traffic, or "entry" touched; ``d0`` fixed), ``s1``
    per gradient element (``s0`` fixed) of the rest (selection,
    residual, compression: the work less the decompression and the agreement's rounds). ``work``:
    (n, seconds) samples; ``decompress``: n -> (units, seconds); ``agreement``: n -> seconds of the
    agreement's rounds (none: the agreement stays in the rest); ``fixed``: the rest's seconds per call
    that do not grow with n (the selector's sample), taken as ``s0`` when ``work`` has one size only
    (two sizes fit ``s0`` themselves). Units 0 (a dense method) fit the decompression per gradient
    element instead (``decompress_per``: ``unit`` or "element")."""
    per_unit = all(units > 0 for units, _ in decompress.values())
    d1, d0 = fit_work([(int(units if per_unit else n), seconds) for n, (units, seconds) in decompress.items()]) \
        if any(seconds > 0 for _, seconds in decompress.values()) else (0.0, 0.0)
    agreement = agreement or {}
    rest = [(n, max(0.0, w - decompress[n][1] - agreement.get(n, 0.0))) for n, w in work]
    if len({n for n, _ in rest}) == 1 and fixed > 0:
        s0 = min(fixed, min(seconds for _, seconds in rest))
        s1, _ = fit_work([(n, seconds - s0) for n, seconds in rest])
    else:
        s1, s0 = fit_work(rest)
    return {"s1": s1, "s0": s0, "d1": d1, "d0": d0, "decompress_per": unit if per_unit else "element",
            "decompress_s": {str(n): seconds for n, (_, seconds) in decompress.items()}}


def _wall(device: str) -> float:
    """``time.perf_counter()`` once the device has finished what it was given."""
    if device != "cpu":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _selector_times(n: int, density: float, repeat: int, device: str) -> dict[str, list[float]]:
    """Each selector's call times picking ``density * n`` of n normal values (this process)."""
    from .. import selection as selectors

    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    k = selection_count(density, n)
    kth = float(torch.topk(x.abs(), k, sorted=False).values.min())
    out = {}
    for name in selectors.available():
        try:
            sel = selectors.make(name)
        except (TypeError, ValueError):  # needs a threshold to start from
            sel = selectors.make(name, threshold=kth)
        sel(x, k)
        times = []
        for _ in range(repeat):
            start = _wall(device)
            sel(x, k)
            times.append(_wall(device) - start)
        out[name] = times
    return out


def measure_selectors(n: int, density: float, repeat: int = 3, device: str = "cpu") -> dict[str, float]:
    """Seconds per element of each selector picking ``density * n`` of n normal values (this process)."""
    return {name: statistics.median(times) / n for name, times in _selector_times(n, density, repeat, device).items()}


def _sampled_threshold_times(n: int, density: float, repeat: int, device: str) -> list[float]:
    """Call times of :func:`~sparsecomm.selection.threshold.estimate_kth_magnitude` on ``x + g`` of n
    normal values (this process), as ExDyna and the adaptive hard threshold call it every step."""
    from ..selection.threshold import estimate_kth_magnitude

    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device)
    k = selection_count(density, n)
    times = []
    for call in range(repeat + 1):
        start = _wall(device)
        estimate_kth_magnitude(x, k, call, addend=g)
        times.append(_wall(device) - start)
    return times[1:]


#: the name under which the one-process fixed parts hold the sampled threshold's (a method whose
#: ``samples_threshold`` is true records it as its selector)
SAMPLED_THRESHOLD = "estimate_kth_magnitude"


def measure_selector_fixed(n: int, density: float, repeat: int = 5, device: str = "cpu") -> dict[str, float]:
    """Seconds per call of each selector that do not grow with n at this density (this process): from
    its least time at n and at n / 4, ``t = fixed + per_element * n``. Selectors that take a sample
    of a size set by the density alone (``exact_topk``'s floor: about 256 / density elements) and a
    top-k of it have such a part; a calibration at one size cannot tell it from the per-element
    work (:func:`split_work`). So has the sampled threshold estimate of ExDyna and the adaptive hard
    threshold (about 1024 / density elements and a k-th value of them; :data:`SAMPLED_THRESHOLD`)."""
    large = _selector_times(n, density, repeat, device)
    small = _selector_times(n // 4, density, repeat, device)
    large[SAMPLED_THRESHOLD] = _sampled_threshold_times(n, density, repeat, device)
    small[SAMPLED_THRESHOLD] = _sampled_threshold_times(n // 4, density, repeat, device)
    return {name: min(max(0.0, (4 * min(small[name]) - min(times)) / 3), min(times)) for name, times in large.items()}


def measure_block_topk(n: int, density: float, repeat: int = 5, device: str = "cpu") -> dict[str, float]:
    """Seconds of one block's top-k as SparDL's Spar-Reduce-Scatter takes it (this process):
    :meth:`~sparsecomm.methods.spardl.srs.BlockSelector.take` with its default selector (``exact_topk``)
    of the block's share of k, out of an accumulator of n elements, for blocks of n / 2 and n / 8;
    the least of ``repeat`` calls each, fitted as ``t = per_element * size + per_block``. The simulator
    costs the change of a method's :meth:`~sparsecomm.methods.base.Method.topk_blocks` with P by it
    (:func:`~.model.block_topk_seconds`)."""
    from ..methods.spardl.srs import Accumulator, BlockSelector
    from ..selection import make as make_selector

    base = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(device)
    work = Accumulator(base.clone())
    blocks = BlockSelector(make_selector("exact_topk"))
    samples = []
    for size in (n // 2, n // 8):
        best = math.inf
        for _ in range(repeat + 1):
            work.tensor.copy_(base)
            start = _wall(device)
            blocks.take(work, 0, size, selection_count(density, size), journal=False)
            best = min(best, _wall(device) - start)
        samples.append((size, best))
    per_element, per_block = fit_work(samples)
    return {"per_element": per_element, "per_block": max(0.0, per_block)}


def profile_from_records(records: Sequence[dict[str, Any]], *, density: float, net: str, device: str,
                         cores: int, colocated: bool, selectors: dict[str, float], meta: dict[str, Any],
                         selector_fixed_s: dict[str, float] | None = None,
                         block_topk_s: dict[str, float] | None = None) -> Profile:
    """The profile from every rank's :func:`calibration_worker` result and the one-process figures."""
    links, dense = fit_links(records), _fit_dense(records)
    contention = comm_contention(records[0]["P"], cores, colocated, net)
    return Profile(net=net, device=device, cores=cores, colocated=colocated, links=links,
                   dense_allreduce=dense, selectors=selectors,
                   methods=_fit_methods(records, density, links, dense, contention, net, colocated, device,
                                        selector_fixed_s),
                   selector_fixed_s=dict(selector_fixed_s or {}), block_topk_s=dict(block_topk_s or {}), meta=meta,
                   records=[dict(r) for r in records])


#: a method run's per-call lists besides ``times`` and ``time_comm``
_PER_CALL = ("time_select", "time_decompress", "time_agreement", "cpu", "bytes_per_call")


#: the per-call lists every method run must hold: its time, its communication, its decompression
#: (the split of the work the model rests on) and its bytes (the median call's traffic)
_REQUIRED = ("times", "time_comm", "time_decompress", "bytes_per_call")


def _check_per_call(records: Sequence[dict[str, Any]]) -> None:
    """ValueError unless every method run of every rank holds the per-call lists the fit needs."""
    for record in records:
        for run in record["runs"]:
            missing = [key for key in _REQUIRED if key not in run]
            if missing:
                raise ValueError(f"the calibration's records of {run['method']} at n={run['n']} lack "
                                 f"{', '.join(missing)}: they were made by an older sparsecomm; calibrate again")


def merge_records(first: Sequence[dict[str, Any]], second: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two calibrations' raw timings (same P, methods and sizes) as one: every method's calls of both
    (so the least over calls is taken over both), and each link and all-reduce sample's least time.

    A shared machine's load changes by the minute; calibrating at several times and merging keeps
    the calibration from resting on one busy minute."""
    if len(first) != len(second) or first[0]["P"] != second[0]["P"]:
        raise ValueError(f"cannot merge calibrations at P={first[0]['P']} and P={second[0]['P']}")
    merged = []
    for a, b in zip(first, second, strict=True):
        runs_b = {(run["method"], run["n"]): run for run in b["runs"]}
        if set(runs_b) != {(run["method"], run["n"]) for run in a["runs"]}:
            raise ValueError("cannot merge calibrations of different methods or sizes")
        runs = []
        for run in a["runs"]:
            other = runs_b[(run["method"], run["n"])]
            timers = {key: run[key] + other[key] for key in _PER_CALL if key in run and key in other}
            runs.append({**{key: value for key, value in run.items() if key not in _PER_CALL},
                         "times": run["times"] + other["times"], "time_comm": run["time_comm"] + other["time_comm"],
                         **timers, "bytes_sent": max(run["bytes_sent"], other["bytes_sent"])})
        links = {(s["kind"], s["algorithm"], s["n"]): s for s in a["links"]}
        for s in b["links"]:
            key = (s["kind"], s["algorithm"], s["n"])
            if key not in links or s["seconds"] < links[key]["seconds"]:
                links[key] = s
        dense = {s["n"]: s for s in a["dense"]}
        for s in b["dense"]:
            if s["n"] not in dense or s["seconds"] < dense[s["n"]]["seconds"]:
                dense[s["n"]] = s
        merged.append({**a, "links": list(links.values()), "dense": list(dense.values()), "runs": runs})
    return merged


def refit(profile: Profile) -> Profile:
    """The profile fitted again from the raw timings it keeps (``records``): a change of the
    estimators applies to an old calibration without measuring again."""
    if not profile.records:
        raise ValueError("this profile keeps no raw timings to fit again; calibrate again")
    return profile_from_records(profile.records, density=profile.meta["density"], net=profile.net,
                                device=profile.device, cores=profile.cores, colocated=profile.colocated,
                                selectors=profile.selectors,
                                selector_fixed_s=profile.selector_fixed_s, block_topk_s=profile.block_topk_s,
                                meta=profile.meta)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def device_name(device: str) -> str:
    """``"cpu"``, or ``"cuda (<the GPU's name>)"``: the profile's device, as simulate prints it."""
    return "cpu" if device == "cpu" else f"cuda ({torch.cuda.get_device_name(device)})"


def calibrate(P: int, methods: Sequence[str], sizes: Sequence[int], density: float, *, net: str | None = None,
              repeat: int = 3, timeout: float = 1800.0, device: str = "cpu") -> Profile:
    """Measure a profile with P forked workers on this machine (loopback, or tc ``net``).

    ``device="cuda"``: the workers run the methods on CUDA tensors of the one GPU (gloo, staged through
    host copies: NCCL refuses two ranks on one device), so the work terms are the GPU's, measured with
    the P workers sharing it (an upper bound for one GPU per worker); the links are this machine's
    loopback, which projections replace with ``--alpha``/``--bandwidth`` and ``--formula-comm``.
    """
    from ..launch.launcher import run_workers

    if P < 2:
        raise ValueError(f"-P {P}: calibration needs at least 2 workers to time links")
    log.info("calibrating P=%d on %s, %s: %d methods at n=%s", P, net or "loopback", device, len(methods),
             list(sizes))
    records = run_workers(P, calibration_worker, list(methods), list(sizes), density, repeat, LINK_SIZES, None,
                          "intra", device, net=net, timeout=timeout)
    n_sel = max(sizes)
    # the workers are gone: only now may this process start CUDA (a forked child of a CUDA process cannot)
    gpu = device != "cpu"
    return profile_from_records(
        records, density=density, net=net or "loopback", device=device_name(device),
        cores=1 if gpu else available_cores(), colocated=not gpu,
        selectors=measure_selectors(n_sel if gpu else min(n_sel, 4_000_000), density, device=device),
        selector_fixed_s=measure_selector_fixed(n_sel if gpu else min(n_sel, 4_000_000), density, device=device),
        block_topk_s=measure_block_topk(n_sel, density, device=device),
        meta={"P": P, "sizes": list(sizes), "density": density, "repeat": repeat,
              "torch_threads_per_worker": 1, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})


# ---------------------------------------------------------------------- one GPU, simulated peers
#: where a method's own selection comes from when it names no selector of its own (the messages of
#: the simulated peers are cut the same way)
_PEER_SELECTOR = "exact_topk"


def _peer_chunks(selector_name: str, gradients: torch.Tensor, peers: int, k: int, device: str
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The ``peers`` simulated ranks' messages: ``k`` entries each (the selector's picks of one of the
    saved gradients, in turn), indices increasing, on ``device``."""
    from ..selection import make as make_selector

    selector = make_selector(selector_name if selector_name else _PEER_SELECTOR)
    indices, values = [], []
    for p in range(peers):
        g = gradients[p % gradients.shape[0]].to(device)
        picked = torch.sort(selector(g, k)).values
        indices.append(picked)
        values.append(g.index_select(0, picked))
    return indices, values


def _decompress_seconds(out: torch.Tensor, indices: list[torch.Tensor], values: list[torch.Tensor], repeat: int,
                        fused: bool) -> float:
    """The least of ``repeat`` calls' wall time of one decompression of the chunks into ``out``: the
    torch path every method takes (:func:`~sparsecomm.transport.merge.average_into`), or the sorted
    chunks' one-kernel merge (:func:`~sparsecomm.transport.merge.average_sorted_into`)."""
    from ..transport.merge import average_into, average_sorted_into

    merge = average_sorted_into if fused else average_into
    stale: Any = "all"
    best = math.inf
    for i in range(repeat + 1):
        start = _wall(str(out.device))
        stale, _ = merge(out, indices, values, len(indices), stale=stale)
        seconds = _wall(str(out.device)) - start
        if i:
            best = min(best, seconds)
    return best


def local_worker(methods: Sequence[tuple[str, dict[str, Any]]], density: float, gradients_path: str, peers: int,
                 repeat: int, device: str) -> dict[str, Any]:
    """Runs in one forked worker (a world of one): each method's calls on the first saved gradient
    (its own work: selection, residual, packing, its own decompression; ``time_comm`` is that of a
    world of one, subtracted), and the decompression of ``peers`` simulated ranks' messages (the
    method's selector's picks of the saved gradients, in turn: what its output merges at P = peers)
    by both merges. ``methods``: (name, options) pairs."""
    import torch.distributed as dist

    from ..methods.base import selection_count

    saved = torch.load(gradients_path, mmap=True, weights_only=True)
    gradients = saved["gradients"]
    layout = [tuple(int(v) for v in span) for span in saved.get("layout", [])] or None
    n = gradients.shape[1]
    own = gradients[0].to(device)
    k = selection_count(density, n)
    runs = []
    for name, extra in methods:
        options = dict(MethodSpec.at_density(name, density,
                                             **({"warmup_steps": 0} if dense_warmup(name) else {}), **extra).options)
        result = time_method_in_worker(name, options, n, repeat, 1, layout=layout,
                                       grad_fn=lambda _n, _rank: own, device=device)
        stats = result["stats"]
        entry = {"method": name, "options": extra, "n": n, "times": result["times"],
                 "time_comm": [s.time_comm for s in stats], "time_select": [s.time_select for s in stats],
                 "time_decompress": [s.time_decompress for s in stats], "selector": result["selector"],
                 "bytes_sent": max(s.bytes_sent for s in stats)}
        if is_sparse(name):
            selector = result["selector"] if result["selector"] != SAMPLED_THRESHOLD else ""
            indices, values = _peer_chunks(selector, gradients, peers, k, device)
            out = torch.empty(n, device=device)
            entry["peers"] = peers
            entry["received"] = sum(int(i.numel()) for i in indices)
            entry["decompress_torch_s"] = _decompress_seconds(out, indices, values, repeat, fused=False)
            entry["decompress_fused_s"] = _decompress_seconds(out, indices, values, repeat, fused=True)
            del out, indices, values
        runs.append(entry)
        if device != "cpu":
            torch.cuda.empty_cache()
    dist.barrier()
    return {"rank": 0, "P": 1, "n": n, "layout_layers": 0 if layout is None else len(layout), "runs": runs}


def local_profile(record: dict[str, Any], *, density: float, device: str, selectors: dict[str, float],
                  selector_fixed_s: dict[str, float], block_topk_s: dict[str, float],
                  meta: dict[str, Any], fused_decompression: bool = True) -> Profile:
    """The profile of one GPU's local work with simulated peers (:func:`local_worker`'s record): per
    method, its work less its own decompression per gradient element (``s1``: selection, residual,
    packing), and the decompression per entry touched (``d1``), from the merge of the peers'
    ``P x k`` entries (the one-kernel merge of sorted chunks with ``fused_decompression``, else the
    torch path the methods take); ``P`` = 1, no link figures (projections take ``--alpha`` and
    ``--bandwidth`` and the formulas' traffic: ``simulate --formula-comm``)."""
    methods: dict[str, dict[str, Any]] = {}
    for run in record["runs"]:
        n = run["n"]
        work = min(t - c for t, c in zip(run["times"], run["time_comm"], strict=True))
        own_decompress = min(run["time_decompress"]) if run["time_decompress"] else 0.0
        entry: dict[str, Any] = {"P": 1, "density": density, "traffic_factor": 1.0, "n": [n],
                                 "work_s": {str(n): work}, "peers_simulated": run.get("peers", 0)}
        if "received" in run:
            merged = run["decompress_fused_s" if fused_decompression else "decompress_torch_s"]
            d1 = merged / max(1, run["received"])
            entry.update({"s1": max(0.0, work - own_decompress) / n, "s0": 0.0, "d1": d1, "d0": 0.0,
                          "decompress_per": "entry",
                          "decompress_s": {str(n): own_decompress},
                          "peers_decompress_s": {"torch": run["decompress_torch_s"],
                                                 "fused": run["decompress_fused_s"],
                                                 "entries": run["received"]}})
        else:
            entry.update({"w1": work / n, "w0": 0.0})
        methods[run["method"]] = entry
    return Profile(net="simulated peers (no links measured)", device=device, cores=1, colocated=False, links={},
                   dense_allreduce={}, selectors=selectors, methods=methods,
                   selector_fixed_s=dict(selector_fixed_s), block_topk_s=dict(block_topk_s), meta=meta,
                   records=[record])


def calibrate_local(methods: Sequence[tuple[str, dict[str, Any]]], density: float, gradients_path: str, *,
                    peers: int = 8, repeat: int = 5, device: str = "cuda", meta: dict[str, Any] | None = None,
                    timeout: float = 1800.0) -> Profile:
    """A profile of one device's local work per call on a saved gradient, with ``peers`` simulated
    ranks' messages to decompress (:func:`local_worker` in one forked worker, then the selectors in
    this process). The gradients file (``torch.save``): ``{"gradients": float32 [G, n], "layout":
    [(offset, numel), ...]}``, G >= 1 saved gradients (the first is this rank's; the peers' messages
    are cut from them in turn)."""
    from ..launch.launcher import run_workers

    if peers < 1:
        raise ValueError(f"--peers {peers} must be >= 1")
    saved = torch.load(gradients_path, mmap=True, weights_only=True)
    if not isinstance(saved, dict) or "gradients" not in saved or saved["gradients"].dim() != 2:
        raise ValueError(f"{gradients_path}: not a saved gradients file "
                         "({'gradients': a [G, n] tensor, 'layout': [(offset, numel), ...]})")
    n = int(saved["gradients"].shape[1])
    del saved
    record = run_workers(1, local_worker, list(methods), density, gradients_path, peers, repeat, device,
                         timeout=timeout)[0]
    # the worker is gone: only now may this process start CUDA (a forked child of a CUDA process cannot)
    return local_profile(
        record, density=density, device=device_name(device),
        selectors=measure_selectors(n, density, device=device),
        selector_fixed_s=measure_selector_fixed(n, density, device=device),
        block_topk_s=measure_block_topk(n, density, device=device),
        meta={"P": 1, "peers": peers, "sizes": [n], "density": density, "repeat": repeat,
              "gradients": os.path.basename(gradients_path),
              "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), **(meta or {})})
