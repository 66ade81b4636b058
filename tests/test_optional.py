"""Optional dependencies: a missing one is a one-line error naming the extra that installs it; a C
extension built from other sources than those beside it is refused, saying how to rebuild it."""

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from sparsecomm.core.optional import (
    MissingExtraError,
    StaleExtensionError,
    available,
    compiled_extension,
    require,
    source_digest,
)


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


# ---------------------------------------------------------------------- the optional C extensions
def _extension_package(tmp_path, monkeypatch, digest: str | None, source: str | None = "int x;\n") -> str:
    """A package ``fakeext`` with a stand-in for a compiled ``_kernel`` (a .py module carrying
    ``SOURCE_DIGEST`` = ``digest``, none when None) and its source ``_kernel.c`` (none when None)."""
    package = tmp_path / "fakeext"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_kernel.py").write_text("" if digest is None else f"SOURCE_DIGEST = {digest!r}\n")
    if source is not None:
        (package / "_kernel.c").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "fakeext" or m.startswith("fakeext.")]:
        monkeypatch.delitem(sys.modules, name)
    return "fakeext"


def test_an_extension_built_from_the_source_beside_it_is_loaded(tmp_path, monkeypatch):
    digest = hashlib.sha256(b"int x;\n").hexdigest()[:16]
    package = _extension_package(tmp_path, monkeypatch, digest)
    assert source_digest(tmp_path / "fakeext" / "_kernel.c") == digest
    assert digest == compiled_extension(package, "_kernel").SOURCE_DIGEST


@pytest.mark.parametrize("built", ["0123456789abcdef", None])
def test_an_extension_built_from_other_sources_is_refused_saying_how_to_rebuild(tmp_path, monkeypatch, built):
    package = _extension_package(tmp_path, monkeypatch, built)
    with pytest.raises(StaleExtensionError) as err:
        compiled_extension(package, "_kernel")
    message = str(err.value)
    assert "\n" not in message
    assert "_kernel.py was built from other sources than" in message and "_kernel.c" in message
    assert f"digest {built or 'none'}, the source's {source_digest(tmp_path / 'fakeext' / '_kernel.c')}" in message
    assert "pip install -e ." in message and "build_ext --inplace --force" in message
    assert isinstance(err.value, ImportError)


def test_an_extension_without_its_source_beside_it_is_loaded_unchecked(tmp_path, monkeypatch):
    package = _extension_package(tmp_path, monkeypatch, "anything", source=None)  # an installed wheel
    assert compiled_extension(package, "_kernel").SOURCE_DIGEST == "anything"


def test_an_extension_that_is_not_built_is_none(tmp_path, monkeypatch):
    package = _extension_package(tmp_path, monkeypatch, "x")
    assert compiled_extension(package, "_absent") is None


@pytest.mark.parametrize("package, name", [("sparsecomm.selection", "_scan"), ("sparsecomm.transport", "_merge")])
def test_the_built_kernels_carry_their_sources_digest(package, name):
    module = compiled_extension(package, name)
    if module is None:
        pytest.skip(f"{package}.{name} is not built here")
    source = Path(module.__file__).with_name(f"{name}.c")
    if not source.is_file():
        pytest.skip("installed without its source")
    assert source_digest(source) == module.SOURCE_DIGEST
