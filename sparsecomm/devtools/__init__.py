"""Tools for the developers of sparsecomm, never loaded by ``import sparsecomm``:

* :mod:`.imports`: the import rules of the layers, checked by reading the source
  (``tests/test_architecture.py``, ``sparsecomm imports``);
* :mod:`.testing`: the invariant checks every method's tests use.
"""
