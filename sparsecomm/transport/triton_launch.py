"""Launching Triton kernels cheaply: the compiled kernel's handle, called straight.

Triton ships with CUDA builds of PyTorch (CPU builds come without it: every user of this module
then takes its torch path). ``TRITON_INTERPRET=1`` runs kernels in Triton's interpreter on CPU
tensors, which the test suite uses to check the GPU kernels without a GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch
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
        launch = self.compiled.get(key)
        if launch is None:
            launch = self.compiled[key] = self._compile(x, args, warps, constants, grid)
        launch(grid, x, *args, *constants.values())

    def _compile(self, x: Tensor, args: tuple, warps: int, constants: dict, grid: tuple):
        """The compiled kernel's launch: its launcher called with the handles it needs, on torch's
        current stream (what ``compiled[grid](...)`` does, less the per-call lookups)."""
        compiled = self.kernel.warmup(x, *args, **constants, num_warps=warps, grid=grid, **self.options)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        compiled._init_handles()
        run, function, metadata = (getattr(compiled, name, None) for name in ("run", "function", "packed_metadata"))
        if run is None or function is None:  # another Triton's layout: its own launch path
            return lambda grid, *values: compiled[grid](*values)
        device = x.device.index
        # the raw current stream, as Triton's own launch asks torch for it (a Stream object costs more)
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

        def launch(grid: tuple, *values: Any) -> None:
            stream = raw_stream(device) if raw_stream is not None else torch.cuda.current_stream(device).cuda_stream
            run(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *values)
        return launch

