"""Offline data sets for training runs: nothing is downloaded at run time.

| name | source | task |
| --- | --- | --- |
| ``digits`` | ``sklearn.datasets.load_digits`` (ships with scikit-learn): 1797 8x8 images | 10 classes |
| ``fashion-mnist`` | Debian package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``) | 10 classes |
| ``fortunes`` | Debian ``fortunes-min`` (``/usr/share/games/fortunes``): character-level text | next character |
| ``fortunes-words`` | the same files, word-level (with ``fortunes``: ~540k tokens, 10k-word vocabulary) | next word |
| ``zipf`` | synthetic: bags of Zipf-distributed tokens over a large vocabulary | 4 classes |
| ``python-source`` | the running Python's standard library source, byte-level BPE (HF ``tokenizers``) | next token |

:func:`load_dataset` returns a :class:`Dataset` with train and test tensors. Splits are seeded, so
every rank (and every resumed run) sees the same split.
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
import logging
import os
import re
import struct
import sys
import sysconfig
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sparsecomm.core.optional import MissingExtraError, require

__all__ = ["Dataset", "load_dataset", "check_data_options", "available_datasets", "DatasetUnavailable",
           "tokenize_words", "FASHION_MNIST_DIR", "FORTUNES_DIR", "python_source_files"]

log = logging.getLogger(__name__)

FASHION_MNIST_DIR = os.environ.get("SPARSECOMM_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")
FORTUNES_DIR = os.environ.get("SPARSECOMM_FORTUNES_DIR", "/usr/share/games/fortunes")


class DatasetUnavailable(RuntimeError):
    """The files of a data set are not on this machine; the message says how to install them."""


@dataclass
class Dataset:
    """Train and test tensors of one task.

    ``task`` is ``"classification"`` (``y`` holds one class per sample) or ``"language-model"``
    (``x`` and ``y`` are token sequences, ``y`` shifted by one). ``info`` holds what a model needs
    to fit the data (``input_shape``, ``num_classes``, ``vocab_size``).
    """

    name: str
    task: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    info: dict[str, object] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return int(self.info["num_classes"])  # type: ignore[call-overload]  # set by every loader

    def train_set(self) -> torch.utils.data.TensorDataset:
        return torch.utils.data.TensorDataset(self.x_train, self.y_train)

    def test_set(self) -> torch.utils.data.TensorDataset:
        return torch.utils.data.TensorDataset(self.x_test, self.y_test)

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, task={self.task}, train={len(self.x_train)}, "
                f"test={len(self.x_test)}, info={self.info})")


def _split(n: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = int(round(n * test_fraction))
    return order[n_test:], order[:n_test]


def _subset(x: torch.Tensor, y: torch.Tensor, limit: int | None, seed: int):
    if limit is None or limit >= len(x):
        return x, y
    keep = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:limit]
    return x[keep], y[keep]


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's 8x8 handwritten digits, scaled to [0, 1], shape (N, 1, 8, 8)."""
    try:
        sk_datasets = require("sklearn.datasets", "data set 'digits'")
    except MissingExtraError as exc:
        raise DatasetUnavailable(str(exc)) from None
    bunch = sk_datasets.load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    train, test = _split(len(x), test_fraction, seed)
    return Dataset("digits", "classification", x[train], y[train], x[test], y[test],
                   {"input_shape": (1, 8, 8), "num_classes": 10})


def _read_idx(path: str) -> torch.Tensor:
    """An IDX file (the MNIST format: big-endian magic, dims, then uint8 data), gzipped."""
    with gzip.open(path, "rb") as handle:
        raw = handle.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (header {raw[:4]!r})")
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    data = torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8)
    return data.reshape(dims)


