"""Step-time simulator: communication from each method's cost formula plus measured per-step work.

A method's predicted time for one call on a flat gradient of ``n`` elements at ``P`` workers is

    T = max(comm + work, cores)   (cores: P colocated workers on fewer cores, :func:`cores_seconds`)
    comm = f * (rounds * alpha * c_s + link_contention(P) * traffic_factor * bytes_sent * beta) + excess * c_s
           - burst + shared_cpu(cpu_comm(P, n), wire, c_r)
           (rounds, bytes_sent: the slowest of a few sampled ranks; wire: the bytes' term less the burst)
    work = (s1 * n + s0 + blocks(P, n) - blocks(P_cal, n) + d1 * swept(P, n) + d0 + a_r * agreement_rounds(P))
           * contention(P) / contention(P_cal)

* ``rounds`` and ``bytes_sent`` come from the formula registered with the method
  (:func:`sparsecomm.methods.cost`); the dense method (the backend's own all-reduce) uses the
  profile's alpha and beta fitted on that all-reduce instead of the point-to-point ones.
* ``traffic_factor``: the calibration's median call's metered bytes over the formula's (1 for exact
  formulas; below 1 where the formula is an upper bound). Without a profile it is 1.
* Work is modelled by what it touches, each part fitted over the calibrated sizes at ``P_cal``:
  ``s1``, ``s0`` the selection, residual and compression per gradient element and per call (at one
  size ``s0`` is the method's selector's fixed part measured in one process,
  ``Profile.selector_fixed_s``, since one size cannot tell the two apart); ``d1``, ``d0`` the
  decompression per byte of its blocked sweep's memory traffic (:func:`decompress_bytes`), or per
  entry touched (a GPU calibration, no sweep), or per gradient element (a dense method); ``a_r`` the
  agreement per round (:func:`agreement_rounds`: none where the method's first message travels in
  it); ``blocks`` SparDL's top-k selections of one block each, more of them as P grows
  (:func:`block_topk_seconds`).
* ``cores``: where P colocated workers share fewer cores than in the calibration, nothing is idle,
  so the cores do every rank's CPU (the calibrated process CPU per call plus what P adds by the
  model) and the wire passes on top (:func:`cores_seconds`); the larger of it and the critical path
  ``comm + work`` is the prediction. It needs the CPU fitted at two sizes or more: at one size its
  fixed part per call cannot be told from the part that grows with n.
* ``contention(P)`` is ``max(1, P / cores)`` when the P workers share one machine of ``cores``
  cores (as in a local validation), 1 for a cluster with a device per worker; ``c_r`` is
  ``contention(P) / contention(P_cal)``. ``compute_scale`` (an assumption the user gives, e.g. a
  GPU's memory bandwidth over this machine's) divides the work term.
* ``excess`` and ``f`` compare the method's measured communication time at ``P_cal`` with the
  formula's. A longer measurement leaves out something the formula does not count: under an
  emulated rate, where the messages' CPU is its own term, a cost per call (set-up, CPU work inside
  the communication's timers, the wait for a peer's imbalance), added once at any P; on loopback a
  cost per message (size headers, index and value messages sent apart, a peer's wake-up), scaled by
  rounds(P) / rounds(P_cal). A shorter one scales the formula down (``f``, the profile's
  ``comm_factor``), except under an emulated rate, where the difference is the token bucket's burst,
  a fixed credit per call (``burst``). All of these are the profile's network's: with a given alpha
  and beta, excess = 0 and f = 1 (the traffic factor still applies).
* ``link_contention(P)`` (:func:`comm_contention`) is ``P / cores`` on loopback with colocated
  workers (a byte over loopback is a kernel copy: CPU work the P processes share), 1 under a rate
  limit.
* The messages' CPU (gloo's work per message, the copies of the bytes, waking the peer) is shared by
  the P colocated processes. Under an emulated rate the calibration fits it per message and per byte
  (``cpu_comm(P, n)``, :func:`comm_cpu_seconds`, by the method's cost formula) and :func:`shared_cpu`
  adds what the contention makes of it: ``(c_r - 1)`` times the per-message part (on the call's
  path), and of the per-byte part (spread over the transfer) only what ``c_r`` times it takes beyond
  the wire time; the rounds keep their time (``c_s = 1``). A single factor per method on that CPU
  (the call's CPU less its own work, over the fitted figure) would divide milliseconds of process
  CPU time by a fraction of one: it is noise, and the fit per message and byte replaces it. On
  loopback, where ``link_contention`` already counts the bytes' copies, each round's fixed cost is
  taken as CPU time: ``c_s = c_r``, no ``cpu_comm`` term.
* ``overlap`` in [0, 1] with a backward time ``backward_s``: the fraction of communication that can
  run behind backward, hidden up to the backward time (the overlapped DDP hook).
  ``T = work + comm - min(overlap * comm, backward_s)``.

The :class:`Profile` is the JSON that ``sparsecomm calibrate`` writes; :mod:`.calibration` measures it.
How far the model holds: docs/simulator.md.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.cost import METHOD_COSTS, fit_alpha_beta
from ..methods import available_methods, cost, is_sparse, method_class
from ..methods.base import selection_count
from ..transport.merge import IN_PLACE_SHARE

__all__ = ["Profile", "Prediction", "predict", "predict_comm", "check_methods", "UnknownMethodError",
           "fit_work", "comm_contention", "layout_options", "PROFILE_VERSION", "speedup_table", "crossover",
           "faster_range", "plot_projection", "touched_entries", "work_seconds", "agreement_rounds",
           "decompress_bytes", "comm_cpu_seconds", "shared_cpu", "tc_rate", "cores_seconds", "block_topk_seconds",
           "mean_comm_cpu_seconds", "powersgd_seconds"]

PROFILE_VERSION = 1

#: what a method's fit in a profile holds: its work split into selection and decompression
SPLIT_WORK = ("s1", "s0", "d1", "d0", "decompress_per")

class UnknownMethodError(ValueError):
    """A method name that is not in :func:`available_methods`."""


def check_methods(names: Iterable[str]) -> list[str]:
    """The names, or :class:`UnknownMethodError` naming the first unknown one and the valid names."""
    known = available_methods()
    out = []
    for name in names:
        name = name.strip()
        if name not in known:
            raise UnknownMethodError(f"unknown method {name!r}; valid names: {', '.join(known)}")
        out.append(name)
    return out


@dataclass
class Profile:
    """What ``sparsecomm calibrate`` measured on one machine and network (JSON round trip)."""

    net: str = "loopback"
    device: str = "cpu"
    cores: int = 1
    colocated: bool = True
    #: link kind ("intra", "inter") -> {"alpha": s per round, "beta": s per byte}
    links: dict[str, dict[str, float]] = field(default_factory=dict)
    #: the backend's own all-reduce (dense): alpha, beta fitted on the ring formula, and its rate
    dense_allreduce: dict[str, float] = field(default_factory=dict)
    #: selector name -> seconds per element (one process, this device)
    selectors: dict[str, float] = field(default_factory=dict)
    #: selector name -> seconds per call that do not grow with n at the calibration's density
    selector_fixed_s: dict[str, float] = field(default_factory=dict)
    #: one block's top-k as SparDL takes it (one process): {"per_element": s, "per_block": s}
    block_topk_s: dict[str, float] = field(default_factory=dict)
    #: method -> its fit at P_cal: {"s1", "s0", "d1", "d0", "decompress_per", "traffic_factor", "P", ...}
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    #: every rank's raw calibration timings (links, native all-reduce, method calls): a refit source
    records: list[dict[str, Any]] = field(default_factory=list)
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        unsplit = sorted(name for name, fit in self.methods.items() if not set(SPLIT_WORK) <= set(fit))
        if unsplit:
            raise ValueError(f"no split of the work into selection and decompression for {', '.join(unsplit)} "
                             "(a calibration by an older sparsecomm): calibrate again with `sparsecomm calibrate`")

    @property
    def alpha(self) -> float:
        return self._link()["alpha"]

    @property
    def beta(self) -> float:
        return self._link()["beta"]

    def _link(self) -> dict[str, float]:
        if not self.links:
            raise ValueError("profile has no link measurements")
        return self.links.get("inter", self.links.get("intra", next(iter(self.links.values()))))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"profile {str(path)!r} cannot be read as JSON: {err}") from None
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile {str(path)!r} is not a version-{PROFILE_VERSION} sparsecomm profile "
                             "(make one with `sparsecomm calibrate`)")
        names = set(cls.__dataclass_fields__)
        try:
            return cls(**{key: value for key, value in data.items() if key in names})
        except ValueError as err:
            raise ValueError(f"profile {str(path)!r}: {err}") from None


@dataclass(frozen=True)
class Prediction:
    """One method's predicted call time at (P, n), its parts, and what it rests on."""

    method: str
    P: int
    n: int
    density: float
    comm_s: float
    work_s: float
    hidden_s: float
    rounds: int
    bytes_sent: float
    exact: bool
    rests_on: str

    @property
    def total_s(self) -> float:
        return self.comm_s + self.work_s - self.hidden_s


