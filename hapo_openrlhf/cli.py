"""``hapo``: the command-line entry point.

    hapo train --config configs/cpu_tiny.yaml [--output-dir DIR] [--resume] [--set k=v ...]
    hapo report RUN_DIR
    hapo list
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _train(args) -> int:
    from rich.console import Console

    from .config import load_config
    from .local.progress import RichProgress, summary_table
    from .local.trainer import LocalTrainer
    from .report.plots import plot_run

    cfg = load_config(args.config, args.set)
    if cfg.backend != "local":
        raise ValueError(f"backend {cfg.backend!r} is not available in this version; use backend: local")
    console = Console()
    trainer = LocalTrainer(cfg, args.output_dir, resume=args.resume)
    console.print(f"[bold]hapo[/] {cfg.run_name}: estimator={cfg.algorithm.estimator} loss={cfg.algorithm.loss} "
                  f"-> {trainer.out}")
    with RichProgress(cfg.warmup.steps, cfg.trainer.steps, console) as prog:
        summary = trainer.fit(progress=prog)
    console.print(summary_table(summary))
    plots = plot_run(trainer.out) if cfg.trainer.steps else []
    for p in plots:
        console.print(f"plot: {p}")
    b, a = summary["before"]["eval/accuracy"], summary["after"]["eval/accuracy"]
    print(json.dumps({"heldout_accuracy_before": b, "heldout_accuracy_after": a, "output_dir": str(trainer.out)}))
    return 0


def _report(args) -> int:
    from .report.plots import plot_run

    for d in args.run_dirs:
        for p in plot_run(d):
            print(p)
    return 0


def _list(args) -> int:
    from .algos import list_estimators, list_losses

    print(json.dumps({"estimators": list_estimators(), "losses": list_losses()}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hapo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train with a run config (embedded CPU back end)")
    t.add_argument("--config", required=True)
    t.add_argument("--output-dir", default=None, help="default: the config's output_dir")
    t.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    t.set_defaults(fn=_train)
    r = sub.add_parser("report", help="plots from one or more run directories")
    r.add_argument("run_dirs", nargs="+")
    r.set_defaults(fn=_report)
    sub.add_parser("list", help="registered estimators and losses").set_defaults(fn=_list)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except (ValueError, FloatingPointError) as e:
        print(f"hapo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
