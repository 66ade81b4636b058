"""Small models for training runs, sized for CPU workers.

| name | model | data |
| --- | --- | --- |
| ``mlp`` | 2 hidden layers, ReLU | any image classification set (flattened) |
| ``cnn`` | VGG-style: conv-conv-pool blocks, then a linear classifier | ``digits``, ``fashion-mnist`` |
| ``lstm`` | embedding, 2-layer LSTM, linear decoder (a character language model) | ``fortunes`` |
| ``embedding`` | a large ``nn.Embedding`` averaged over a bag, then linear (row-sparse gradients) | ``zipf`` |

:func:`make_model` builds one from the data set's ``info`` (input shape, classes, vocabulary).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["MLP", "SmallVGG", "LSTMLanguageModel", "BagOfEmbeddings", "make_model", "available_models",
           "MODEL_DATA"]


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


_BUILDERS: dict[str, Callable[..., nn.Module]] = {"mlp": _mlp, "cnn": _cnn, "lstm": _lstm, "embedding": _embedding}
#: the data sets each model fits (the first is its default)
MODEL_DATA: dict[str, list[str]] = {
    "mlp": ["digits", "fashion-mnist"],
    "cnn": ["digits", "fashion-mnist"],
    "lstm": ["fortunes"],
    "embedding": ["zipf"],
}


def available_models() -> list[str]:
    return sorted(_BUILDERS)


def make_model(name: str, info: dict, **options) -> nn.Module:
    """Build model ``name`` for a data set whose ``info`` is given (see :class:`sparsecomm.app.data.Dataset`)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(available_models())}")
    missing = [key for key in {"mlp": ["input_shape", "num_classes"], "cnn": ["input_shape", "num_classes"],
                               "lstm": ["vocab_size"], "embedding": ["vocab_size", "num_classes"]}[name]
               if key not in info]
    if missing:
        raise ValueError(f"model {name!r} does not fit this data (its info lacks {missing}); "
                         f"model {name!r} fits data sets {MODEL_DATA[name]}")
    return _BUILDERS[name](info, **options)
