"""OpenRLHF's DeepSpeed ``ReferenceModelActor`` (the KL reference, ``algorithm.kl_coef > 0``),
unchanged but for rank 0's rendezvous port: one outside the kernel's ephemeral range
(``cluster/ports.py``), as hapo's policy, Megatron and PRM actors pick it."""

from __future__ import annotations

import ray
from openrlhf.trainer.ray.launcher import ReferenceModelActor

from ....cluster.ports import OutsideEphemeralPort


class HapoReferenceModelActorImpl(OutsideEphemeralPort, ReferenceModelActor.__ray_actor_class__):
    pass


HapoReferenceModelActor = ray.remote(num_gpus=1)(HapoReferenceModelActorImpl)
