"""Measuring a :class:`~sparsecomm.app.simulator.Profile`: links, the native all-reduce, selectors,
decompression and each method's per-step work, on this machine (forked workers, loopback or an
emulated ``net``) or on a cluster (this process one rank under ``torchrun``).

Links: ring and Rabenseifner all-reduce of several sizes, timed per call (the slowest rank), each
sample ``(rounds, bytes sent, seconds)`` from the collective's cost formula; alpha and beta by least
squares (:func:`sparsecomm.core.cost.fit_alpha_beta`). With nodes (``LOCAL_WORLD_SIZE`` below the
world size) the same is done inside each node ("intra") and across nodes, one rank per node ("inter");
otherwise the one fit is "intra" (every link here is the same kind).

Methods: each method's call at density d, its wall time minus its own ``time_comm`` is its work
(selection, residual, decompression); the metered bytes over the formula's are its traffic factor;
its ``time_comm`` over the formula's time under the fitted alpha and beta is its comm factor (what the
formula's rounds leave out: size headers and separate index and value messages, per-call setup).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..core.cost import fit_alpha_beta
from ..methods import MethodSpec, cost, is_sparse
from ..methods.base import selection_count
from .simulator import Profile, comm_contention, fit_work, layout_options

__all__ = ["calibrate", "calibration_worker", "fit_links", "measure_selectors", "measure_recv_element",
           "profile_from_records", "refit", "merge_records", "method_runs", "slowest_best", "LINK_SIZES"]

log = logging.getLogger(__name__)

#: element counts of the link-fitting all-reduces
LINK_SIZES = (1_000, 4_000, 16_000, 64_000, 250_000, 1_000_000, 2_000_000)
_LINK_ALGORITHMS = ("ring", "rabenseifner")


def _time_collective(comm, algorithm: str, n: int, repeat: int) -> float:
    """Best over calls of this rank's wall time of one all-reduce of n elements (after a barrier)."""
    import torch.distributed as dist

    from ..transport.collectives import allreduce

    x = torch.ones(n)
    times = []
    for i in range(repeat + 1):
        dist.barrier()
        start = time.perf_counter()
        if algorithm == "native":
            comm.native_all_reduce(x.clone())
        else:
            allreduce(comm, x, algorithm)
        if i:
            times.append(time.perf_counter() - start)
    return min(times)


def _link_samples(comm, kind: str, sizes: Sequence[int], repeat: int) -> list[dict[str, Any]]:
    out = []
    for n in sizes:
        for algorithm in _LINK_ALGORITHMS:
            seconds = _time_collective(comm, algorithm, n, repeat)
            c = cost(algorithm, P=comm.size, n=n, rank=comm.rank)
            out.append({"kind": kind, "algorithm": algorithm, "P": comm.size, "n": n, "rounds": c.rounds,
                        "bytes": c.bytes_sent, "seconds": seconds})
    return out


def calibration_worker(methods: Sequence[str], sizes: Sequence[int], density: float, repeat: int,
                       link_sizes: Sequence[int] = LINK_SIZES, local_size: int | None = None,
                       link_kind: str = "intra") -> dict[str, Any]:
    """Runs in every rank: link, native all-reduce and method timings (this rank's figures).

    ``link_kind`` names the links when the ranks are not split into nodes (forked workers: "intra").
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
        seconds = _time_collective(comm, "native", n, repeat)
        c = cost("dense", P=P, n=n, rank=comm.rank)
        dense.append({"n": n, "rounds": c.rounds, "bytes": c.bytes_sent, "seconds": seconds})
    runs = method_runs(methods, sizes, density, repeat)
    dist.barrier()
    return {"rank": comm.rank, "P": P, "links": links, "dense": dense, "runs": runs}


def method_runs(methods: Sequence[str], sizes: Sequence[int], density: float, repeat: int,
                warmup: int = 1) -> list[dict[str, Any]]:
    """Runs in every rank: each method's call times, ``time_comm`` and bytes at each size (this rank)."""
    from .bench.common import time_method_in_worker

    runs = []
    for n in sizes:
        for name in methods:
            options = dict(MethodSpec.at_density(name, density).options)
            result = time_method_in_worker(name, options, n, repeat, warmup)
            stats = result["stats"]
            runs.append({"method": name, "n": n, "times": result["times"],
                         "time_comm": [s.time_comm for s in stats],
                         "bytes_sent": max(s.bytes_sent for s in stats)})
    return runs


