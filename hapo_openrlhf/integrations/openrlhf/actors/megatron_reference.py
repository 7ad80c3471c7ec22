"""The KL reference for ``backend: megatron``: a frozen Megatron GPTModel under the policy's
TP x PP layout, in place of OpenRLHF's DeepSpeed ``ReferenceModelActor``.

With ``algorithm.kl_coef > 0`` OpenRLHF's driver builds a reference group
(``args.ref.num_nodes`` x ``num_gpus_per_node`` Ray actors, the policy's count; flags.py)
and its experience maker calls ``forward`` on it for every micro-batch, with the same
dispatch as the policy's old-log-prob pass (``duplicate_actors`` = TP x PP, so the
reference's replicas are the policy's). This actor builds the same GPTModel stage from the
same Hugging Face checkpoint (``MegatronPolicyActorImpl._build_model``: its own process
groups, the family's converter, the fused or logits head) and keeps nothing else: no DDP,
no optimizer state, no checkpoint (the reference never changes; a resume rebuilds it from
``pretrain``). Its memory is the weights alone, ``params_dtype`` bytes per parameter split
over TP x PP (a 7B model in bf16: 14 GB / (TP x PP) per GPU), on GPUs of its own
(docs/megatron.md, "KL to a reference").

The KL term itself is the policy actor's (``MegatronPolicyActorImpl._optimizer_step``):
OpenRLHF's ``compute_approx_kl`` (k1 / k2 / k3) and ``aggregate_loss`` on these log-probs.
"""

from __future__ import annotations

from typing import Optional

import ray
import torch

from .megatron_actor import MegatronPolicyActorImpl


class MegatronReferenceActorImpl(MegatronPolicyActorImpl):
    def init_model_from_pretrained(self, strategy, pretrain):
        self._build_model(strategy, pretrain)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.top_p = 1.0  # the reference's pass returns log-probs only (no nucleus log-mass)
        self.nucleus_every, self.steps_done = 0, 0

    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        return_output=False,
        packed_seq_lens: Optional[list[int]] = None,
        mm_train_inputs_list=None,
    ) -> torch.Tensor:
        """Upstream's reference forward: the action log-probs [B, A] (masked, on the CPU) at
        the rollout temperature, as OpenRLHF's ``ReferenceModelActor`` returns them."""
        if mm_train_inputs_list and any(mm_train_inputs_list):
            raise ValueError("the Megatron reference has no vision inputs")
        lp, _, _ = self._logprobs_entropy(sequences, attention_mask)
        A = action_mask.shape[1]
        return (lp[:, -A:] * action_mask.to(lp.device).float()).cpu()


MegatronReferenceActor = ray.remote(num_gpus=1)(MegatronReferenceActorImpl)
