"""An emulated switched network on one machine: network namespaces, a bridge and tc rate limits.

docs/architecture.md, "Measurement": a network of a given bandwidth is emulated on one machine
where the kernel allows it. :class:`EmulatedNetwork` builds, for ``world_size`` ranks in nodes of
``local_size`` ranks (default 1: every rank is its own node)::

    namespace <name>-hub:   bridge "sc-bridge" --+-- "sc-port0"  (tbf: hub -> node 0)
                                                 +-- "sc-port1"  (tbf: hub -> node 1)  ...
                                                 |  veth pairs
    namespace <name>-n0:    lo, "sc-node0" 10.213.C.1/24  (tbf: node 0 -> hub)   ranks 0 .. L-1
    namespace <name>-n1:    lo, "sc-node1" 10.213.C.2/24  (tbf: node 1 -> hub)   ranks L .. 2L-1 ...

(with ``local_size=1`` the namespaces are ``<name>-r<rank>`` and the interfaces ``sc-rank<rank>``,
one per rank, as before nodes existed). Every node has a full-duplex link (its NIC) of the given
rate to a non-blocking switch: a message from node a to node b is limited by a's egress (node side)
and by b's ingress (the egress of b's port on the bridge), and all ranks of a node share that NIC,
as a cloud node's GPUs share its network card. The ranks of one node share its namespace and its
address, so messages between them travel over the namespace's loopback device: the fast intra-node
path, unlimited, or limited to ``intra_rate`` by a tbf on ``lo`` (one shared budget for all of the
node's intra-node traffic, both directions together, like a node's internal bus).

Both ends of each veth pair are created directly inside their namespaces, so nothing is ever added
to the root namespace (no link, address or route) and the interface names only have to be unique
inside one namespace; the namespaces' names carry the creating pid and a per-process counter
(``sc<pid>-<counter>-hub``, ``sc<pid>-<counter>-r<rank>`` or ``-n<node>``), so concurrent networks
never collide and :func:`cleanup_stale` can tell the orphans of dead processes.

The spelling of a network for :func:`~sparsecomm.run_workers` (``net=``) is parsed by
:func:`parse_net`: a rate (``"1gbit"``: one rank per node) or ``"NODESxLOCAL:RATE"``
(``"2x4:1gbit"``), optionally ``"NODESxLOCAL:RATE/INTRA_RATE"`` (``"2x4:1gbit/10gbit"``).

The rate limiter is a token bucket filter (``tc-tbf(8)``) with

* ``rate``: a tc rate in bits per second with an explicit unit (``"100mbit"``, ``"1gbit"``, ``"500kbit"``,
  ``"1gibit"``). tc's byte units (``"1gbps"`` is 8 Gbit/s to tc, 1 Gbit/s to most readers) are refused;
* ``burst`` (bucket size): default ``max(rate x 1 ms, 64 KiB)``. At least 64 KiB because veth passes
  GSO super-packets of up to 64 KiB (a smaller bucket makes tbf split every one of them), and at
  least 1 ms of traffic so that timer granularity does not cap high rates (on ``lo``, whose packets
  reach 64 KiB plus headers, at least 128 KiB);
* ``latency``: the longest a packet may wait in the tbf queue before it is dropped (tbf's ``latency``,
  which sets its queue length); it is not an added propagation delay.

Use: create the network in the parent, fork the workers, call :meth:`EmulatedNetwork.enter` in each
child before it opens any socket, and set the environment it returns (``GLOO_SOCKET_IFNAME``) so gloo
binds the rank's interface. The network is torn down by ``__exit__`` on every exit path, at
interpreter exit (``atexit``) and on SIGTERM in the creating process if the block is still open;
what a SIGKILLed creator leaves behind is removed by :func:`cleanup_stale`, which every new network
runs first.

Delay is not emulated: ``sch_netem`` is often missing from minimal kernels, so the one-way latency is
the software stack's (tens of microseconds).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from ..core.validate import check_int, is_int
from .netns import NETNS_DIR, run_tool, setns, stale_namespaces

__all__ = ["EmulatedNetwork", "NetSpec", "LOOPBACK", "emulated_net", "parse_net", "unavailable_reason",
           "cleanup_stale", "parse_rate", "parse_size", "parse_time"]

#: the one name of the network that is not emulated (the host's loopback) in the API and every command
LOOPBACK = "loopback"


def emulated_net(net: str | None) -> str | None:
    """The ``net=`` to emulate: ``None`` for the loopback network (``None`` or ``"loopback"``), else ``net``."""
    return None if net is None or net == LOOPBACK else net

log = logging.getLogger(__name__)

BRIDGE = "sc-bridge"
ADDRESS_PREFIX = "10.213"           # private range; the third octet is a per-call id
MAX_WORLD_SIZE = 253                # hosts .1 .. .253 of a /24
MIN_BURST_BYTES = 64 * 1024
MIN_LOOPBACK_BURST_BYTES = 128 * 1024
BURST_SECONDS = 1e-3

_NAME_RE = re.compile(r"^sc(?P<pid>\d+)-(?P<counter>\d+)-(?P<role>hub|probe|r\d+|n\d+)$")
_counter = itertools.count()

# ---------------------------------------------------------------------------------------------
# tc quantities (tc(8), "PARAMETERS"): rates, sizes, times, each parsed to SI numbers.

_RATE_UNITS = {  # bits per second
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
}
#: tc's bytes-per-second units: ambiguous (tc reads "1gbps" as 8 Gbit/s), so refused with the bit spelling
_BYTE_RATE_UNITS = {"bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
                    "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40}
_SIZE_UNITS = {  # bytes; a bare number is bytes
    "": 1, "b": 1, "k": 2**10, "kb": 2**10, "m": 2**20, "mb": 2**20, "g": 2**30, "gb": 2**30,
    "kbit": 2**10 / 8, "mbit": 2**20 / 8, "gbit": 2**30 / 8,
}
_TIME_UNITS = {  # seconds; a bare number is microseconds
    "": 1e-6, "us": 1e-6, "usec": 1e-6, "usecs": 1e-6, "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
    "s": 1.0, "sec": 1.0, "secs": 1.0,
}
_NUMBER_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def _parse(what: str, value: object, units: dict[str, float], example: str) -> float:
    match = _NUMBER_RE.match(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in units:
        names = ", ".join(u for u in units if u)
        raise ValueError(f"{what}={value!r} is not a tc {what}: write a positive number followed by "
                         f"one of the units {names} (for example {example!r})")
    result = float(match.group(1)) * units[unit]
    if result <= 0:
        raise ValueError(f"{what}={value!r} must be positive")
    return result


def parse_rate(rate: str) -> float:
    """A tc rate string in bits per second (``"100mbit"``, ``"1gbit"``) -> bits per second.

    A unit is required: tc reads a bare number as bytes per second while its manual says bits,
    so ``"100"`` is refused rather than guessed. So are tc's byte units (``"1gbps"``: 8 Gbit/s to tc,
    1 Gbit/s to many readers): the error names both bit spellings.
    """
    match = _NUMBER_RE.match(rate) if isinstance(rate, str) else None
    if match and match.group(2).lower() in _BYTE_RATE_UNITS:
        number, unit = match.group(1), match.group(2).lower()
        as_tc = _bits_spelling(float(number) * _BYTE_RATE_UNITS[unit])
        as_bits = f"{number}{unit[:-3]}bit"
        raise ValueError(f"rate={rate!r} is ambiguous: tc reads {unit!r} as bytes per second ({as_tc}), many "
                         f"read it as bits per second ({as_bits}); write the rate in bits: {as_bits} or {as_tc}")
    return _parse("rate", rate, _RATE_UNITS, "100mbit")


def _bits_spelling(bits_per_second: float) -> str:
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g}{unit}"
    return f"{bits_per_second:g}bit"


def parse_size(size: str) -> float:
    """A tc size string (``"64kb"`` = 64 KiB, ``"256kbit"``, bare number = bytes) in bytes."""
    return _parse("burst", size, _SIZE_UNITS, "64kb")


def parse_time(duration: str) -> float:
    """A tc time string (``"50ms"``, ``"200us"``, ``"1s"``, bare number = microseconds) in seconds."""
    return _parse("latency", duration, _TIME_UNITS, "50ms")


@dataclass(frozen=True)
class NetSpec:
    """A parsed ``net=`` spelling: ``nodes`` x ``local_size`` ranks, the node NIC's ``rate`` and the
    optional intra-node ``intra_rate`` (``None``: the node's loopback, unlimited)."""

    nodes: int
    local_size: int
    rate: str
    intra_rate: str | None = None


_NET_RE = re.compile(r"^\s*(?P<nodes>\d+)\s*x\s*(?P<local>\d+)\s*:\s*(?P<rate>[^/\s]+)\s*"
                     r"(?:/\s*(?P<intra>\S+)\s*)?$")


def parse_net(net: str, world_size: int) -> NetSpec:
    """Parse ``net=`` for ``world_size`` ranks: ``"RATE"`` (one rank per node) or
    ``"NODESxLOCAL:RATE"`` or ``"NODESxLOCAL:RATE/INTRA_RATE"``; NODES x LOCAL must equal world_size.

    Raises:
        ValueError: naming the value and the rule (a malformed rate, a layout of the wrong size).
    """
    if not isinstance(net, str):
        raise ValueError(f"net={net!r} must be a string: a tc rate ('1gbit') or "
                         f"'NODESxLOCAL:RATE[/INTRA_RATE]' ('2x4:1gbit')")
    if ":" not in net:
        parse_rate(net)
        return NetSpec(nodes=world_size, local_size=1, rate=net.strip())
    match = _NET_RE.match(net)
    if match is None:
        raise ValueError(f"net={net!r} is not 'NODESxLOCAL:RATE' or 'NODESxLOCAL:RATE/INTRA_RATE' "
                         f"(for example '2x4:1gbit' or '2x4:1gbit/10gbit')")
    nodes, local = int(match.group("nodes")), int(match.group("local"))
    if nodes < 1 or local < 1:
        raise ValueError(f"net={net!r}: NODES={nodes} and LOCAL={local} must be positive")
    if nodes * local != world_size:
        raise ValueError(f"net={net!r} describes NODES x LOCAL = {nodes} x {local} = {nodes * local} "
                         f"ranks, but world_size={world_size}: NODES x LOCAL must equal the number "
                         f"of workers")
    rate, intra = match.group("rate"), match.group("intra")
    parse_rate(rate)
    if intra is not None:
        parse_rate(intra)
    return NetSpec(nodes=nodes, local_size=local, rate=rate, intra_rate=intra)


# ---------------------------------------------------------------------------------------------
# Running iproute2.

def _run_batch(tool: str, namespace: str, lines: list[str]) -> None:
    """Run many ``ip``/``tc`` commands inside ``namespace`` with one process (``-batch``)."""
    done = subprocess.run([tool, "-n", namespace, "-batch", "-"], input="\n".join(lines) + "\n",
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{tool} -n {namespace} -batch` failed (exit {done.returncode}) on "
                           f"{lines}: {done.stderr.strip() or done.stdout.strip()}")


def _delete_namespace(name: str) -> bool:
    """Delete one named namespace (its links go with it); False when it did not exist."""
    if not os.path.exists(os.path.join(NETNS_DIR, name)):
        return False
    try:
        run_tool("ip", "netns", "delete", name)
    except RuntimeError as exc:
        log.warning("could not delete network namespace %s: %s", name, exc)
        return False
    return True


def _new_base_name() -> str:
    return f"sc{os.getpid()}-{next(_counter)}"


_unavailable_cache: dict[int, str | None] = {}


def unavailable_reason() -> str | None:
    """``None`` when namespaces, veth, a bridge and tbf can be used here; else a sentence why not.

    Checks root, ``ip`` and ``tc`` from iproute2, and then probes the kernel by building a
    throw-away namespace holding a bridge, a veth pair and a tbf qdisc. Cached per process.
    """
    pid = os.getpid()
    if pid not in _unavailable_cache:
        _unavailable_cache[pid] = _probe()
    return _unavailable_cache[pid]


def _probe() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network emulation needs root (network namespaces and tc need CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command of iproute2 is not installed"
    probe = f"{_new_base_name()}-probe"
    try:
        run_tool("ip", "netns", "add", probe)
    except RuntimeError as exc:
        return f"the kernel refused to create a network namespace: {exc}"
    try:
        _run_batch("ip", probe, ["link add sc-bridge type bridge",
                                 "link add sc-a type veth peer name sc-b"])
        run_tool("tc", "-n", probe, "qdisc", "add", "dev", "sc-a", "root", "tbf", "rate", "1mbit",
             "burst", "64kb", "latency", "50ms")
    except RuntimeError as exc:
        return f"the kernel cannot build an emulated link (bridge, veth, tbf): {exc}"
    finally:
        _delete_namespace(probe)
    return None


# ---------------------------------------------------------------------------------------------
# Teardown on atexit and SIGTERM of the creating process.

_open_networks: set[EmulatedNetwork] = set()
_registry_lock = threading.Lock()
_atexit_registered = False
_previous_sigterm: object = None
_sigterm_installed = False


def _close_all_owned() -> None:
    with _registry_lock:
        owned = [net for net in _open_networks if net._owner_pid == os.getpid()]
    for network in owned:
        network.close()


def _on_sigterm(signum: int, frame: object) -> None:
    """Tear down this process's open networks, then do what SIGTERM did before us."""
    _close_all_owned()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _register(network: EmulatedNetwork) -> None:
    global _atexit_registered, _previous_sigterm, _sigterm_installed
    with _registry_lock:
        _open_networks.add(network)
        if not _atexit_registered:
            atexit.register(_close_all_owned)
            _atexit_registered = True
        if not _sigterm_installed and threading.current_thread() is threading.main_thread():
            _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
            _sigterm_installed = True


def _unregister(network: EmulatedNetwork) -> None:
    global _sigterm_installed
    with _registry_lock:
        _open_networks.discard(network)
        still_open = any(net._owner_pid == os.getpid() for net in _open_networks)
        if (_sigterm_installed and not still_open
                and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is _on_sigterm):
            signal.signal(signal.SIGTERM, _previous_sigterm)  # type: ignore[arg-type]
            _sigterm_installed = False


# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Link:
    """One rank's attachment: its namespace, its interface and address, the bridge port."""
    namespace: str
    interface: str
    address: str
    port: str


class EmulatedNetwork:
    """``world_size`` ranks in nodes on one switch, every node's link limited to ``rate`` both ways.

    Args:
        world_size: number of ranks (1 .. 253 nodes).
        rate: link rate of each node (its NIC), a tc rate with its unit (``"1gbit"``, ``"100mbit"``).
        local_size: ranks per node L (consecutive ranks share a node); must divide ``world_size``.
            Default 1: every rank is its own node with its own link.
        intra_rate: rate of a node's loopback (its ranks' messages to each other), a tc rate;
            default ``None``: unlimited.
        burst: tbf bucket size (tc size, ``"128kb"``); default ``max(rate x 1 ms, 64 KiB)``.
        latency: tbf's longest queueing delay before a packet is dropped (tc time, ``"50ms"``).

    Raises:
        ValueError: a parameter is malformed (the message names it and the rule).
        RuntimeError: on ``__enter__``, when the network cannot be built (see
            :func:`unavailable_reason`).
    """

    def __init__(self, world_size: int, rate: str, *, local_size: int = 1, intra_rate: str | None = None,
                 burst: str | None = None, latency: str = "50ms") -> None:
        if not is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be a positive integer")
        if not is_int(local_size) or local_size < 1 or world_size % local_size:
            raise ValueError(f"local_size={local_size!r} (ranks per node) must be a positive integer "
                             f"dividing world_size={world_size}")
        if world_size // local_size > MAX_WORLD_SIZE:
            raise ValueError(f"world_size={world_size!r} must be an integer in 1..{MAX_WORLD_SIZE} "
                             f"nodes (one /24 subnet per network)")
        self.world_size = world_size
        self.local_size = local_size
        self.nodes = world_size // local_size
        self.rate = rate
        self.rate_bits_per_second = parse_rate(rate)
        self.intra_rate = intra_rate
        self.intra_rate_bits_per_second = parse_rate(intra_rate) if intra_rate is not None else None
        self.burst_bytes = int(parse_size(burst) if burst is not None
                               else max(self.rate_bits_per_second / 8 * BURST_SECONDS,
                                        MIN_BURST_BYTES))
        self.latency_seconds = parse_time(latency)
        self._owner_pid = os.getpid()
        self._name = ""
        self._hub = ""
        self._links: list[_Link] = []
        self._created: list[str] = []     # namespaces that exist now, for teardown
        self._open = False

    # -- building ---------------------------------------------------------------------------

    def __enter__(self) -> EmulatedNetwork:
        if self._open:
            raise RuntimeError(f"{self!r} is already open; an EmulatedNetwork is entered once")
        cleanup_stale()  # orphans of killed runs would otherwise pile up in /run/netns
        self._owner_pid = os.getpid()
        self._name = _new_base_name()
        self._hub = f"{self._name}-hub"
        call_id = (self._owner_pid * 131 + int(self._name.rsplit("-", 1)[1])) % 250 + 1
        role, device = ("r", "sc-rank") if self.local_size == 1 else ("n", "sc-node")
        self._links = [_Link(namespace=f"{self._name}-{role}{node}", interface=f"{device}{node}",
                             address=f"{ADDRESS_PREFIX}.{call_id}.{node + 1}", port=f"sc-port{node}")
                       for node in range(self.nodes)]
        self._open = True
        _register(self)
        started = time.perf_counter()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        log.info("emulated network %s: %d x %d ranks at %s (intra-node %s, burst %d B, latency %g s) "
                 "built in %.3f s", self._name, self.nodes, self.local_size, self.rate,
                 self.intra_rate or "unlimited", self.burst_bytes, self.latency_seconds,
                 time.perf_counter() - started)
        return self

    def _tbf(self, device: str) -> str:
        return (f"qdisc add dev {device} root tbf rate {self.rate_bits_per_second:.0f}bit "
                f"burst {self.burst_bytes} latency {self.latency_seconds * 1e6:.0f}us")

    def _loopback_tbf(self) -> str:
        assert self.intra_rate_bits_per_second is not None
        burst = max(self.intra_rate_bits_per_second / 8 * BURST_SECONDS, MIN_LOOPBACK_BURST_BYTES)
        return (f"qdisc add dev lo root tbf rate {self.intra_rate_bits_per_second:.0f}bit "
                f"burst {burst:.0f} latency {self.latency_seconds * 1e6:.0f}us")

    def _build(self) -> None:
        for namespace in [self._hub] + [link.namespace for link in self._links]:
            run_tool("ip", "netns", "add", namespace)
            self._created.append(namespace)
        # "addrgenmode none": no IPv6 link-local addresses, so the links carry only IPv4 traffic
        # between the ranks' own addresses (no neighbour discovery chatter).
        hub_ip = [f"link add {BRIDGE} type bridge", f"link set {BRIDGE} addrgenmode none",
                  f"link set {BRIDGE} up", "link set lo up"]
        for link in self._links:
            # Both ends are born in their namespaces: nothing passes through the root namespace.
            hub_ip += [f"link add {link.port} type veth peer name {link.interface} "
                       f"netns {link.namespace}",
                       f"link set {link.port} master {BRIDGE}",
                       f"link set {link.port} addrgenmode none", f"link set {link.port} up"]
        _run_batch("ip", self._hub, hub_ip)
        _run_batch("tc", self._hub, [self._tbf(link.port) for link in self._links])
        for link in self._links:
            _run_batch("ip", link.namespace, [
                "link set lo up",
                f"addr add {link.address}/24 dev {link.interface}",
                f"link set {link.interface} addrgenmode none",
                f"link set {link.interface} up",
            ])
            _run_batch("tc", link.namespace, [self._tbf(link.interface)] +
                       ([self._loopback_tbf()] if self.intra_rate is not None else []))

    # -- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Delete every namespace (and so every link) of this network; idempotent.

        Only the creating process tears down: a forked worker that exits leaves the network alone.
        """
        if not self._open or os.getpid() != self._owner_pid:
            return
        started = time.perf_counter()
        for namespace in reversed(self._created):
            _delete_namespace(namespace)
        self._created.clear()
        self._open = False
        _unregister(self)
        log.info("emulated network %s torn down in %.3f s", self._name,
                 time.perf_counter() - started)

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- in the workers ---------------------------------------------------------------------

    def _link(self, rank: int) -> _Link:
        if not self._open:
            raise RuntimeError(f"{self!r} is not open: use it inside its `with` block")
        check_int("rank", rank, minimum=0, maximum=self.world_size - 1)
        return self._links[self.node_of(rank)]

    def node_of(self, rank: int) -> int:
        """The node of ``rank`` (nodes hold ``local_size`` consecutive ranks)."""
        return rank // self.local_size

    def namespace(self, rank: int) -> str:
        """Name of ``rank``'s network namespace, its node's (as ``ip netns list`` shows it)."""
        return self._link(rank).namespace

    def namespaces(self) -> list[str]:
        """Every namespace of this network, the hub's first."""
        if not self._open:
            raise RuntimeError(f"{self!r} is not open: use it inside its `with` block")
        return [self._hub] + [link.namespace for link in self._links]

    def interface(self, rank: int) -> str:
        """Name of ``rank``'s interface inside its namespace (what ``GLOO_SOCKET_IFNAME`` names)."""
        return self._link(rank).interface

    def address(self, rank: int) -> str:
        """``rank``'s IPv4 address, its node's (private, reachable only from this network's namespaces)."""
        return self._link(rank).address

    def enter(self, rank: int) -> dict[str, str]:
        """Move this (forked, single-threaded) process into ``rank``'s namespace.

        Call in the child after fork and before any socket is opened. Only the calling thread
        moves (``setns(2)``); threads started afterwards inherit its namespace, threads that
        already exist do not, hence the warning below.

        Returns:
            Environment variables the worker must set so that gloo binds the rank's interface.
        """
        link = self._link(rank)
        if os.getpid() == self._owner_pid:
            raise RuntimeError("EmulatedNetwork.enter() moves the calling process into a rank's "
                               "namespace: call it in a forked worker, not in the process that "
                               "created the network")
        threads = len(os.listdir("/proc/self/task"))
        if threads > 1:
            log.warning("rank %d enters its namespace with %d threads running; only the calling "
                        "thread moves", rank, threads)
        _setns(os.path.join(NETNS_DIR, link.namespace))
        return {"GLOO_SOCKET_IFNAME": link.interface, "TP_SOCKET_IFNAME": link.interface}

    def __repr__(self) -> str:
        state = f"name={self._name!r}" if self._open else "closed"
        return (f"EmulatedNetwork(world_size={self.world_size}, rate={self.rate!r}, "
                f"local_size={self.local_size}, intra_rate={self.intra_rate!r}, {state})")


def _setns(path: str) -> None:
    """Join the network namespace bound at ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd)
    finally:
        os.close(fd)


def cleanup_stale() -> list[str]:
    """Delete the namespaces of our naming scheme whose creating process is dead.

    Returns:
        The names of the namespaces deleted (empty when there were none).
    """
    removed = [name for name in stale_namespaces(_NAME_RE) if _delete_namespace(name)]
    if removed:
        log.info("removed %d stale emulated-network namespaces: %s", len(removed), removed)
    return removed
