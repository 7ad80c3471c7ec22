"""`hapo eval`: Avg@k / Pass@k / response length on the paper's benchmarks.

Resumable: each benchmark's samples go to ``OUT/<stem>-<identity>.samples.jsonl``,
one line per problem, appended and fsynced batch by batch. ``<identity>`` hashes what
the samples depend on: the benchmark's resolved path (or bundled name), the content of
all its rows, and the generation settings. So two benchmarks with one basename get two
files, and an edited benchmark (or other settings) starts a fresh file instead of
grading stale samples against new answers. A rerun skips finished problems; every
problem has its own seed (``seed + index``), whatever batch it lands in, so a resumed
evaluation -- after a kill, a full disk or a torn line -- produces exactly the samples an
uninterrupted one would. A corrupt line (or a record whose problem no longer matches, or
whose scores / lengths are not k numbers) is reported with file and line and its problem
is generated again; the valid records after it are kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..data.templates import apply_template
from ..rewards import MathVerifier
from .benchmarks import BENCHMARKS, Benchmark, load_benchmark
from .engines import Engine, SamplingSpec
from .metrics import summarize_samples

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSettings:
    template: str
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 4096
    seed: int = 0
    batch_prompts: int = 16
    k: int | None = None  # override every benchmark's k
    limit: int | None = None  # first N problems of each benchmark

    def __post_init__(self):
        if self.k is not None and self.k < 1 or self.limit is not None and self.limit < 1:
            raise ValueError(f"--k and --limit must be >= 1, got k={self.k}, limit={self.limit}")
        if not (self.temperature > 0 and 0 < self.top_p <= 1 and self.max_new_tokens > 0 and self.batch_prompts > 0):
            raise ValueError("eval needs temperature > 0, top-p in (0, 1], max-new-tokens > 0, batch-prompts > 0")


def _check_record(rec, problems: list, k: int) -> int:
    """The record's problem index; a ``ValueError`` saying what is wrong with it otherwise."""
    import math

    if not isinstance(rec, dict):
        raise ValueError(f"a JSON {type(rec).__name__}, not a record")
    i = rec.get("index")
    if isinstance(i, bool) or not isinstance(i, int) or not (0 <= i < len(problems)) \
            or rec.get("id") != problems[i].id or rec.get("answer") != list(problems[i].answer):
        raise ValueError("it belongs to another problem")
    for key, ok in (("scores", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
                    ("lengths", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)):
        vals = rec.get(key)
        if not isinstance(vals, list) or len(vals) != k or not all(ok(v) for v in vals):
            raise ValueError(f"'{key}' must be a list of k={k} numbers, got {str(vals)[:80]}")
    return i


def _read_done(path: Path, problems: list, k: int) -> dict[int, dict]:
    """Finished problems. A corrupt line, a record that does not belong to the problem at its
    index, or one without k scores and lengths is reported (file:line) and dropped, so that
    problem is generated again; the file is rewritten with the valid records only (nothing
    valid after a bad line is lost)."""
    done, dropped = {}, []
    if path.exists():
        for ln, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                i = _check_record(rec, problems, k)
            except ValueError as e:
                dropped.append(f"{path}:{ln} ({e})")
                continue
            done[i] = rec
        if dropped:
            log.warning("dropping %d unusable sample record(s), their problems are generated again: %s",
                        len(dropped), "; ".join(dropped[:5]))
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(done[i]) + "\n" for i in sorted(done)))
            os.replace(tmp, path)
    return done


def benchmark_identity(bench: Benchmark, s: "EvalSettings") -> str:
    """A hash of what the samples depend on: the benchmark (resolved path or bundled name
    and every row), and the generation settings (not ``limit``, which only shortens)."""
    from ..data.loader import BUNDLED

    where = bench.name if bench.name in BUNDLED else str(Path(bench.name).resolve())
    rows = [(p.id, p.problem, list(p.answer)) for p in load_benchmark(bench, None)]
    gen = {k: v for k, v in asdict(s).items() if k != "limit"}
    blob = json.dumps({"where": where, "rows": rows, "k": s.k or bench.k, "gen": gen}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _append(path: Path, records: list[dict]) -> None:
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())


def check_prompt_lengths(engine: Engine, bench: Benchmark, prompts: list[str]) -> None:
    """Every prompt of a benchmark must fit what the engine can take: checked by token count
    before anything is generated, so a 1 MB prompt is a named error, not a multi-GB
    allocation, and no other problem's compute is spent first."""
    limit = getattr(engine, "max_prompt_tokens", None)
    if not limit:
        return
    for i, text in enumerate(prompts):
        n = len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
        if n > limit:
            raise ValueError(f"benchmark {bench.name!r}: problem {i} ({text[:60]!r}...) is a {n}-token prompt, over "
                             f"the {limit} tokens this engine can take ({engine.prompt_limit}); drop the problem "
                             f"(--limit, or edit the file)")


