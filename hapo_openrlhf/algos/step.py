"""One RL step's algorithm, the same on every back end.

Every trainer -- the embedded one (``local/trainer.py``) and the OpenRLHF controller
(``integrations/openrlhf/controller/experience.py``, which also drives the Megatron actor) -- builds one
:class:`~hapo_openrlhf.algos.advantages.AdvantageInputs` for the whole rollout batch and then calls,
in this order and nowhere else:

1. :func:`before_update`: the configured estimator (token advantages and the loss mask), the Four
   Quadrant split of the batch and its metrics, the estimator's own metrics, and a stateful loss's
   state for this step (STARE's controller: ``loss_state`` for every loss call, the state to
   checkpoint, its metrics);
2. the back end's own update (its losses read ``StepResult.advantages``, ``loss_mask`` and
   ``loss_state``);
3. :func:`after_update`: a loss that learns from the step's reported metrics records them (PAEC's
   anchor) in the state the back end checkpoints.

``algorithm`` is the run's ``algorithm`` section (``config.AlgorithmConfig``): anything with its
fields ``estimator``, ``estimator_params``, ``loss``, ``loss_params``, ``quadrant_split``,
``quadrant_quantile`` and ``quadrant_threshold``. Imports torch only, like the rest of ``algos``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch

from .advantages import AdvantageInputs, outcome_polarity, run_estimator, split_quadrants
from .losses import loss_observe, loss_step_state
from .quadrants import quadrant_metrics


class AlgorithmSection(Protocol):
    estimator: str
    estimator_params: Mapping[str, Any]
    loss: str
    loss_params: Mapping[str, Any]
    quadrant_split: str
    quadrant_quantile: float
    quadrant_threshold: float | None


@dataclass
class StepResult:
    """What one step's algorithm gives the update. Rows are in the caller's order."""

    advantages: torch.Tensor  # [B, T], 0 off the response
    loss_mask: torch.Tensor  # [B, T]: the tokens the loss and its normaliser count
    quadrant_masks: dict[str, torch.Tensor]  # PHR/PLR/NHR/NLR -> [B, T] bool
    threshold: torch.Tensor  # the quadrants' entropy cut
    loss_state: dict | None  # a stateful loss's state for this step's loss calls (None: no state)
    persisted: dict  # the method's state to checkpoint
    metrics: dict[str, float]  # the quadrants', then the estimator's, then the loss state's
    state_metrics: dict[str, float]  # the loss state's alone (the controller also sends them to the actors)


def before_update(algorithm: AlgorithmSection, inputs: AdvantageInputs, persisted: dict | None, *,
                  old_logprobs: torch.Tensor, estimator_order: torch.Tensor | None = None) -> StepResult:
    """The step's advantages, loss mask, quadrant metrics and loss state (module docstring, 1).

    ``estimator_order``: a permutation of the rows that puts them in rollout order, for a back end
    whose rows are not (the OpenRLHF controller's micro-batches): the estimator sees the rows in
    that order -- LESS's clustering depends on the order of a group's responses -- and its output
    is put back in the caller's. ``old_logprobs`` [B, T]: the behaviour log-probs the loss state
    is computed from."""
    a = algorithm
    if estimator_order is None:
        out = run_estimator(a.estimator, inputs, **dict(a.estimator_params))
        advantages, loss_mask = out.advantages, out.loss_mask
    else:
        o = estimator_order
        # every per-row tensor in rollout order (whatever fields AdvantageInputs has); the rest as is
        in_order = dataclasses.replace(inputs, **{f.name: getattr(inputs, f.name)[o] for f in dataclasses.fields(inputs)
                                                  if isinstance(getattr(inputs, f.name), torch.Tensor)})
        out = run_estimator(a.estimator, in_order, **dict(a.estimator_params))
        inv = torch.argsort(o)
        advantages = out.advantages[inv]
        loss_mask = out.loss_mask[inv] if out.loss_mask is not None else None
    if loss_mask is None:
        loss_mask = inputs.response_mask
    masks, tau = split_quadrants(inputs, a.quadrant_split, a.quadrant_quantile, a.quadrant_threshold)
    metrics = quadrant_metrics(advantages, inputs.entropy, inputs.response_mask, tau, polarity=outcome_polarity(inputs))
    metrics.update(out.metrics)
    loss_state, persisted, state_metrics = loss_step_state(
        a.loss, dict(a.loss_params), persisted, entropy=inputs.entropy, response_mask=inputs.response_mask,
        old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask)
    metrics.update(state_metrics)
    return StepResult(advantages, loss_mask, masks, tau, loss_state, persisted, metrics, state_metrics)


def after_update(algorithm: AlgorithmSection, persisted: dict | None, update_metrics: Mapping[str, Any]) -> dict:
    """The method's state after the update, from the step's reported metrics (module docstring, 3)."""
    return loss_observe(algorithm.loss, dict(algorithm.loss_params), persisted, dict(update_metrics))
