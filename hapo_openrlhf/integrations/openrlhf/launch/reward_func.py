"""OpenRLHF ``--reward.remote_url`` reward file: rule-based math verification.

OpenRLHF's ``SingleTurnAgentExecutor`` loads this file by path inside each rollout
engine and calls ``reward_func(queries, prompts, labels)`` once per sample, where a
query is the decoded prompt + response. The response is the text after the prompt;
it is graded against the label (a JSON list of accepted answers, as written by
``hapo_openrlhf.integrations.openrlhf.launch.data``) with hapo's verifier: last
``\\boxed{}`` after ``</think>``, normalised string match, exact rationals, then
math-verify in a time-limited subprocess.

Upstream swallows a reward function's exception and then fails the whole batch
for want of a reward model, so nothing here raises for a bad response: an
unparseable answer scores ``HAPO_REWARD_WRONG`` (default 0).
"""

from __future__ import annotations

import json
import os
import threading

import torch

_SPECIAL = ("<|im_end|>", "<|endoftext|>", "<｜end▁of▁sentence｜>", "</s>")
_VERIFIER = None
_VERIFIER_LOCK = threading.Lock()


def _verifier():
    """One verifier per engine process; OpenRLHF calls ``reward_func`` from several threads
    at once (``asyncio.to_thread`` per sample), so creation is locked and ``score`` is
    thread-safe."""
    global _VERIFIER
    with _VERIFIER_LOCK:
        if _VERIFIER is None:
            from hapo_openrlhf.rewards import MathVerifier

            _VERIFIER = MathVerifier(timeout_s=float(os.environ.get("HAPO_REWARD_TIMEOUT_S", "5")))
    return _VERIFIER


def response_text(query: str, prompt: str) -> str:
    """The generated part of ``query``: what follows the prompt, special tokens removed."""
    if query.startswith(prompt):
        text = query[len(prompt):]
    else:  # decoding may not reproduce the prompt byte for byte: cut after its last 32 chars
        tail = prompt[-32:]
        k = query.rfind(tail) if tail else -1
        text = query[k + len(tail):] if k >= 0 else query
    for s in _SPECIAL:
        text = text.replace(s, "")
    return text


def parse_label(label) -> list[str]:
    if isinstance(label, (list, tuple)):
        return [str(x) for x in label]
    try:
        v = json.loads(label)
    except (TypeError, ValueError):
        return [str(label)]
    return [str(x) for x in v] if isinstance(v, list) else [str(v)]


def reward_func(queries, prompts, labels, **kwargs):
    wrong = float(os.environ.get("HAPO_REWARD_WRONG", "0"))
    scores = []
    for q, p, lab in zip(queries, prompts, labels):
        ok = _verifier().score(response_text(q, p), parse_label(lab))
        scores.append(1.0 if ok > 0.5 else wrong)
    r = torch.tensor(scores, dtype=torch.float32)
    return {"rewards": r, "scores": (r > 0.5).float(), "extra_logs": {"accuracy": (r > 0.5).float()}}