def load_fashion_mnist(seed: int = 0, train_size: int | None = None, test_size: int | None = None) -> Dataset:
    """Fashion-MNIST (28x28 grey images, 10 classes) from Debian's ``dataset-fashion-mnist``.

    ``train_size`` / ``test_size`` keep a seeded random subset (for quick runs).
    """
    names = {"x_train": "train-images-idx3-ubyte.gz", "y_train": "train-labels-idx1-ubyte.gz",
             "x_test": "t10k-images-idx3-ubyte.gz", "y_test": "t10k-labels-idx1-ubyte.gz"}
    paths = {key: os.path.join(FASHION_MNIST_DIR, name) for key, name in names.items()}
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        raise DatasetUnavailable(
            f"data set 'fashion-mnist' is not installed (missing {missing[0]}); install it with "
            f"`sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or put the four IDX .gz "
            f"files in a folder named by SPARSECOMM_FASHION_MNIST_DIR")
    arrays = {key: _read_idx(path) for key, path in paths.items()}
    x_train = arrays["x_train"].float().div_(255.0).unsqueeze(1)
    x_test = arrays["x_test"].float().div_(255.0).unsqueeze(1)
    x_train, y_train = _subset(x_train, arrays["y_train"].long(), train_size, seed)
    x_test, y_test = _subset(x_test, arrays["y_test"].long(), test_size, seed + 1)
    return Dataset("fashion-mnist", "classification", x_train, y_train, x_test, y_test,
                   {"input_shape": (1, 28, 28), "num_classes": 10})


def _fortune_text() -> str:
    if not os.path.isdir(FORTUNES_DIR):
        raise DatasetUnavailable(
            f"data set 'fortunes' is not installed ({FORTUNES_DIR} does not exist); install it with "
            f"`sudo apt-get install fortunes-min` (Debian/Ubuntu; `fortunes` adds more text), or point "
            f"SPARSECOMM_FORTUNES_DIR at a folder of fortune files")
    texts = []
    for name in sorted(os.listdir(FORTUNES_DIR)):
        path = os.path.join(FORTUNES_DIR, name)
        if name.endswith((".dat", ".u8")) or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as handle:
            texts.append(handle.read())
    if not texts:
        raise DatasetUnavailable(f"no fortune files in {FORTUNES_DIR}; install `fortunes-min`")
    # Fortune files separate entries with lines holding only "%".
    return "\n".join(t.replace("\n%\n", "\n\n") for t in texts)


def load_fortunes(seed: int = 0, seq_len: int = 64, test_fraction: float = 0.1) -> Dataset:
    """Character-level language modelling on the fortune cookie files (``x``: seq_len characters,
    ``y``: the next character at each position). Sequences are non-overlapping windows."""
    text = _fortune_text()
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([index[ch] for ch in text], dtype=torch.int64)
    count = (len(ids) - 1) // seq_len
    x = ids[:count * seq_len].reshape(count, seq_len)
    y = ids[1:count * seq_len + 1].reshape(count, seq_len)
    train, test = _split(count, test_fraction, seed)
    return Dataset("fortunes", "language-model", x[train], y[train], x[test], y[test],
                   {"vocab_size": len(vocab), "num_classes": len(vocab), "seq_len": seq_len,
                    "characters": len(text)})


_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")


def tokenize_words(text: str) -> list[str]:
    """Lower-cased words (with an apostrophe suffix: ``don't``) and single punctuation marks;
    a blank line (the end of a fortune) becomes ``<eos>``."""
    tokens: list[str] = []
    for entry in text.lower().split("\n\n"):
        words = _WORD.findall(entry)
        if words:
            tokens += words + ["<eos>"]
    return tokens


