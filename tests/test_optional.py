"""Optional dependencies: a missing one is a one-line error naming the extra that installs it."""

import sys

import pytest
import torch

from sparsecomm.core.optional import MissingExtraError, available, require


def _hide(monkeypatch, package):
    """Make ``import package`` (and its submodules) fail as if it were not installed."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


@pytest.mark.parametrize("module, extra, distribution", [
    ("matplotlib", "plots", "matplotlib"), ("PIL.Image", "data", "pillow"), ("tqdm", "data", "tqdm"),
    ("sklearn.datasets", "data", "scikit-learn")])
def test_a_missing_dependency_names_its_extra(monkeypatch, module, extra, distribution):
    _hide(monkeypatch, module.split(".")[0])
    with pytest.raises(MissingExtraError) as err:
        require(module, "the thing")
    assert str(err.value) == f"the thing needs {distribution}: pip install 'sparsecomm[{extra}]'"
    assert not available(module)


def test_an_installed_dependency_is_returned():
    pytest.importorskip("matplotlib")
    assert require("matplotlib", "a plot").__name__ == "matplotlib" and available("matplotlib")


def test_only_known_extras_are_required():
    with pytest.raises(ValueError, match="not an optional dependency"):
        require("numpy", "arrays")


def test_datacache_png_writing_without_pillow_names_the_data_extra(monkeypatch, tmp_path):
    from sparsecomm.integration.datacache import write_png_dataset

    _hide(monkeypatch, "PIL")
    with pytest.raises(MissingExtraError, match=r"writing PNG files needs pillow: pip install 'sparsecomm\[data\]'"):
        write_png_dataset(torch.zeros(2, 4, 4, dtype=torch.uint8), torch.zeros(2), str(tmp_path))
