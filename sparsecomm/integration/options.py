"""Checking a method's options before the process group exists.

``SparseHookState(None, method, density=...)`` is often built before ``init_process_group``. A method
instance needs a communicator, so the check of values that depend on the ranks (a probe instance)
waits for the process group; what needs none is checked at construction already, by the method's
spec (:class:`~sparsecomm.methods.MethodSpec`): the option names, the density rule, the policy.
"""

from __future__ import annotations

from typing import Any

from ..methods import MethodSpec

__all__ = ["check_options_offline"]


def check_options_offline(name: str, options: dict[str, Any]) -> None:
    """``ValueError`` / ``TypeError`` naming the option when ``options`` cannot build method ``name``
    on any process group: an unknown option, a missing or out-of-range density, or a density given to
    a dense method."""
    MethodSpec.of(name, options)
