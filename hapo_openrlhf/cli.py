"""``hapo``: the command-line entry point.

    hapo train --config configs/cpu_tiny.yaml [--output-dir DIR] [--resume] [--set k=v ...]
    hapo train --backend openrlhf --config configs/qwen25_math_7b_hapo.yaml [--print-command]
    hapo train --config configs/qwen25_math_7b_hapo_megatron.yaml [--print-command]   # Megatron policy actor
    hapo eval --model DIR [--benchmarks aime24,math500,...] [--output-dir DIR]
    hapo submit CONFIG [--nodes N --gpus-per-node G --partition P --time T --account A] [--dry-run]
    hapo scale CONFIG --nodes 1,2,4,8 | hapo scale --collect BASE_DIR
    hapo experiment quadrants|compare|alpha|all [--config configs/experiments/toy_repro.yaml] [--seeds 1,2,3]
    hapo report RUN_DIR [RUN_DIR ...] | hapo report EXPERIMENT_DIR
    hapo doctor --config CONFIG [--json] [--static] | hapo doctor --gpu-smoke [--json]
    hapo list
    hapo extend-context SOURCE DEST --factor F [--original N]   # YaRN in config.json (Qwen's long context)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path


# ``hapo train``'s end-of-run report (plots + HTML, ~2-3 CPU-s on the tiny config) is skipped with
# --no-report or this variable set to 1: sweeps, Slurm arrays, and the test suite's ~40 training
# runs that do not read it; `hapo report RUN_DIR` builds it later from the run's files
NO_REPORT_ENV = "HAPO_NO_REPORT"


def _no_report(args) -> bool:
    value = os.environ.get(NO_REPORT_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{NO_REPORT_ENV} must be 0 or 1 (1: skip hapo train's report), got {value!r}")
    return args.no_report or value == "1"


def _train(args) -> int:
    from rich.console import Console

    from .config import load_config
    from .local.progress import RichProgress, summary_table
    from .rundir.preemption import EXIT_PREEMPTED, Preempted, on_stop_signal
    from .local.trainer import LocalTrainer
    from .report.html import build_report

    no_report = _no_report(args)  # a bad value is named before anything trains
    overrides = list(args.set) + ([f"backend={args.backend}"] if args.backend else [])
    cfg = load_config(args.config, overrides)
    if cfg.backend in ("openrlhf", "megatron"):  # OpenRLHF's controller; the policy actor differs
        from .integrations.openrlhf.launch.flags import build_argv

        if args.print_command:
            print(json.dumps(build_argv(cfg, args.output_dir)))
            return 0
        if args.resume:
            print("note: the openrlhf back end always resumes from its newest checkpoint (--ckpt.load_enable)",
                  file=sys.stderr)
        from .integrations.openrlhf.launch.train import main as openrlhf_main

        return openrlhf_main(["--config", args.config, *(["--output-dir", args.output_dir] if args.output_dir else []),
                              *[x for kv in overrides for x in ("--set", kv)]])
    if args.print_command:
        raise ValueError("--print-command is for --backend openrlhf or megatron (the local back end runs in this process)")
    console = Console()
    trainer = LocalTrainer(cfg, args.output_dir, resume=args.resume)
    if trainer.resumed_from:
        print(f"hapo: resumed from {trainer.resumed_from} (step {trainer.state.step})", file=sys.stderr, flush=True)
    console.print(f"[bold]hapo[/] {cfg.run_name}: estimator={cfg.algorithm.estimator} loss={cfg.algorithm.loss} "
                  f"-> {trainer.out}")

    def _stop(signum):
        trainer.stop_requested = True
        print(f"hapo: signal {signum}: checkpointing at the end of this step, then exiting", file=sys.stderr)

    on_stop_signal(_stop)
    try:
        with RichProgress(cfg.warmup.steps, cfg.trainer.steps, console) as prog:
            summary = trainer.fit(progress=prog)
    except Preempted as e:
        print(json.dumps({"preempted_at_step": e.step, "output_dir": str(trainer.out)}))
        return EXIT_PREEMPTED
    console.print(summary_table(summary))
    if cfg.trainer.steps and not no_report:
        console.print(f"report: {build_report([trainer.out], trainer.out / 'report')}")
    elif cfg.trainer.steps:
        console.print(f"report: not built ({NO_REPORT_ENV}=1 or --no-report); `hapo report {trainer.out}` builds it",
                      soft_wrap=True, markup=False, highlight=False)
    b, a = summary["before"]["eval/accuracy"], summary["after"]["eval/accuracy"]
    print(json.dumps({"heldout_accuracy_before": b, "heldout_accuracy_after": a, "output_dir": str(trainer.out)}))
    return 0


def _eval(args) -> int:
    from rich.console import Console

    from .eval.benchmarks import parse_benchmarks, resolve_template
    from .eval.engines import make_engine
    from .eval.harness import EvalSettings, markdown_table, run_eval

    from .eval.engines import check_local_model

    if args.vllm_enforce_eager and args.engine == "hf":
        raise ValueError("--vllm-enforce-eager is a vLLM setting; --engine hf does not take it")
    benches = parse_benchmarks(args.benchmarks)

    def settings_with(template: str) -> EvalSettings:
        return EvalSettings(
            template=template, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
            seed=args.seed, batch_prompts=args.batch_prompts, k=args.k, limit=args.limit)

    settings_with("plain")  # the numbers first, then the model (before its template is looked up)
    check_local_model(args.model)
    settings = settings_with(resolve_template(args.model, args.template))
    out = args.output_dir or str(Path(args.model) / "eval")
    console = Console(stderr=True)
    engine = make_engine(args.engine, args.model,
                         **({"enforce_eager": True} if args.vllm_enforce_eager else {}))
    report = run_eval(engine, args.model, benches, settings, out,
                      progress=lambda b, d, n: console.print(f"{b}: {d}/{n} problems", highlight=False))
    print(markdown_table(args.model, report["results"]))
    print(json.dumps({"results": str(Path(out) / "results.json")}))
    return 0


def _submit_options(args):
    from .cluster.sbatch import SubmitOptions

    return SubmitOptions(
        nodes=getattr(args, "nodes_n", None), gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
        partition=args.partition, account=args.account, time=args.time, signal_seconds=args.signal_seconds,
        max_requeues=args.max_requeues, ray_port=args.ray_port, array=getattr(args, "array", None),
        output_dir=args.output_dir, sets=tuple(args.set), extra_sbatch=tuple(args.sbatch),
        ray_check=getattr(args, "ray_check", False), ray_num_gpus=args.ray_num_gpus, network_interface=args.network_interface,
    )


def _submit(args) -> int:
    from .cluster.sbatch import output_dir_of, render, submit
    from .config import load_config
    from .cluster.doctor import FAIL, report, run_checks

    opts = _submit_options(args)
    script = render(args.config, opts)
    if not args.skip_doctor:  # the checks a login node can answer (no CUDA here)
        checks = run_checks(load_config(args.config, list(opts.sets)), static=True, output_dir=args.output_dir,
                            interface=opts.network_interface)
        problems = [c for c in checks if c.status != "ok"]
        if problems:
            print("hapo doctor (static):\n" + report(problems), file=sys.stderr)
        if any(c.status == FAIL for c in checks) and not args.dry_run:
            raise ValueError("the config has blocking problems (above); fix them, or pass --skip-doctor")
    if args.dry_run:
        print(script, end="")
        return 0
    out = output_dir_of(args.config, opts)
    job = submit(script, out, test_only=args.test_only)
    print(json.dumps({"test_only": job} if args.test_only else {"job_id": job, "output_dir": str(out)}))
    return 0


def _scale(args) -> int:
    from .cluster.scale import collect, parse_nodes, submit_scaling

    if args.collect:
        table = collect(Path(args.collect))
        print((Path(args.collect) / "scale.md").read_text(), end="")
        print(json.dumps({"table": table}))
        return 0
    if not args.config:
        raise ValueError("hapo scale needs CONFIG (or --collect BASE_DIR)")
    from .config import load_config

    base = Path(args.output_dir or (load_config(args.config, args.set).output_dir + "_scale"))
    args.output_dir = None
    jobs = submit_scaling(args.config, parse_nodes(args.nodes), _submit_options(args), base, args.dry_run)
    if not args.dry_run:
        print(json.dumps({"jobs": jobs, "collect": f"hapo scale --collect {base}"}))
    return 0


def _add_slurm_args(p) -> None:
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: openrlhf.actor_gpus_per_node")
    p.add_argument("--cpus-per-task", type=int, default=None)
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--time", default="24:00:00")
    p.add_argument("--signal-seconds", type=int, default=None,
                   help="USR1 this long before the time limit (default: slurm.signal_lead_s, or derived from the "
                        "config's response length and model size: >= 30 min at 24k tokens)")
    p.add_argument("--max-requeues", type=int, default=20)
    p.add_argument("--ray-port", type=int, default=6379)
    p.add_argument("--network-interface", "--ray-interface", dest="network_interface", default=None,
                   help="the network interface every node's Ray, gloo and NCCL traffic uses, e.g. ib0 "
                        "(default: each library's own choice)")
    p.add_argument("--ray-num-gpus", type=int, default=None,
                   help="GPUs each Ray node advertises and must register (default: --gpus-per-node)")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="an extra #SBATCH option, e.g. --sbatch=--qos=high")
    p.add_argument("--dry-run", action="store_true", help="print the rendered script, submit nothing")


def _experiment(args) -> int:
    from rich.console import Console

    from .experiment import build_experiment_report, load_experiment, run_experiment
    from .experiment.spec import parse_seeds

    seeds = parse_seeds(args.seeds) if args.seeds else None
    exp = load_experiment(args.config, seeds=seeds, output_dir=args.output_dir, workers=args.workers,
                          overrides=args.set, warm_start_seed=args.warm_start_seed)
    suites = list(exp.suites) if "all" in args.suites else list(dict.fromkeys(args.suites))
    console = Console(stderr=True)
    state = {"done": 0, "total": 0}

    def on_event(kind: str, info: dict) -> None:
        if kind == "plan":
            state["total"] = info["jobs"]
            console.print(f"[bold]hapo experiment[/] {', '.join(suites)}: {info['jobs']} jobs "
                          f"({info['reused']} already finished), {exp.workers} workers -> {exp.output_dir}")
            return
        state["done"] += 1
        head = f"[{state['done']}/{state['total']}] {info['name']}"
        if kind == "failed":
            console.print(f"{head} [red]FAILED[/] after {info['wall_s']:.0f} s: {info['error']}", highlight=False)
            return
        b, a = info["summary"]["before"]["eval/accuracy"], info["summary"]["after"]["eval/accuracy"]
        how = "reused" if kind == "reused" else f"{info['wall_s']:.0f} s"
        console.print(f"{head} ({how}): held-out accuracy {b:.3f} -> {a:.3f}", highlight=False)

    manifest = run_experiment(exp, suites, on_event, code_change=args.code_change)
    bad = manifest["failed"] + manifest["skipped_after_failed_warm_start"]
    report = None
    if any(j["status"] == "done" and not j["name"].startswith("warm_start/") for j in manifest["jobs"].values()):
        report = build_experiment_report(exp.output_dir)
        console.print(f"report: {report}")
        from .experiment.report import export_results

        console.print(f"results (every table of the report, to keep under version control): "
                      f"{export_results(exp.output_dir)}")
    if bad:
        console.print(f"[red]{len(manifest['failed'])} failed[/] ({', '.join(manifest['failed'])}); "
                      f"{len(manifest['skipped_after_failed_warm_start'])} not run because their warm start failed. "
                      f"Errors: {exp.output_dir / 'experiment.json'}; rerun the same command to retry them.")
    print(json.dumps({"report": str(report) if report else None, "wall_s": round(manifest["wall_s_this_invocation"], 1),
                      "failed": manifest["failed"], "skipped": manifest["skipped_after_failed_warm_start"]}))
    return 1 if bad else 0


def _report(args) -> int:
    from .experiment import build_experiment_report, is_experiment_dir
    from .report.html import build_report

    from .experiment.results import is_results_file

    if len(args.run_dirs) == 1 and is_experiment_dir(args.run_dirs[0]):
        if args.results:
            from .experiment.report import export_results

            print(export_results(args.run_dirs[0], args.results))
        print(build_experiment_report(args.run_dirs[0], args.output_dir))
        return 0
    if args.results:
        raise ValueError("--results writes an experiment's results file: give one experiment directory")
    if len(args.run_dirs) == 1 and is_results_file(args.run_dirs[0]):  # a committed results file, alone
        print(build_experiment_report(args.run_dirs[0], args.output_dir))
        return 0
    out = args.output_dir or (Path(args.run_dirs[0]) / "report" if len(args.run_dirs) == 1 else Path("hapo_report"))
    print(build_report(args.run_dirs, out))
    return 0


def _doctor(args) -> int:
    from .cluster.doctor import FAIL, report, run_checks
    from .gpu_smoke import gpu_smoke, smoke_table

    if args.gpu_smoke:
        summary = gpu_smoke(args.output_dir)
        print(json.dumps(summary, indent=1) if args.json else smoke_table(summary))
        return 0 if summary["ok"] else 1
    if not args.config:
        raise ValueError("hapo doctor needs --config CONFIG (or --gpu-smoke)")
    if args.gpu_gb is not None and not (math.isfinite(args.gpu_gb) and args.gpu_gb > 0):
        raise ValueError(f"--gpu-gb must be a positive number of GB (one GPU's memory), got {args.gpu_gb}")
    from .config import load_config

    checks = run_checks(load_config(args.config, args.set), static=args.static, output_dir=args.output_dir,
                        interface=args.network_interface, dry_run=not args.no_dry_run, gpu_gb=args.gpu_gb)
    print(report(checks, as_json=args.json))
    return 1 if any(c.status == FAIL for c in checks) else 0


def _list(args) -> int:
    from .algos import ESTIMATORS, list_estimators, list_losses

    print(json.dumps({"estimators": list_estimators(), "losses": list_losses(),
                      "not_implemented": ESTIMATORS.refused()}))
    return 0


def _add_experiment_parsers(sub) -> None:
    """``hapo experiment`` and ``hapo report`` (which also reads an experiment's directory or results file)."""
    x = sub.add_parser("experiment", help="variants x seeds from shared warm starts, then one report")
    x.add_argument("suites", nargs="+", metavar="SUITE", help="suites of the experiment file, or 'all'")
    x.add_argument("--config", default="configs/experiments/toy_repro.yaml", help="the experiment file")
    x.add_argument("--seeds", default=None, help="comma-separated; default: the experiment file's")
    x.add_argument("--workers", type=int, default=None, help="parallel runs; default: the experiment file's")
    x.add_argument("--warm-start-seed", type=int, default=None,
                   help="one warm start, trained with this seed, shared by every seed's runs; default: the "
                        "experiment file's warm_start_seed (absent: a warm start per seed)")
    x.add_argument("--output-dir", default=None, help="default: the experiment file's output_dir")
    x.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run-config key in every run (merged into 'common')")
    x.add_argument("--code-change", default=None, metavar="REASON",
                   help="go on with an experiment registered under other code (package sources, torch or "
                        "transformers) or on other CPU arithmetic (ATen's CPU capability, the CPU model); the reason "
                        "is recorded in experiment.json and printed in the report")
    x.set_defaults(fn=_experiment)
    r = sub.add_parser("report", help="plots from run directories, or an experiment directory's report")
    r.add_argument("run_dirs", nargs="+", help="run directories, one experiment directory, or one experiment's "
                                                "results file (results.json)")
    r.add_argument("--output-dir", default=None, help="default: RUN_DIR/report (one run) or ./hapo_report")
    r.add_argument("--results", default=None, metavar="FILE",
                   help="with an experiment directory: also write its results file there (to commit)")
    r.set_defaults(fn=_report)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hapo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train with a run config (embedded CPU back end, or OpenRLHF)")
    t.add_argument("--config", required=True)
    t.add_argument("--backend", choices=["local", "openrlhf", "megatron"], default=None, help="default: the config's backend")
    t.add_argument("--print-command", action="store_true",
                   help="openrlhf: print OpenRLHF's argv as one JSON list on the last line, start nothing")
    t.add_argument("--output-dir", default=None, help="default: the config's output_dir")
    t.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    t.add_argument("--no-report", action="store_true",
                   help=f"do not build the end-of-run report (plots + HTML; also {NO_REPORT_ENV}=1); "
                        "`hapo report RUN_DIR` builds it later")
    t.set_defaults(fn=_train)
    e = sub.add_parser("eval", help="Avg@k / Pass@k of a model on the benchmarks (resumable)")
    e.add_argument("--model", required=True, help="a Hugging Face model directory")
    e.add_argument("--benchmarks", default="aime24,aime25,amc23,math500,minerva,olympiadbench")
    e.add_argument("--output-dir", default=None, help="default: MODEL/eval")
    e.add_argument("--engine", default="auto", choices=["auto", "hf", "vllm"])
    e.add_argument("--template", default="auto", help="prompt template; auto: from hapo.json or the model name")
    e.add_argument("--temperature", type=float, default=0.6)
    e.add_argument("--top-p", type=float, default=0.95)
    e.add_argument("--max-new-tokens", type=int, default=4096)
    e.add_argument("--k", type=int, default=None, help="samples per problem (default: 32 AIME/AMC, 4 others)")
    e.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    e.add_argument("--batch-prompts", type=int, default=16)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--vllm-enforce-eager", action="store_true",
                   help="vLLM: no compiled graphs (torch.compile, CUDA graphs): starts faster, decodes slower")
    e.set_defaults(fn=_eval)
    s = sub.add_parser("submit", help="render the sbatch script for a run config and submit it")
    s.add_argument("config")
    s.add_argument("--nodes", dest="nodes_n", type=int, default=None, help="default: openrlhf.actor_num_nodes or 1")
    s.add_argument("--array", default=None, help="'seeds=1,2,3' or 'quadrants': one array task each")
    s.add_argument("--test-only", action="store_true", help="sbatch --test-only: validate, do not queue")
    s.add_argument("--ray-check", action="store_true", help="only bring Ray up on every node and report (no training)")
    s.add_argument("--skip-doctor", action="store_true", help="submit even if `hapo doctor --static` finds problems")
    _add_slurm_args(s)
    s.set_defaults(fn=_submit)
    sc = sub.add_parser("scale", help="submit a run at several node counts; --collect tabulates tokens/s")
    sc.add_argument("config", nargs="?")
    sc.add_argument("--nodes", default="1,2,4,8")
    sc.add_argument("--collect", default=None, metavar="BASE_DIR")
    _add_slurm_args(sc)
    sc.set_defaults(fn=_scale)
    _add_experiment_parsers(sub)
    d = sub.add_parser("doctor", help="preflight a run config here (packages, CUDA, paths, disk, Slurm lead), "
                                      "or --gpu-smoke: the one-GPU acceptance run")
    d.add_argument("--config", default=None)
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--output-dir", default=None, help="the run's output directory (default: the config's)")
    d.add_argument("--static", action="store_true", help="only what a login node can answer (no CUDA/NCCL)")
    d.add_argument("--network-interface", "--ray-interface", dest="network_interface", default=None,
                   help="check this network interface (the one hapo submit --network-interface names)")
    d.add_argument("--no-dry-run", action="store_true",
                   help="backend megatron: skip the full-size dry run of every rank role (meta device, fake "
                        "process group; a few seconds)")
    d.add_argument("--gpu-gb", type=float, default=None,
                   help="GPU memory for the dry run's per-rank arithmetic (default: this node's GPUs, else 80)")
    d.add_argument("--gpu-smoke", action="store_true",
                   help="one GPU: fused head, bf16 GEMM, flash-attn varlen, algos on CUDA, OpenRLHF loop with a CUDA "
                        "vLLM engine + stop/resume, Megatron TP=1 (2 GPUs); --output-dir keeps its work")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=_doctor)
    sub.add_parser("list", help="registered estimators and losses").set_defaults(fn=_list)
    x = sub.add_parser("extend-context", help="a model directory with YaRN added to its config.json (weights linked)")
    x.add_argument("source", help="a local model directory, or a hub id in the local Hugging Face cache")
    x.add_argument("dest", help="a new (or empty) directory")
    x.add_argument("--factor", type=float, required=True, help="the context's stretch (Qwen3: 4 = 131,072 positions)")
    x.add_argument("--original", type=int, default=None,
                   help="the pretraining context in positions (default: the model's max_position_embeddings)")
    x.set_defaults(fn=_extend_context)
    return ap


def _extend_context(args) -> int:
    from .cluster.context_extension import extend_context

    out = extend_context(args.source, args.dest, factor=args.factor, original=args.original)
    print(f"{out}: YaRN x{args.factor:g} (config.json rewritten, weights linked to {args.source})")
    return 0


def describe_error(e: BaseException) -> str:
    """One line for a user: what went wrong and where, without a traceback."""
    import errno

    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"the disk is full{f' writing {e.filename}' if e.filename else ''} ({e.strerror}); free space and rerun"
    if isinstance(e, OSError) and e.errno == errno.EFBIG:
        return f"a file-size limit stopped writing {e.filename}: {e.strerror}"
    if isinstance(e, RuntimeError) and ("iostream" in str(e).lower() or "No space left" in str(e)):
        return f"writing a file failed, most likely a full disk: {e}"
    if isinstance(e, (ValueError, FloatingPointError, OSError)):
        return str(e)
    return f"{type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("hapo: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place every error becomes one clear line
        if args.verbose:
            import traceback

            traceback.print_exc()
        expected = isinstance(e, (ValueError, FloatingPointError, OSError))
        hint = "" if expected or args.verbose else " (run with -v for the traceback)"
        print(f"hapo: error: {describe_error(e)}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
