"""The leaf layer: what every other layer may use and which imports nothing of the library.

* :mod:`.registry`: the one name -> object registry behind methods, selectors and cost formulas;
* :mod:`.validate`: argument checks that raise errors naming the value and the rule;
* :mod:`.cost`: the alpha-beta :class:`~.cost.Cost` record, its arithmetic and the formula registry;
* :mod:`.buffers`: the library's long-lived length-n buffers, advised as transparent huge pages.
"""
