"""A CPU stand-in for Transformer Engine's ``FusedAdam`` (TE 2.20.2), and the switch that
makes megatron-core build its optimizers on it as it does when TE is installed.

TE needs CUDA, so it cannot be imported here. What the Megatron actor's checkpointing
depends on is TE's *state layout and state_dict semantics*, which live in Python
(``transformer_engine/pytorch/optimizers/fused_adam.py`` in the ``transformer-engine``
2.20.2 wheel) -- mirrored here, for fp32 states:

* the per-parameter state holds ``exp_avg``, ``exp_avg_sq`` (and ``master_param`` with
  ``master_weights``) only; the step count lives in each param group (``group["step"]``,
  an int), never in the per-parameter state;
* ``state_dict()`` passes **every** per-parameter state key through
  ``get_unscaled_state``, which looks it up in ``name_to_dtype_map`` (those three keys):
  any other key, ``step`` included, is a ``KeyError``; ``load_state_dict()`` likewise
  sets every key through ``set_scaled_state``;
* the update is TE's ``multi_tensor_adam`` kernel (``transformer_engine/common/
  multi_tensor/adam.cu``, ``adam_update``), in fp32: ``update = m_hat / (sqrt(v_hat) +
  eps) + wd * p`` (``adam_w_mode``), ``p -= lr * update``.

``tests/megatron/test_te_standin.py`` checks those facts against the wheel's source.
What the stand-in cannot prove: anything of TE's CUDA kernels beyond that formula (fused
launch, fp16 / bf16 / fp8 states and their scaling, ``capturable``, ``store_param_remainders``,
``master_weights`` -- all refused here), and TE's layers.

:func:`use_te_fused_adam` points megatron-core's optimizer modules at it exactly where
their ``try: from transformer_engine.pytorch.optimizers import FusedAdam`` would:
``megatron.core.optimizer.Adam`` / ``USING_PYTORCH_OPTIMIZER`` and ``distrib_optimizer``'s
``HAVE_APEX_OR_TE`` / ``USING_TE_OPTIMIZER`` (megatron-core 0.16.1 - 0.19.x), without putting
a ``transformer_engine`` package on the path (which would switch on TE's layers too).
"""

from __future__ import annotations

from copy import deepcopy
from itertools import chain

import torch

TE_VERSION = "2.20.2"  # the wheel this stand-in mirrors (test_te_standin.py reads it)


class FusedAdam(torch.optim.Optimizer):
    """TE's ``FusedAdam`` for fp32 parameters and states (module docstring)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False, set_grad_none=None):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        unsupported = {"capturable": capturable, "master_weights": master_weights,
                       "use_decoupled_grad": use_decoupled_grad, "store_param_remainders": store_param_remainders,
                       "non-fp32 states": any(d != torch.float32 for d in (exp_avg_dtype, exp_avg_sq_dtype,
                                                                           master_weight_dtype))}
        if any(unsupported.values()):
            raise NotImplementedError(f"the TE FusedAdam stand-in covers fp32 states only, not "
                                      f"{[k for k, v in unsupported.items() if v]}")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.master_weights = master_weights
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}

    # ------------------------------------------------------------------ state
    def get_unscaled_state(self, param, state_name):
        state = self.state[param]
        dtype = self.name_to_dtype_map[state_name]  # TE: any other key (``step``) is a KeyError
        assert dtype == torch.float32 and state[state_name].dtype == torch.float32
        return state[state_name]

    def set_scaled_state(self, param, state_name, unscaled_state):
        assert unscaled_state.dtype == torch.float32
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, False)
        self.state[param][state_name].copy_(unscaled_state)

    def _initialize_state(self, param, state_name, zero_buffer: bool, store_param_remainders: bool = False):
        data = torch.empty_like(param, dtype=self.name_to_dtype_map[state_name])
        if zero_buffer:
            data.zero_()
        self.state[param][state_name] = data

    def initialize_state(self, param, store_param_remainders=False):
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)

    def _id_map(self, state_dict):
        saved = deepcopy(state_dict["param_groups"])
        return dict(zip(chain.from_iterable(g["params"] for g in saved),
                        chain.from_iterable(g["params"] for g in self.param_groups)))

    def state_dict(self):
        state_dict = super().state_dict()
        ids = self._id_map(state_dict)
        for k, v in state_dict["state"].items():
            if k in ids:
                state_dict["state"][k] = {name: self.get_unscaled_state(ids[k], name) for name in v}
        return state_dict

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        ids = self._id_map(state_dict)
        for k, v in state_dict["state"].items():
            if k in ids:
                param = ids[k]
                self.state[param] = {}
                for name in v:
                    if v[name] is not None:
                        self.set_scaled_state(param, name, v[name].float())

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1  # one step for the group, as TE keeps it
            beta1, beta2 = group["betas"]
            bc1 = 1 - beta1 ** group["step"] if group["bias_correction"] else 1.0
            bc2 = 1 - beta2 ** group["step"] if group["bias_correction"] else 1.0
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p)
                if p.grad is None:
                    continue
                g, m, v = p.grad.float(), state["exp_avg"], state["exp_avg_sq"]
                if self.adam_w_mode == 0:  # ADAM_MODE_0: L2
                    g = g + wd * p
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + eps)
                if self.adam_w_mode == 1:  # ADAM_MODE_1: decoupled weight decay
                    update = update + wd * p
                p.sub_(lr * update)
        return loss


def use_te_fused_adam(monkeypatch) -> None:
    """Make megatron-core build on the stand-in as it builds on TE's ``FusedAdam``."""
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.distrib_optimizer as dopt

    monkeypatch.setattr(mopt, "Adam", FusedAdam)
    monkeypatch.setattr(mopt, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(dopt, "Adam", FusedAdam)
    monkeypatch.setattr(dopt, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(dopt, "USING_TE_OPTIMIZER", True)


class Patch:
    """``monkeypatch``'s ``setattr`` for spawned workers (no pytest fixture there)."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)
