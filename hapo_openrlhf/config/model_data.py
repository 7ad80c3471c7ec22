"""The model and the data: the tiny model's architecture or a checkpoint, the problems, the warm-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .base import choices, require


# The tiny model's architecture when model.path is unset. With model.path these keys
# default to none: the loaded model's own config.json decides, and a key that is given is
# checked against it (config/model_files.py: check_architecture), never silently ignored.
TINY_ARCHITECTURE = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                     "intermediate_size": 384, "max_position_embeddings": 256, "tie_word_embeddings": True,
                     "family": "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # a Hugging Face model dir; None builds the tiny model below
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool | None = None
    # the tiny model's architecture when path is unset: qwen2 (the paper's), qwen3, llama
    family: str | None = None
    # LM head + log-prob + entropy fused and chunked over tokens (no [B, T, V] logits)
    fused_head: bool = True
    # with fused_head and a row-local loss (ppo, entro_reg) the embedded trainer computes
    # each chunk's gradient inside the head's forward (no logits recomputation)
    fused_loss_in_forward: bool = True
    # training forwards drop padding and run the rows as one packed sequence
    # (flash-attn varlen on GPU, a block-diagonal SDPA mask on CPU)
    packing: bool = False

    def __post_init__(self):
        if not self.path:  # the tiny model: its defaults fill what is not given
            for k, v in TINY_ARCHITECTURE.items():
                if getattr(self, k) is None:
                    object.__setattr__(self, k, v)
        for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position_embeddings"):
            v = getattr(self, k)
            require(v is None or v > 0, f"model.{k} must be > 0, got {v}")
        if self.hidden_size is not None and self.num_heads is not None:
            require(self.hidden_size % self.num_heads == 0, "model.hidden_size must be divisible by model.num_heads")
        if self.num_heads is not None and self.num_kv_heads is not None:
            require(self.num_heads % self.num_kv_heads == 0, "model.num_heads must be divisible by model.num_kv_heads")
        require(self.family in (None, "qwen2", "qwen3", "llama"),
                 f"model.family must be one of qwen2, qwen3, llama, got {self.family!r}")

    def architecture_given(self) -> dict[str, Any]:
        """With ``path`` set: the architecture keys the config states (each must match the
        loaded model); without: every key (the tiny model is built from them)."""
        return {k: getattr(self, k) for k in TINY_ARCHITECTURE if getattr(self, k) is not None}


def _optional_seed(x) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**62)


# the largest synthetic train or held-out set (the draw keeps every problem in memory)
MAX_SYNTHETIC_PROBLEMS = 1_000_000


@dataclass(frozen=True)
class SyntheticConfig:
    n_terms: int = 3
    digits: int = 2
    ops: str = "+-"
    slip_prob: float = 0.0  # warm-up teacher's per-step error rate (see data/synthetic.py)
    shortcut_prob: float = 0.0  # share of warm-up answers given without the worked chain
    shortcut_error: float = 0.0  # how often such a direct warm-up answer is a near-miss guess
    # the chain variant (data/synthetic.py): min_terms .. n_terms terms; the teacher skips an
    # intermediate result with skip_prob per step, and such a merged step is a near miss with skip_error
    min_terms: int | None = None
    skip_prob: float = 0.0
    skip_error: float = 0.0
    train_size: int = 4000
    eval_size: int = 128
    # the held-out problems' draw; none: the run's seed + 1. A fixed value gives every run of an
    # experiment one held-out set (train problems still follow the run's seed)
    eval_seed: int | None = None

    def __post_init__(self):
        require(_optional_seed(self.eval_seed),
                 f"data.synthetic.eval_seed must be none or an integer >= 0, got {self.eval_seed!r}")
        # named here, at load, rather than when the task is first built (data/synthetic.py checks again)
        require(self.min_terms is None or 2 <= self.min_terms <= self.n_terms,
                 f"data.synthetic.min_terms must be in [2, n_terms={self.n_terms}], got {self.min_terms}")
        for k in ("slip_prob", "shortcut_prob", "skip_prob"):
            require(0 <= getattr(self, k) < 1, f"data.synthetic.{k} must be in [0, 1), got {getattr(self, k)}")
        for k in ("shortcut_error", "skip_error"):
            require(0 <= getattr(self, k) <= 1, f"data.synthetic.{k} must be in [0, 1], got {getattr(self, k)}")
        require(2 <= self.n_terms <= 64, f"data.synthetic.n_terms must be in [2, 64], got {self.n_terms}")
        require(1 <= self.digits <= 18, f"data.synthetic.digits must be in [1, 18], got {self.digits}")
        require(bool(self.ops) and not set(self.ops) - set("+-*"),
                 f"data.synthetic.ops must be a non-empty string of '+', '-', '*', got {self.ops!r}")
        # sizes are checked before the draw: it makes up to 50 x n attempts, so a size near or over
        # what the task can produce would run for minutes before failing
        from ..data.synthetic import ArithmeticTask

        task = ArithmeticTask(self.n_terms, self.digits, self.ops, min_terms=self.min_terms)
        for k, heldout in (("train_size", False), ("eval_size", True)):
            n = getattr(self, k)
            require(1 <= n <= MAX_SYNTHETIC_PROBLEMS,
                     f"data.synthetic.{k} must be in [1, {MAX_SYNTHETIC_PROBLEMS}], got {n}")
            cap = task.side_capacity(heldout)
            require(n <= cap * 0.95, f"data.synthetic.{k} ({n}) is more than 95% of the ~{cap} distinct "
                                    f"{'held-out' if heldout else 'training'} problems this task has "
                                    f"(n_terms {self.n_terms}, digits {self.digits}, ops {self.ops!r}); "
                                    f"lower it or make the task larger")


@dataclass(frozen=True)
class DataConfig:
    train: str = "synthetic"  # "synthetic", a bundled name, a file, or hf:<id>
    eval: str = "synthetic"
    template: str = "tiny"
    problem_field: str | None = None
    answer_field: str | None = None
    on_bad_row: Literal["error", "skip"] = "error"
    eval_limit: int | None = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)

    def __post_init__(self):
        from ..data.templates import TEMPLATES

        require(self.template in TEMPLATES, f"data.template must be one of {sorted(TEMPLATES)}, got {self.template!r}")
        require(self.on_bad_row in choices(type(self), "on_bad_row"), f"data.on_bad_row must be 'error' or 'skip', got {self.on_bad_row!r}")
        require(self.eval_limit is None or self.eval_limit >= 1,
                 f"data.eval_limit must be >= 1 (or null: every problem), got {self.eval_limit}")
        for k in ("train", "eval"):
            require(bool(str(getattr(self, k)).strip()), f"data.{k} must not be empty")


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised warm-up on worked synthetic solutions before RL (embedded run)."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3

    def __post_init__(self):
        require(self.steps >= 0 and self.batch_size > 0 and self.lr > 0, "warmup: steps >= 0, batch_size > 0, lr > 0")
