"""Entry point: OpenRLHF 0.11.2's own ``train_ppo_ray`` with hapo's subclasses installed.

    hapo train --backend openrlhf|megatron --config CONFIG [--print-command]
    python -m hapo_openrlhf.integrations.openrlhf.launch.train --config CONFIG [--print-command]

1. ``flags.build_argv`` turns the run config into OpenRLHF flags (one function).
2. ``--print-command`` prints that argv as one JSON list on the last line and stops.
3. Otherwise the prompts are written as JSONL under the output directory, and the
   body of OpenRLHF's ``if __name__ == "__main__":`` block -- its real argument
   parser and every validation it does -- runs with that argv. Its final
   ``train(args)`` call is routed to :func:`train_with_hapo`, which attaches the run
   config to ``args.hapo`` (it travels to every Ray actor inside the strategy),
   points ``train_ppo_ray.PolicyModelActor`` at hapo's policy actor (the DeepSpeed
   subclass, or the Megatron actor for ``backend: megatron``, whose KL reference is then
   ``megatron_reference.MegatronReferenceActor``, else ``deepspeed_reference``'s subclass of
   upstream's) and
   ``ppo_trainer.PPOTrainer`` / ``ppo_trainer_async.PPOTrainerAsync`` at hapo's
   controllers (``openrlhf.async`` picks which one OpenRLHF builds), and calls
   OpenRLHF's own ``train``.

Only the driver is patched; the workers receive the subclasses because Ray
pickles the actor classes by import path (``hapo_openrlhf`` must be importable
on every node).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable

from ....config import RunConfig, load_config
from ....rundir.preemption import EXIT_PREEMPTED
from .flags import RunPaths, build_argv
# OpenRLHF's own CLI (its parser and main block), importable from here as before
from .upstream_cli import parse_with_upstream, run_upstream_main, upstream_option, upstream_parser  # noqa: F401


def policy_actor_class(backend: str):
    """The Ray actor class OpenRLHF's driver builds its policy group from."""
    if backend == "megatron":
        from ..actors.megatron_actor import MegatronPolicyActor

        return MegatronPolicyActor
    from ..actors.deepspeed_actor import HapoPolicyModelActor

    return HapoPolicyModelActor


