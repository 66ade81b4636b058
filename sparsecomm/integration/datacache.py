"""DataCache: two-level caching of training data (Shi et al., MLSys 2021, section 4.1, Fig. 5 and 9).

Training data sits on a slow networked source (here :class:`~sparsecomm_lab.fileserver.FileServer`,
an HTTP server behind a rate-limited emulated link). :class:`DataCache` puts two levels in front of it:

1. a **local file-system cache**: the first read of a file fetches it from the source and writes it
   to ``cache_dir`` (atomically); later reads, in this run or in any later run or process (e.g. the
   next run of a hyper-parameter search), read the local copy;
2. an **in-memory key-value store** of decoded, pre-processed samples keyed by the sample index:
   from the second epoch on, a sample costs a dictionary look-up instead of a read and a decode.

**Sharding.** The data set is split over ``world_size`` holders (nodes): sample i belongs to holder
``i % world_size`` (:meth:`DataCache.owner`), and only the holder keeps it in memory, so each node's
memory holds 1/world_size of the data set. :func:`shard_epoch` gives each rank its own samples in a
fresh order every epoch, so every sample is delivered exactly once per epoch across the ranks and
every read from the second epoch on is a memory hit. A sample asked of a non-holder is read from the
local file cache or the source and not kept (in this emulation each node is one rank and the nodes
do not serve each other, so "fetched from its holder" is the source's copy).

**Pipelining.** :class:`PrefetchLoader` builds batches in a pool of threads, ``prefetch`` batches
ahead of the training loop (Pillow's decoding and torch's tensor operations release the GIL), and
measures the time the loop waits for data: the I/O time of Fig. 9.

Augmentation (random crop after 2-pixel padding, horizontal flip) runs per sample and per epoch on
the cached pre-processed tensors, as in the paper's pipeline (decode, normalize; then augment).

The naive reader of Fig. 9 is the same object without caches: ``DataCache(source, names, decode,
cache_dir=None, memory=False)``.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import os
import random
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..core.optional import require
from ..core.validate import check_int

__all__ = ["DataCache", "CacheStats", "PrefetchLoader", "EpochStats", "shard_epoch", "write_png_dataset",
           "decode_png", "augment", "LabelledImages", "FASHION_MNIST_MEAN", "FASHION_MNIST_STD"]

log = logging.getLogger(__name__)

FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530


class Source(Protocol):
    def fetch(self, name: str) -> bytes: ...


@dataclass
class CacheStats:
    """Where the reads of a :class:`DataCache` were answered."""

    memory_hits: int = 0
    file_hits: int = 0
    source_fetches: int = 0
    source_bytes: int = 0

    def copy(self) -> CacheStats:
        return dataclasses.replace(self)


class DataCache:
    """Samples by index through a memory store and a local file cache in front of a slow ``source``.

    Args:
        source: has ``fetch(name) -> bytes`` (e.g. :class:`~sparsecomm_lab.fileserver.FileClient`).
        names: the file name of each sample index.
        decode: (bytes, index) -> the pre-processed sample (what the memory store keeps).
        cache_dir: the local file-system cache (created if missing); ``None``: no file cache.
        memory: keep decoded samples of this holder in memory.
        rank, world_size: this holder and the number of holders the data set is split over.
    """

    def __init__(self, source: Source, names: Sequence[str], decode: Callable[[bytes, int], Any], *,
                 cache_dir: str | None = None, memory: bool = True, rank: int = 0, world_size: int = 1) -> None:
        check_int("world_size", world_size, minimum=1)
        check_int("rank", rank, minimum=0, maximum=world_size - 1)
        self.source = source
        self.names = list(names)
        self.decode = decode
        self.cache_dir = cache_dir
        self.memory = memory
        self.rank, self.world_size = rank, world_size
        self.stats = CacheStats()
        self._store: dict[int, Any] = {}
        self._lock = threading.Lock()
        if cache_dir is not None:
            os.makedirs(cache_dir, exist_ok=True)

    def __len__(self) -> int:
        return len(self.names)

    def owner(self, index: int) -> int:
        """The holder (rank) that keeps sample ``index`` in memory."""
        return index % self.world_size

    def read_file(self, name: str) -> bytes:
        """The bytes of ``name``: from the local file cache, else from the source (then cached)."""
        if self.cache_dir is not None:
            path = os.path.join(self.cache_dir, name)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                with self._lock:
                    self.stats.file_hits += 1
                return data
            except FileNotFoundError:
                pass
        data = self.source.fetch(name)
        with self._lock:
            self.stats.source_fetches += 1
            self.stats.source_bytes += len(data)
        if self.cache_dir is not None:
            self._write_atomically(os.path.join(self.cache_dir, name), data)
        return data

    @staticmethod
    def _write_atomically(path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # readers see the whole file or none
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self.names):
            raise IndexError(f"sample index {index} out of range 0..{len(self.names) - 1}")
        if self.memory:
            sample = self._store.get(index)
            if sample is not None:
                with self._lock:
                    self.stats.memory_hits += 1
                return sample
        sample = self.decode(self.read_file(self.names[index]), index)
        if self.memory and self.owner(index) == self.rank:
            self._store[index] = sample
        return sample

    @property
    def in_memory(self) -> int:
        """How many samples the memory store holds."""
        return len(self._store)


def shard_epoch(n: int, rank: int, world_size: int, epoch: int, seed: int = 0) -> list[int]:
    """This rank's sample indices for ``epoch``: the samples it holds (``i % world_size == rank``),
    shuffled afresh each epoch. Over the ranks, every index of ``range(n)`` exactly once."""
    check_int("world_size", world_size, minimum=1)
    check_int("rank", rank, minimum=0, maximum=world_size - 1)
    indices = list(range(rank, n, world_size))
    random.Random(seed * 1_000_003 + epoch).shuffle(indices)
    return indices


@dataclass
class EpochStats:
    """One epoch of a :class:`PrefetchLoader`: samples, wall time, time waiting for data, cache reads."""

    samples: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    cache: CacheStats = field(default_factory=CacheStats)


class PrefetchLoader:
    """Batches of ``(inputs, labels, indices)`` built by ``threads`` threads, ``prefetch`` batches ahead.

    Args:
        cache: the :class:`DataCache` (or naive reader) the samples come from; each sample is
            ``(tensor, label)``.
        batch_size: samples per batch (the last batch of an epoch may be smaller).
        transform: ``(sample_tensor, index, epoch) -> tensor``, per sample (augmentation).
    """

    def __init__(self, cache: DataCache, batch_size: int, transform: Callable[[torch.Tensor, int, int], torch.Tensor],
                 *, threads: int = 4, prefetch: int = 8) -> None:
        self.cache = cache
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.threads = check_int("threads", threads, minimum=1)
        self.prefetch = check_int("prefetch", prefetch, minimum=1)
        self.transform = transform
        self.last_epoch = EpochStats()

    def _batch(self, indices: list[int], epoch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs, labels = [], []
        for index in indices:
            tensor, label = self.cache[index]
            inputs.append(self.transform(tensor, index, epoch))
            labels.append(label)
        return torch.stack(inputs), torch.tensor(labels), torch.tensor(indices)

    def epoch(self, indices: Sequence[int], epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield the batches of ``indices`` in order; afterwards :attr:`last_epoch` holds the figures."""
        batches = [list(indices[i:i + self.batch_size]) for i in range(0, len(indices), self.batch_size)]
        stats = EpochStats()
        before = self.cache.stats.copy()
        start = time.perf_counter()
        with ThreadPoolExecutor(self.threads, thread_name_prefix="prefetch") as pool:
            pending: deque[Future] = deque()
            upcoming = iter(batches)
            try:
                for batch in itertools.islice(upcoming, self.prefetch):
                    pending.append(pool.submit(self._batch, batch, epoch))
                while pending:
                    waited = time.perf_counter()
                    result = pending.popleft().result()
                    stats.wait_s += time.perf_counter() - waited
                    nxt = next(upcoming, None)
                    if nxt is not None:
                        pending.append(pool.submit(self._batch, nxt, epoch))
                    stats.samples += len(result[2])
                    yield result
            finally:
                for future in pending:
                    future.cancel()
        stats.wall_s = time.perf_counter() - start
        after = self.cache.stats
        stats.cache = CacheStats(after.memory_hits - before.memory_hits, after.file_hits - before.file_hits,
                                 after.source_fetches - before.source_fetches, after.source_bytes - before.source_bytes)
        self.last_epoch = stats


