"""Optional dependencies: ``require(module, purpose)`` imports one or names the extra that installs it.

``pip install sparsecomm`` needs only torch and numpy. Reading images, the experiments' data sets and
progress bars need ``sparsecomm[data]`` (pillow, scikit-learn, tqdm); drawing needs
``sparsecomm[plots]`` (matplotlib). A missing one is one line::

    MissingExtraError: writing PNG files needs pillow: pip install 'sparsecomm[data]'
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "require", "available"]

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
