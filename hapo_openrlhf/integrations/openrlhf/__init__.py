"""The one seam into OpenRLHF 0.11.2 (Ray controller, vLLM rollouts, DeepSpeed actors).

Nothing here is imported by the rest of the package; only :mod:`.flags` (pure
Python) may be imported without OpenRLHF installed.

* :mod:`.flags`      -- the one function that turns a run config into OpenRLHF flags
* :mod:`.actor`      -- ``PolicyModelActor`` subclass: old log-probs + behaviour entropy
* :mod:`.experience` -- ``RemoteExperienceMaker`` subclass: registry advantages, quadrant metrics
* :mod:`.loss`       -- ``PolicyLoss``-compatible loss dispatching to the registry losses
* :mod:`.trainer`    -- ``PPOTrainer`` subclass that installs the experience maker
* :mod:`.train`      -- entry point: runs OpenRLHF's own ``train_ppo_ray`` main with them
* :mod:`.reward_func` -- OpenRLHF ``--reward.remote_url`` reward file (math verification)
"""

OPENRLHF_VERSION = "0.11.2"