# ---------------------------------------------------------------------- the Fashion-MNIST image pipeline
def write_png_dataset(images: torch.Tensor, labels: torch.Tensor, directory: str) -> list[str]:
    """Write uint8 grey ``images`` (N, H, W) as ``NNNNNN.png`` files and ``labels.txt`` into
    ``directory``, once (an existing complete set is kept). Returns the file names in index order."""
    Image = require("PIL.Image", "writing PNG files")
    names = [f"{i:06d}.png" for i in range(len(images))]
    marker = os.path.join(directory, "labels.txt")
    if os.path.exists(marker):
        with open(marker) as f:
            if len(f.read().split()) == len(names):
                return names
    os.makedirs(directory, exist_ok=True)
    array = images.to(torch.uint8).numpy()
    for name, image in zip(names, array, strict=True):
        Image.fromarray(image, mode="L").save(os.path.join(directory, name), format="PNG")
    with open(marker + ".part", "w") as f:
        f.write("\n".join(str(int(y)) for y in labels.tolist()) + "\n")
    os.replace(marker + ".part", marker)
    return names


def decode_png(data: bytes, mean: float = FASHION_MNIST_MEAN, std: float = FASHION_MNIST_STD) -> torch.Tensor:
    """PNG bytes -> a normalized float32 tensor (1, H, W): the pre-processing the memory store keeps."""
    Image = require("PIL.Image", "decoding PNG files")
    with Image.open(io.BytesIO(data)) as image:
        array = np.asarray(image.convert("L"), dtype=np.float32)
    return ((torch.from_numpy(array.copy()) / 255.0 - mean) / std).unsqueeze(0)


def augment(tensor: torch.Tensor, index: int, epoch: int, seed: int = 0, pad: int = 2) -> torch.Tensor:
    """Random crop after ``pad``-pixel zero padding and a random horizontal flip, drawn from
    (seed, epoch, index): a fresh augmentation of each sample every epoch, reproducible."""
    rng = random.Random((seed * 1_000_003 + epoch) * 10_000_019 + index)
    _, height, width = tensor.shape
    padded = torch.nn.functional.pad(tensor, (pad, pad, pad, pad))
    top, left = rng.randint(0, 2 * pad), rng.randint(0, 2 * pad)
    out = padded[:, top:top + height, left:left + width]
    return out.flip(-1) if rng.random() < 0.5 else out.contiguous()


class LabelledImages:
    """The decode step of the Fashion-MNIST pipeline: (PNG bytes, index) -> (normalized tensor, label)."""

    def __init__(self, labels: Sequence[int]) -> None:
        self.labels = [int(y) for y in labels]

    def __call__(self, data: bytes, index: int) -> tuple[torch.Tensor, int]:
        return decode_png(data), self.labels[index]