def fit_links(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """kind -> {"alpha", "beta"} from every rank's link samples (the slowest rank's time per sample)."""
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
                 colocated: bool = True) -> dict[str, dict[str, Any]]:
    """Per method and size, estimators of the undisturbed call (this machine is shared; a disturbed
    call is only ever slower, so the least over calls is the estimate):

    * total: :func:`slowest_best`, the statistic the validation measures;
    * work: for each rank the least over calls of its wall time less its own ``time_comm`` (a rank's
      ``time_comm`` includes waiting for its peers' work, its own selection and decompression do not),
      then the largest over ranks (the critical rank); comm: total less work;
    * traffic factor: metered bytes over the formula's (data-dependent counts: the measured density);
    * comm factor: comm, with ``contention`` (:func:`~.simulator.comm_contention` at this P) divided
      out, over the formula's time of the slowest rank under the fitted link (the native all-reduce's
      for dense) alpha and beta at the measured traffic: what the formula's rounds leave out (size
      headers, index and value messages sent apart, per-call setup)."""
    P = records[0]["P"]
    link = links.get("inter", links.get("intra", {"alpha": 0.0, "beta": 0.0}))
    per: dict[str, list[tuple[int, float, float, float, float]]] = {}
    for i, run in enumerate(records[0]["runs"]):
        total = slowest_best(records, i)
        own = max(min(t - c for t, c in zip(r["runs"][i]["times"], r["runs"][i]["time_comm"], strict=True))
                  for r in records)
        work = min(max(0.0, own), total)
        comm = (total - work) / contention
        sent = max(r["runs"][i]["bytes_sent"] for r in records)
        name, n = run["method"], run["n"]
        k = selection_count(density, n) if is_sparse(name) else 0
        layout = layout_options(name, P, net, colocated)  # the workers' node layout
        costs = [cost(name, P=P, n=n, k=k, rank=r, density=density, **layout) for r in range(P)]
        formula = max(c.bytes_sent for c in costs)
        traffic = sent / formula if formula else 1.0
        a, b = (dense["alpha"], dense["beta"]) if name == "dense" and "alpha" in dense else (link["alpha"],
                                                                                              link["beta"])
        modelled = max(c.rounds * a + traffic * c.bytes_sent * b for c in costs)
        comm_factor = comm / modelled if modelled > 0 else 1.0
        per.setdefault(name, []).append((n, work, traffic, comm_factor, comm))
    out = {}
    for name, samples in per.items():
        w1, w0 = fit_work([(n, w) for n, w, *_ in samples])
        out[name] = {"w1": w1, "w0": w0, "traffic_factor": statistics.mean(s[2] for s in samples),
                     "comm_factor": statistics.mean(s[3] for s in samples),
                     "P": P, "density": density, "sizes": sorted({s[0] for s in samples}),
                     "work_s": {str(s[0]): s[1] for s in samples}, "comm_s": {str(s[0]): s[4] for s in samples}}
    return out


def measure_selectors(n: int, density: float, repeat: int = 3) -> dict[str, float]:
    """Seconds per element of each selector picking ``density * n`` of n normal values (this process)."""
    from ..blocks import selectors

    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
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
            start = time.perf_counter()
            sel(x, k)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) / n
    return out


def measure_recv_element(n: int, received: int, repeat: int = 3) -> float:
    """Seconds per received sparse element: scatter-add of ``received`` random pairs into n zeros."""
    gen = torch.Generator().manual_seed(1)
    indices = torch.randint(0, n, (received,), generator=gen)
    values = torch.randn(received, generator=gen)
    out = torch.zeros(n)
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        out.index_add_(0, indices, values)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / received


def profile_from_records(records: Sequence[dict[str, Any]], *, density: float, net: str, device: str,
                         cores: int, colocated: bool, selectors: dict[str, float], recv_element_s: float,
                         meta: dict[str, Any]) -> Profile:
    """The profile from every rank's :func:`calibration_worker` result and the one-process figures."""
    links, dense = fit_links(records), _fit_dense(records)
    contention = comm_contention(records[0]["P"], cores, colocated, net)
    return Profile(net=net, device=device, cores=cores, colocated=colocated, links=links,
                   dense_allreduce=dense, selectors=selectors, recv_element_s=recv_element_s,
                   methods=_fit_methods(records, density, links, dense, contention, net, colocated), meta=meta,
                   records=[dict(r) for r in records])


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
            runs.append({**run, "times": run["times"] + other["times"],
                         "time_comm": run["time_comm"] + other["time_comm"],
                         "bytes_sent": max(run["bytes_sent"], other["bytes_sent"])})
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
        raise ValueError("this profile keeps no raw timings (made before they were stored); calibrate again")
    return profile_from_records(profile.records, density=profile.meta["density"], net=profile.net,
                                device=profile.device, cores=profile.cores, colocated=profile.colocated,
                                selectors=profile.selectors, recv_element_s=profile.recv_element_s,
                                meta=profile.meta)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def calibrate(P: int, methods: Sequence[str], sizes: Sequence[int], density: float, *, net: str | None = None,
              repeat: int = 3, timeout: float = 1800.0) -> Profile:
    """Measure a profile with P forked workers on this machine (loopback, or tc ``net``)."""
    from .launcher import run_workers

    if P < 2:
        raise ValueError(f"-P {P}: calibration needs at least 2 workers to time links")
    log.info("calibrating P=%d on %s: %d methods at n=%s", P, net or "loopback", len(methods), list(sizes))
    records = run_workers(P, calibration_worker, list(methods), list(sizes), density, repeat, net=net,
                          timeout=timeout)
    n_sel = max(sizes)
    return profile_from_records(
        records, density=density, net=net or "loopback", device="cpu", cores=available_cores(),
        colocated=True, selectors=measure_selectors(min(n_sel, 4_000_000), density),
        recv_element_s=measure_recv_element(min(n_sel, 4_000_000), max(1, selection_count(density, n_sel)) * P),
        meta={"P": P, "sizes": list(sizes), "density": density, "repeat": repeat,
              "torch_threads_per_worker": 1, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
