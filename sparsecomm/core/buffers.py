"""Long-lived length-n buffers (a residual, its spare, a reused output, DGC's momentum) on huge pages.

Error feedback streams its residual and spare buffer at every call and visits them again at the
selected entries, and a sparse result is written into a reused output at scattered entries. On
4 KiB pages a 100 MB buffer spans 25,600 pages, more than a core's TLB holds, so every streamed page
and nearly every scattered entry costs a page-table walk. A buffer that the library keeps from one
call to the next is therefore advised to the kernel as a huge-page region (``madvise(MADV_HUGEPAGE)``,
2 MiB pages) before anything is written to it, where that can help: a CPU tensor of at least
:data:`MIN_BYTES` on Linux. The advice changes no value and no bit; where the kernel offers no
transparent huge pages (``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``never``, another
operating system) the buffer is an ordinary one. The setting ``always`` gives every large allocation
huge pages anyway; ``madvise``, a common default, gives them only to regions advised so.

Only the library's own buffers are advised: the caller's gradient and ``out=`` tensor are not.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch

__all__ = ["long_lived_empty", "long_lived_zeros", "MIN_BYTES"]

#: buffers smaller than this are left alone (a few 2 MiB pages at most: no page walk worth a system call)
MIN_BYTES = 4 << 20

#: ``MADV_HUGEPAGE`` of Linux's ``<sys/mman.h>``
_MADV_HUGEPAGE = 14
_PAGE = 4096


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (Linux only), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # the process's own libc, as launch/ loads it
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _advise_huge_pages(t: torch.Tensor) -> None:
    """Advise the whole pages inside ``t``'s memory as a huge-page region (nothing written yet, so its
    first touches fault in huge pages); a refusal (EINVAL where the kernel has no transparent huge
    pages) leaves an ordinary buffer."""
    madvise = _madvise()
    nbytes = t.numel() * t.element_size()
    if madvise is None or t.device.type != "cpu" or not t.is_contiguous() or nbytes < MIN_BYTES:
        return
    start = -(-t.data_ptr() // _PAGE) * _PAGE
    end = (t.data_ptr() + nbytes) // _PAGE * _PAGE
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)


def long_lived_empty(shape: int | tuple[int, ...] | torch.Size, *, dtype: torch.dtype,
                     device: torch.device | str) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)`` for a buffer kept across calls, its pages
    advised as huge where that helps (see the module docstring)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    _advise_huge_pages(t)
    return t


def long_lived_zeros(shape: int | tuple[int, ...] | torch.Size, *, dtype: torch.dtype,
                     device: torch.device | str) -> torch.Tensor:
    """:func:`long_lived_empty` filled with zeros (advised before the zeros touch it)."""
    return long_lived_empty(shape, dtype=dtype, device=device).zero_()
