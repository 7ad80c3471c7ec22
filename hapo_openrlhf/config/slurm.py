"""The Slurm job: partition, time, signals, requeues."""

from __future__ import annotations

from dataclasses import dataclass

from .base import require


@dataclass(frozen=True)
class SlurmConfig:
    """How ``hapo submit`` asks Slurm to warn the job before its time limit (docs/cluster.md).

    The warning (``--signal=B:USR1@<lead>``) must come early enough for the step in flight
    to finish and checkpoint: a 24k-token step takes tens of minutes. ``signal_lead_s``
    sets it; otherwise it is 1.5 x ``expected_step_s`` + 300 s when that is given, else a
    heuristic from the response length and model size (``cluster.sbatch.signal_lead_seconds``)."""

    signal_lead_s: int | None = None
    expected_step_s: float | None = None

    def __post_init__(self):
        require(self.signal_lead_s is None or 30 <= self.signal_lead_s <= 65535,
                 f"slurm.signal_lead_s must be in 30..65535 seconds (Slurm's --signal limit), got {self.signal_lead_s}")
        require(self.expected_step_s is None or 0 < self.expected_step_s <= 43000,
                 f"slurm.expected_step_s must be in (0, 43000] seconds (1.5 x it + 300 s is the signal lead, at most "
                 f"65535 s), got {self.expected_step_s}")
