"""Write the run's prompts as the JSONL OpenRLHF reads (``--data.input_key prompt --data.label_key label``).

The prompt is already templated by hapo's template registry (the same text the
local trainer and ``hapo eval`` use), so OpenRLHF gets neither
``--data.input_template`` nor ``--data.apply_chat_template``. The label is a JSON
list of accepted answers, read back by ``reward_func.parse_label``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ....config import RunConfig
from ....data.templates import apply_template
from ....data.datasets import make_datasets


def _write_jsonl(path: Path, problems, template: str) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    n = 0
    with open(tmp, "w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": apply_template(template, p.problem), "label": json.dumps(list(p.answer)),
                                "id": p.id, "datasource": p.source or "train"}) + "\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return n


def write_prompt_files(cfg: RunConfig, train_path: Path, eval_path: Path | None) -> dict[str, int]:
    """Materialise ``data.train`` (and ``openrlhf.eval_dataset``) for OpenRLHF; returns row counts."""
    if cfg.warmup.steps:
        raise ValueError("backend openrlhf starts from model.path; set warmup.steps: 0 (warm-up is the local back end's)")
    _, train, _ = make_datasets(_with_eval(cfg, None))
    counts = {"train": _write_jsonl(train_path, train, cfg.data.template)}
    if not counts["train"]:
        raise ValueError(f"data.train {cfg.data.train!r} has no usable rows")
    if eval_path is not None and cfg.openrlhf.eval_dataset:
        _, _, evals = make_datasets(_with_eval(cfg, cfg.openrlhf.eval_dataset))
        counts["eval"] = _write_jsonl(eval_path, evals, cfg.data.template)
    return counts


def _with_eval(cfg: RunConfig, spec: str | None) -> RunConfig:
    import dataclasses

    data = dataclasses.replace(cfg.data, eval=spec or ("synthetic" if cfg.data.train == "synthetic" else cfg.data.train))
    return dataclasses.replace(cfg, data=data)
