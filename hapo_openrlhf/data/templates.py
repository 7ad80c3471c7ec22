"""Prompt templates, registered by name (one place to add a model family)."""

from __future__ import annotations

DEEPSCALER_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."

TEMPLATES: dict[str, str] = {
    # Qwen2.5-Math's original chat prompt (as in the paper's 7B runs)
    "qwen25_math": (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{{}}."
        "<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"
    ),
    # DeepScaleR-1.5B (DeepSeek-R1-Distill chat format) with the paper's suffix
    "deepscaler": "<｜User｜>{problem}" + DEEPSCALER_SUFFIX.replace("{}", "{{}}") + "<｜Assistant｜><think>\n",
    # the embedded tiny model: short, ASCII only (character tokenizer)
    "tiny": "Q: {problem}\nA: ",
    "plain": "{problem}",
}


def apply_template(name: str, problem: str) -> str:
    if name not in TEMPLATES:
        raise ValueError(f"unknown prompt template {name!r}; known: {sorted(TEMPLATES)}")
    return TEMPLATES[name].format(problem=problem)
