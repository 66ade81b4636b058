"""The lab: the experiments behind the measurements in ``docs/``, never loaded by ``import sparsecomm``.

* the training harness: :mod:`.training` (a training run of a workload under a method), :mod:`.models`,
  :mod:`.data`, :mod:`.checkpoint`, :mod:`.progress`;
* the campaign of time-to-accuracy runs (:mod:`.campaign`), its reports (:mod:`.reporting`), the fault
  campaign (:mod:`.faults`), and the rate-limited file server of the DataCache bench (:mod:`.fileserver`);
* :mod:`.bench`: one module per ``sparsecomm bench NAME``; :mod:`.commands`: ``sparsecomm train``,
  ``demo`` and ``report``.

Only the command line (:mod:`sparsecomm.cli`, inside its functions) and the tests import it; its
modules need the extras ``sparsecomm[data]`` (pillow, scikit-learn, tqdm) and ``[plots]`` (matplotlib)
where they read images or draw.
"""