#: how a profile's decompression term is counted (``decompress_per``), as "rests on" names it
_DECOMPRESS_UNIT = {"entry": "entry touched", "byte": "byte swept", "element": "gradient element"}


def comm_contention(P: int, cores: int, colocated: bool, net: str) -> float:
    """How many times slower the links get when P colocated workers share ``cores`` cores on loopback.

    On loopback a "link" is a copy through the kernel by the sending and the receiving process: CPU
    work, so P processes on ``cores`` cores each get ``cores / P`` of a core (factor ``P / cores``).
    Under an emulated rate (``net`` a tc rate) or on a cluster the link's rate bounds it instead (1).
    """
    return max(1.0, P / cores) if colocated and net == "loopback" else 1.0


def tc_rate(net: str) -> bool:
    """Whether a profile's network is an emulated rate (``sparsecomm.launch.netemu``: a tc token
    bucket per link, e.g. "1gbit", "2x4:1gbit"), not loopback or a torchrun job's own network."""
    return net != "loopback" and not net.startswith("torchrun")


def layout_options(name: str, P: int, net: str, colocated: bool) -> dict[str, Any]:
    """The node layout the workers run in, for the formulas that depend on it (``local_size``).

    :func:`~sparsecomm.launch.launcher.run_workers` on loopback puts all P workers on one node (L = P:
    hitopk's first stage is a dense reduce-scatter, twolevel a tree over all ranks); under a plain tc
    rate, and in a projection to a cluster, every rank is its own node (L = 1)."""
    is_sparse(name)  # loads the formulas (ValueError naming the known methods)
    if "local_size" not in inspect.signature(METHOD_COSTS.get(name)).parameters:
        return {}
    return {"local_size": P if net == "loopback" and colocated else 1}


