"""Launching Triton kernels cheaply: the compiled kernel's handle, called straight.

Triton ships with CUDA builds of PyTorch (CPU builds come without it: every user of this module
then takes its torch path). ``TRITON_INTERPRET=1`` runs kernels in Triton's interpreter on CPU
tensors, which the test suite uses to check the GPU kernels without a GPU.
"""

from __future__ import annotations

import os
from typing import Any

from torch import Tensor

__all__ = ["Launcher", "interpreted", "installed"]

try:
    import triton  # noqa: F401  (only whether it imports)
except ImportError:
    triton = None


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def installed() -> bool:
    """Whether Triton can be imported here."""
    return triton is not None


class Launcher:
    """A Triton kernel compiled once per (device, 16-byte alignment of its first tensor ``x``, the
    dtypes of its tensors, warps, constexpr values) and then launched straight through its compiled
    handle, which takes the constexprs positionally: pass them as keywords in the kernel's own order.
    Integer arguments must keep to one side of 2^31 from call to call (they are compiled as int32 or
    int64 by the first call's value).

    Triton's own ``kernel[grid](...)`` binds and specializes the arguments on every call, about 50
    microseconds of Python in Triton 3.6: more than the kernel itself on gradients of a few million
    elements. The kernels here are declared not to specialize on their integer arguments nor on the
    alignment of any pointer but the first, so one compiled kernel serves every call with the same
    key. Under the interpreter (``TRITON_INTERPRET=1``) the plain launch is used. ``options``:
    compiler options (``enable_fp_fusion=False`` where float64 arithmetic must round as the host's).
    """

    def __init__(self, kernel, **options: Any) -> None:
        self.kernel = kernel
        self.options = options
        self.compiled: dict = {}

    def __call__(self, programs: int, x: Tensor, *args, warps: int, **constants: int) -> None:
        grid = (max(1, programs), 1, 1)
        if interpreted() or not x.is_cuda:
            self.kernel[grid](x, *args, **constants, num_warps=warps, **self.options)
            return
        key = (x.device.index, x.dtype, x.data_ptr() % 16 == 0, warps, *constants.values(),
               *[a.dtype for a in args if isinstance(a, Tensor)])
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel.warmup(x, *args, **constants, num_warps=warps, grid=grid, **self.options)
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            self.compiled[key] = compiled
        compiled[grid](x, *args, *constants.values())

