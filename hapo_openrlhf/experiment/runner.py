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
import signal
import time
import traceback
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any, Callable

from ..rundir.jsonfile import read_json_object
from .registration import read_manifest_for_update, register, run_code, run_identity
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
    """Worker side: train one run to completion; never raises (errors are reported). The
    parent has prepared ``job.out`` (:func:`_prepare`): it resumes from a checkpoint when
    one is there, else starts in the empty directory."""
    t0 = time.perf_counter()
    handler = None
    try:
        from ..rundir.checkpoint import list_complete
        from ..config import RunConfig, from_dict
        from ..local.trainer import LocalTrainer

        cfg = from_dict(RunConfig, job.config)
        resume = bool(list_complete(job.out / "checkpoints"))
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
        from ..rundir import runlock

        runlock.release(job.out)


def _die_with_the_runner() -> None:
    """Linux: this worker gets SIGKILL when the runner that started it dies (``prctl``'s
    ``PR_SET_PDEATHSIG``), so a runner killed with -9 leaves no worker training on, holding its
    run's lock; a runner already gone by now ends the worker too."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the runner died before the call took effect
        os._exit(1)


def _worker_loop(conn) -> None:
    """A worker process: run the jobs the parent sends, one at a time, until it sends None (or
    the runner dies: :func:`_die_with_the_runner`)."""
    _die_with_the_runner()
    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send(_run_job(job))


# written by the runner into every run directory it creates; the only directories it ever
# deletes (a run that died before its first checkpoint) are ones holding this marker
MARKER = ".hapo-experiment-run"


def _confined(exp: Experiment, d: Path) -> None:
    """``d`` must lie under the output directory through real directories only: every path
    component below ``OUT`` that exists must be a directory, not a symbolic link (a link
    would send the runner's writes, and its clean-up of a dead run, anywhere)."""
    root = exp.output_dir
    rel = d.relative_to(root)  # names are checked at load (spec.NAME), so this cannot escape
    if ".." in rel.parts:
        raise ValueError(f"{d} is outside the experiment's output directory {root}")
    cur = root
    for part in rel.parts:
        cur = cur / part
        if cur.is_symlink():
            raise ValueError(f"{cur} is a symbolic link; the experiment runner writes and cleans up only real "
                             f"directories inside {root}. Replace the link with a directory or use another "
                             f"--output-dir")
        if cur.exists() and not cur.is_dir():
            raise ValueError(f"{cur} is not a directory; move it aside or use another --output-dir")


def _prepare(exp: Experiment, job: Job) -> None:
    """Make ``job.out`` ready for its worker: an existing run with a complete checkpoint is
    left to resume; one that died before its first checkpoint is cleared, but only if this
    runner created it (its marker) and no process holds its run lock; a directory the runner
    did not create is never deleted (a named error instead)."""
    from ..rundir import runlock
    from ..rundir.checkpoint import list_complete

    _confined(exp, job.out)
    if job.out.exists() and not list_complete(job.out / "checkpoints") and any(job.out.iterdir()):
        if not (job.out / MARKER).is_file() or (job.out / MARKER).is_symlink():
            raise ValueError(f"{job.out} exists, holds no checkpoint and was not created by `hapo experiment` "
                             f"(no {MARKER}); it is left untouched. Move it aside and rerun")
        runlock.acquire(job.out)  # refused while another process (a `hapo train` there) holds it
        try:
            for child in job.out.iterdir():
                if child.name in (runlock.LOCK_NAME, MARKER):
                    continue
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        finally:
            runlock.release(job.out)
    job.out.mkdir(parents=True, exist_ok=True)
    marker = job.out / MARKER
    if not marker.exists():
        marker.write_text(json.dumps({"experiment": str(exp.output_dir), "job": job.name}) + "\n")


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


def _died(job: Job, proc, t0: float) -> dict[str, Any]:
    code = proc.exitcode
    how = (f"killed by signal {-code} ({signal.Signals(-code).name}{'; the out-of-memory killer?' if -code == 9 else ''})"
           if code is not None and code < 0 else f"exit status {code}")
    return {"name": job.name, "status": "failed", "wall_s": time.perf_counter() - t0,
            "error": f"the worker process running it died ({how}); its last checkpoint, if any, is kept and a "
                     f"rerun resumes it", "traceback": ""}


class _Workers:
    """Up to ``n`` worker processes (spawned: fresh interpreters, no torch/Ray state
    inherited), each running one job at a time. Unlike a ``ProcessPoolExecutor``, the job of
    a worker that dies (killed, out of memory) is known: it alone is reported failed, a new
    worker takes the next job, and the other jobs go on."""

    def __init__(self, n: int):
        self.n, self.ctx = n, multiprocessing.get_context("spawn")
        self.idle: list[tuple[Any, Any]] = []  # (process, connection)
        self.busy: dict[Any, tuple[Any, Job, float]] = {}  # connection -> (process, job, start)

    def free(self) -> bool:
        return len(self.busy) < self.n

    def submit(self, job: Job) -> None:
        while self.idle and not self.idle[-1][0].is_alive():  # an idle worker killed between jobs
            self.idle.pop()[1].close()
        if self.idle:
            proc, conn = self.idle.pop()
        else:
            conn, child = self.ctx.Pipe()
            proc = self.ctx.Process(target=_worker_loop, args=(child,), daemon=True)
            proc.start()
            child.close()
        conn.send(job)
        self.busy[conn] = (proc, job, time.perf_counter())

    def wait(self) -> list[tuple[Job, dict[str, Any]]]:
        """Block until at least one job ends; its (job, result) pairs."""
        ready = mp_connection.wait([*self.busy, *(p.sentinel for p, _, _ in self.busy.values())])
        out = []
        for conn in list(self.busy):
            proc, job, t0 = self.busy[conn]
            if conn not in ready and proc.sentinel not in ready:
                continue
            try:
                result = conn.recv() if conn.poll() else None
            except (EOFError, OSError):
                result = None
            del self.busy[conn]
            if result is None or not proc.is_alive():
                proc.join(timeout=5)
                if result is None:
                    result = _died(job, proc, t0)
                conn.close()
            else:
                self.idle.append((proc, conn))
            out.append((job, result))
        return out

    def close(self) -> None:
        for proc, conn in self.idle:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc, _, _ in self.busy.values():
            proc.terminate()
        for proc, conn in self.idle + [(p, c) for c, (p, _, _) in self.busy.items()]:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
            conn.close()


def run_experiment(exp: Experiment, suites: list[str],
                   on_event: Callable[[str, dict], None] | None = None, code_change: str | None = None) -> dict[str, Any]:
    """Train the warm starts and every run of ``suites``; returns (and writes to
    ``OUTPUT/experiment.json``) the manifest with each job's status and wall time. One
    runner per output directory (``OUT/.hapo.lock``, as for a run directory)."""
    from ..rundir import runlock

    unknown = [s for s in suites if s not in exp.suites]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; {exp.path} defines {sorted(exp.suites)} (or use 'all')")
    if exp.output_dir.is_symlink() and not exp.output_dir.exists():
        raise ValueError(f"output directory {exp.output_dir} is a dangling symbolic link")
    runlock.acquire(exp.output_dir)  # a second runner is refused here, before anything is touched
    try:
        return _run_locked(exp, suites, on_event, code_change)
    finally:
        runlock.release(exp.output_dir)


def _as_when_it_ran(r: dict, before: dict) -> dict:
    """A reused run's record: its wall time when it ran, and the code it ran with (none recorded: it
    finished before runs recorded theirs)."""
    r["wall_s"] = before.get("wall_s", 0.0)
    if "code" in before:
        r["code"] = before["code"]
    return r


def _run_locked(exp: Experiment, suites: list[str], on_event, code_change: str | None = None) -> dict[str, Any]:
    variants = exp.variants_of(suites)
    warm = exp.warm_jobs()
    runs = {s: [exp.runs[(v, s)] for v in variants] for s in exp.seeds}
    for j in warm + [j for js in runs.values() for j in js]:
        _confined(exp, j.out)
    # fail on a conflicting finished run before anything starts
    results: dict[str, dict] = {}
    for j in warm + [j for js in runs.values() for j in js]:
        r = _finished(j)
        if r is not None:
            results[j.name] = r
    manifest_path = exp.output_dir / "experiment.json"
    previous = read_manifest_for_update(manifest_path)
    manifest = {**exp.manifest(), "suites_run": sorted(set(previous.get("suites_run", [])) | set(suites)),
                "jobs": previous.get("jobs", {})}
    finished = {name: (j.out / "summary.json").stat().st_mtime for j in warm + [j for js in runs.values() for j in js]
                if (name := j.name) in results}
    manifest.update(register(previous, exp, variants, manifest_path, finished, code_change, code := run_identity()))
    ran_with = run_code(code)  # each job this invocation runs records it (issue 60: the run's code identity)
    exp.output_dir.mkdir(parents=True, exist_ok=True)
    _write_json(manifest_path, manifest)  # the registration, before the first job starts
    t_start = time.perf_counter()
    emit = on_event or (lambda kind, info: None)
    emit("plan", {"jobs": len(warm) + sum(map(len, runs.values())), "reused": len(results)})

    def record(r: dict) -> None:
        manifest["jobs"][r["name"]] = {k: v for k, v in r.items() if k != "summary"} | (
            {"before": r["summary"]["before"], "after": r["summary"]["after"]} if r.get("summary") else {})
        manifest["wall_s_this_invocation"] = time.perf_counter() - t_start
        _write_json(manifest_path, manifest)

    for r in results.values():
        record(_as_when_it_ran(r, manifest["jobs"].get(r["name"], {})))
        emit("reused", r)
    failed: list[str] = []
    queue: list[Job] = []

    def queue_runs(warm_job: Job) -> None:
        for seed in exp.seeds:
            if exp.warm[seed].name == warm_job.name:
                queue.extend(j for j in runs[seed] if j.name not in results)

    for j in warm:
        if j.name in results:
            queue_runs(j)
        else:
            queue.append(j)
    workers = _Workers(exp.workers)
    try:
        while queue or workers.busy:
            while queue and workers.free():
                job = queue.pop(0)
                try:
                    _prepare(exp, job)
                except ValueError as e:  # named, recorded, and the other jobs go on
                    r = {"name": job.name, "status": "failed", "wall_s": 0.0, "error": str(e), "traceback": ""}
                    results[job.name] = r
                    record(r)
                    emit("failed", r)
                    failed.append(job.name)
                    continue
                workers.submit(job)
            if not workers.busy:
                break
            for job, r in workers.wait():
                results[job.name] = r = {**r, "code": ran_with}
                record(r)
                emit(r["status"], r)
                if r["status"] != "done":
                    failed.append(job.name)
                elif job.variant is None:
                    queue_runs(job)
    finally:
        workers.close()
    skipped = [j.name for s in exp.seeds for j in runs[s] if j.name not in results]
    manifest.update(failed=failed, skipped_after_failed_warm_start=skipped,
                    wall_s_this_invocation=time.perf_counter() - t_start)
    _write_json(manifest_path, manifest)
    return manifest
