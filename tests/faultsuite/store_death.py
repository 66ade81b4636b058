"""The rank that hosts the store dies (the fault table of docs/reliability.md and tests/test_store_death.py).

``init_process_group`` with ``env://`` (``MASTER_ADDR``/``MASTER_PORT``) makes rank 0 host the job's
TCP store; when rank 0 dies the store goes with it. Here P processes call a method (topk) in a loop, and
rank 0 exits at the third call: every survivor must raise the same error within the process group's
timeout, saying the store is gone, and blame no healthy rank.

    python tests/faultsuite/store_death.py        # prints one line per rank
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time

TIMEOUT = 5.0


def _worker() -> None:
    import torch
    import torch.distributed as dist

    import sparsecomm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    rank = dist.get_rank()
    method = sparsecomm.make_method("topk", density=0.1)
    for step in range(5):
        if step == 2 and rank == 0:
            print(f"RESULT {rank} {time.time()!r} exits (hosting the store)", flush=True)
            os._exit(3)
        try:
            method(torch.randn(1000))
        except Exception as exc:  # noqa: BLE001 - what this rank saw
            print(f"RESULT {rank} {time.time()!r} {type(exc).__name__}: {exc}", flush=True)
            os._exit(1)
    print(f"RESULT {rank} {time.time()!r} finished", flush=True)


def run(P: int = 3) -> list[tuple[int, float, str]]:
    """Launch P ranks; returns (rank, seconds from rank 0's exit, what the rank said), by rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(P):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(P)}
        procs.append(subprocess.Popen([sys.executable, __file__, "_worker"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    lines = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        lines += [line.split(" ", 3) for line in out.splitlines() if line.startswith("RESULT ")]
    found = {int(rank): (float(when), text) for _, rank, when, text in lines}
    died = found[0][0]
    return [(rank, found[rank][0] - died, found[rank][1]) for rank in sorted(found)]


if __name__ == "__main__":
    if sys.argv[1:] == ["_worker"]:
        _worker()
    else:
        for rank, seconds, text in run():
            print(f"rank {rank}: {seconds:.1f} s: {text}")
