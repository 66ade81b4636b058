"""The communication-heavy workloads of issue 13 (models.WideVGG, models.WordLSTM, data
fortunes-words) and the per-model training defaults."""

from __future__ import annotations

import pytest
import torch
from sparsecomm_lab.data import DatasetUnavailable, load_dataset, tokenize_words
from sparsecomm_lab.models import MODEL_DEFAULTS, available_models, make_model, model_defaults
from sparsecomm_lab.training import TrainConfig

FASHION_INFO = {"input_shape": (1, 28, 28), "num_classes": 10}
WORDS_INFO = {"vocab_size": 10000}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, info, bulk", [
    ("vgg-fc", FASHION_INFO, (torch.nn.Linear,)),
    ("word-lstm", WORDS_INFO, (torch.nn.Embedding, torch.nn.Linear)),
])
def test_communication_heavy_models_hold_10_to_30M_parameters_mostly_in_cheap_layers(name, info, bulk):
    model = make_model(name, info)
    total = _count(model)
    assert 10e6 <= total <= 30e6, total
    cheap = sum(_count(m) for m in model.modules() if isinstance(m, bulk))
    assert cheap / total > 0.97, (name, cheap / total)


def test_vgg_fc_and_word_lstm_forward_shapes():
    vgg = make_model("vgg-fc", FASHION_INFO)
    assert vgg(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    lstm = make_model("word-lstm", {"vocab_size": 50}, embed_dim=16, hidden=8)
    assert lstm(torch.zeros(2, 7, dtype=torch.int64)).shape == (2, 7, 50)


def test_word_lstm_embedding_gradient_touches_only_the_batch_rows():
    torch.manual_seed(0)
    lstm = make_model("word-lstm", {"vocab_size": 100}, embed_dim=8, hidden=8)
    tokens = torch.tensor([[3, 5, 5, 9]])
    lstm(tokens).sum().backward()
    rows = lstm.embed.weight.grad.abs().sum(dim=1).nonzero().flatten().tolist()
    assert rows == [3, 5, 9]


def test_tokenize_words_lowercases_keeps_contractions_and_marks_entry_ends():
    assert tokenize_words("Don't panic!\n\nIt's 42.") == ["don't", "panic", "!", "<eos>", "it's", "42", ".", "<eos>"]


def test_fortunes_words_is_a_word_level_language_model_with_a_capped_vocabulary():
    try:
        data = load_dataset("fortunes-words", max_vocab=5000, test_size=50)
    except DatasetUnavailable as exc:
        pytest.skip(str(exc))
    assert data.task == "language-model"
    assert data.info["vocab_size"] == 5000
    assert int(data.x_train.max()) < 5000 and len(data.x_test) == 50
    assert torch.equal(data.x_train[:, 1:], data.y_train[:, :-1])  # y is x shifted by one token
    assert data.info["tokens"] > 15_000  # fortunes-min alone has ~18k words, with fortunes ~460k
    assert data.info["unk_fraction"] < 0.15


def test_fortunes_words_rejects_a_vocabulary_without_words():
    with pytest.raises(ValueError, match="max_vocab=1"):
        load_dataset("fortunes-words", max_vocab=1)


def test_every_model_has_tuned_defaults_and_train_config_fills_them_in():
    assert set(available_models()) <= set(MODEL_DEFAULTS)
    config = TrainConfig(model="cnn", data="fashion-mnist")
    tuned = model_defaults("cnn", "fashion-mnist")
    assert (config.lr, config.batch_size, config.epochs) == (tuned["lr"], tuned["batch_size"], tuned["epochs"])
    assert tuned["lr"] != model_defaults("cnn", "digits")["lr"]
    explicit = TrainConfig(model="cnn", data="fashion-mnist", lr=0.3, batch_size=8, epochs=1)
    assert (explicit.lr, explicit.batch_size, explicit.epochs) == (0.3, 8, 1)


def _train_locally(model_name: str, data, config: TrainConfig, steps: int) -> float:
    """Single-process SGD with ``config``'s lr, batch and momentum; returns the test accuracy."""
    torch.manual_seed(0)
    model = make_model(model_name, data.info)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    batch = config.batch_size  # one worker's batch (the global batch of a P-worker step costs P times more)
    for step in range(steps):
        start = (step * batch) % (len(data.x_train) - batch)
        x, y = data.x_train[start:start + batch], data.y_train[start:start + batch]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        return float((model(data.x_test).argmax(1) == data.y_test).float().mean()) * 100


@pytest.mark.parametrize("model_name", ["cnn", "vgg-fc"])
def test_default_lr_learns_fashion_mnist(model_name):
    """The reported defect: cnn on fashion-mnist at the default lr diverged to 10% (chance)."""
    try:
        data = load_dataset("fashion-mnist", train_size=2000, test_size=300)
    except DatasetUnavailable as exc:
        pytest.skip(str(exc))
    config = TrainConfig(model=model_name, data="fashion-mnist")
    assert _train_locally(model_name, data, config, steps=40) > 50.0