def load_fortunes_words(seed: int = 0, seq_len: int = 35, max_vocab: int = 10000, test_fraction: float = 0.1,
                        test_size: int | None = 300, train_size: int | None = None) -> Dataset:
    """Word-level language modelling on the fortune files (Zaremba et al.'s PTB setting, scaled down).

    The ``max_vocab - 1`` most frequent tokens keep their id (ties broken alphabetically), the rest
    map to ``<unk>``. ``x`` holds non-overlapping windows of ``seq_len`` tokens, ``y`` the next token
    at each position; a seeded ``test_fraction`` of the windows is held out, of which ``test_size``
    are kept (the evaluation of a 10k-word softmax is the costly part; ``None`` keeps all).
    """
    if max_vocab < 2:
        raise ValueError(f"max_vocab={max_vocab!r} must be >= 2 (<unk> and at least one word)")
    tokens = tokenize_words(_fortune_text())
    if len(tokens) < 100_000:
        log.warning("fortunes-words: only %d tokens in %s; the LSTM workload expects ~575k: install the "
                    "Debian package `fortunes` beside `fortunes-min`", len(tokens), FORTUNES_DIR)
    counts = Counter(tokens)
    kept = sorted(counts, key=lambda w: (-counts[w], w))[:max_vocab - 1]
    vocab = ["<unk>"] + kept
    index = {word: i for i, word in enumerate(vocab)}
    ids = torch.tensor([index.get(word, 0) for word in tokens], dtype=torch.int64)
    count = (len(ids) - 1) // seq_len
    x = ids[:count * seq_len].reshape(count, seq_len)
    y = ids[1:count * seq_len + 1].reshape(count, seq_len)
    train, test = _split(count, test_fraction, seed)
    x_train, y_train = _subset(x[train], y[train], train_size, seed)
    x_test, y_test = _subset(x[test], y[test], test_size, seed + 1)
    unk = float((ids == 0).float().mean())
    return Dataset("fortunes-words", "language-model", x_train, y_train, x_test, y_test,
                   {"vocab_size": len(vocab), "num_classes": len(vocab), "seq_len": seq_len,
                    "tokens": len(ids), "unk_fraction": round(unk, 4)})


def load_zipf(seed: int = 0, vocab_size: int = 20000, bag_size: int = 20, train_size: int = 8000,
              test_size: int = 2000, num_classes: int = 4, exponent: float = 1.1) -> Dataset:
    """Bags of ``bag_size`` tokens drawn from a Zipf law over ``vocab_size`` tokens.

    Each token carries a hidden class (seeded); a bag's label is the most frequent class among its
    tokens (ties to the lower class). An embedding model of this task touches only the rows of
    the tokens in a batch, so its gradient is row-sparse, and the frequent tokens dominate it.
    """
    gen = torch.Generator().manual_seed(seed + 7919)
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
    probs = ranks.pow(-exponent)
    probs /= probs.sum()
    token_class = torch.randint(num_classes, (vocab_size,), generator=gen)
    total = train_size + test_size
    tokens = torch.multinomial(probs, total * bag_size, replacement=True, generator=gen).reshape(total, bag_size)
    counts = torch.nn.functional.one_hot(token_class[tokens], num_classes).sum(dim=1)
    labels = counts.argmax(dim=1)
    return Dataset("zipf", "classification", tokens[:train_size], labels[:train_size],
                   tokens[train_size:], labels[train_size:],
                   {"vocab_size": vocab_size, "num_classes": num_classes, "bag_size": bag_size})


