"""Train / held-out problems for the embedded trainer."""

from __future__ import annotations

from .loader import load_problems
from .synthetic import ArithmeticTask


def make_datasets(cfg):
    """(task or None, train problems, eval problems). The synthetic task draws disjoint
    train and held-out problems; any other source goes through the data loader."""
    d = cfg.data
    s = d.synthetic
    task = ArithmeticTask(n_terms=s.n_terms, digits=s.digits, ops=s.ops, slip_prob=s.slip_prob, shortcut_prob=s.shortcut_prob,
                          shortcut_error=s.shortcut_error, min_terms=s.min_terms, skip_prob=s.skip_prob,
                          skip_error=s.skip_error)
    if d.train == "synthetic":
        train = task.problems(s.train_size, cfg.seed, heldout=False)
    else:
        if cfg.warmup.steps:
            raise ValueError("warmup.steps > 0 needs data.train: synthetic (worked solutions); set warmup.steps: 0")
        train, _ = load_problems(d.train, problem_field=d.problem_field, answer_field=d.answer_field,
                                 on_bad_row=d.on_bad_row)
        task = None
    if d.eval == "synthetic":
        eval_seed = cfg.seed + 1 if s.eval_seed is None else s.eval_seed
        evals = task.problems(s.eval_size, eval_seed, heldout=True) if task else None
        if evals is None:
            raise ValueError("data.eval: synthetic needs data.train: synthetic")
    else:
        evals, _ = load_problems(d.eval, limit=d.eval_limit, problem_field=d.problem_field, answer_field=d.answer_field,
                                 on_bad_row=d.on_bad_row)
    return task, train, evals
