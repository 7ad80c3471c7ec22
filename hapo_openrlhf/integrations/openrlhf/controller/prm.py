"""PRIME's implicit PRM in OpenRLHF's experience maker (issue 59): the PRM group's update and score
in ``prm.update``'s order, as the embedded trainer runs them (``local/prm.py``, ``ImplicitPRM.step``)
and the recipe's ``prime_ray_trainer.fit`` does:

* ``before`` -- train on the batch, then score it again with the updated PRM (two forwards);
* ``after`` -- train on the batch; the q the advantage reads is the update's own forwards' (each
  mini-batch's, before its optimizer step);
* ``none`` -- score only.

The PRM group (``actors/prm_actor.py``) is OpenRLHF's critic group, hidden from upstream's
``make_experience`` (which would score every micro-batch with it before the update) and called here
after it, on the experiences upstream made. q rides on each experience as ``process_q`` [b, A] (and
``prm_seen``: the responses as the PRM scored them before training on them, for the held-out
metrics) until ``registry_advantages`` reads them.
"""

from __future__ import annotations

from typing import Any, Sequence

import ray
import torch

from ....config import RunConfig


def outcomes(experiences: Sequence[Any]) -> list[torch.Tensor]:
    """Each micro-batch's 0/1 outcomes: the verifier's reward > 0.5, before any length penalty (the
    registry's ``correct``)."""
    return [(e.rewards.float().reshape(-1) > 0.5).float() for e in experiences]


def _scatter(rows: dict[int, torch.Tensor], e) -> torch.Tensor:
    """The update's per-row q (rollout position -> q on the response tokens) laid out as ``e``'s [b, A]."""
    out = torch.zeros(e.action_mask.shape, dtype=torch.float32)
    for j, pos in enumerate(e.index):
        m = e.action_mask[j].bool()
        if pos not in rows or rows[pos].numel() != int(m.sum()):
            raise RuntimeError(f"the PRM's update returned no q (or q of another length) for rollout row {pos}")
        out[j, m] = rows[pos]
    return out


def run(maker, group, experiences: Sequence[Any], cfg: RunConfig) -> dict[str, float]:
    """Score (and train) the PRM group on the made experiences in ``cfg.prm.update``'s order; sets
    ``process_q`` and ``prm_seen`` on each experience; returns the update's status (empty for none)."""
    dup = maker.args.ds.ring_attn_size * maker.args.ds.tensor_parallel_size

    def score() -> list[torch.Tensor]:
        refs = group.async_run_method_batch(method_name="forward", sequences=[e.sequences for e in experiences],
                                            action_mask=[e.action_mask for e in experiences],
                                            attention_mask=[e.attention_mask for e in experiences])
        got = maker._flatten_results(refs, dup)
        if len(got) != len(experiences):
            raise RuntimeError(f"the PRM group scored {len(got)} micro-batches of {len(experiences)}")
        return [q.float() for q in got]

    status: dict[str, float] = {}
    sleep = bool(maker.args.ds.enable_sleep)  # colocated (OpenRLHF's sleep mode): on the GPU only meanwhile
    if sleep:
        ray.get(group.async_run_method(method_name="reload_states"))
    if cfg.prm.update == "none":
        q = seen = score()
    else:
        ray.get(group.async_run_method_batch(method_name="prm_append", experience=list(experiences),
                                             outcome=outcomes(experiences)))
        results = ray.get(group.async_run_method(method_name="prm_update"))
        status, rows = dict(results[0]["status"]), {}
        for r in results:  # every data-parallel rank's rows (ring / TP duplicates hold the same)
            rows.update(r["rows"])
        seen = [_scatter(rows, e) for e in experiences]
        q = score() if cfg.prm.update == "before" else seen
    if sleep:
        ray.get(group.async_run_method(method_name="offload_states"))
    for e, qe, se in zip(experiences, q, seen, strict=True):
        if qe.shape != e.action_mask.shape:
            raise RuntimeError(f"PRM q {tuple(qe.shape)} does not match action_mask {tuple(e.action_mask.shape)}")
        e.process_q, e.prm_seen = qe * e.action_mask, se * e.action_mask
    return {k: float(v) for k, v in status.items()}
