"""Running workers on one machine: the local launcher and the network emulation.

* :mod:`.launcher`: ``run_workers(P, fn, ...)`` forks P workers into one gloo process group
  (``net=`` runs them on an emulated network) and returns their results; :class:`WorkerError`;
* :mod:`.netemu`: emulated networks (one network namespace per worker, tc rate, delay and loss);
* :mod:`.netns`: the network-namespace plumbing netemu stands on.
"""

from .launcher import WorkerError, run_workers

__all__ = ["run_workers", "WorkerError"]
