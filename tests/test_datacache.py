"""DataCache (Shi et al., section 4.1): the file cache survives the process that filled it, the memory
store answers from the second epoch, every sample is delivered exactly once per epoch across ranks,
and the same through the real file server in its own network namespace (skipped where namespaces
cannot be built)."""

import os

import pytest
import torch
from sparsecomm_lab.fileserver import FileServer, unavailable_reason

from sparsecomm import DataCache, run_workers
from sparsecomm.integration.datacache import (
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    LabelledImages,
    PrefetchLoader,
    augment,
    decode_png,
    shard_epoch,
    write_png_dataset,
)

N = 37  # no world size used here divides it


class DirectorySource:
    """A source reading a local directory and counting its fetches."""

    def __init__(self, root):
        self.root = root
        self.fetches = 0

    def fetch(self, name):
        self.fetches += 1
        with open(os.path.join(self.root, name), "rb") as f:
            return f.read()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (N, 28, 28), generator=gen, dtype=torch.uint8)
    labels = torch.randint(0, 10, (N,), generator=gen)
    root = str(tmp_path_factory.mktemp("pngs"))
    names = write_png_dataset(pixels, labels, root)
    return root, names, pixels, labels


def _labels(root):
    with open(os.path.join(root, "labels.txt")) as f:
        return [int(y) for y in f.read().split()]


