"""Run config -> OpenRLHF 0.11.2 ``train_ppo_ray`` flags, in one function.

Nothing in the generated flags repeats a value by hand: every number comes from
the run config. The flags use 0.11's dotted names (``--algo.advantage.estimator``,
``--ckpt.path``, ``--ds.ring_attn_size``). ``tests/integrations/openrlhf`` feeds the
list for every shipped config through OpenRLHF's real argument parser.

Paths: everything a run writes lives under its output directory::

    OUT/openrlhf_data/{train,eval}.jsonl   prompts (templated) + labels, written at launch
    OUT/ckpt/_actor/global_stepN/          DeepSpeed sharded checkpoints (OpenRLHF's layout)
    OUT/final/                             the trained model (Hugging Face layout)
    OUT/tensorboard/                       OpenRLHF's TensorBoard logs
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ....config.prm import openrlhf_prm_batches
from ....config import RunConfig

PROGRAM = "openrlhf.cli.train_ppo_ray"
REWARD_FUNC = Path(__file__).with_name("reward_func.py")

# Estimator names OpenRLHF's parser accepts. Our experience maker replaces the whole
# advantage computation, so this only has to be a group estimator (it turns the
# critic off and makes OpenRLHF insist on n_samples_per_prompt > 1).
_UPSTREAM_ESTIMATOR = "group_norm"
UPSTREAM_EPS_CLIP = 0.2  # OpenRLHF 0.11.2's --actor.eps_clip default
_UPSTREAM_AGG = {"token-mean": "token-mean", "seq-mean-token-mean": "seq-mean-token-mean",
                 "seq-mean-token-sum-norm": "seq-mean-token-mean"}


@dataclass(frozen=True)
class RunPaths:
    out: Path

    @property
    def data_dir(self) -> Path:
        return self.out / "openrlhf_data"

    @property
    def train_jsonl(self) -> Path:
        return self.data_dir / "train.jsonl"

    @property
    def eval_jsonl(self) -> Path:
        return self.data_dir / "eval.jsonl"

    @property
    def ckpt(self) -> Path:
        return self.out / "ckpt"

    @property
    def final(self) -> Path:
        return self.out / "final"

    @property
    def tensorboard(self) -> Path:
        return self.out / "tensorboard"


def _f(x: float) -> str:
    return repr(float(x))


def engine_logprobs_mode(cfg: RunConfig) -> str | None:
    """vLLM's ``logprobs_mode`` for the rollout engines (None: the correction is off and
    OpenRLHF asks for no log-probs). OpenRLHF 0.11.2 always passes ``processed_logprobs``
    (``train_ppo_ray``): log-softmax after temperature *and* top-p, i.e. renormalised over the
    nucleus S, so log mu(a) = log pi_T(a) - log P(S). ``algorithm.is_correction.behaviour``
    picks (docs/method.md 6b):

    * ``processed``: upstream's ``processed_logprobs``;
    * ``raw``: the full-vocabulary log-prob at the rollout temperature, as the trainer
      computes its old log-probs. vLLM's ``raw_logprobs`` are taken *before* temperature, so
      they are that only at temperature 1; at another temperature with top-p 1 nothing is
      truncated and ``processed_logprobs`` are exactly it. Temperature != 1 with top-p < 1
      has no vLLM mode that gives it: refused, naming the keys."""
    isc, r = cfg.algorithm.is_correction, cfg.rollout
    if not isc.enabled:
        return None
    if isc.behaviour == "processed":
        return "processed_logprobs"
    if r.temperature == 1.0:
        return "raw_logprobs"
    if r.top_p == 1.0:
        return "processed_logprobs"
    raise ValueError(f"algorithm.is_correction.behaviour=raw needs rollout.temperature 1.0 or rollout.top_p 1.0 "
                     f"(got {r.temperature} and {r.top_p}): vLLM returns full-vocabulary log-probs before "
                     f"temperature (raw_logprobs) or after temperature and top-p (processed_logprobs), never "
                     f"both scaled and untruncated; set behaviour: processed to use the nucleus-renormalised ones")


def _check_model_keys(cfg: RunConfig) -> None:
    """OpenRLHF and Megatron train the model at ``model.path`` as it is: an architecture key in
    the config (``model.family``, ``model.hidden_size``, ...) is checked against its
    ``config.json``, or refused when the path is a hub id there is no local file to check."""
    from ....config.model_files import check_architecture, model_config_json

    given = cfg.model.architecture_given()
    if not given:
        return
    if not (Path(cfg.model.path) / "config.json").is_file():
        raise ValueError(f"model.path {cfg.model.path!r} is not a local model directory, so "
                         f"{', '.join('model.' + k for k in given)} cannot be checked against it; remove "
                         f"{'them' if len(given) > 1 else 'it'} (the model's own config.json decides)")
    check_architecture(cfg.model, model_config_json(cfg.model.path))


def _check_batch_layout(cfg: RunConfig) -> int:
    """The rollout and train batches divide as OpenRLHF needs; returns the ranks that receive the
    same micro-batches beside ring attention (the Megatron actor's TP x PP, else 1)."""
    o, r = cfg.openrlhf, cfg.rollout
    if r.max_new_tokens >= o.max_len:
        raise ValueError(f"rollout.max_new_tokens ({r.max_new_tokens}) must be < openrlhf.max_len ({o.max_len})")
    n = r.samples_per_prompt
    world = o.actor_num_nodes * o.actor_gpus_per_node
    if (r.prompts_per_step * n) % o.train_batch_size:
        raise ValueError(f"openrlhf.train_batch_size ({o.train_batch_size}) must divide the rollout batch "
                         f"(rollout.prompts_per_step x samples_per_prompt = {r.prompts_per_step * n})")
    # ranks that receive the same micro-batches: OpenRLHF's controller knows them as
    # ring_attn_size x ds.tensor_parallel_size; the Megatron actor's model-parallel group
    # (TP x PP) is passed as ds.tensor_parallel_size (docs/megatron.md, "Controller")
    mp = cfg.megatron.model_parallel_size if cfg.backend == "megatron" else 1
    dp = world // (o.ring_attn_size * mp)
    if o.train_batch_size % (o.micro_train_batch_size * dp):
        raise ValueError(f"openrlhf.train_batch_size ({o.train_batch_size}) must be a multiple of "
                         f"micro_train_batch_size x data-parallel size ({o.micro_train_batch_size} x {dp})")
    _check_prm_group(cfg, dp)
    return mp


def _algorithm_flags(cfg: RunConfig, lp: dict) -> list[str]:
    """The algorithm's optional flags: dual clip, the KL loss, the entropy OpenRLHF must compute,
    DAPO's dynamic filtering, the mismatch correction (``lp``: the loss's parameters with defaults)."""
    from ....algos.losses import LOSSES

    a, argv = cfg.algorithm, []
    if "dual_clip" in lp and lp["dual_clip"] is not None:
        argv += ["--actor.dual_clip", _f(lp["dual_clip"])]
    if a.kl_coef > 0:  # k3 KL to the reference as a loss term (GRPO style), never in the reward
        argv += ["--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
    if "entropy" in LOSSES.get(a.loss).accepts:  # entro_reg, rsi_s: OpenRLHF computes the current entropy
        argv += ["--actor.entropy_coef", "0"]  # (coefficient 0: upstream adds nothing; hapo's loss uses it)
    if a.dynamic_sampling:  # DAPO: drop groups whose rewards all agree, refill from the loader
        argv += ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.0", "1.0"]
    isc = a.is_correction
    if isc.enabled:  # OpenRLHF then asks vLLM for the sampled tokens' log-probs; hapo's loss applies it
        argv += ["--algo.advantage.is_correction_level", isc.level, "--algo.advantage.is_correction_mode", isc.mode,
                 "--algo.advantage.is_correction_gating", isc.gating,
                 "--algo.advantage.is_correction_threshold", *(_f(t) for t in isc.threshold)]
    return argv


def _switch_flags(cfg: RunConfig, paths: RunPaths) -> list[str]:
    """OpenRLHF's switches the ``openrlhf`` section turns on (placement, async, vLLM, packing,
    memory, saves) and the held-out evaluation."""
    o, argv = cfg.openrlhf, []
    if o.colocate_all:
        argv += ["--train.colocate_all"]
    if o.async_:  # OpenRLHF's PPOTrainerAsync (hapo's subclass: trainer_async.py)
        argv += ["--train.async_enable", "--train.async_queue_size", str(o.async_queue_size)]
        if o.partial_rollout:
            argv += ["--train.partial_rollout_enable"]
    if o.vllm_enforce_eager:
        argv += ["--vllm.enforce_eager"]
    if o.vllm_enable_sleep and o.colocate_all:
        argv += ["--vllm.enable_sleep", "--ds.enable_sleep"]
    if o.vllm_sync_backend == "gloo":
        argv += ["--vllm.sync_with_ray"]
    if o.packing_samples:
        argv += ["--ds.packing_samples"]
    if o.dynamic_batch:
        argv += ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", str(o.max_tokens_per_gpu)]
    if o.gradient_checkpointing:
        argv += ["--actor.gradient_checkpointing_enable"]
    if o.adam_offload:
        argv += ["--ds.adam_offload"]
    if o.ref_offload:
        argv += ["--ref.offload"]
    if o.save_hf:
        argv += ["--ckpt.save_hf"]
    if o.eval_dataset:
        argv += ["--eval.dataset", str(paths.eval_jsonl), "--eval.split", "train",
                 "--eval.steps", str(cfg.trainer.eval_every or -1),
                 "--eval.temperature", _f(cfg.eval.temperature),
                 "--eval.n_samples_per_prompt", str(cfg.eval.n_samples)]
    return argv


def _check_prm_group(cfg: RunConfig, dp: int) -> None:
    """PRIME's PRM group (``actors/prm_actor.py``) before Ray starts: its batches cut evenly over its
    ``dp`` data-parallel actors (placed as the policy's), and no dynamic batch (which re-cuts its
    micro-batches)."""
    o = cfg.openrlhf
    if not cfg.trains_prm:
        return
    if o.dynamic_batch:
        raise ValueError("openrlhf.dynamic_batch with PRIME: the PRM group trains on the experience maker's "
                         "micro-batches (one DeepSpeed accumulation per prm.mini_batch_size responses), which "
                         "OpenRLHF's dynamic batch re-cuts: set openrlhf.dynamic_batch false")
    openrlhf_prm_batches(cfg, dp)


def build_argv(cfg: RunConfig, out: str | Path | None = None) -> list[str]:
    """``[PROGRAM, --flag, value, ...]``: the argv OpenRLHF's ``train_ppo_ray`` main parses."""
    if cfg.backend not in ("openrlhf", "megatron"):
        raise ValueError(f"OpenRLHF flags are for backend openrlhf or megatron, not {cfg.backend!r}")
    engine_logprobs_mode(cfg)  # refuses a behaviour vLLM cannot serve before anything starts
    if not cfg.model.path:
        raise ValueError(f"backend {cfg.backend} needs model.path (a Hugging Face model directory or hub id)")
    _check_model_keys(cfg)
    paths = RunPaths(Path(out or cfg.output_dir))
    o, r, a, opt = cfg.openrlhf, cfg.rollout, cfg.algorithm, cfg.optim
    n = r.samples_per_prompt
    mp = _check_batch_layout(cfg)
    from ....algos.losses import LOSSES

    # the loss's parameters with the registry's defaults (the one source of truth for them); a loss
    # without a clip (kl_cov) passes OpenRLHF its own default, 0.2, which no hapo loss then reads
    lp = {**LOSSES.get(a.loss).defaults, **a.loss_params}
    eps_low, eps_high = (lp["eps_low"], lp["eps_high"]) if "eps_low" in lp else (UPSTREAM_EPS_CLIP, UPSTREAM_EPS_CLIP)
    argv = [
        PROGRAM,
        # models and placement
        "--actor.model_name_or_path", cfg.model.path,
        "--actor.num_nodes", str(o.actor_num_nodes),
        "--actor.num_gpus_per_node", str(o.actor_gpus_per_node),
        "--ref.num_nodes", str(o.actor_num_nodes),
        "--ref.num_gpus_per_node", str(o.actor_gpus_per_node),
        "--vllm.num_engines", str(o.vllm_num_engines),
        "--vllm.tensor_parallel_size", str(o.vllm_tensor_parallel_size),
        "--vllm.gpu_memory_utilization", _f(o.vllm_gpu_memory_utilization),
        "--vllm.sync_backend", o.vllm_sync_backend,
        # DeepSpeed
        "--ds.zero_stage", str(o.zero_stage),
        "--ds.param_dtype", o.param_dtype,
        "--ds.attn_implementation", o.attn_implementation,
        "--ds.ring_attn_size", str(o.ring_attn_size),
        "--ds.ring_attn_head_stride", str(o.ring_attn_head_stride),
        "--ds.tensor_parallel_size", str(mp),
        # data: prompts are templated by hapo (one template registry for every back end)
        "--data.prompt_dataset", str(paths.train_jsonl),
        "--data.input_key", "prompt",
        "--data.label_key", "label",
        "--data.max_len", str(o.max_len),
        "--data.max_samples", str(o.max_samples),
        # rollout
        "--rollout.batch_size", str(r.prompts_per_step),
        "--rollout.n_samples_per_prompt", str(n),
        "--rollout.max_new_tokens", str(r.max_new_tokens),
        "--rollout.temperature", _f(r.temperature),
        "--rollout.top_p", _f(r.top_p),
        "--rollout.micro_batch_size", str(o.micro_rollout_batch_size),
        # reward: rule-based math verification, run inside the rollout engines
        "--reward.remote_url", str(REWARD_FUNC),
        # algorithm (advantages come from hapo's registry; see experience.py)
        "--algo.advantage.estimator", _UPSTREAM_ESTIMATOR,
        "--algo.kl.init_coef", _f(a.kl_coef),
        # actor update
        "--actor.eps_clip_low_high", _f(eps_low), _f(eps_high),
        "--actor.loss_agg_mode", _UPSTREAM_AGG[a.aggregation],
        "--actor.adam.lr", _f(opt.lr),
        "--actor.adam.betas", _f(opt.betas[0]), _f(opt.betas[1]),
        "--actor.adam.weight_decay", _f(opt.weight_decay),
        "--actor.max_norm", _f(opt.grad_clip),
        "--actor.lr_scheduler", o.lr_scheduler,
        "--actor.lr_warmup_ratio", _f(o.lr_warmup_ratio),
        "--train.batch_size", str(o.train_batch_size),
        "--train.micro_batch_size", str(o.micro_train_batch_size),
        "--train.max_epochs", str(opt.ppo_epochs),
        "--train.num_episodes", str(o.num_episodes),
        "--train.seed", str(cfg.seed),
        # checkpoints: always resume from the newest complete one (Slurm requeue)
        "--ckpt.path", str(paths.ckpt),
        "--ckpt.output_dir", str(paths.final),
        "--ckpt.save_steps", str(cfg.trainer.save_every if cfg.trainer.save_every else -1),
        "--ckpt.max_num", str(cfg.trainer.keep_last),
        "--ckpt.load_enable",
        "--logger.tensorboard_dir", str(paths.tensorboard),
    ]
    argv += _algorithm_flags(cfg, lp) + _switch_flags(cfg, paths)
    _check_extra_args(o.extra_args, argv)
    return argv + list(o.extra_args)


def _upstream_resolver():
    """``upstream_cli.upstream_option`` (OpenRLHF's own parser) when OpenRLHF's CLI imports (it
    imports vLLM and flash-attn at module level), else None."""
    import importlib.util

    if importlib.util.find_spec("openrlhf") is None:
        return None
    from .upstream_cli import upstream_option, upstream_parser

    try:
        upstream_parser()
    except ImportError:
        return None
    return upstream_option


def _check_extra_args(extra: tuple[str, ...], argv: list[str]) -> None:
    """``openrlhf.extra_args`` may add OpenRLHF options, not silently change what hapo runs:
    a flag the config already generates would override it (argparse keeps the last one) while
    config.json records the config's value. The vLLM importance-sampling correction is
    the config's ``algorithm.is_correction`` (hapo's losses read it there, so the flags
    alone would be parsed and not applied).

    Flags are compared the way OpenRLHF's parser reads them: argparse accepts any
    unambiguous abbreviation (``--ckpt.pat`` is ``--ckpt.path``), so each flag is resolved
    with OpenRLHF's own parser to its destination. Without OpenRLHF installed (``hapo train
    --print-command`` on a laptop without vLLM) a flag that abbreviates a generated one is refused."""
    generated = [t for t in argv if t.startswith("--")]
    resolve = _upstream_resolver()
    gen_dests = {(resolve(g)[0] or g) for g in generated} if resolve else set()
    correction = "--algo.advantage.is_correction"
    for tok in extra:
        if not tok.startswith("--"):
            continue  # an option's value
        flag = tok.split("=", 1)[0]
        shown = flag
        if resolve:
            dest, ambiguous = resolve(flag)
            if ambiguous:
                raise ValueError(f"openrlhf.extra_args: {flag} is ambiguous in OpenRLHF's parser (it could be "
                                 f"{', '.join(ambiguous[:6])}); spell the option out")
            if dest is None:
                raise ValueError(f"openrlhf.extra_args: {flag} is not an option of OpenRLHF 0.11.2's train_ppo_ray")
            if dest != flag[2:]:
                shown = f"{flag} (OpenRLHF reads it as --{dest})"
            taken, is_corr = dest in gen_dests, ("--" + dest).startswith(correction)
        else:
            taken = any(g == flag or g.startswith(flag) for g in generated)
            is_corr = flag.startswith(correction) or correction.startswith(flag)
        if is_corr:
            key = (dest if resolve else flag).rsplit("_", 1)[-1]
            raise ValueError(f"openrlhf.extra_args: {shown}: set algorithm.is_correction.{key} instead (hapo's "
                             f"losses apply the correction from the config; docs/method.md)")
        if taken:
            raise ValueError(f"openrlhf.extra_args: {shown} is generated from the config; set the config key "
                             f"instead (docs/openrlhf.md lists the mapping)")
