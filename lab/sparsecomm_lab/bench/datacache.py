"""`sparsecomm bench datacache`: Fig. 9 of Shi et al. -- I/O time and throughput per epoch, naive
reading against DataCache, on a real image pipeline behind a real slow file server.

Fashion-MNIST training images are written once as PNG files and served by
:class:`~sparsecomm.experiments.fileserver.FileServer` (``http.server`` in its own network namespace behind a
``--rate`` link shared by all readers, like a networked file system behind a NIC). P workers (one
emulated node each) train a small CNN with a dense gradient all-reduce on their shard of the data,
fed by a :class:`~sparsecomm.integration.datacache.PrefetchLoader`:

* naive: every epoch reads every sample over the link and decodes it;
* cached: :class:`~sparsecomm.integration.datacache.DataCache` (node-local file cache, then an in-memory
  store of decoded samples of the node's shard);
* cached, new run: a new run (new processes, empty memory) on the file cache the cached run left.

I/O time = the time the training loop waits for its next batch; throughput = samples of all ranks /
the slowest rank's epoch time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from sparsecomm.cli.table import markdown_table
from sparsecomm.integration.datacache import (
    DataCache,
    LabelledImages,
    PrefetchLoader,
    augment,
    shard_epoch,
    write_png_dataset,
)
from sparsecomm.launch.launcher import run_workers
from sparsecomm_lab.bench.common import configurations
from sparsecomm_lab.data import load_fashion_mnist
from sparsecomm_lab.fileserver import FileServer
from sparsecomm_lab.models import SmallVGG

HELP = "I/O time and throughput per epoch, naive reading vs DataCache, from a rate-limited file server (Fig. 9)"


def _train_worker(mode: str, make_source, names: list[str], labels: list[int], cache_root: str, epochs: int,
                  batch_size: int, threads: int) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cached = mode != "naive"
    cache = DataCache(make_source(), names, LabelledImages(labels), rank=rank, world_size=world, memory=cached,
                      cache_dir=os.path.join(cache_root, f"node{rank}") if cached else None)
    loader = PrefetchLoader(cache, batch_size, augment, threads=threads, prefetch=2 * threads)
    torch.manual_seed(0)
    model = SmallVGG((1, 28, 28), 10, channels=(16, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = []
    for epoch in range(epochs):
        dist.barrier()
        loss_sum = 0.0
        for inputs, targets, _ in loader.epoch(shard_epoch(len(names), rank, world, epoch), epoch):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            for grad in (p.grad for p in model.parameters() if p.grad is not None):
                dist.all_reduce(grad)
                grad.div_(world)
            optimizer.step()
            loss_sum += float(loss.detach()) * len(targets)
        stats = loader.last_epoch
        out.append({"samples": stats.samples, "wall_s": stats.wall_s, "wait_s": stats.wait_s,
                    "fetches": stats.cache.source_fetches, "file_hits": stats.cache.file_hits,
                    "memory_hits": stats.cache.memory_hits, "link_bytes": stats.cache.source_bytes,
                    "loss": loss_sum / max(stats.samples, 1)})
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=2, help="workers = emulated nodes (default 2)")
    parser.add_argument("--samples", type=int, default=6000, help="Fashion-MNIST training images used (default 6000)")
    parser.add_argument("--rate", default="10mbit", help="the file server's link rate, a tc rate (default 10mbit)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per batch per worker (default 64)")
    parser.add_argument("--threads", type=int, default=4, help="prefetching threads per worker (default 4)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker group")


def _rows(mode: str, per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for epoch in range(len(per_rank[0])):
        figures = [r[epoch] for r in per_rank]
        wall = max(f["wall_s"] for f in figures)
        rows.append({
            "reader": mode, "epoch": epoch + 1, "I/O time (s)": max(f["wait_s"] for f in figures),
            "epoch time (s)": wall, "throughput (samples/s)": sum(f["samples"] for f in figures) / wall,
            "server reads": sum(f["fetches"] for f in figures), "file-cache hits": sum(f["file_hits"] for f in figures),
            "memory hits": sum(f["memory_hits"] for f in figures),
            "MB over link": sum(f["link_bytes"] for f in figures) / 1e6, "loss": figures[0]["loss"]})
    return rows


def check(args) -> None:
    from sparsecomm.launch.netemu import parse_rate

    for name in ("workers", "samples", "epochs", "batch_size", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    parse_rate(args.rate)


def run(args) -> int:
    check(args)
    data = load_fashion_mnist(seed=0, train_size=args.samples)
    pixels = (data.x_train.squeeze(1) * 255).round().to(torch.uint8)
    workdir = tempfile.mkdtemp(prefix="sparsecomm-datacache-")
    try:
        started = time.perf_counter()
        names = write_png_dataset(pixels, data.y_train, os.path.join(workdir, "served"))
        written_s = time.perf_counter() - started
        labels = [int(y) for y in data.y_train.tolist()]
        png_mb = sum(os.path.getsize(os.path.join(workdir, "served", n)) for n in names) / 1e6
        cache_root = os.path.join(workdir, "node-caches")
        rows: list[dict[str, Any]] = []
        with FileServer(os.path.join(workdir, "served"), rate=args.rate) as server:
            modes = (("naive", args.epochs), ("DataCache", args.epochs), ("DataCache, new run", 1))
            for mode, epochs in configurations(modes, "datacache", lambda m: f"{m[0]} ({m[1]} epochs)"):
                per_rank = run_workers(args.workers, _train_worker, mode, server.client, names, labels, cache_root,
                                       epochs, args.batch_size, args.threads, timeout=args.timeout)
                rows += _rows(mode, per_rank)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(markdown_table(rows))
    naive = {r["epoch"]: r for r in rows if r["reader"] == "naive"}
    cached = {r["epoch"]: r for r in rows if r["reader"] == "DataCache"}
    print()
    print(markdown_table([{
        "epoch": e, "I/O time naive / DataCache": naive[e]["I/O time (s)"] / max(cached[e]["I/O time (s)"], 1e-9),
        "throughput DataCache / naive": cached[e]["throughput (samples/s)"] / naive[e]["throughput (samples/s)"]}
        for e in sorted(cached)]))
    print(f"\nP={args.workers} workers (one emulated node each), {len(names)} Fashion-MNIST PNGs ({png_mb:.2f} MB, "
          f"written once in {written_s:.1f} s) served by http.server in its own network namespace behind a "
          f"{args.rate} link; batch {args.batch_size} per worker, {args.threads} prefetching threads; SmallVGG "
          "(16, 32 channels) with a dense all-reduce per step; I/O time = the slowest rank's wait for batches")
    return 0
