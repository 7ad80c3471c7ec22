"""`hapo eval`: Avg@k / Pass@k / response length on the paper's benchmarks.

Resumable: each benchmark's samples go to ``OUT/<bench>.samples.jsonl``, one
line per problem, appended and fsynced batch by batch. A rerun skips finished
problems; batches have fixed boundaries and seeds (``seed + batch start``), so a
resumed evaluation produces exactly the samples an uninterrupted one would.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..data.templates import apply_template
from ..rewards import MathVerifier
from .benchmarks import Benchmark, load_benchmark
from .engines import Engine, SamplingSpec
from .metrics import summarize_samples


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


def _read_done(path: Path) -> dict[int, dict]:
    """Finished problems; a torn last line (killed mid-write) is dropped and rewritten."""
    done, good = {}, []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                break
            done[rec["index"]] = rec
            good.append(line)
        path.write_text("".join(l + "\n" for l in good))
    return done


def _append(path: Path, records: list[dict]) -> None:
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())


def eval_benchmark(engine: Engine, bench: Benchmark, s: EvalSettings, out_dir: Path, verifier: MathVerifier,
                   progress=None) -> dict:
    problems = load_benchmark(bench, s.limit)
    k = s.k or bench.k
    path = out_dir / f"{Path(bench.name).stem}.samples.jsonl"
    done = _read_done(path)
    for start in range(0, len(problems), s.batch_prompts):
        idx = [i for i in range(start, min(start + s.batch_prompts, len(problems))) if i not in done]
        if not idx:
            continue
        # batches are appended whole, so after a kill a batch is either done or not: a resumed
        # run regenerates exactly the missing batches with their original seeds (a partial
        # batch only arises when --limit or --batch-prompts changed; its seed is then new)
        spec = SamplingSpec(k, s.temperature, s.top_p, s.max_new_tokens, s.seed + idx[0])
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
    return summarize(Path(bench.name).stem, [done[i] for i in range(len(problems))], k)


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
        old = json.loads(settings_file.read_text())
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
