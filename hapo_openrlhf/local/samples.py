"""Token-level sample dumps for the token-credit view (`hapo report`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..algos.quadrants import QUADRANTS


def dump_token_samples(path: Path, tokenizer, rollout, rewards, entropy, adv, base_adv, qmasks, n: int) -> None:
    """Write the first ``n`` responses with per-token entropy, final and base advantage,
    multiplier (final / base where base != 0) and quadrant."""
    path.parent.mkdir(parents=True, exist_ok=True)
    label = torch.full(entropy.shape, -1, dtype=torch.long)
    for qi, q in enumerate(QUADRANTS):
        label[qmasks[q]] = qi
    lines = []
    for i in range(min(n, entropy.shape[0])):
        m = rollout.response_mask_BR[i].bool()
        ids = rollout.response_ids_BR[i][m].tolist()
        b = base_adv[i][m]
        a = adv[i][m]
        mult = torch.where(b != 0, a / torch.where(b != 0, b, torch.ones_like(b)), torch.ones_like(b))
        lines.append(json.dumps({
            "row": i,
            "reward": float(rewards[i]),
            "tokens": [tokenizer.decode([t]) for t in ids],
            "entropy": [round(float(x), 5) for x in entropy[i][m]],
            "advantage": [round(float(x), 5) for x in a],
            "base_advantage": [round(float(x), 5) for x in b],
            "multiplier": [round(float(x), 5) for x in mult],
            "quadrant": [QUADRANTS[int(q)] if q >= 0 else "" for q in label[i][m]],
        }))
    path.write_text("\n".join(lines) + "\n")
