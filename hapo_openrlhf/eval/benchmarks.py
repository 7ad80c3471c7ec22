"""The six benchmarks of the paper's protocol, with their default k."""

from __future__ import annotations

from dataclasses import dataclass

from ..data.loader import BUNDLED, EVAL_SKIP_HINT, Problem, load_problems


@dataclass(frozen=True)
class Benchmark:
    name: str
    k: int  # samples per problem: Avg@k and Pass@k


# paper protocol: k = 32 for AIME/AMC (few problems, high variance), 4 for the rest
BENCHMARKS = {
    b.name: b
    for b in (
        Benchmark("aime24", 32), Benchmark("aime25", 32), Benchmark("amc23", 32),
        Benchmark("math500", 4), Benchmark("minerva", 4), Benchmark("olympiadbench", 4),
    )
}


def parse_benchmarks(spec: str) -> list[Benchmark]:
    """"aime24,math500" (or "all") -> benchmarks; an unknown name is an error. A bundled
    training file or a JSONL path may be given too (k = 4)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["all"]:
        return list(BENCHMARKS.values())
    out = []
    for n in names:
        if n in BENCHMARKS:
            out.append(BENCHMARKS[n])
        elif n in BUNDLED or n.endswith((".jsonl", ".json", ".parquet")):
            out.append(Benchmark(n, 4))
        else:
            raise ValueError(f"unknown benchmark {n!r}; known: {sorted(BENCHMARKS)} (or 'all', or a data file)")
    if not out:
        raise ValueError("no benchmark given")
    return out


def load_benchmark(b: Benchmark, limit: int | None = None) -> list[Problem]:
    problems, _ = load_problems(b.name, skip_hint=EVAL_SKIP_HINT)
    return problems[:limit] if limit else problems


def resolve_template(model_path: str, requested: str = "auto") -> str:
    """The prompt template for a model: as requested, or from ``hapo.json`` written by
    ``hapo train``, or from the model family in its name (Qwen2.5-Math, DeepScaleR /
    R1-Distill)."""
    from pathlib import Path

    from ..data.templates import TEMPLATES
    from ..rundir.jsonfile import read_json_object

    if requested != "auto":
        if requested not in TEMPLATES:
            raise ValueError(f"unknown prompt template {requested!r}; known: {sorted(TEMPLATES)}")
        return requested
    hint = Path(model_path) / "hapo.json"
    if hint.exists():
        t = read_json_object(hint, "hapo train's note of the prompt template").get("template")
        if t not in TEMPLATES:
            raise ValueError(f"{hint}: 'template' must be one of {sorted(TEMPLATES)}, got {t!r}; fix it or pass "
                             f"--template")
        return t
    names = [str(model_path)]
    cfg = Path(model_path) / "config.json"
    if cfg.exists():
        names.append(str(read_json_object(cfg, "the model's config").get("_name_or_path", "")))
    low = " ".join(names).lower()
    if "deepscaler" in low or "r1-distill" in low:
        return "deepscaler"
    if "qwen2.5-math" in low or "qwen25_math" in low or "qwen2.5_math" in low:
        return "qwen25_math"
    raise ValueError(f"cannot infer the prompt template of {model_path!r}; pass --template {sorted(TEMPLATES)}")
