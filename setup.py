"""Build of the optional C kernel; all other metadata is in pyproject.toml.

``sparsecomm.selection._scan`` (the fused magnitude scan of the selectors) and
``sparsecomm.transport._merge`` (the merge of sorted sparse chunks, the methods' decompression) are
optional extensions: where they cannot be compiled (no C compiler) the install still succeeds and
the code uses its pure-torch paths, which give the same results bit for bit, slower on CPU.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("sparsecomm.selection._scan", ["sparsecomm/selection/_scan.c"],
                             extra_compile_args=["-O3"], optional=True),
                   Extension("sparsecomm.transport._merge", ["sparsecomm/transport/_merge.c"],
                             extra_compile_args=["-O3"], optional=True)])
