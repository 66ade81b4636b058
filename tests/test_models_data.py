"""Offline data sets and the models that fit them."""

import pytest
import torch
from sparsecomm_lab import data as data_module
from sparsecomm_lab.data import DatasetUnavailable, load_dataset
from sparsecomm_lab.models import MODEL_DATA, make_model


def test_digits_split_is_seeded_and_disjoint():
    a, b = load_dataset("digits", seed=3), load_dataset("digits", seed=3)
    assert torch.equal(a.x_train, b.x_train) and a.x_train.shape[1:] == (1, 8, 8)
    assert len(a.x_train) + len(a.x_test) == 1797
    assert float(a.x_train.max()) <= 1.0


def test_zipf_tokens_are_skewed_and_labels_learnable():
    ds = load_dataset("zipf", vocab_size=1000, train_size=500, test_size=100)
    counts = torch.bincount(ds.x_train.reshape(-1), minlength=1000)
    assert counts[0] > 20 * counts[500:].float().mean()
    assert set(ds.y_train.tolist()) <= set(range(4))


def test_missing_debian_data_names_the_package(monkeypatch, tmp_path):
    monkeypatch.setattr(data_module, "FASHION_MNIST_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(data_module, "FORTUNES_DIR", str(tmp_path / "none"))
    with pytest.raises(DatasetUnavailable, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist")
    with pytest.raises(DatasetUnavailable, match="apt-get install fortunes-min"):
        load_dataset("fortunes")


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="unknown data set 'mnist2'"):
        load_dataset("mnist2")
    with pytest.raises(ValueError, match="unknown model 'resnet-9'"):
        make_model("resnet-9", {})
    with pytest.raises(ValueError, match="does not fit"):
        make_model("lstm", load_dataset("digits").info)


@pytest.mark.parametrize("model", sorted(MODEL_DATA))
def test_each_model_fits_its_data(model):
    name = MODEL_DATA[model][0]
    options = {"vocab_size": 500, "train_size": 64, "test_size": 16} if name == "zipf" else {}
    try:
        ds = load_dataset(name, **options)
    except DatasetUnavailable as exc:
        pytest.skip(str(exc))
    net = make_model(model, ds.info)
    out = net(ds.x_train[:4])
    expected = (4, ds.x_train.shape[1], ds.num_classes) if ds.task == "language-model" else (4, ds.num_classes)
    assert out.shape == expected
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, ds.num_classes), ds.y_train[:4].reshape(-1))
    loss.backward()
    if model == "embedding":  # only the rows of the batch's tokens get a gradient
        rows = (net.embed.weight.grad.abs().sum(dim=1) > 0).sum().item()
        assert 0 < rows <= ds.x_train[:4].numel()


def test_an_option_the_loader_does_not_take_is_refused_before_training():
    from sparsecomm_lab.training import TrainConfig
    with pytest.raises(ValueError, match=r"data set 'digits' takes no option 'tset_size'; its options: test_fraction"):
        load_dataset("digits", tset_size=3)
    config = TrainConfig(model="resnet", data="fashion-mnist", data_options={"test_sise": 200})
    with pytest.raises(ValueError, match=r"data set 'fashion-mnist' takes no option 'test_sise'; its options: "
                                         r"train_size, test_size"):
        config.validate()
