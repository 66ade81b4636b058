"""The transport layer: every byte any method sends goes through here and is metered.

* :mod:`.meter`: :class:`TrafficMeter`, bytes / messages / rounds per named phase;
* :mod:`.comm`: :class:`Communicator`, metered point-to-point messages over a process group,
  sub-groups (teams, nodes) and native collectives;
* :mod:`.chunk`: :class:`SparseChunk`, the (indices, values) unit sparse methods send;
* :mod:`.collectives`: dense collectives from point to point (ring, Rabenseifner, recursive
  doubling), any P, with their cost formulas;
* :mod:`.sparse_collectives`: all-gathers of messages of unknown size (halving distances, Bruck)
  and their traffic replay.
"""

from .chunk import SparseChunk, add_chunks, index_dtype, pair_bytes
from .comm import Communicator
from .meter import PhaseTraffic, TrafficMeter

__all__ = ["Communicator", "TrafficMeter", "PhaseTraffic", "SparseChunk", "add_chunks", "index_dtype",
           "pair_bytes"]
