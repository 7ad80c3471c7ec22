"""Run an experiment's warm starts and RL runs in a pool of worker processes.

Each seed's warm start (or the one warm start of every seed) is one embedded-trainer run
with ``trainer.steps: 0`` (SFT warm-up, evaluation, Hugging Face model saved); each RL
run of that seed is submitted when it finishes and loads that model (``model.path``,
``warmup.steps: 0``), reusing its evaluation as step 0 (local/eval_cache.py). Runs are
ordinary embedded-trainer runs with their own ``config.yaml``, so any one of them can be
rerun alone with ``hapo train --config RUN_DIR/config.yaml``.

Re-invoking the experiment reuses every finished run whose saved config equals the
one asked for (a different one is an error, never overwritten), resumes a run that
has a checkpoint, and restarts a run that died before its first checkpoint.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

from ..jsonfile import read_json_object
from .spec import Experiment, Job, config_matches


def _quiet_worker(log_file: Path) -> logging.Handler:
    """Send this run's log records to ``RUN_DIR/run.log`` instead of the shared console
    (two workers would interleave their lines), and turn off Hugging Face progress bars."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    import transformers

    transformers.utils.logging.disable_progress_bar()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler


def _run_job(job: Job) -> dict[str, Any]:
    """Worker side: train one run to completion; never raises (errors are reported)."""
    t0 = time.perf_counter()
    handler = None
    try:
        from ..checkpoint import list_complete
        from ..config import RunConfig, from_dict
        from ..local.trainer import LocalTrainer

        cfg = from_dict(RunConfig, job.config)
        resume = bool(list_complete(job.out / "checkpoints"))
        if job.out.exists() and not resume:  # died before its first checkpoint: start it again
            shutil.rmtree(job.out)
        handler = _quiet_worker(job.out / "run.log")
        summary = LocalTrainer(cfg, job.out, resume=resume).fit()
        return {"name": job.name, "status": "done", "wall_s": time.perf_counter() - t0, "summary": summary,
                "resumed": resume}
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which keeps going
        return {"name": job.name, "status": "failed", "wall_s": time.perf_counter() - t0,
                "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()


def _finished(job: Job) -> dict | None:
    summary = job.out / "summary.json"
    if not summary.exists():
        return None
    if not config_matches(job.out, job.config):
        raise ValueError(
            f"{str(job.out)!r} holds a finished run made with a different configuration than the experiment "
            f"asks for now; use another --output-dir, or delete that run directory to redo it"
        )
    return {"name": job.name, "status": "done", "wall_s": 0.0, "summary": read_json_object(summary, "the run's summary"),
            "reused": True}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def run_experiment(exp: Experiment, suites: list[str],
                   on_event: Callable[[str, dict], None] | None = None) -> dict[str, Any]:
    """Train the warm starts and every run of ``suites``; returns (and writes to
    ``OUTPUT/experiment.json``) the manifest with each job's status and wall time."""
    unknown = [s for s in suites if s not in exp.suites]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; {exp.path} defines {sorted(exp.suites)} (or use 'all')")
    variants = exp.variants_of(suites)
    warm = exp.warm_jobs()
    runs = {s: [exp.runs[(v, s)] for v in variants] for s in exp.seeds}
    # fail on a conflicting finished run before anything starts
    results: dict[str, dict] = {}
    for j in warm + [j for js in runs.values() for j in js]:
        r = _finished(j)
        if r is not None:
            results[j.name] = r
    exp.output_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = exp.output_dir / "experiment.json"
    previous = read_json_object(manifest_path, "the experiment's manifest") if manifest_path.exists() else {}
    if not isinstance(previous.get("suites_run", []), list) or not isinstance(previous.get("jobs", {}), dict):
        raise ValueError(f"{manifest_path}: 'suites_run' must be a list and 'jobs' an object; move the file aside "
                         f"to start the manifest afresh (finished runs are found again from their directories)")
    manifest = {**exp.manifest(), "suites_run": sorted(set(previous.get("suites_run", [])) | set(suites)),
                "jobs": previous.get("jobs", {})}
    t_start = time.perf_counter()
    emit = on_event or (lambda kind, info: None)
    emit("plan", {"jobs": len(warm) + sum(map(len, runs.values())), "reused": len(results)})

    def record(r: dict) -> None:
        manifest["jobs"][r["name"]] = {k: v for k, v in r.items() if k != "summary"} | (
            {"before": r["summary"]["before"], "after": r["summary"]["after"]} if r.get("summary") else {})
        manifest["wall_s_this_invocation"] = time.perf_counter() - t_start
        _write_json(manifest_path, manifest)

    for r in results.values():
        r["wall_s"] = manifest["jobs"].get(r["name"], {}).get("wall_s", 0.0)  # its time when it ran
        record(r)
        emit("reused", r)
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no torch/Ray state is inherited
    failed: list[str] = []
    with ProcessPoolExecutor(max_workers=exp.workers, mp_context=ctx) as pool:
        pending: dict[Future, Job] = {}

        def submit_runs(warm_job: Job) -> None:
            for seed in exp.seeds:
                if exp.warm[seed].name == warm_job.name:
                    for j in runs[seed]:
                        if j.name not in results:
                            pending[pool.submit(_run_job, j)] = j

        for j in warm:
            if j.name in results:
                submit_runs(j)
            else:
                pending[pool.submit(_run_job, j)] = j
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                job = pending.pop(fut)
                r = fut.result()
                results[job.name] = r
                record(r)
                emit(r["status"], r)
                if r["status"] != "done":
                    failed.append(job.name)
                    continue
                if job.variant is None:
                    submit_runs(job)
    skipped = [j.name for s in exp.seeds for j in runs[s] if j.name not in results]
    manifest.update(failed=failed, skipped_after_failed_warm_start=skipped,
                    wall_s_this_invocation=time.perf_counter() - t_start)
    _write_json(manifest_path, manifest)
    return manifest
