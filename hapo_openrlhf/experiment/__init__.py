"""Multi-run experiments on the embedded trainer (variants x seeds from shared warm
starts) and their report: ``hapo experiment`` / ``hapo report EXPERIMENT_DIR``."""

from .report import build_experiment_report, is_experiment_dir
from .runner import run_experiment
from .spec import Experiment, load_experiment

__all__ = ["Experiment", "build_experiment_report", "is_experiment_dir", "load_experiment", "run_experiment"]
