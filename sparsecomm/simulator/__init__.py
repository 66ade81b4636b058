"""The performance model: predicted step times at worker counts one machine cannot hold.

* :mod:`.model`: the simulator (:class:`Profile`, :func:`predict`): each method's registered cost
  formula plus its measured per-step work;
* :mod:`.calibration`: measures a :class:`Profile` on this machine or a cluster.

The commands ``sparsecomm simulate``, ``advise`` and ``calibrate`` drive it (:mod:`sparsecomm.cli`).
"""

from .model import Prediction, Profile, UnknownMethodError, predict

__all__ = ["Profile", "Prediction", "predict", "UnknownMethodError"]
