"""Building blocks the methods are made of, above the transport:

* :mod:`.selectors`: top-k and threshold selectors over one fused magnitude scan;
* :mod:`.sketch`: the count-sketch of S2 Reducer;
* :mod:`.metrics`: ExDyna's sparsification metrics (actual density, padding overhead, global error).
"""
