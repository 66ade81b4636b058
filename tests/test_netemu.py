"""Tests of the emulated network (sparsecomm/netemu.py): parameters, build and teardown on every exit
path, isolation of the ranks, and the rate gloo actually achieves through a limited link."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from sparsecomm import run_workers
from sparsecomm.launch import netemu
from sparsecomm.launch.netemu import (
    EmulatedNetwork,
    cleanup_stale,
    parse_rate,
    parse_size,
    parse_time,
    unavailable_reason,
)


def needs_net(test):
    """Mark a test that builds namespaces: `net` marker, skipped with the reason where impossible."""
    skip = pytest.mark.skipif(unavailable_reason() is not None,
                              reason=f"network emulation unavailable: {unavailable_reason()}")
    return pytest.mark.net(skip(test))


def namespaces_now():
    return set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()


def root_links():
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    return {line.split(":")[1].strip() for line in out.stdout.splitlines()}


def ip_in(namespace, *args):
    return subprocess.run(["ip", "-n", namespace, *args], capture_output=True, text=True,
                          check=True).stdout


def tbf_rates(namespace):
    """{device: rate string} of the tbf qdiscs in ``namespace``."""
    out = subprocess.run(["tc", "-n", namespace, "qdisc", "show"], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[4]: line.split()[line.split().index("rate") + 1]
            for line in out.splitlines() if line.startswith("qdisc tbf")}


# -- parameters (no privileges needed) ----------------------------------------------------------

@pytest.mark.parametrize("text, bits", [("100mbit", 100e6), ("1gbit", 1e9), ("10Gbit", 10e9),
                                        ("500kbit", 500e3), ("1.5mbit", 1.5e6), ("10Mbit", 10e6),
                                        ("1mibit", 2**20), ("64bit", 64)])
def test_rate_parsing(text, bits):
    assert parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("bad", ["100", "fast", "-1mbit", "0mbit", "1gigabit", "mbit", "", 100, None])
def test_bad_rate_is_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match="rate=") as info:
        EmulatedNetwork(2, bad)
    assert repr(bad) in str(info.value)


def test_sizes_times_and_default_burst():
    assert parse_size("64kb") == 65536 and parse_size("1000") == 1000
    assert parse_size("256kbit") == 32768
    assert parse_time("50ms") == pytest.approx(0.05) and parse_time("200") == pytest.approx(2e-4)
    # default burst: max(rate x 1 ms, 64 KiB)
    assert EmulatedNetwork(2, "100mbit").burst_bytes == 65536
    assert EmulatedNetwork(2, "10gbit").burst_bytes == 1_250_000
    assert EmulatedNetwork(2, "1gbit", burst="256kb").burst_bytes == 262144
    with pytest.raises(ValueError, match="burst='lots'"):
        EmulatedNetwork(2, "1gbit", burst="lots")
    with pytest.raises(ValueError, match="latency='soon'"):
        EmulatedNetwork(2, "1gbit", latency="soon")
    for bad in (0, 254, 2.0, True):
        with pytest.raises(ValueError, match="world_size="):
            EmulatedNetwork(bad, "1gbit")


def test_unavailable_reason_says_why(monkeypatch):
    monkeypatch.setattr(netemu, "_unavailable_cache", {})
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in unavailable_reason()
    monkeypatch.setattr(netemu, "_unavailable_cache", {})
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netemu.shutil, "which", lambda tool: None if tool == "tc" else "/sbin/ip")
    assert "`tc`" in unavailable_reason()


def test_closed_network_refuses_worker_calls():
    network = EmulatedNetwork(2, "1gbit")
    with pytest.raises(RuntimeError, match="not open"):
        network.enter(0)


# -- building and tearing down ------------------------------------------------------------------

@needs_net
def test_build_is_complete_and_teardown_leaves_nothing():
    links_before = root_links()
    with EmulatedNetwork(3, "100mbit") as network:
        names = network.namespaces()
        assert len(set(names)) == 4 and set(names) <= namespaces_now()
        assert root_links() == links_before, "nothing may be added to the root namespace"
        hub_rates = tbf_rates(names[0])
        assert sorted(hub_rates) == ["sc-port0", "sc-port1", "sc-port2"]
        assert set(hub_rates.values()) == {"100Mbit"}
        for rank in range(3):
            namespace = network.namespace(rank)
            assert tbf_rates(namespace) == {network.interface(rank): "100Mbit"}
            addresses = ip_in(namespace, "-o", "-4", "addr", "show", "dev", network.interface(rank))
            assert f"inet {network.address(rank)}/24" in addresses
            assert network.address(rank).startswith("10.213.")
            assert "state UP" in ip_in(namespace, "link", "show", network.interface(rank))
            assert "LOOPBACK,UP" in ip_in(namespace, "link", "show", "lo")
        assert len({network.address(r) for r in range(3)}) == 3
    assert not set(names) & namespaces_now()
    assert root_links() == links_before


@needs_net
def test_concurrent_networks_do_not_collide():
    with EmulatedNetwork(2, "1gbit") as first, EmulatedNetwork(2, "1gbit") as second:
        assert not set(first.namespaces()) & set(second.namespaces())
        assert first.address(0) != second.address(0)
        names = first.namespaces() + second.namespaces()
    assert not set(names) & namespaces_now()


@needs_net
def test_exception_in_the_block_tears_down():
    with pytest.raises(KeyError, match="boom"), EmulatedNetwork(2, "1gbit") as network:
        names = network.namespaces()
        raise KeyError("boom")
    assert names and not set(names) & namespaces_now()


@needs_net
def test_enter_is_for_forked_workers_only():
    with EmulatedNetwork(2, "1gbit") as network:
        with pytest.raises(RuntimeError, match="forked worker"):
            network.enter(0)
        with pytest.raises(ValueError, match="rank=2"):
            network.enter(2)


def _fork_network_owner(then):
    """Fork a child that opens a 2-rank network, reports its namespaces, then does ``then()``.

    Returns (child pid, the namespaces it created)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            network = EmulatedNetwork(2, "1gbit").__enter__()
            os.write(write_end, " ".join(network.namespaces()).encode())
            os.close(write_end)
            then()
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        names = reader.read().split()
    return pid, names