def python_source_files() -> list[tuple[str, str]]:
    """(path relative to the standard library, text) of every ``.py`` file of the running Python's
    standard library, in sorted path order (third-party ``site-packages`` excluded)."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[tuple[str, str]] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8", errors="replace") as handle:
                    found.append((os.path.relpath(path, root), handle.read()))
    found.sort()
    if not found:
        raise DatasetUnavailable(f"no .py files under {root}: this Python ships without its standard library's source")
    return found


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sparsecomm-lab")


def _python_source_tokens(train_chars: int, test_chars: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """The token ids of the training and held-out text of ``python-source``, cached on disk.

    A file goes to the held-out text when the CRC-32 of its path is 0 modulo 20 (about 5% of the
    files, the same on every machine with the same Python), else to the training text; each part
    is the concatenation of its files in path order, cut at the given number of characters. The
    tokenizer is a byte-level BPE (the GPT-2 scheme: every byte is a symbol, so no text is unknown)
    trained on the training text; its training is deterministic, so the cache only saves time.
    """
    key = hashlib.sha256(f"{sys.version}|{train_chars}|{test_chars}|{vocab_size}".encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"python-source-{key}.pt")
    if os.path.exists(path):
        return torch.load(path)
    try:
        import tokenizers
    except ImportError:
        raise DatasetUnavailable("data set 'python-source' needs the package tokenizers (a dependency of the "
                                 "lab: `pip install -e lab` or `pip install tokenizers`)") from None
    train_parts: list[str] = []
    test_parts: list[str] = []
    for rel, text in python_source_files():
        (test_parts if zlib.crc32(rel.encode()) % 20 == 0 else train_parts).append(text)
    train_text = "\n".join(train_parts)[:train_chars]
    test_text = "\n".join(test_parts)[:test_chars]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    chunks = [train_text[i:i + 100_000] for i in range(0, len(train_text), 100_000)]
    tokenizer.train_from_iterator(chunks, trainer)

    def encode(text: str) -> torch.Tensor:
        pieces = [text[i:i + 100_000] for i in range(0, len(text), 100_000)]
        return torch.tensor([i for e in tokenizer.encode_batch(pieces) for i in e.ids], dtype=torch.int32)

    tokens = {"train": encode(train_text), "test": encode(test_text),
              "vocab_size": torch.tensor(tokenizer.get_vocab_size())}
    os.makedirs(_cache_dir(), exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=_cache_dir(), delete=False, suffix=".tmp") as handle:
        torch.save(tokens, handle)
    os.replace(handle.name, path)  # atomic: concurrent runs never read a partial file
    return tokens


def load_python_source(seed: int = 0, seq_len: int = 64, vocab_size: int = 8192, train_chars: int = 4_000_000,
                       test_chars: int = 200_000, test_size: int | None = 128) -> Dataset:
    """Language modelling on Python source code: the standard library of the running Python, which
    every machine has (:func:`python_source_files`), tokenized by a byte-level BPE of ``vocab_size``
    tokens (:func:`_python_source_tokens`, held-out files apart).

    ``x`` holds non-overlapping windows of ``seq_len`` tokens, ``y`` the next token at each
    position; of the held-out windows a seeded ``test_size`` are kept (``None``: all).
    """
    if seq_len < 2 or vocab_size < 300:
        raise ValueError(f"seq_len={seq_len!r} must be >= 2 and vocab_size={vocab_size!r} >= 300 "
                         f"(the 256 bytes and some merges)")
    tokens = _python_source_tokens(train_chars, test_chars, vocab_size)

    def windows(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = ids.to(torch.int64)
        count = (len(ids) - 1) // seq_len
        return ids[:count * seq_len].reshape(count, seq_len), ids[1:count * seq_len + 1].reshape(count, seq_len)

    x_train, y_train = windows(tokens["train"])
    x_test, y_test = _subset(*windows(tokens["test"]), test_size, seed + 1)
    vocab = int(tokens["vocab_size"])
    return Dataset("python-source", "language-model", x_train, y_train, x_test, y_test,
                   {"vocab_size": vocab, "num_classes": vocab, "seq_len": seq_len,
                    "tokens": len(tokens["train"]), "python": sys.version.split()[0]})


_LOADERS: dict[str, Callable[..., Dataset]] = {
    "digits": load_digits,
    "fashion-mnist": load_fashion_mnist,
    "fortunes-words": load_fortunes_words,
    "fortunes": load_fortunes,
    "zipf": load_zipf,
    "python-source": load_python_source,
}


def available_datasets() -> list[str]:
    return sorted(_LOADERS)


def check_data_options(name: str, options: dict[str, Any]) -> None:
    """Refuse an unknown data set, or an option its loader does not take, naming the ones it takes."""
    if name not in _LOADERS:
        raise ValueError(f"unknown data set {name!r}; available: {', '.join(available_datasets())}")
    known = [p for p in inspect.signature(_LOADERS[name]).parameters if p != "seed"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"data set {name!r} takes no option {', '.join(map(repr, unknown))}; "
                         f"its options: {', '.join(known)}")


def load_dataset(name: str, seed: int = 0, **options: Any) -> Dataset:
    """Load data set ``name`` (see the module table); options go to its loader.

    Raises:
        ValueError: unknown name, or an option the loader does not take.
        DatasetUnavailable: the files are not installed (the message says how to install them).
    """
    check_data_options(name, options)
    dataset = _LOADERS[name](seed=seed, **options)
    log.info("loaded %r", dataset)
    return dataset
