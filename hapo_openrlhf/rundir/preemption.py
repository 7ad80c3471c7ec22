"""Preemption and time limits: checkpoint at the next safe point, exit, let Slurm requeue.

A job that receives ``SIGUSR1`` (``#SBATCH --signal=B:USR1@<s>``, or ``scancel --batch
--signal=USR1``) or ``SIGTERM`` finishes the step it is in, writes a complete checkpoint
and exits with :data:`EXIT_PREEMPTED`. ``hapo_openrlhf.cluster.job`` (the sbatch step)
turns that exit code into ``scontrol requeue``; the requeued job resumes from the newest
complete checkpoint.

Back ends: the local trainer checks ``stop_requested`` after every step. The OpenRLHF
controller runs in a Ray actor, which a signal to the driver does not reach, so the
driver writes :data:`PREEMPT_FLAG` into the output directory and the controller checks
for it after every global step (``integrations/openrlhf/controller/trainer.py``).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Callable

EXIT_PREEMPTED = 85  # "checkpointed and stopped on request; requeue me"
PREEMPT_FLAG = ".hapo_preempt_requested"
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preempted(Exception):
    """Raised after the checkpoint of ``step`` was written because a stop was requested."""

    def __init__(self, step: int):
        super().__init__(f"stopped on request after checkpointing step {step}")
        self.step = step


def on_stop_signal(callback: Callable[[int], None]) -> None:
    """Call ``callback(signum)`` on SIGUSR1 / SIGTERM (instead of dying)."""
    for s in SIGNALS:
        signal.signal(s, lambda signum, _frame: callback(signum))


def request_flag(output_dir: str | Path) -> Path:
    return Path(output_dir) / PREEMPT_FLAG