@needs_net
def test_cleanup_stale_removes_only_the_namespaces_of_dead_processes():
    with EmulatedNetwork(2, "1gbit") as mine:
        pid, orphans = _fork_network_owner(then=lambda: os._exit(0))  # dies without teardown
        os.waitpid(pid, 0)
        assert len(orphans) == 3 and set(orphans) <= namespaces_now()
        removed = cleanup_stale()
        assert set(orphans) <= set(removed)
        assert not set(orphans) & namespaces_now()
        assert set(mine.namespaces()) <= namespaces_now(), "a live process's network was removed"


@needs_net
def test_a_new_network_removes_orphans_first():
    pid, orphans = _fork_network_owner(then=lambda: os._exit(0))
    os.waitpid(pid, 0)
    with EmulatedNetwork(2, "1gbit"):
        assert not set(orphans) & namespaces_now()


@needs_net
def test_sigterm_in_the_owner_tears_down():
    pid, names = _fork_network_owner(then=lambda: time.sleep(60))
    assert len(names) == 3 and set(names) <= namespaces_now()
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert not set(names) & namespaces_now()


@needs_net
def test_atexit_tears_down_a_network_left_open():
    code = ("from sparsecomm.launch.netemu import EmulatedNetwork\n"
            "network = EmulatedNetwork(2, '1gbit').__enter__()\n"
            "print(' '.join(network.namespaces()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names = out.stdout.split()
    assert len(names) == 3 and not set(names) & namespaces_now()


# -- traffic through the emulated links ---------------------------------------------------------

def timed_transfer(nbytes):
    """Rank 0 sends ``nbytes`` to rank 1; returns (interfaces seen, seconds, received checksum)."""
    interfaces = sorted(name for _, name in socket.if_nameindex())
    tensor = torch.arange(nbytes // 4, dtype=torch.float32) if dist.get_rank() == 0 \
        else torch.zeros(nbytes // 4)
    dist.barrier()
    started = time.perf_counter()
    if dist.get_rank() == 0:
        dist.send(tensor, 1)
    else:
        dist.recv(tensor, 0)
    seconds = time.perf_counter() - started
    dist.barrier()
    return interfaces, seconds, float(tensor.double().sum())


@needs_net
def test_gloo_through_100mbit_links_runs_close_to_the_rate():
    nbytes = 24 * 2**20
    (seen0, _, _), (seen1, seconds, checksum) = run_workers(2, timed_transfer, nbytes,
                                                            net="100mbit", timeout=60)
    assert seen0 == ["lo", "sc-rank0"] and seen1 == ["lo", "sc-rank1"], "ranks must be isolated"
    n = nbytes // 4
    assert checksum == n * (n - 1) / 2
    achieved = nbytes * 8 / seconds
    assert 0.5 * 100e6 <= achieved <= 1.15 * 100e6, f"achieved {achieved / 1e6:.1f} Mbit/s"


def rank_and_sum():
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return dist.get_rank(), float(total)


@needs_net
def test_every_rank_reaches_every_other_through_the_bridge():
    assert run_workers(3, rank_and_sum, net="1gbit", timeout=60) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_bench_net_prints_its_tables(capsys):
    from sparsecomm.cli import main

    emulated = "1gbit" if unavailable_reason() is None else "loopback"
    assert main(["bench", "net", "--net", f"loopback,{emulated}", "--size-mb", "1", "--repeats", "1",
                 "--world-sizes", "2", "--setup-repeats", "1", "--ring-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "| loopback | 1 | 1 |" in out and "| loopback | 3 | 1 | 1 |" in out
    if unavailable_reason() is None:
        assert "| 1gbit | 1 | 1 |" in out and "| 2 | 1 |" in out
    assert main(["bench", "net", "--net", "fast"]) == 2
    assert "rate='fast'" in capsys.readouterr().err
