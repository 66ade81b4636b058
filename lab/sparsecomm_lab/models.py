"""Small models for training runs, sized for CPU workers.

| name | model | data |
| --- | --- | --- |
| ``mlp`` | 2 hidden layers, ReLU | any image classification set (flattened) |
| ``cnn`` | VGG-style: conv-conv-pool blocks, then a linear classifier | ``digits``, ``fashion-mnist`` |
| ``lstm`` | embedding, 2-layer LSTM, linear decoder (a character language model) | ``fortunes`` |
| ``embedding`` | a large ``nn.Embedding`` averaged over a bag, then linear (row-sparse gradients) | ``zipf`` |
| ``vgg-fc`` | VGG-style: two thin conv blocks, then wide fully connected layers (~14M parameters) | ``fashion-mnist`` |
| ``word-lstm`` | wide word embedding, 1-layer LSTM, linear decoder (~13M parameters) | ``fortunes-words`` |

The last two are the communication-heavy workloads of the campaign: most of their parameters sit in
fully connected or embedding layers, whose gradient is large but cheap to compute, so at
1 Gbit/s a DDP step spends most of its time moving the gradient, as VGG-16 and the LSTM language
models of the papers do (SparDL, RedSync: VGG-16, LSTM on PTB; Shi et al.: embeddings).

:func:`make_model` builds one from the data set's ``info`` (input shape, classes, vocabulary);
:data:`MODEL_DEFAULTS` holds the tuned training hyperparameters of each model and data set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["MLP", "SmallVGG", "WideVGG", "LSTMLanguageModel", "WordLSTM", "BagOfEmbeddings", "make_model",
           "available_models", "MODEL_DATA", "MODEL_DEFAULTS", "model_defaults"]


class MLP(nn.Module):
    """Flatten, then ``hidden`` fully connected ReLU layers, then the classifier."""

    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int] = (128, 64)) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _he_init(module: nn.Module) -> None:
    """He et al. (2015) initialization for ReLU networks (normal, fan-in), zero biases: without it,
    torch's default (uniform, gain 1/sqrt(3)) shrinks the signal through the stacked layers and the
    first hundreds of SGD steps stay at chance."""
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)


class SmallVGG(nn.Module):
    """VGG-style CNN (Simonyan and Zisserman's 3x3 conv stacks) shrunk for small images.

    ``channels`` gives one block per entry: two 3x3 conv + ReLU layers and a 2x2 max-pool (skipped
    once the map is 1 pixel wide). A linear layer classifies the flattened last map.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (32, 64)) -> None:
        super().__init__()
        in_ch, height, width = input_shape
        layers: list[nn.Module] = []
        for out_ch in channels:
            layers += [nn.Conv2d(in_ch, out_ch, 3, padding=1), nn.ReLU(),
                       nn.Conv2d(out_ch, out_ch, 3, padding=1), nn.ReLU()]
            if min(height, width) >= 2:
                layers.append(nn.MaxPool2d(2))
                height, width = height // 2, width // 2
            in_ch = out_ch
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(in_ch * height * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class WideVGG(nn.Module):
    """VGG-style CNN whose parameters sit in wide fully connected layers (VGG-16's FC6/FC7 shape).

    Two blocks of two 3x3 conv + ReLU layers and a 2x2 max-pool (``channels``), then fully
    connected ReLU layers of widths ``fc`` with dropout, then the classifier. With the defaults on
    28x28 images: 1568 -> 4096 -> 2048 -> 10, about 15M parameters, of which the convolutions hold
    under 0.1%: the gradient is ~60 MB but a step costs a few GFLOP.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (8, 16),
                 fc: Sequence[int] = (4096, 2048), dropout: float = 0.0) -> None:
        super().__init__()
        self.features = SmallVGG(input_shape, num_classes, channels).features
        with torch.no_grad():
            width = self.features(torch.zeros(1, *input_shape)).numel()
        layers: list[nn.Module] = [nn.Flatten()]
        for h in fc:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.classifier = nn.Sequential(*layers)
        _he_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class LSTMLanguageModel(nn.Module):
    """Token embedding, a ``num_layers`` LSTM and a linear decoder to next-token logits.

    ``forward`` maps (batch, seq) token ids to (batch, seq, vocab) logits.
    """

    def __init__(self, vocab_size: int, embed_dim: int = 64, hidden: int = 128, num_layers: int = 2,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=num_layers, batch_first=True, dropout=dropout)
        self.decoder = nn.Linear(hidden, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.decoder(out)


class WordLSTM(nn.Module):
    """Word-level LSTM language model with a wide embedding (the seeds' LSTM-on-PTB analogue).

    A ``vocab_size x embed_dim`` embedding (most of the parameters: ~10M with the defaults and a
    10k vocabulary), a projection to ``hidden``, a 1-layer LSTM and a linear decoder to the
    vocabulary. A step touches only the embedding rows of its tokens, so the compute is small
    while the dense gradient is the whole table. ``forward`` maps (batch, seq) token ids to
    (batch, seq, vocab) logits.
    """

    def __init__(self, vocab_size: int, embed_dim: int = 1024, hidden: int = 128, num_layers: int = 1,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.drop = nn.Dropout(dropout)
        self.project = nn.Linear(embed_dim, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=num_layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab_size)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.project(self.drop(self.embed(tokens))))
        return self.decoder(self.drop(out))


class BagOfEmbeddings(nn.Module):
    """Mean of the embeddings of a bag of tokens, then a linear classifier.

    With a large vocabulary the embedding table dominates the parameters, and a batch touches only
    the rows of its tokens: the gradient is sparse by construction (dense tensor, mostly zero rows).
    """

    def __init__(self, vocab_size: int, num_classes: int, embed_dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab_size, embed_dim, mode="mean")
        self.classifier = nn.Linear(embed_dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embed(tokens))


def _mlp(info: dict, **options) -> nn.Module:
    return MLP(math.prod(info["input_shape"]), info["num_classes"], **options)


def _cnn(info: dict, **options) -> nn.Module:
    return SmallVGG(info["input_shape"], info["num_classes"], **options)


def _lstm(info: dict, **options) -> nn.Module:
    return LSTMLanguageModel(info["vocab_size"], **options)


def _embedding(info: dict, **options) -> nn.Module:
    return BagOfEmbeddings(info["vocab_size"], info["num_classes"], **options)


def _vgg_fc(info: dict, **options) -> nn.Module:
    return WideVGG(info["input_shape"], info["num_classes"], **options)


def _word_lstm(info: dict, **options) -> nn.Module:
    return WordLSTM(info["vocab_size"], **options)


_BUILDERS: dict[str, Callable[..., nn.Module]] = {"mlp": _mlp, "cnn": _cnn, "lstm": _lstm, "embedding": _embedding,
                                                 "vgg-fc": _vgg_fc, "word-lstm": _word_lstm}
_NEEDS: dict[str, list[str]] = {"mlp": ["input_shape", "num_classes"], "cnn": ["input_shape", "num_classes"],
                                "lstm": ["vocab_size"], "embedding": ["vocab_size", "num_classes"],
                                "vgg-fc": ["input_shape", "num_classes"], "word-lstm": ["vocab_size"]}
#: the data sets each model fits (the first is its default)
MODEL_DATA: dict[str, list[str]] = {
    "mlp": ["digits", "fashion-mnist"],
    "cnn": ["digits", "fashion-mnist"],
    "lstm": ["fortunes"],
    "embedding": ["zipf"],
    "vgg-fc": ["fashion-mnist"],
    "word-lstm": ["fortunes-words"],
}

#: tuned training hyperparameters per (model, data set), keyed by model (its default data) or
#: ``"model/data"``; SGD with momentum 0.9 and the cosine schedule (see benchmarks/lr-sweep for the
#: runs that chose them). Per-worker batch size.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "mlp": {"lr": 0.05, "batch_size": 16, "epochs": 5},
    "cnn": {"lr": 0.05, "batch_size": 16, "epochs": 5},
    "cnn/fashion-mnist": {"lr": 0.03, "batch_size": 32, "epochs": 3},
    "lstm": {"lr": 0.5, "batch_size": 16, "epochs": 5},
    "embedding": {"lr": 0.5, "batch_size": 32, "epochs": 5},
    "vgg-fc": {"lr": 0.005, "batch_size": 16, "epochs": 2},
    "word-lstm": {"lr": 1.0, "batch_size": 8, "epochs": 3},
}


def model_defaults(model: str, data: str | None = None) -> dict[str, Any]:
    """The tuned ``lr``, ``batch_size`` and ``epochs`` of ``model`` on ``data`` (its default data
    when ``None``): the ``model/data`` entry of :data:`MODEL_DEFAULTS` over the model's entry."""
    if model not in MODEL_DEFAULTS:
        raise ValueError(f"unknown model {model!r}; available: {', '.join(available_models())}")
    return {**MODEL_DEFAULTS[model], **MODEL_DEFAULTS.get(f"{model}/{data}", {})}


def available_models() -> list[str]:
    return sorted(_BUILDERS)


def make_model(name: str, info: dict, **options) -> nn.Module:
    """Build model ``name`` for a data set whose ``info`` is given
    (see :class:`sparsecomm.experiments.data.Dataset`)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(available_models())}")
    missing = [key for key in _NEEDS[name] if key not in info]
    if missing:
        raise ValueError(f"model {name!r} does not fit this data (its info lacks {missing}); "
                         f"model {name!r} fits data sets {MODEL_DATA[name]}")
    return _BUILDERS[name](info, **options)
