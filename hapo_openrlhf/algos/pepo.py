"""PEPO (Kim & Kwak, arXiv 2609.39402): entropy-windowed credit for successful responses.

Source of truth: the paper (no code is published). Per response of T_i valid tokens, a
softmax of the behaviour entropy over a centred window of ``window`` tokens (the ends
padded by reflection, numpy's ``mode="reflect"``, repeated when the window is longer than
the response), at temperature ``temperature``:

    e_t = exp(H_t / temp) / sum_{|k - t| <= window // 2} exp(H_k / temp)
    c_t = T_i e_t / sum_k e_k            (so sum_t c_t = T_i)
    A_t = c_t A_i  for successful responses;  A_t = A_i  for failures

A_i is the registry's GRPO advantage; "successful" is the verifier's outcome
(``inputs.correct``), or A_i > 0 without one. No gradient flows through c.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .advantages import ESTIMATORS, AdvantageInputs, AdvantageOutput, grpo_sequence_advantage


def reflect_index(j: torch.Tensor, n: int) -> torch.Tensor:
    """Positions ``j`` (any integers) folded into [0, n) by reflection about the end tokens
    (the end token itself is not repeated), periodically: numpy's ``pad(mode="reflect")``."""
    if n == 1:
        return torch.zeros_like(j)
    period = 2 * (n - 1)
    j = j.remainder(period)
    return torch.where(j > n - 1, period - j, j)


def window_softmax(h: torch.Tensor, window: int, temperature: float) -> torch.Tensor:
    """e_t for one response's entropies ``h`` [T] (see the module docstring)."""
    n, half = h.numel(), window // 2
    x = h.double() / temperature
    x = x - x.max()  # a constant shift cancels in every ratio
    padded = torch.exp(x[reflect_index(torch.arange(-half, n + half, device=h.device), n)])
    csum = torch.nn.functional.pad(padded.cumsum(0), (1, 0))
    denom = csum[window:window + n] - csum[:n]  # sum over padded[t : t + window] = |k - t| <= half
    return torch.exp(x) / denom


# the padded row holds T + window values: a window of 1e9 would allocate gigabytes per row
MAX_WINDOW = (1 << 20) + 1


def _check(p: Mapping[str, Any]) -> None:
    if not 1 <= p["window"] <= MAX_WINDOW or p["window"] % 2 == 0:
        raise ValueError(f"pepo.window must be an odd integer in [1, {MAX_WINDOW}] (a centred window), "
                         f"got {p['window']}")
    if not p["temperature"] > 0:
        raise ValueError(f"pepo.temperature must be > 0, got {p['temperature']}")


@ESTIMATORS.register("pepo", validate=_check)
def pepo(inputs: AdvantageInputs, *, window: int = 101, temperature: float = 1.0,
         eps: float = 1e-6) -> AdvantageOutput:
    """GRPO's A_i, redistributed over a successful response's tokens by windowed entropy."""
    mask = inputs.response_mask.bool()
    A = grpo_sequence_advantage(inputs, eps).float()
    success = inputs.correct.bool() if inputs.correct is not None else A > 0
    c = mask.float()  # failures (and empty rows): c = 1
    for i in torch.nonzero(success & mask.any(-1)).flatten().tolist():
        e = window_softmax(inputs.entropy[i][mask[i]].detach().float(), window, temperature)
        c[i, mask[i]] = (e * e.numel() / e.sum()).float()
    shaped = c[success & mask.any(-1)]
    metrics = {"pepo/c_max": float(shaped.max()) if shaped.numel() else 1.0}
    return AdvantageOutput(A.unsqueeze(-1) * c, metrics=metrics)
