"""``sparsecomm bench net``: what the emulated network (sparsecomm/netemu.py) actually delivers.

Two tables:

* point to point, per ``--net`` value: rank 0 sends one large message to rank 1, which answers with
  4 bytes (one clock, rank 0's, times both); the achieved rate is ``8 x size / time``. A 4-byte
  ping-pong gives the one-way latency (alpha of the alpha-beta cost model), and the achieved rate
  gives its beta = 1 / rate. ``loopback`` is the network without emulation, for comparison;
* ring shift, per ``--net`` value: all P ranks at once send a message to rank r+1 and receive one
  from rank r-1, so every link is busy in both directions; on a non-blocking switch each rank still
  gets the link rate (until the CPUs of this machine run out);
* node NIC (``--nodes 2x4``): on emulated nodes (``net="2x4:RATE"``), 1 and then all L local ranks
  of node 0 send a message each to their peers on node 1 at once; all share node 0's one NIC, so
  the node's achieved rate (L x size / slowest time) should stay at the limit however many send,
  and one rank alone should get all of it. An intra-node transfer (rank 0 to rank 1, loopback)
  shows the fast path beside it;
* the time to build and to tear down an emulated network of P ranks (namespaces, bridge, veths, tbf).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.launcher import run_workers
from sparsecomm.launch.netemu import LOOPBACK, EmulatedNetwork, emulated_net, parse_rate, unavailable_reason

HELP = "measure the emulated network: point-to-point rate and latency, setup/teardown time"

PING_REPEATS = 50


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--net", type=_comma_list, default=[LOOPBACK, "100mbit", "1gbit"],
                        help="comma-separated networks to measure: link rates (tc syntax) and loopback "
                             "(default: loopback,100mbit,1gbit)")
    parser.add_argument("--size-mb", type=float, default=32.0,
                        help="size of the large message in MiB (default: 32)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed transfers per rate; the table shows the median (default: 3)")
    parser.add_argument("--ring-size", type=int, default=8,
                        help="P of the ring-shift measurement, 0 to skip it (default: 8)")
    parser.add_argument("--nodes", default=None,
                        help="NODESxLOCAL (e.g. 2x4): also measure a node's shared NIC with 1 and LOCAL "
                             "senders at once, for every emulated --net rate (default: skip)")
    parser.add_argument("--world-sizes", type=lambda s: [int(p) for p in _comma_list(s)],
                        default=[2, 8], help="P values for the setup/teardown timing (default: 2,8)")
    parser.add_argument("--setup-repeats", type=int, default=5,
                        help="networks built per P; the table shows the median (default: 5)")


def _point_to_point(nbytes: int, repeats: int) -> dict[str, list[float]] | None:
    """Worker: rank 0 times ``repeats`` transfers of ``nbytes`` to rank 1 and 4-byte ping-pongs."""
    rank = dist.get_rank()
    big = torch.zeros(nbytes // 4)
    tiny = torch.zeros(1)
    peer = 1 - rank
    for _ in range(5):  # warm-up: connections, buffers
        (dist.send if rank == 0 else dist.recv)(tiny, peer)
        (dist.recv if rank == 0 else dist.send)(tiny, peer)
    pings, transfers = [], []
    for _ in range(PING_REPEATS):
        started = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(tiny, peer)
        (dist.recv if rank == 0 else dist.send)(tiny, peer)
        pings.append((time.perf_counter() - started) / 2)
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(big, peer)
        (dist.recv if rank == 0 else dist.send)(tiny, peer)
        transfers.append(time.perf_counter() - started)
    return {"pings": pings, "transfers": transfers} if rank == 0 else None


def _rate_rows(nets: list[str], nbytes: int, repeats: int) -> list[dict]:
    rows = []
    for net in nets:
        emulated = emulated_net(net)
        timings = run_workers(2, _point_to_point, nbytes, repeats, net=emulated, timeout=600)[0]
        seconds = statistics.median(timings["transfers"])
        achieved = nbytes * 8 / seconds
        row = {"net": net, "message MiB": nbytes / 2**20, "repeats": repeats,
               "median s": seconds, "achieved Mbit/s": achieved / 1e6,
               "% of rate": 100 * achieved / parse_rate(net) if emulated else "-",
               "one-way latency us (median)": 1e6 * statistics.median(timings["pings"]),
               "(min)": 1e6 * min(timings["pings"])}
        rows.append(row)
    return rows


def _ring_shift(nbytes: int, repeats: int) -> list[float]:
    """Worker: ``repeats`` timed rounds of sending ``nbytes`` to rank+1 while receiving from rank-1."""
    rank, size = dist.get_rank(), dist.get_world_size()
    outgoing, incoming = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
    seconds = []
    for _ in range(repeats + 1):  # the first round is a warm-up
        dist.barrier()
        started = time.perf_counter()
        requests = [dist.isend(outgoing, (rank + 1) % size), dist.irecv(incoming, (rank - 1) % size)]
        for request in requests:
            if request is not None:
                request.wait()
        dist.barrier()
        seconds.append(time.perf_counter() - started)
    return seconds[1:]


def _ring_rows(nets: list[str], world_size: int, nbytes: int, repeats: int) -> list[dict]:
    rows = []
    for net in nets:
        emulated = emulated_net(net)
        per_rank = run_workers(world_size, _ring_shift, nbytes, repeats, net=emulated, timeout=600)
        seconds = statistics.median(max(times) for times in zip(*per_rank, strict=False))
        achieved = nbytes * 8 / seconds
        rows.append({"net": net, "P": world_size, "message MiB per rank": nbytes / 2**20,
                     "repeats": repeats, "median s": seconds,
                     "per-rank Mbit/s each way": achieved / 1e6,
                     "% of rate": 100 * achieved / parse_rate(net) if emulated else "-"})
    return rows


def _node_nic(nbytes: int, repeats: int, senders: int, intra: bool) -> list[float]:
    """Worker on emulated nodes: the first ``senders`` local ranks of node 0 each send ``nbytes`` to
    the same local rank of node 1, all at once (``intra``: rank 0 sends to rank 1 of its own node);
    returns this rank's times of ``repeats`` rounds (barrier to barrier)."""
    rank = dist.get_rank()
    local_size = int(os.environ["LOCAL_WORLD_SIZE"])
    node, local = divmod(rank, local_size)
    outgoing, incoming = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
    if intra:
        role = {0: ("send", 1), 1: ("recv", 0)}.get(rank)
    elif local < senders and node in (0, 1):
        role = ("send", rank + local_size) if node == 0 else ("recv", rank - local_size)
    else:
        role = None
    seconds = []
    for _ in range(repeats + 1):  # the first round is a warm-up
        dist.barrier()
        started = time.perf_counter()
        if role is not None:
            kind, peer = role
            request = dist.isend(outgoing, peer) if kind == "send" else dist.irecv(incoming, peer)
            if request is not None:
                request.wait()
        dist.barrier()
        seconds.append(time.perf_counter() - started)
    return seconds[1:]


