"""``sparsecomm bench block_sparse``: S2 Reducer against AllGather (topka), SparCML (topkdsa), OmniReduce and the
dense all-reduce, on the two workloads of S2's evaluation ([S2Reducer], section 4,
Fig. 3 and 7, Appendix B):

* ``embedding``: the gradient of a Zipf-distributed token batch in a large embedding (the analogue of
  GNMT's embedding layers): each rank draws ``--tokens`` tokens from a Zipf law over ``--vocab`` rows,
  runs :class:`ZipfModel` (embedding, mean pooling, a two-layer head) forward and backward, and the
  row-sparse embedding gradient goes through :class:`~sparsecomm.integration.embedding.RowSparseReducer`
  (each route never builds the dense gradient; ``dense`` is the baseline that does);
* ``blocks``: block-sparsified flat gradients of ``--size`` elements, ``--block-density`` of the blocks
  of ``--block`` elements non-zero, the non-zero blocks at random places on each rank; the registered
  methods at density = ``--block-density`` (which then select exactly the non-zero elements).

Per method and workload: the slowest rank's median time per call and communication time (S2's Fig. 7
and Appendix B.2 compare the communication overhead), the largest rank's bytes sent and rounds, and
the ratios of each method's times to s2reducer's. One worker group per (workload, method), one
after another in this process tree, the methods interleaved over ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
from torch import Tensor, nn

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.launcher import run_workers
from sparsecomm.launch.netemu import unavailable_reason
from sparsecomm.simulator.calibration import time_method_in_worker
from sparsecomm_lab.bench.common import network_label, parse_count, parse_networks

HELP = "S2 Reducer vs AllGather, SparCML, OmniReduce, dense on embedding and block-sparse gradients"

METHODS = ("s2reducer", "topka", "topkdsa", "omnireduce", "dense")


# ---------------------------------------------------------------------- the Zipf workload
def zipf_tokens(vocab: int, count: int, generator: torch.Generator, exponent: float = 1.0) -> Tensor:
    """``count`` token ids in ``[0, vocab)`` with P(id = r) ~ (r + 1)^-exponent (inverse transform of
    the continuous power law, then floor): the word-frequency law of natural-language corpora."""
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    if exponent == 1.0:
        x = torch.pow(float(vocab), u)
    else:
        a = 1.0 - exponent
        x = torch.pow((vocab ** a - 1.0) * u + 1.0, 1.0 / a)
    return (x.floor().long() - 1).clamp_(0, vocab - 1)


class ZipfModel(nn.Module):
    """An embedding of ``vocab`` rows and a small head: mean of the token vectors, Linear, ReLU,
    Linear to ``classes``. ``sparse=True`` makes the embedding gradient a sparse COO tensor."""

    def __init__(self, vocab: int, dim: int = 64, hidden: int = 128, classes: int = 16, sparse: bool = True) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, sparse=sparse)
        self.head = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))
        self.classes = classes

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.embedding(tokens).mean(1))

    def loss(self, tokens: Tensor) -> Tensor:
        """Cross-entropy against a label read off the tokens (first token mod classes)."""
        return nn.functional.cross_entropy(self(tokens), tokens[:, 0] % self.classes)


# ---------------------------------------------------------------------- workers
def embedding_worker(route: str, vocab: int, dim: int, tokens: int, calls: int, warmup: int,
                     seed: int = 0) -> dict[str, Any]:
    """Worker: per call, a fresh Zipf batch forward and backward (untimed), then the timed averaging
    of the sparse embedding gradient by ``route``. Returns times, stats and the touched-row counts."""
    import torch.distributed as dist

    from sparsecomm.integration.embedding import RowSparseReducer, reduce_embedding_grad

    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = ZipfModel(vocab, dim=dim, sparse=True)
    reducer = RowSparseReducer(None, route, num_rows=vocab, dim=dim)
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    times, stats, touched = [], [], []
    for i in range(warmup + calls):
        model.zero_grad(set_to_none=True)
        batch = zipf_tokens(vocab, tokens, gen).reshape(-1, 32) if tokens % 32 == 0 \
            else zipf_tokens(vocab, tokens, gen).reshape(1, -1)
        model.loss(batch).backward()
        grad = model.embedding.weight.grad
        assert grad is not None
        dist.barrier()
        start = time.perf_counter()
        reduce_embedding_grad(grad, reducer)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
            stats.append(reducer.stats)
            touched.append(int(grad.coalesce().indices().numel()))
    return {"times": times, "stats": stats, "touched": touched}


def block_sparse_gradient(n: int, rank: int, block: int, fraction: float) -> Tensor:
    """A gradient whose non-zeros fill ``fraction`` of the blocks of ``block`` elements, at places
    drawn per rank (the blocks of different ranks mostly differ)."""
    gen = torch.Generator().manual_seed(10_007 * rank + 1)
    blocks = -(-n // block)
    chosen = torch.randperm(blocks, generator=gen)[:max(1, round(fraction * blocks))]
    grad = torch.zeros(blocks * block)
    view = grad.view(blocks, block)
    view[chosen] = torch.randn(chosen.numel(), block, generator=gen)
    return grad[:n].clone()


# ---------------------------------------------------------------------- the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=4, help="worker count P (default 4)")
    parser.add_argument("--workloads", default="embedding,blocks", help="embedding and/or blocks (default both)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated (default {','.join(METHODS)})")
    parser.add_argument("--vocab", default="100k", help="embedding rows (default 100k)")
    parser.add_argument("--dim", type=int, default=128, help="embedding dimension (default 128)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank per batch (default 4096 = 128 x 32)")
    parser.add_argument("--size", "-n", default="25M",
                        help="blocks workload: gradient elements (default 25M, about ResNet-50's)")
    parser.add_argument("--block", type=int, default=32, help="blocks workload: elements per block (default 32)")
    parser.add_argument("--block-density", type=float, default=1 / 32,
                        help="blocks workload: fraction of non-zero blocks per rank (default 1/32, S2's rate)")
    parser.add_argument("--net", default="1gbit", help="loopback or a tc rate (default 1gbit)")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per worker group (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first (default 1)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the methods (default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker group")


def _run_one(workload: str, name: str, args: argparse.Namespace, net: str | None) -> dict[str, Any]:
    P = args.workers
    if workload == "embedding":
        per_rank = run_workers(P, embedding_worker, name, parse_count(args.vocab), args.dim, args.tokens,
                               args.repeat, args.warmup, net=net, timeout=args.timeout)
    else:
        options: dict[str, Any] = {} if name == "dense" else {"density": args.block_density}
        if name in ("s2reducer", "omnireduce"):
            options["block_size"] = args.block
        grad_fn = functools.partial(_block_grad, block=args.block, fraction=args.block_density)
        per_rank = run_workers(P, time_method_in_worker, name, options, parse_count(args.size), args.repeat,
                               args.warmup, 0, None, grad_fn, net=net, timeout=args.timeout)
    calls = len(per_rank[0]["times"])
    return {"times": [max(r["times"][i] for r in per_rank) for i in range(calls)],
            "sent": [max(r["stats"][i].bytes_sent for r in per_rank) for i in range(calls)],
            "rounds": [max(r["stats"][i].rounds for r in per_rank) for i in range(calls)],
            "comm": [max(r["stats"][i].time_comm for r in per_rank) for i in range(calls)],
            "modelled": per_rank[0]["stats"][-1].modelled_bytes,
            "touched": [t for r in per_rank for t in r.get("touched", [])]}


def _block_grad(n: int, rank: int, block: int, fraction: float) -> Tensor:
    return block_sparse_gradient(n, rank, block, fraction)


def run(args: argparse.Namespace) -> int:
    workloads = [w.strip() for w in args.workloads.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    if any(w not in ("embedding", "blocks") for w in workloads):
        raise SystemExit(f"--workloads={args.workloads}: each must be 'embedding' or 'blocks'")
    if any(m not in METHODS for m in methods):
        raise SystemExit(f"--methods={args.methods}: each must be one of {METHODS}")
    if args.workers < 1 or args.repeat < 1 or args.rounds < 1 or not 0 < args.block_density <= 1:
        raise SystemExit("--workers, --repeat, --rounds must be positive and --block-density in (0, 1]")
    net = parse_networks(args.net)[0]
    if net is not None and unavailable_reason() is not None:
        print(f"Network emulation is unavailable here ({unavailable_reason()}); loopback only.\n")
        net = None
    rows = []
    for workload in workloads:
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
        for _ in range(args.rounds):
            for name in methods:
                runs[name].append(_run_one(workload, name, args, net))
        times = {m: statistics.median([t for r in runs[m] for t in r["times"]]) for m in methods}
        comms = {m: statistics.median([t for r in runs[m] for t in r["comm"]]) for m in methods}
        for name in methods:
            sent = statistics.median([b for r in runs[name] for b in r["sent"]])
            touched = [t for r in runs[name] for t in r["touched"]]
            rows.append({
                "workload": workload, "method": name,
                "time/call (s)": times[name], "comm (s)": comms[name],
                "MB sent max rank": f"{sent / 1e6:.3g}{' (ring model)' if runs[name][0]['modelled'] else ''}",
                "rounds": max(x for r in runs[name] for x in r["rounds"]),
                "s2reducer speed-up": times[name] / times["s2reducer"] if "s2reducer" in times else "-",
                "comm / s2reducer's": comms[name] / comms["s2reducer"] if "s2reducer" in comms else "-",
                "touched rows/rank": statistics.median(touched) if touched else "-",
            })
    print(markdown_table(rows))
    print(f"\nP={args.workers}, network {network_label(net)}; embedding: vocab {args.vocab} x dim {args.dim}, "
          f"{args.tokens} Zipf tokens per rank per batch; blocks: n={args.size}, {args.block_density:g} of the "
          f"blocks of {args.block} non-zero; time: median over {args.rounds} round(s) x {args.repeat} calls of the "
          f"slowest rank; 'comm (s)': the slowest rank's communication phase (the whole call for the embedding "
          f"routes, which do no selection); 's2reducer speed-up' = time of the method / time of s2reducer")
    return 0