def with_logprobs_mode(create: Callable, mode: str | None) -> Callable:
    """``create_vllm_engines`` with its ``logprobs_mode`` argument replaced by ``mode`` where
    OpenRLHF asks for log-probs (it passes ``"processed_logprobs"`` whenever the correction
    is on, None otherwise; flags.engine_logprobs_mode picks ours). Everything else passes
    through, bound to upstream's own signature (a renamed parameter fails here, by name)."""
    sig = inspect.signature(create)
    if "logprobs_mode" not in sig.parameters:
        raise RuntimeError(f"{create.__qualname__} has no logprobs_mode parameter (OpenRLHF version changed?)")

    @functools.wraps(create)
    def _create(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        if bound.arguments.get("logprobs_mode") is not None:
            bound.arguments["logprobs_mode"] = mode
        return create(*bound.args, **bound.kwargs)

    return _create


@contextlib.contextmanager
def installed(backend: str = "openrlhf", logprobs_mode: str | None = None, routed_experts: bool = False,
              prm: bool = False):
    """Point OpenRLHF's driver-side names at the hapo subclasses (restored on exit):
    the policy actor (DeepSpeed or Megatron), the controller, where the correction asks
    the engines for log-probs the engines' ``logprobs_mode`` (:func:`with_logprobs_mode`),
    and under rollout routing replay the rollout actor ``create_vllm_engines`` builds
    (``routes.routed_rollout_actor``: engines that return their routed experts), and for an estimator
    that trains an implicit PRM (PRIME) the critic group's actor (``prm_actor.HapoPRMActor``)."""
    import openrlhf.cli.train_ppo_ray as cli
    import openrlhf.trainer.ppo_trainer as pt
    import openrlhf.trainer.ppo_trainer_async as pta
    import openrlhf.trainer.ray.vllm_engine as ve

    from ..controller.trainer import HapoPPOTrainer
    from ..controller.trainer_async import HapoPPOTrainerAsync

    saved = (cli.PolicyModelActor, cli.ReferenceModelActor, pt.PPOTrainer, pta.PPOTrainerAsync,
             cli.create_vllm_engines, ve.RolloutRayActor, cli.CriticModelActor)
    cli.PolicyModelActor, pt.PPOTrainer, pta.PPOTrainerAsync = (policy_actor_class(backend), HapoPPOTrainer,
                                                                HapoPPOTrainerAsync)
    if backend == "megatron":  # the KL reference (kl_coef > 0): a frozen GPTModel under the policy's layout
        from ..actors.megatron_reference import MegatronReferenceActor

        cli.ReferenceModelActor = MegatronReferenceActor
    else:  # upstream's, with rank 0's port outside the ephemeral range (cluster/ports.py)
        from ..actors.deepspeed_reference import HapoReferenceModelActor

        cli.ReferenceModelActor = HapoReferenceModelActor
    if prm:
        from ..actors.prm_actor import HapoPRMActor

        cli.CriticModelActor = HapoPRMActor
    if logprobs_mode is not None:
        cli.create_vllm_engines = with_logprobs_mode(cli.create_vllm_engines, logprobs_mode)
    if routed_experts:
        from ..actors.routes import routed_rollout_actor

        ve.RolloutRayActor = routed_rollout_actor(ve.RolloutRayActor)
    try:
        yield
    finally:
        (cli.PolicyModelActor, cli.ReferenceModelActor, pt.PPOTrainer, pta.PPOTrainerAsync,
         cli.create_vllm_engines, ve.RolloutRayActor, cli.CriticModelActor) = saved


def train_with_hapo(args, cfg: RunConfig, out: str | Path | None = None) -> None:
    import openrlhf.cli.train_ppo_ray as cli

    if args.critic.model_name_or_path:
        raise ValueError("hapo estimators are critic-free; OpenRLHF was asked for a critic")
    from .flags import engine_logprobs_mode

    prm = cfg.trains_prm
    if prm:  # PRIME's implicit PRM: OpenRLHF's critic group, placed as the policy's actors (prm_actor.py)
        args.critic.model_name_or_path = args.actor.model_name_or_path
        args.critic.num_nodes, args.critic.num_gpus_per_node = args.actor.num_nodes, args.actor.num_gpus_per_node
    # the typed config's transport to every Ray actor: each rebuilds it (config.transported)
    args.hapo = {**cfg.to_dict(), "output_dir": str(out or cfg.output_dir)}
    with installed(cfg.backend, engine_logprobs_mode(cfg), routed_experts=cfg.routing_replay, prm=prm):
        cli.train(args)


def check_megatron_model(cfg: RunConfig) -> None:
    """``backend: megatron`` with a local model directory: its family and the layout
    (``families.check_actor_family``: experts over ``expert_parallel``, ...) before Ray or any
    process starts. A hub id is checked by the actor after the download."""
    if cfg.backend != "megatron" or not cfg.model.path:
        return
    path = Path(cfg.model.path).expanduser()
    if not (path / "config.json").is_file():
        return
    from types import SimpleNamespace

    from ....rundir.jsonfile import read_json_object
    from ....megatron.families import check_actor_family

    check_actor_family(SimpleNamespace(**read_json_object(path / "config.json", "the model's config")), cfg.megatron)


def _vocab(path: Path, what: str) -> int | None:
    from ....rundir.jsonfile import read_json_object

    conf = read_json_object(path / "config.json", what)
    v = conf.get("vocab_size", (conf.get("text_config") or {}).get("vocab_size"))
    return v if isinstance(v, int) else None


def check_prm_models(cfg: RunConfig) -> None:
    """PRIME's ``prm.path`` / ``prm.ref_path`` before Ray or any process starts, as the embedded
    trainer checks them (``local/prm.py``): a path that names a directory must exist and hold a
    model whose vocabulary is the policy's -- q is a difference of log-probs of the policy's tokens.
    A hub id (not a path on this machine) is left to the actors' download, as for the policy."""
    if not cfg.trains_prm:
        return
    policy = Path(cfg.model.path).expanduser() if cfg.model.path else None
    want = _vocab(policy, "the policy's config") if policy and (policy / "config.json").is_file() else None
    for key in ("path", "ref_path"):
        v = getattr(cfg.prm, key)
        if v is None:
            continue
        path = Path(v).expanduser()
        if not path.exists():
            if not re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", v):  # "org/name" or "name": a hub id
                raise ValueError(f"prm.{key} {v!r} does not exist")
            continue
        if not (path / "config.json").is_file():
            raise ValueError(f"prm.{key} {v!r} holds no config.json: not a Hugging Face model directory")
        got = _vocab(path, f"prm.{key}'s config")
        if want is not None and got != want:
            raise ValueError(f"prm.{key} {v!r} has a vocabulary of {got} tokens, the policy ({cfg.model.path}) "
                             f"{want}: the PRM scores the policy's tokens, so it must share its tokenizer")


def launch(cfg: RunConfig, out: str | Path | None = None) -> Path:
    """Write the prompt files and run OpenRLHF with hapo installed; returns the output dir."""
    from ....rundir import runlock
    from .data import write_prompt_files

    check_megatron_model(cfg)
    check_prm_models(cfg)
    from ..actors.routes import check_engine_platform

    if cfg.routing_replay:  # R3 and this Python's vLLM (the engines' where it is) cannot return routes
        check_engine_platform()
    paths = RunPaths(Path(out or cfg.output_dir))
    argv = build_argv(cfg, paths.out)
    runlock.acquire(paths.out)  # one driver per run directory (the Slurm job may hold it for us)
    (paths.out / "openrlhf_argv.json").write_text(json.dumps(argv))
    (paths.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    write_prompt_files(cfg, paths.train_jsonl, paths.eval_jsonl)
    os.environ.setdefault("HAPO_REWARD_TIMEOUT_S", str(cfg.algorithm.reward_timeout_s))
    os.environ.setdefault("HAPO_REWARD_WRONG", str(cfg.algorithm.reward_wrong))
    run_upstream_main(argv, lambda args: train_with_hapo(args, cfg, paths.out))
    if paths.final.exists():  # lets `hapo eval --template auto` pick the training prompt format
        (paths.final / "hapo.json").write_text(json.dumps({"template": cfg.data.template}))
    return paths.out


def _is_preempted(e: BaseException) -> bool:
    """Ray re-raises the controller's ``Preempted`` as a ``RayTaskError`` subclass of it (or wraps it)."""
    from ....rundir.preemption import Preempted

    return isinstance(e, Preempted) or isinstance(getattr(e, "cause", None), Preempted)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hapo_openrlhf.integrations.openrlhf.launch.train")
    ap.add_argument("--config", required=True)
    ap.add_argument("--output-dir", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--print-command", action="store_true",
                    help="print the OpenRLHF argv as one JSON list on the last line and exit")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config, a.set)
        if a.print_command:
            print(json.dumps(build_argv(cfg, a.output_dir)))
            return 0
        out = launch(cfg, a.output_dir)
    except Exception as e:
        if _is_preempted(e):
            print(f"hapo: {e}", file=sys.stderr)
            return EXIT_PREEMPTED
        if not isinstance(e, (ValueError, OSError)):
            raise
        print(f"hapo: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"output_dir": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
