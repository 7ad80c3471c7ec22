"""The one seam into OpenRLHF 0.11.2 (Ray controller, vLLM rollouts, DeepSpeed actors), grouped by
role as OpenRLHF groups its own (``cli``, ``trainer/ppo_utils``, ``trainer/ray``).

Nothing here is imported by the rest of the package but the CLI (which the Slurm job runs);
only :mod:`.launch.flags` (pure Python) may be imported without OpenRLHF installed.

* :mod:`.launch`     -- the run config as OpenRLHF's flags (``flags``), OpenRLHF's own main with
  hapo's classes (``train``), the prompt files and the reward file
* :mod:`.controller` -- ``PPOTrainer`` / ``PPOTrainerAsync`` subclasses and the experience maker:
  the whole batch's advantages through ``algos.step``, the step limit, checkpointed method state
* :mod:`.actors`     -- the DeepSpeed and Megatron policy actors, the Megatron KL reference, the
  loss every actor runs, rollout routing replay's tables
"""

OPENRLHF_VERSION = "0.11.2"
