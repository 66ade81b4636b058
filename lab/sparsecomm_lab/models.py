"""Small models for training runs, sized for CPU workers.

| name | model | data |
| --- | --- | --- |
| ``mlp`` | 2 hidden layers, ReLU | any image classification set (flattened) |
| ``cnn`` | VGG-style: conv-conv-pool blocks, then a linear classifier | ``digits``, ``fashion-mnist`` |
| ``lstm`` | embedding, 2-layer LSTM, linear decoder (a character language model) | ``fortunes`` |
| ``embedding`` | a large ``nn.Embedding`` averaged over a bag, then linear (row-sparse gradients) | ``zipf`` |
| ``vgg-fc`` | VGG-style: two thin conv blocks, then wide fully connected layers (~14M parameters) | ``fashion-mnist`` |
| ``word-lstm`` | wide word embedding, 1-layer LSTM, linear decoder (~13M parameters) | ``fortunes-words`` |
| ``gpt`` | decoder-only transformer, pre-LayerNorm, tied embeddings (~3.7M parameters) | ``python-source`` |
| ``resnet`` | a ResNet with BatchNorm, narrow early and wide late stages (~4.3M parameters) | ``fashion-mnist`` |

``vgg-fc``, ``word-lstm``, ``gpt`` and ``resnet`` are the communication-heavy workloads of the
campaign: at 1 Gbit/s a DDP step of theirs spends most of its time moving the gradient, as VGG-16,
ResNets and the LSTM and transformer language models of the papers do (SparDL, RedSync: VGG-16, LSTM
on PTB; Shi et al.: ResNet-50, transformers, embeddings). ``gpt`` and ``resnet`` are the models users
train most (a GPT trained with AdamW, a BatchNorm CNN trained with SGD and momentum); the gradient of
``word-lstm`` is mostly an embedding that a step touches only a few rows of.

:func:`make_model` builds one from the data set's ``info`` (input shape, classes, vocabulary);
:data:`MODEL_DEFAULTS` holds the tuned training hyperparameters of each model and data set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["MLP", "SmallVGG", "WideVGG", "LSTMLanguageModel", "WordLSTM", "BagOfEmbeddings", "GPT", "ResNet",
           "make_model", "available_models", "MODEL_DATA", "MODEL_DEFAULTS", "model_defaults"]


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
                 dropout: float = 0.0, sparse_embedding: bool = False) -> None:
        super().__init__()
        # sparse_embedding: the table's gradient is a sparse tensor of the touched rows, which DDP
        # all-gathers instead of all-reducing the whole table (what a PyTorch user would try first)
        self.embed = nn.Embedding(vocab_size, embed_dim, sparse=sparse_embedding)
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


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask (each position attends to itself and the past)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} must be a multiple of heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class TransformerBlock(nn.Module):
    """A pre-LayerNorm block (Xiong et al. 2020): ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model in the style of GPT-2 (Radford et al. 2019).

    Token and learned position embeddings, ``layers`` pre-LayerNorm blocks, a final LayerNorm, and
    next-token logits from the token embedding itself (tied input and output embeddings). Weights
    are initialized as GPT-2 does: normal(0, 0.02), the residual projections scaled by
    ``1/sqrt(2 * layers)``. ``forward`` maps (batch, seq) token ids to (batch, seq, vocab) logits.
    """

    def __init__(self, vocab_size: int, context: int, width: int = 256, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.context = context
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(TransformerBlock(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() >= 2:
                scaled = name.endswith(("attn.proj.weight", "mlp.2.weight"))
                nn.init.normal_(param, 0.0, 0.02 / math.sqrt(2 * layers) if scaled else 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.context:
            raise ValueError(f"a sequence of {length} tokens is longer than the context ({self.context})")
        x = self.token(tokens) + self.position(torch.arange(length, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.token.weight.t()


class BasicBlock(nn.Module):
    """He et al.'s basic residual block: two 3x3 conv + BatchNorm, a projection shortcut on a change
    of width or stride."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.relu(self.bn1(self.conv1(x)))
        return nn.functional.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet (He et al. 2016) with BatchNorm for small images: a 3x3 stem (stride ``stem_stride``),
    one stage of ``blocks`` basic blocks per entry of ``widths`` (stride 2 from the second stage on),
    global average pooling and a linear classifier. Narrow early stages on large maps and wide late
    stages on small ones make the gradient large against the compute (a communication-heavy CNN:
    on 28x28 images the 512-wide stage runs on 2x2 maps)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, widths: Sequence[int] = (16, 32, 128, 512),
                 blocks: int = 1, stem_stride: int = 2) -> None:
        super().__init__()
        in_ch = input_shape[0]
        self.stem = nn.Sequential(nn.Conv2d(in_ch, widths[0], 3, stride=stem_stride, padding=1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages: list[nn.Module] = []
        width = widths[0]
        for i, out in enumerate(widths):
            for j in range(blocks):
                stages.append(BasicBlock(width, out, 2 if i > 0 and j == 0 else 1))
                width = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(width, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


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


def _gpt(info: dict, **options) -> nn.Module:
    return GPT(info["vocab_size"], info["seq_len"], **options)


def _resnet(info: dict, **options) -> nn.Module:
    return ResNet(info["input_shape"], info["num_classes"], **options)


_BUILDERS: dict[str, Callable[..., nn.Module]] = {"mlp": _mlp, "cnn": _cnn, "lstm": _lstm, "embedding": _embedding,
                                                 "vgg-fc": _vgg_fc, "word-lstm": _word_lstm, "gpt": _gpt,
                                                 "resnet": _resnet}
_NEEDS: dict[str, list[str]] = {"mlp": ["input_shape", "num_classes"], "cnn": ["input_shape", "num_classes"],
                                "lstm": ["vocab_size"], "embedding": ["vocab_size", "num_classes"],
                                "vgg-fc": ["input_shape", "num_classes"], "word-lstm": ["vocab_size"],
                                "gpt": ["vocab_size", "seq_len"], "resnet": ["input_shape", "num_classes"]}
#: the data sets each model fits (the first is its default)
MODEL_DATA: dict[str, list[str]] = {
    "mlp": ["digits", "fashion-mnist"],
    "cnn": ["digits", "fashion-mnist"],
    "lstm": ["fortunes"],
    "embedding": ["zipf"],
    "vgg-fc": ["fashion-mnist"],
    "word-lstm": ["fortunes-words"],
    "gpt": ["python-source"],
    "resnet": ["fashion-mnist"],
}

#: tuned training hyperparameters per (model, data set), keyed by model (its default data) or
#: ``"model/data"``; SGD with momentum 0.9 and the cosine schedule (the campaigns tune the learning rate
#: on their own grid, docs/training.md). Per-worker batch size.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "mlp": {"lr": 0.05, "batch_size": 16, "epochs": 5},
    "cnn": {"lr": 0.05, "batch_size": 16, "epochs": 5},
    "cnn/fashion-mnist": {"lr": 0.03, "batch_size": 32, "epochs": 3},
    "lstm": {"lr": 0.5, "batch_size": 16, "epochs": 5},
    "embedding": {"lr": 0.5, "batch_size": 32, "epochs": 5},
    "vgg-fc": {"lr": 0.005, "batch_size": 16, "epochs": 2},
    "word-lstm": {"lr": 1.0, "batch_size": 8, "epochs": 3},
    # AdamW as GPT-2-style models train (betas 0.9/0.95, decoupled weight decay 0.1, warm-up, cosine,
    # clipping at 1.0); small batches keep the step's compute small against its gradient
    "gpt": {"lr": 1e-3, "batch_size": 2, "epochs": 1, "optimizer": "adamw", "betas": (0.9, 0.95),
            "weight_decay": 0.1, "warmup_steps": 50},
    "resnet": {"lr": 0.05, "batch_size": 32, "epochs": 1, "weight_decay": 5e-4},
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
    (see :class:`sparsecomm_lab.data.Dataset`)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(available_models())}")
    missing = [key for key in _NEEDS[name] if key not in info]
    if missing:
        raise ValueError(f"model {name!r} does not fit this data (its info lacks {missing}); "
                         f"model {name!r} fits data sets {MODEL_DATA[name]}")
    return _BUILDERS[name](info, **options)
