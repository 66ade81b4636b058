"""Build of the optional C kernel; all other metadata is in pyproject.toml.

``sparsecomm.selection._scan`` (the fused magnitude scan of the selectors) and
``sparsecomm.transport._merge`` (the merge of sorted sparse chunks, the methods' decompression) are
optional extensions: where they cannot be compiled (no C compiler) the install still succeeds and
the code uses its pure-torch paths, which give the same results bit for bit, slower on CPU.
"""

import hashlib

from setuptools import Extension, setup

#: -ffp-contract=off: no multiply and add fused into one rounding (GCC fuses them by default), so the
#: kernels round every operation as the torch paths they must match bit for bit do
FLAGS = ["-O3", "-ffp-contract=off"]


def extension(name: str, source: str) -> Extension:
    """The optional extension ``name`` built from ``source``, with the source's digest compiled in
    (``SOURCE_DIGEST``, as sparsecomm.core.optional.source_digest computes it: the package refuses a
    build from other sources than those beside it)."""
    with open(source, "rb") as file:
        digest = hashlib.sha256(file.read()).hexdigest()[:16]
    return Extension(name, [source], extra_compile_args=FLAGS, optional=True,
                     define_macros=[("SOURCE_DIGEST", f'"{digest}"')])


setup(ext_modules=[extension("sparsecomm.selection._scan", "sparsecomm/selection/_scan.c"),
                   extension("sparsecomm.transport._merge", "sparsecomm/transport/_merge.c")])