def _sample_ranks(P: int) -> list[int]:
    return sorted({0, 1 % P, P // 2, P - 1})


def _received_elements(name: str, P: int, n: int, k: int, density: float, options: dict[str, Any]) -> float:
    """Sparse (index, value) pairs one rank receives per call, from the formula (0 for dense methods)."""
    if not is_sparse(name) or P == 1:
        return 0.0
    c = cost(name, P=P, n=n, k=k, rank=0, density=density, **options)
    pair = 8 if n < 2 ** 31 else 12
    return c.bytes_recv / pair


def agreement_rounds(P: int, ride: str = "") -> int:
    """Messages each rank sends in a call's agreement that are not the method's own
    (:func:`~sparsecomm.transport.control.max_all_reduce`, a dissemination: ceil(log2 P) steps of
    one small header; 0 for one worker). ``ride``: what of the method's rides on the agreement where
    it agrees after its scan on gloo (the calibration's ``agreement_ride``): ``"gather"``, its
    all-gather, every step (0 of its own); ``"ride"``, SparDL's Spar-Reduce-Scatter, every step where
    P is a power of two (0 of its own; elsewhere it agrees apart)."""
    if ride == "gather" or (ride == "ride" and P & (P - 1) == 0):
        return 0
    return math.ceil(math.log2(P)) if P > 1 else 0


def decompress_bytes(name: str, P: int, n: int, k: int, density: float, options: dict[str, Any]) -> float:
    """Memory traffic (bytes) of one call's decompression, the blocked sweep of
    :func:`~sparsecomm.transport.merge.average_into` over the output, for the ``m``
    :func:`touched_entries`: the pairs read once (``m`` x 8 bytes, 12 past 2^31 elements), and the
    output's cache lines (16 float32 elements, 64 bytes): with ``m`` entries spread over ``n``, a share
    ``1 - exp(-16 m / n)`` of the lines is touched; a block with more than
    :data:`~sparsecomm.transport.merge.IN_PLACE_SHARE` (1/6) of its lines touched is streamed out whole
    (each line written once), a sparser one has its touched lines read and written in place (the
    cut-over's own break-even: a touched line costs about six streamed ones). Output:
    ``4 n x min(1, share / IN_PLACE_SHARE)`` bytes, at most one write of the output however many
    entries arrive. 0 for a dense method."""
    m = touched_entries(name, P, n, k, density, options)
    if m <= 0 or n <= 0:
        return 0.0
    pair = 8 if n < 2 ** 31 else 12
    touched_share = 1.0 - math.exp(-16.0 * m / n)
    return pair * m + 4.0 * n * min(1.0, touched_share / IN_PLACE_SHARE)


def _messages_cpu(name: str, P: int, n: int, density: float, link: dict[str, float], options: dict[str, Any],
                  ranks: Iterable[int]) -> list[tuple[float, float]]:
    """Each of ``ranks``' (per message, per byte) CPU seconds at (P, n) by the method's cost formula."""
    k = selection_count(density, n) if is_sparse(name) else 0
    out = []
    for rank in ranks:
        c = cost(name, P=P, n=n, k=k, rank=rank, density=density, **options)
        out.append((link["cpu_round_s"] * c.rounds, link["cpu_byte_s"] * (c.bytes_sent + c.bytes_recv)))
    return out


def comm_cpu_seconds(name: str, P: int, n: int, density: float, link: dict[str, float],
                     options: dict[str, Any]) -> tuple[float, float]:
    """CPU seconds the messages cost the slowest sampled rank at (P, n), by the link's CPU fit
    (:func:`~.calibration.fit_links`, on the calibration's all-reduces) and the method's cost
    formula: (``cpu_round_s`` per message, ``cpu_byte_s`` per byte sent or received)."""
    worst = (0.0, 0.0)
    for parts in _messages_cpu(name, P, n, density, link, options, _sample_ranks(P)):
        if sum(parts) >= sum(worst):
            worst = parts
    return worst


def mean_comm_cpu_seconds(name: str, P: int, n: int, density: float, link: dict[str, float],
                          options: dict[str, Any]) -> tuple[float, float]:
    """:func:`comm_cpu_seconds` of the mean rank, not the slowest: what the cores spend on one rank's
    messages on average (CLT-k's leader, the root of its broadcast, sends more than the others, and the
    cores do every rank's share). Over every rank up to P = 64, over the sampled ranks beyond."""
    parts = _messages_cpu(name, P, n, density, link, options, range(P) if P <= 64 else _sample_ranks(P))
    return sum(x for x, _ in parts) / len(parts), sum(y for _, y in parts) / len(parts)


def shared_cpu(comm_cpu: tuple[float, float], wire_s: float, c_r: float) -> float:
    """The time the communication's CPU adds when ``c_r`` times as many processes share each core as
    in the calibration: the messages' fixed CPU (``comm_cpu[0]``: set-up, wake-ups) lies on the
    call's path, ``(c_r - 1)`` times it; the bytes' CPU (``comm_cpu[1]``: copies, spread over the
    transfer) overlaps the rate-limited wire's ``wire_s`` and adds only what the shared CPU takes
    beyond the longer of the two (which the calibrated time already holds)."""
    per_message, per_byte = comm_cpu
    return (c_r - 1) * per_message + max(0.0, c_r * per_byte - max(wire_s, per_byte))


def cores_seconds(calib: dict[str, Any], name: str, P: int, n: int, density: float, options: dict[str, Any],
                  calib_options: dict[str, Any], link: dict[str, float], wire_s: float, c_r: float,
                  block_topk: dict[str, float] | None = None, scan: bool = True) -> float | None:
    """The cores' estimate of a call at (P, n) where the P colocated workers share the cores ``c_r``
    times as densely as in the calibration (``contention(P) / contention(P_cal)``): the cores do
    every rank's CPU, ``c_r`` times the mean rank's, and the wire's time passes on top (the exchange
    waits on it, the cores idle; an all-gather's ranks all wait at once), except the copies of the
    bytes, which run while the bytes move:

        cores = c_r * (cpu(P, n) - bytes_cpu(P, n)) + max(wire_s, c_r * bytes_cpu(P, n))

    ``cpu(P, n)``: a rank's process CPU per call as calibrated at P_cal (``cpu1 * n + cpu0``, the
    mean over ranks: every thread, gloo's included, which the critical path at P_cal hides on a core
    the other rank leaves idle) plus what P adds to it by the model: the work's growth
    (:func:`work_seconds`: the decompression's sweep, the agreement's rounds, SparDL's blocks' top-k)
    and the mean rank's messages' (:func:`mean_comm_cpu_seconds`, per message and per byte).
    ``bytes_cpu``: the latter's per-byte part at P. ``None`` where the profile has no CPU fit: a
    calibration at one size (whose CPU's fixed part per call cannot be told from the part that grows
    with n) or on a network without a rate limit (no CPU fit of the link).
    """
    if "cpu1" not in calib or "cpu_round_s" not in link:
        return None
    P_cal = calib["P"]
    work_P = work_seconds(calib, name, P, n, density, options, calib_options, block_topk, scan)
    work_cal = work_seconds(calib, name, P_cal, n, density, calib_options, calib_options, block_topk, scan)
    messages_P = mean_comm_cpu_seconds(name, P, n, density, link, options)
    messages_cal = mean_comm_cpu_seconds(name, P_cal, n, density, link, calib_options)
    cpu = calib["cpu1"] * n + calib["cpu0"] + (work_P - work_cal) + (sum(messages_P) - sum(messages_cal))
    bytes_cpu = messages_P[1]
    return c_r * max(0.0, cpu - bytes_cpu) + max(wire_s, c_r * bytes_cpu)


def touched_entries(name: str, P: int, n: int, k: int, density: float, options: dict[str, Any]) -> float:
    """Sparse entries one rank's decompression touches per call: its own ``k`` and the (index,
    value) pairs it receives (:func:`_received_elements`, from the cost formula); 0 for a dense
    method."""
    if not is_sparse(name):
        return 0.0
    return k + _received_elements(name, P, n, k, density, options)


def block_topk_seconds(name: str, P: int, n: int, options: dict[str, Any], block_topk: dict[str, float] | None,
                       scan: bool = True) -> float:
    """Seconds of a method's top-k selections of one block each at (P, n)
    (:meth:`~sparsecomm.methods.base.Method.topk_blocks`: SparDL's Spar-Reduce-Scatter, one block at
    P = 2, four at P = 6), at the profile's one-process cost of a block's top-k (``block_topk``:
    seconds per element and per block, :func:`~.calibration.measure_block_topk`); 0 for the other
    methods and for profiles without it."""
    if not block_topk:
        return 0.0
    sizes = method_class(name).topk_blocks(P, n, scan, **options)
    return sum(block_topk["per_element"] * size + block_topk["per_block"] for size in sizes)


def work_seconds(calib: dict[str, Any], name: str, P: int, n: int, density: float, options: dict[str, Any],
                 calib_options: dict[str, Any], block_topk: dict[str, float] | None = None,
                 scan: bool = True) -> float:
    """A method's work at (P, n) from its calibration entry ``calib``, before the contention factor
    (the module docstring's ``work``): selection per gradient element, decompression per byte of its
    sweep's memory traffic (:func:`decompress_bytes`; per gradient element for a dense method; per
    touched entry for a GPU calibration, ``decompress_per`` "entry") and the agreement per round
    (:func:`agreement_rounds`, where the calibration timed it: ``agreement_round_s``). A method that
    selects from blocks whose number changes with P (SparDL) adds its blocks' top-k at P less those at
    P_cal (:func:`block_topk_seconds`, ``block_topk`` being the profile's one-process cost; ``scan``:
    the compiled CPU scan selects the first blocks)."""
    k = selection_count(density, n) if is_sparse(name) else 0
    per = calib["decompress_per"]
    units = (n if per == "element" else touched_entries(name, P, n, k, density, options) if per == "entry"
             else decompress_bytes(name, P, n, k, density, options))
    decompress = calib["d1"] * units + calib["d0"]
    agreement = calib.get("agreement_round_s", 0.0) * agreement_rounds(P, calib.get("agreement_ride", ""))
    blocks = (block_topk_seconds(name, P, n, options, block_topk, scan)
              - block_topk_seconds(name, calib["P"], n, calib_options, block_topk, scan))
    return max(0.0, calib["s1"] * n + calib["s0"] + blocks) + max(0.0, decompress) + agreement


def predict_comm(name: str, P: int, n: int, density: float, alpha: float, beta: float,
                 options: dict[str, Any] | None = None, traffic_factor: float = 1.0,
                 ) -> tuple[float, int, float, bool]:
    """(seconds, rounds, bytes sent, exact) of the slowest sampled rank's communication."""
    options = options or {}
    k = selection_count(density, n) if is_sparse(name) else 0
    worst: tuple[float, int, float, bool] = (0.0, 0, 0.0, True)
    for rank in _sample_ranks(P):
        c = cost(name, P=P, n=n, k=k, rank=rank, density=density, **options)
        sent = traffic_factor * c.bytes_sent
        seconds = c.rounds * alpha + sent * beta
        if seconds >= worst[0]:
            worst = (seconds, c.rounds, sent, c.exact)
    return worst


def predict(name: str, P: int, n: int, density: float, *, profile: Profile | None = None,
            alpha: float | None = None, beta: float | None = None, options: dict[str, Any] | None = None,
            colocated: bool | None = None, compute_scale: float = 1.0, overlap: float = 0.0,
            backward_s: float = 0.0, use_comm_factor: bool = True) -> Prediction:
    """Predicted call time of method ``name`` (see the module docstring for the model).

    alpha/beta override the profile's; without a profile they are required and the work is zero
    (the prediction is then exactly the cost formula's time). ``use_comm_factor=False`` drops the
    profile's measured traffic and comm factors (the formula's time under the fitted alpha and beta).
    """
    options = options or {}
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap={overlap} must lie in [0, 1]")
    if compute_scale <= 0:
        raise ValueError(f"compute_scale={compute_scale} must be positive")
    rests: list[str] = []
    contention_comm = contention_rounds = 1.0
    comm_cpu: tuple[float, float] | None = None  # the messages' CPU (per message, per byte): rate-limited
    if profile is None:
        if alpha is None or beta is None:
            raise ValueError("predict needs a profile or both alpha and beta")
        a, b, factor, work, comm_factor = alpha, beta, 1.0, 0.0, 1.0
        rests.append("cost formula only (no profile: no selection/decompression time)")
    else:
        calib = profile.methods.get(name)
        share = profile.colocated if colocated is None else colocated
        given = alpha is not None or beta is not None
        user_options = options
        options = {**layout_options(name, P, profile.net, share), **user_options}
        calib_options = {**layout_options(name, calib["P"], profile.net, profile.colocated),
                         **user_options} if calib else options
        factor = float(calib.get("traffic_factor", 1.0)) if calib and use_comm_factor else 1.0
        # the comm factor is this machine's and network's (relative to its fitted links): it does not
        # carry to a network given by alpha/beta; the traffic factor (the data's density) does
        comm_factor = float(calib.get("comm_factor", 1.0)) if calib and use_comm_factor and not given else 1.0
        if name == "dense" and "alpha" in profile.dense_allreduce and not given:
            a, b = profile.dense_allreduce["alpha"], profile.dense_allreduce["beta"]
            rests.append("fitted native all-reduce alpha/beta")
        else:
            a = profile.alpha if alpha is None else alpha
            b = profile.beta if beta is None else beta
            rests.append("given alpha/beta" if given else f"fitted alpha/beta ({profile.net})")
        if not given:
            contention_comm = comm_contention(P, profile.cores, share, profile.net)
            if contention_comm > 1:
                rests.append(f"loopback links slowed {contention_comm:g}x (P workers on {profile.cores} cores)")
        work = 0.0
        if calib:
            contention = max(1.0, P / profile.cores) if share else 1.0
            calib_contention = max(1.0, calib["P"] / profile.cores) if profile.colocated else 1.0
            if not given:
                contention_rounds = contention / calib_contention
                link = profile._link()
                if share and tc_rate(profile.net) and "cpu_round_s" in link:
                    comm_cpu = comm_cpu_seconds(name, P, n, density, link, options)
                if contention_rounds > 1:
                    rests.append(f"rounds' CPU cost {contention_rounds:g}x (P workers on {profile.cores} cores"
                                 + ("; the messages' CPU measured per message and byte)" if comm_cpu is not None
                                    else ")"))
            work = (work_seconds(calib, name, P, n, density, options, calib_options, profile.block_topk_s,
                                 scan=profile.device == "cpu") * contention / calib_contention) / compute_scale
            rests.append(f"work measured at P={calib['P']}, density={calib['density']:g} (selection per element, "
                         f"decompression per {_DECOMPRESS_UNIT[calib['decompress_per']]}"
                         + (", agreement per round" if "agreement_round_s" in calib else "") + ")")
            if factor != 1.0:
                rests.append(f"traffic {factor:.2f} x formula (measured)")
            if comm_factor != 1.0:
                rests.append(f"comm time {comm_factor:.2f} x formula (measured at P={calib['P']})")
        else:
            rests.append("no measured work for this method (formula only)")
        if compute_scale != 1.0:
            rests.append(f"ASSUMED compute {compute_scale:g}x this device")
    comm, rounds, sent, exact = predict_comm(name, P, n, density, a, b, options, factor)
    excess = burst_credit = 0.0
    if profile is not None and calib and comm_factor != 1.0 and calib.get("comm_s"):
        # the measured comm at the calibration P against the formula's there. What the formula leaves
        # out (the excess) is, where the messages' CPU is its own term (a rate-limited network: per
        # message, in shared_cpu), a cost per call: set-up, the CPU work inside the comm's timers
        # (ExDyna's union of the gathered indices), the wait for a peer's imbalance; elsewhere a cost
        # per message (a round's size header, separate index and value messages, the peer's wake-up),
        # added per round. A formula that over-estimates is scaled down, except on an emulated rate,
        # where the over-estimate is the token bucket's burst: bytes per call that pass at once, a
        # fixed credit per call however many bytes follow
        n_cal = max(int(size) for size in calib["comm_s"])
        measured = float(calib["comm_s"][str(n_cal)])
        formula, rounds_cal, _, _ = predict_comm(name, calib["P"], n_cal, density, a, b, calib_options, factor)
        if measured >= formula and rounds_cal:
            excess = measured - formula
            if comm_cpu is None:
                excess *= rounds / rounds_cal
            comm_factor = 1.0
        elif formula > 0 and tc_rate(profile.net):
            burst_credit, comm_factor = formula - measured, 1.0
        elif formula > 0:
            comm_factor = measured / formula
    # the rounds' fixed cost is CPU time the colocated workers share; where the messages' CPU was
    # measured (a rate-limited network) that share is its own term and the rounds keep their time
    round_scale = contention_rounds if comm_cpu is None else 1.0
    wire = comm_factor * contention_comm * (comm - rounds * a)
    comm = max(0.0, comm_factor * rounds * a * round_scale + wire + excess * round_scale - burst_credit)
    if comm_cpu is not None:
        comm += shared_cpu(comm_cpu, max(0.0, wire - burst_credit), contention_rounds)
        if profile is not None and calib and contention_rounds > 1 and compute_scale == 1.0:
            # the cores' estimate: P ranks' CPU on fewer cores, plus the wire (the larger one is the call)
            cores = cores_seconds(calib, name, P, n, density, options, calib_options, link,
                                  comm_factor * rounds * a + max(0.0, wire - burst_credit), contention_rounds,
                                  profile.block_topk_s, scan=profile.device == "cpu")
            if cores is not None and cores > comm + work:
                work = cores - comm
                rests.append(f"the cores' estimate (P ranks' CPU on {profile.cores} cores, plus the wire)")
    hidden = min(overlap * comm, backward_s)
    if overlap:
        rests.append(f"overlap {overlap:g} of comm behind {backward_s * 1e3:.0f} ms backward")
    if not exact and factor == 1.0:
        rests.append("traffic is the formula's upper bound")
    return Prediction(name, P, n, density, comm, work, hidden, rounds, sent, exact, "; ".join(rests))


def fit_work(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(w1, w0): per-element and fixed seconds from ``(n, seconds)`` samples (one size: w0 = 0)."""
    sizes = {n for n, _ in samples}
    if not samples:
        raise ValueError("fit_work needs at least one (n, seconds) sample")
    if len(sizes) == 1:
        n = samples[0][0]
        return sum(t for _, t in samples) / len(samples) / n, 0.0
    # the same least-squares solver as alpha/beta: seconds = w1 * n + w0 * 1
    w1, w0 = fit_alpha_beta([(n, 1.0, t) for n, t in samples])
    return w1, w0


def powersgd_seconds(P: int, elements: dict[str, int], alpha: float, beta: float, local_s: float = 0.0
                     ) -> tuple[float, float]:
    """(communication, local work) seconds of one step of torch's PowerSGD hook (Vogels et al.,
    "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019)
    at P workers: three ring all-reduces one after the other (the tensors it sends uncompressed, the
    P factors, the Q factors; ``elements``: their float32 element counts, e.g. from
    ``benchmarks/gpu/gpt_step.py``), each at the ring formula's ``2 (P - 1)`` rounds and
    ``2 (P - 1) / P`` of its bytes, and ``local_s`` of local work (measured)."""
    seconds = 0.0
    for part in ("uncompressed", "p", "q"):
        count = int(elements.get(part, 0))
        if count and P > 1:
            c = cost("ring", P=P, n=count, rank=0)
            seconds += c.rounds * alpha + c.bytes_sent * beta
    return seconds, local_s


def speedup_table(methods: Sequence[str], workers: Sequence[int], n: int, density: float,
                  **kwargs: Any) -> list[dict[str, Any]]:
    """Rows of (method, P, predicted ms, speed-up over dense) for every method and worker count."""
    rows = []
    for P in workers:
        dense = predict("dense", P, n, density, **kwargs).total_s
        for name in methods:
            p = predict(name, P, n, density, **kwargs)
            rows.append({"method": name, "P": P, "time_s": p.total_s, "comm_s": p.comm_s, "work_s": p.work_s,
                         "speedup": dense / p.total_s if p.total_s > 0 else math.inf, "rests_on": p.rests_on})
    return rows


def crossover(rows: Sequence[dict[str, Any]], method: str) -> int | None:
    """The smallest P of ``rows`` at which ``method`` is not faster than dense (None: faster at every P)."""
    for row in sorted((r for r in rows if r["method"] == method), key=lambda r: r["P"]):
        if row["speedup"] <= 1.0 + 1e-9:
            return int(row["P"])
    return None


def faster_range(rows: Sequence[dict[str, Any]], method: str, margin: float = 0.05) -> str:
    """Where in ``rows`` ``method`` beats dense by more than ``margin`` (a speed-up above 1 + margin;
    smaller differences are below what the model can tell): "all P", "never", or the P ranges
    ("P <= 64", "P >= 128", "16 <= P <= 256", joined by ", " when there are several)."""
    mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["P"])
    Ps = [int(r["P"]) for r in mine]
    wins = [r["speedup"] > 1.0 + margin for r in mine]
    if all(wins):
        return "all P"
    if not any(wins):
        return "never"
    spans, start = [], None
    for i, win in enumerate(wins + [False]):
        if win and start is None:
            start = i
        elif not win and start is not None:
            lo, hi = Ps[start], Ps[i - 1]
            spans.append(f"P <= {hi}" if start == 0 else f"P >= {lo}" if i == len(Ps) else
                         f"P = {lo}" if lo == hi else f"{lo} <= P <= {hi}")
            start = None
    return ", ".join(spans)


def plot_projection(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """PNG: step time (left) and speed-up over dense (right) against P, one line per method."""
    from ..core.optional import require

    matplotlib = require("matplotlib", "the projection plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = [plt.get_cmap("tab20")(j) for j in range(20)]
    for i, name in enumerate(dict.fromkeys(r["method"] for r in rows)):
        mine = sorted((r for r in rows if r["method"] == name), key=lambda r: r["P"])
        Ps = [r["P"] for r in mine]
        style = dict(marker=".", label=name, color=colors[(2 * i) % 20 + (i // 10) % 2],
                     linestyle=("-", "--", ":")[i % 3], linewidth=2.2 if name == "dense" else 1.3)
        ax_t.plot(Ps, [1e3 * r["time_s"] for r in mine], **style)
        ax_s.plot(Ps, [r["speedup"] for r in mine], **style)
    for ax in (ax_t, ax_s):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers P")
        ax.grid(True, alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("predicted step time (ms)")
    ax_s.set_yscale("log")
    ax_s.axhline(1.0, color="black", linewidth=0.8)
    ax_s.set_ylabel("speed-up over dense all-reduce")
    ax_s.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
