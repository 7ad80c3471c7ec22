"""Slurm: render and submit sbatch scripts (``hapo submit``), the batch-step launcher with
Ray bring-up, preemption and requeue (:mod:`.job`), scaling runs (``hapo scale``)."""