def eval_benchmark(engine: Engine, bench: Benchmark, s: EvalSettings, out_dir: Path, verifier: MathVerifier,
                   progress=None) -> dict:
    problems = load_benchmark(bench, s.limit)
    k = s.k or bench.k
    check_prompt_lengths(engine, bench, [apply_template(s.template, p.problem) for p in problems])
    stem = Path(bench.name).stem
    path = out_dir / f"{stem}-{benchmark_identity(bench, s)}.samples.jsonl"
    for other in sorted(out_dir.glob(f"{stem}-*.samples.jsonl")):
        if other != path:
            log.warning("%s: samples of another version of %s (rows or settings differ) are not reused",
                        other, bench.name)
    done = _read_done(path, problems, k)
    for start in range(0, len(problems), s.batch_prompts):
        idx = [i for i in range(start, min(start + s.batch_prompts, len(problems))) if i not in done]
        if not idx:
            continue
        # one seed per problem: a problem regenerated after a kill or a torn write gets the samples
        # an uninterrupted run gave it, whichever problems share its batch now
        spec = SamplingSpec(k, s.temperature, s.top_p, s.max_new_tokens, tuple(s.seed + i for i in idx))
        outs = engine.generate([apply_template(s.template, problems[i].problem) for i in idx], spec)
        recs = []
        for i, samples in zip(idx, outs):
            p = problems[i]
            scores = [verifier.score(text, p.answer) for text, _ in samples]
            recs.append({"index": i, "id": p.id, "answer": list(p.answer), "scores": scores,
                         "lengths": [n for _, n in samples], "responses": [t for t, _ in samples]})
        _append(path, recs)
        done.update({r["index"]: r for r in recs})
        if progress:
            progress(bench.name, len(done), len(problems))
    label = stem if bench.name in BENCHMARKS or bench.name == stem else bench.name  # two files, one basename
    return summarize(label, [done[i] for i in range(len(problems))], k)


def summarize(name: str, recs: list[dict], k: int) -> dict:
    scores = [r["scores"] for r in recs]
    lengths = [l for r in recs for l in r["lengths"]]
    return {
        "benchmark": name, "problems": len(recs), "k": k,
        **summarize_samples(scores, k),
        "pass@1": summarize_samples(scores, 1)["pass@1"],
        "mean_response_tokens": sum(lengths) / max(len(lengths), 1),
    }


def markdown_table(model: str, results: list[dict]) -> str:
    lines = [f"# Evaluation: `{model}`", "", "| benchmark | problems | k | Avg@k | Pass@k | mean tokens |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        k = r["k"]
        lines.append(f"| {r['benchmark']} | {r['problems']} | {k} | {r[f'avg@{k}']:.4f} | {r[f'pass@{k}']:.4f} | "
                     f"{r['mean_response_tokens']:.1f} |")
    if len(results) > 1:
        avg = sum(r[f"avg@{r['k']}"] for r in results) / len(results)
        lines.append(f"| **mean** | | | {avg:.4f} | | |")
    return "\n".join(lines) + "\n"


def run_eval(engine: Engine, model: str, benches: list[Benchmark], s: EvalSettings, out_dir: str | Path,
             progress=None) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings_file = out_dir / "settings.json"
    current = {**asdict(s), "model": model}
    if settings_file.exists():
        try:
            old = json.loads(settings_file.read_text())
        except (ValueError, OSError) as e:
            old = e
        if not isinstance(old, dict):
            raise ValueError(f"{settings_file} is unreadable or not a JSON object, so the samples in {out_dir} cannot "
                             f"be matched to a model and settings; use a new --output-dir (or delete that file if "
                             f"they are this model's)")
        changed = {k for k in current if old.get(k) != current[k] and k != "limit"}
        if changed:
            raise ValueError(f"{out_dir} holds samples made with other settings ({sorted(changed)}); "
                             f"use a new --output-dir")
    settings_file.write_text(json.dumps(current, indent=2))
    verifier = MathVerifier(timeout_s=10.0)
    t0 = time.time()
    try:
        results = [eval_benchmark(engine, b, s, out_dir, verifier, progress) for b in benches]
    finally:
        verifier.close()
    report = {"model": model, "engine": engine.name, "settings": current,
              "results": results, "wall_s": time.time() - t0,
              "grader": verifier.stats.metrics("grader/")}
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    (out_dir / "results.md").write_text(markdown_table(model, results))
    return report
