"""The time-to-quality campaign: each workload's arms (DDP, PowerSGD, the sparse recipes, the floor)
tuned on one shared learning-rate grid, three seeds at each arm's best rate, a target set by DDP's
quality, and the time to it on emulated networks.

:mod:`.plan` (workloads, arms, the grid), :mod:`.run` (the three phases: convergence, timing,
confirmation, and where records go), :mod:`.quiet` (the quiet-machine rule of timed runs),
:mod:`.analysis` (the target, steps and composed time to it, the limit) and :mod:`.report`
(``report.md``, ``summary.json``, the plot). The command is ``sparsecomm campaign``.
"""

from .analysis import Campaign, analyse
from .plan import ARMS, SEEDS, WORKLOADS, Arm, Workload, arms_of, workload
from .quiet import QuietPolicy, add_quiet_arguments, quiet_policy
from .report import write_report
from .run import load_records, run_confirmation, run_convergence, run_timing

__all__ = ["Campaign", "analyse", "ARMS", "SEEDS", "WORKLOADS", "Arm", "Workload", "arms_of", "workload",
           "QuietPolicy", "add_quiet_arguments", "quiet_policy", "write_report", "load_records", "run_confirmation",
           "run_convergence", "run_timing"]