def test_png_round_trip_and_augmentation(images):
    root, names, pixels, labels = images
    assert _labels(root) == labels.tolist() and len(names) == N
    assert write_png_dataset(pixels, labels, root) == names  # written once: kept
    with open(os.path.join(root, names[3]), "rb") as f:
        decoded = decode_png(f.read())
    expected = ((pixels[3].float() / 255 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD).unsqueeze(0)
    torch.testing.assert_close(decoded, expected)
    a, b = augment(decoded, 3, epoch=1), augment(decoded, 3, epoch=1)
    assert a.shape == decoded.shape and torch.equal(a, b)
    assert any(not torch.equal(augment(decoded, 3, epoch=e), a) for e in range(2, 8))


def test_shard_epoch_partitions_and_reshuffles():
    for world_size in (1, 2, 3, 5):
        for epoch in (0, 1):
            shards = [shard_epoch(N, r, world_size, epoch) for r in range(world_size)]
            assert sorted(i for s in shards for i in s) == list(range(N))
    assert shard_epoch(N, 0, 2, 0) != shard_epoch(N, 0, 2, 1)
    with pytest.raises(ValueError, match="rank=2"):
        shard_epoch(N, 2, 2, 0)


def test_memory_store_holds_this_holders_samples(images, tmp_path):
    root, names, _, _ = images
    source = DirectorySource(root)
    cache = DataCache(source, names, LabelledImages(_labels(root)), cache_dir=str(tmp_path), rank=1, world_size=2)
    for i in range(N):
        cache[i]
    assert (source.fetches, cache.in_memory) == (N, N // 2)
    for i in range(N):
        cache[i]
    assert cache.stats.memory_hits == N // 2 and cache.stats.file_hits == N - N // 2
    assert source.fetches == N
    with pytest.raises(IndexError):
        cache[N]


def test_naive_reader_reads_the_source_every_time(images):
    root, names, _, _ = images
    source = DirectorySource(root)
    naive = DataCache(source, names, LabelledImages(_labels(root)), cache_dir=None, memory=False)
    for _ in range(2):
        for i in range(N):
            naive[i]
    assert source.fetches == 2 * N and naive.in_memory == 0


def _epochs_worker(make_source, names, labels, cache_dir, epochs):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cache = DataCache(make_source(), names, LabelledImages(labels), cache_dir=os.path.join(cache_dir, f"node{rank}"),
                      rank=rank, world_size=world)
    loader = PrefetchLoader(cache, batch_size=4, transform=augment, threads=3, prefetch=3)
    delivered, stats = [], []
    for epoch in range(epochs):
        seen = []
        for inputs, targets, indices in loader.epoch(shard_epoch(len(names), rank, world, epoch), epoch):
            assert inputs.shape[1:] == (1, 28, 28) and targets.tolist() == [labels[i] for i in indices.tolist()]
            seen += indices.tolist()
        delivered.append(seen)
        stats.append(loader.last_epoch.cache)
    return delivered, stats


def _check_exactly_once(results, epochs):
    for epoch in range(epochs):
        everything = [i for delivered, _ in results for i in delivered[epoch]]
        assert sorted(everything) == list(range(N)), f"epoch {epoch}: not every sample exactly once"


def _source_factory(root):
    return lambda: DirectorySource(root)


@pytest.mark.parametrize("P", [1, 3])
def test_every_sample_once_per_epoch_and_file_cache_survives_a_new_process(images, tmp_path, P):
    root, names, _, _ = images
    labels = _labels(root)
    first = run_workers(P, _epochs_worker, _source_factory(root), names, labels, str(tmp_path), 2, timeout=120)
    _check_exactly_once(first, 2)
    for _, (epoch1, epoch2) in first:
        assert epoch1.source_fetches > 0 and epoch1.memory_hits == 0
        assert epoch2.source_fetches == 0 and epoch2.file_hits == 0 and epoch2.memory_hits == epoch1.source_fetches
    # the cache is killed: new processes, new DataCache objects, the same cache directories
    second = run_workers(P, _epochs_worker, _source_factory(root), names, labels, str(tmp_path), 1, timeout=120)
    _check_exactly_once(second, 1)
    for (_, (again,)), (_, (before, _)) in zip(second, first, strict=True):
        assert again.source_fetches == 0 and again.file_hits == before.source_fetches


needs_server = pytest.mark.skipif(unavailable_reason() is not None,
                                  reason=f"the file server needs network namespaces: {unavailable_reason()}")


def _namespaces():
    return set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()


@pytest.mark.net
@needs_server
def test_through_the_file_server_in_its_namespace(images, tmp_path):
    root, names, _, _ = images
    labels = _labels(root)
    with FileServer(root, rate="50mbit") as server:
        own = {server.server_namespace, server.client_namespace}
        assert own <= _namespaces()
        client = server.client()
        assert client.fetch("labels.txt").decode().split() == [str(y) for y in labels]
        with pytest.raises(FileNotFoundError, match="404"):
            client.fetch("missing.png")
        first = run_workers(2, _epochs_worker, server.client, names, labels, str(tmp_path), 2, timeout=120)
        _check_exactly_once(first, 2)
        assert sum(epoch1.source_bytes for _, (epoch1, _) in first) >= sum(
            os.path.getsize(os.path.join(root, n)) for n in names)
        second = run_workers(2, _epochs_worker, server.client, names, labels, str(tmp_path), 1, timeout=120)
        assert all(again.source_fetches == 0 and again.file_hits > 0 for _, (again,) in second)
    assert not own & _namespaces(), "the file server's namespaces outlived it"


def test_bad_arguments(images):
    root, names, _, _ = images
    with pytest.raises(ValueError, match="rank=3"):
        DataCache(DirectorySource(root), names, LabelledImages([]), rank=3, world_size=2)
    with pytest.raises(ValueError, match="batch_size=0"):
        PrefetchLoader(DataCache(DirectorySource(root), names, LabelledImages([])), 0, augment)
    with pytest.raises(ValueError, match="root="):
        FileServer(os.path.join(root, "missing"))


@pytest.mark.net
@needs_server
def test_file_server_torn_down_on_exception_and_after_sigkill(images):
    import signal
    import subprocess
    import sys
    import time

    from sparsecomm_lab.fileserver import cleanup_stale_servers

    root = images[0]
    server = FileServer(root, rate="50mbit")
    with pytest.raises(KeyError), server:
        assert server.server_namespace in _namespaces()
        raise KeyError("boom")
    assert not {server.server_namespace, server.client_namespace} & _namespaces()
    # a creator killed by SIGKILL: its server dies with it, its namespaces go at the next cleanup
    script = ("import os, signal, sys\nfrom sparsecomm_lab.fileserver import FileServer\n"
              "server = FileServer(sys.argv[1]).__enter__()\nprint(os.getpid(), server._process.pid, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    child = subprocess.run([sys.executable, "-c", script, root], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL
    creator_pid, server_pid = (int(v) for v in child.stdout.split())
    deadline = time.monotonic() + 10
    while _running(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(server_pid), "the server outlived its creator"
    left = {n for n in _namespaces() if n.startswith(f"scfs{creator_pid}-")}
    assert len(left) == 2, "the killed creator's namespaces should still be there"
    assert set(cleanup_stale_servers()) >= left
    assert not left & _namespaces()


def _running(pid):
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
