"""Optional dependencies: ``require(module, purpose)`` imports one or names the extra that installs it;
:func:`compiled_extension` loads one of the optional C kernels.

``pip install sparsecomm`` needs only torch and numpy. Reading images, the experiments' data sets and
progress bars need ``sparsecomm[data]`` (pillow, scikit-learn, tqdm); drawing needs
``sparsecomm[plots]`` (matplotlib). A missing one is one line::

    MissingExtraError: writing PNG files needs pillow: pip install 'sparsecomm[data]'
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "require", "available", "StaleExtensionError", "source_digest",
           "compiled_extension"]

#: top-level module -> (distribution to install, extra of sparsecomm that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "PIL": ("pillow", "data"),
    "sklearn": ("scikit-learn", "data"),
    "tqdm": ("tqdm", "data"),
    "matplotlib": ("matplotlib", "plots"),
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (e.g. ``"PIL.Image"``) for ``purpose`` ("writing PNG files"), or raise
    :class:`MissingExtraError` naming the distribution and the extra to install."""
    top = module.split(".")[0]
    if top not in EXTRAS:
        raise ValueError(f"{module!r} is not an optional dependency of sparsecomm; known: {', '.join(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if err.name is not None and err.name.split(".")[0] != top:
            raise  # the package is there but one of its own imports failed: show that error
        distribution, extra = EXTRAS[top]
        raise MissingExtraError(f"{purpose} needs {distribution}: pip install 'sparsecomm[{extra}]'") from None


def available(module: str) -> bool:
    """Whether the optional dependency ``module`` can be imported."""
    try:
        require(module, "")
    except MissingExtraError:
        return False
    return True


class StaleExtensionError(ImportError):
    """A C extension was built from other sources than those beside it (an in-place build older than
    the checkout); the message says how to rebuild it."""


def source_digest(path: str | Path) -> str:
    """The digest a C extension is built with (setup.py's ``SOURCE_DIGEST``): the first 16 hex digits
    of the SHA-256 of its source file."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def compiled_extension(package: str, name: str) -> ModuleType | None:
    """The optional C extension ``package.name`` (e.g. ``"sparsecomm.transport"``, ``"_merge"``), or
    ``None`` where it is not built (no compiler at install: the callers take their torch paths).

    Where its source ``name.c`` lies beside it (a checkout, an editable install), the extension must
    have been built from that very source: setup.py compiles the source's digest into it
    (``SOURCE_DIGEST``). A build from older sources may lack a function the Python code calls, or
    take other arguments, so it is refused with :class:`StaleExtensionError`, which says how to
    rebuild, rather than failing later with an ``AttributeError`` or a wrong result."""
    try:
        module = importlib.import_module(f"{package}.{name}")
    except ImportError:
        return None
    source = Path(module.__file__ or "").with_name(f"{name}.c")
    if source.is_file():
        built, wanted = getattr(module, "SOURCE_DIGEST", ""), source_digest(source)
        if built != wanted:
            raise StaleExtensionError(
                f"{Path(module.__file__ or name).name} was built from other sources than {source} (digest "
                f"{built or 'none'}, the source's {wanted}): rebuild it with `pip install -e .` or "
                f"`python setup.py build_ext --inplace --force` in the checkout")
    return module