def _node_rows(nets: list[str], nodes: str, nbytes: int, repeats: int) -> list[dict]:
    count, local = (int(part) for part in nodes.lower().split("x"))
    rows = []
    for net in nets:
        if emulated_net(net) is None:
            continue
        spec = f"{count}x{local}:{net}"
        for senders, intra in ((1, True), (1, False), (local, False)):
            per_rank = run_workers(count * local, _node_nic, nbytes, repeats, senders, intra, net=spec,
                                   timeout=600)
            seconds = statistics.median(max(times) for times in zip(*per_rank, strict=False))
            achieved = senders * nbytes * 8 / seconds
            rows.append({"net": spec, "path": "intra-node (loopback)" if intra else "node 0 -> node 1",
                         "senders at once": senders, "MiB per sender": nbytes / 2**20,
                         "repeats": repeats, "median s": seconds, "node Mbit/s": achieved / 1e6,
                         "% of NIC rate": 100 * achieved / parse_rate(net)})
    return rows


def _check_nodes(nodes: str | None) -> None:
    if nodes is None:
        return
    parts = nodes.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) >= 1 for part in parts) or int(parts[0]) < 2:
        raise ValueError(f"--nodes={nodes!r} must be NODESxLOCAL with at least 2 nodes (e.g. 2x4)")


def _setup_rows(world_sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    for world_size in world_sizes:
        setups, teardowns = [], []
        for _ in range(repeats):
            network = EmulatedNetwork(world_size, "1gbit")
            started = time.perf_counter()
            network.__enter__()
            built = time.perf_counter()
            network.__exit__(None, None, None)
            setups.append(built - started)
            teardowns.append(time.perf_counter() - built)
        rows.append({"P": world_size, "repeats": repeats, "setup s (median)": statistics.median(setups),
                     "teardown s (median)": statistics.median(teardowns)})
    return rows


def check(args: argparse.Namespace) -> None:
    for name, value in (("--size-mb", args.size_mb), ("--repeats", args.repeats),
                        ("--setup-repeats", args.setup_repeats)):
        if value <= 0:
            raise ValueError(f"{name}={value} must be positive")
    if args.ring_size == 1 or args.ring_size < 0:
        raise ValueError(f"--ring-size={args.ring_size} must be 0 (skip) or at least 2")
    _check_nodes(args.nodes)
    rates = [parse_rate(net) for net in args.net if net != LOOPBACK]
    if not rates and LOOPBACK not in args.net:
        raise ValueError("--net is empty: give rates such as 100mbit,1gbit or loopback")


def run(args: argparse.Namespace) -> int:
    check(args)
    nets = args.net
    reason = unavailable_reason()
    if reason is not None:
        print(f"Network emulation is unavailable here ({reason}); measuring loopback only.\n")
        nets = [LOOPBACK]
    nbytes = int(args.size_mb * 2**20) // 4 * 4
    print(f"{_machine_load()} at the start; times on a busy machine are noisy (medians, and the "
          f"minimum latency, are the robust figures).\n")
    print("Point to point, 2 ranks (rank 0 sends, rank 1 answers 4 bytes; gloo over TCP):\n")
    print(markdown_table(_rate_rows(nets, nbytes, args.repeats)))
    if args.ring_size > 0:
        print(f"\nRing shift, {args.ring_size} ranks at once (each sends to rank+1, receives from "
              f"rank-1; the slowest rank's time):\n")
        print(markdown_table(_ring_rows(nets, args.ring_size, nbytes, args.repeats)))
    if reason is None and args.nodes is not None:
        print(f"\nNode NIC, {args.nodes} emulated nodes (the senders of node 0 share its one NIC; "
              f"the slowest sender's time):\n")
        print(markdown_table(_node_rows(nets, args.nodes, nbytes, args.repeats)))
    if reason is None:
        print("\nBuilding and tearing down an emulated network (namespaces, bridge, veth, tbf):\n")
        print(markdown_table(_setup_rows(args.world_sizes, args.setup_repeats)))
    print(f"\n{_machine_load()} at the end.")
    return 0


def _machine_load() -> str:
    return f"{os.cpu_count()} CPUs, load average (1 min) {os.getloadavg()[0]:.2f}"
