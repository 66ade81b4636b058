"""Build of the optional C kernel; all other metadata is in pyproject.toml.

``sparsecomm.selection._scan`` (the fused magnitude scan of the selectors) is an optional extension:
where it cannot be compiled (no C compiler) the install still succeeds and the
selectors use their pure-torch path, which gives the same selections, slower on CPU.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("sparsecomm.selection._scan", ["sparsecomm/selection/_scan.c"],
                             extra_compile_args=["-O3"], optional=True)])
