"""Checking a method's options before the process group exists (issue 23, item 6).

``SparseHookState(None, method, density=...)`` is often built before ``init_process_group``. A method
instance needs a communicator, so the full check (a probe instance) waits for the process group; what
needs no process group is checked at construction already: the option names (against the method
class's constructor) and the density rule of sparse methods.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..core.validate import check_fraction
from ..methods import method_class

__all__ = ["check_options_offline"]


def check_options_offline(name: str, options: dict[str, Any]) -> None:
    """``ValueError`` / ``TypeError`` naming the option when ``options`` cannot build method ``name``
    on any process group: an unknown option, a missing or out-of-range density, or a density given to
    a dense method."""
    cls = method_class(name)
    parameters = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        accepted = {p for p in parameters if p not in ("self", "comm")}
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise TypeError(f"method {name!r} takes no option(s) {', '.join(map(repr, unknown))}; "
                            f"its options: {', '.join(sorted(accepted)) or 'none'}")
    if cls.sparse:
        if options.get("density") is None:
            raise ValueError(f"method {name!r} needs density= (a fraction in (0, 1])")
        check_fraction("density", options["density"])
    elif options.get("density") is not None:
        raise ValueError(f"method {name!r} is dense and takes no density (got {options['density']!r})")
