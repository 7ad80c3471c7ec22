"""``hapo doctor``: a preflight of a run config on this machine, and the one-GPU smoke.

    hapo doctor --config CONFIG [--json] [--static]
    hapo doctor --gpu-smoke [--json] [--output-dir DIR]

Each check gives one line: ``ok``, ``warn`` (the run starts but something is off) or
``fail`` (the run cannot start, or would stop or hang on the cluster), with the fix.
The exit status is 1 when any check fails. ``--static`` leaves out what only a compute
node can answer (CUDA, GPU count, NCCL): ``hapo submit`` runs those checks on the login
node before ``sbatch``; the job runs the full set before it starts Ray.

What the checks cannot see here is what ``--gpu-smoke`` measures on one GPU
(docs/status.md records each run of it).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .config import RunConfig

OK, WARN, FAIL = "ok", "warn", "fail"

# (distribution, pinned version, why it is needed); versions the project integrates with
PINS = {
    "torch": "2.13.0",
    "transformers": "5.15.0",
    "openrlhf": "0.11.2",
    "deepspeed": "0.19.6",
    "ray": "2.55.0",
    "vllm": "0.29.0",
    "flash-attn": "2.8.3",
    "ring-flash-attn": "0.1.8",
    "megatron-core": "0.16.1",
}
INSTALL_DOC = "docs/cluster.md, 'Installing on GPU nodes'"
# bytes per parameter a checkpoint holds: bf16 weights + fp32 masters + Adam m and v
CKPT_BYTES_PER_PARAM = 2 + 4 + 4 + 4


@dataclass
class Check:
    name: str
    status: str
    message: str
    fix: str = ""

    def line(self) -> str:
        fix = f" -> {self.fix}" if self.fix and self.status != OK else ""
        return f"[{self.status:>4}] {self.name}: {self.message}{fix}"


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _base(v: str) -> str:
    return v.split("+")[0]


def required_packages(cfg: RunConfig) -> list[tuple[str, str]]:
    """(distribution, why) the config needs on the nodes that run it."""
    need = [("torch", "every back end"), ("transformers", "every back end")]
    if cfg.backend in ("openrlhf", "megatron"):
        o = cfg.openrlhf
        need += [("openrlhf", "the OpenRLHF controller"), ("deepspeed", "OpenRLHF's strategy"),
                 ("ray", "OpenRLHF's actors"), ("vllm", "the rollout engines")]
        if o.attn_implementation == "flash_attention_2" or o.packing_samples:
            need.append(("flash-attn", f"attn_implementation {o.attn_implementation} / packed samples"))
        if o.ring_attn_size > 1:
            need.append(("ring-flash-attn", f"openrlhf.ring_attn_size {o.ring_attn_size}"))
    if cfg.backend == "megatron":
        need.append(("megatron-core", "backend: megatron"))
        if cfg.megatron.layer_spec == "te":
            need.append(("transformer-engine", "megatron.layer_spec: te"))
    return need


def check_python() -> Check:
    v = sys.version_info
    ok = (3, 10) <= (v.major, v.minor) <= (3, 12)
    return Check("python", OK if ok else WARN, f"{v.major}.{v.minor}.{v.micro}",
                 "" if ok else "tested with Python 3.10-3.12 (vLLM 0.29 wheels: 3.9-3.12)")


def check_packages(cfg: RunConfig) -> list[Check]:
    out = []
    for dist, why in required_packages(cfg):
        have, pin = _version(dist), PINS.get(dist)  # no pin: any version (not tested here)
        if have is None:
            fix = {"flash-attn": "pip install flash-attn==2.8.3 --no-build-isolation (after torch)",
                   "ring-flash-attn": "pip install ring-flash-attn==0.1.8",
                   "vllm": "pip install -e '.[openrlhf,gpu]' (vllm==0.29.0)",
                   "openrlhf": "pip install --no-deps openrlhf==0.11.2",
                   "megatron-core": "pip install -e '.[megatron]'",
                   "transformer-engine": "pip install --no-build-isolation 'transformer-engine[pytorch]' matching "
                                         "megatron-core 0.16.1 (untested here), or megatron.layer_spec: local",
                   }.get(dist, f"pip install {dist}=={pin}")
            out.append(Check(f"package {dist}", FAIL, f"not installed (needed for {why})",
                             f"{fix}; the ordered install is in {INSTALL_DOC}"))
        elif pin is not None and _base(have) != pin:
            out.append(Check(f"package {dist}", WARN, f"{have}, the project is tested with {pin}",
                             f"pip install {dist}=={pin}"))
        else:
            out.append(Check(f"package {dist}", OK, have))
    return out


def gpus_needed(cfg: RunConfig) -> int:
    """GPUs per node the layout uses (actors, plus vLLM's own when not colocated)."""
    if cfg.backend == "local":
        return 0
    from .cluster.sbatch import default_gpus_per_node

    return default_gpus_per_node(cfg)


def check_cuda(cfg: RunConfig) -> list[Check]:
    need = gpus_needed(cfg)
    if not need:
        return [Check("cuda", OK, "not needed (backend local runs on the CPU)")]
    import torch

    if not torch.cuda.is_available():
        return [Check("cuda", FAIL, f"no CUDA device visible (torch {torch.__version__}); backend {cfg.backend} "
                                    f"needs {need} GPUs per node",
                      "run on a GPU node (inside the Slurm job), with a CUDA build of torch==2.13.0")]
    n = torch.cuda.device_count()
    mems = [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(n)]
    names = {torch.cuda.get_device_name(i) for i in range(n)}
    out = [Check("cuda", OK if n >= need else FAIL,
                 f"{n} x {', '.join(sorted(names))} ({min(mems):.0f} GiB each), the layout needs {need} per node",
                 "" if n >= need else "ask for more GPUs per node, or shrink openrlhf.actor_gpus_per_node / engines")]
    try:
        v = torch.cuda.nccl.version()
        out.append(Check("nccl", OK, ".".join(map(str, v)) if isinstance(v, tuple) else str(v)))
    except Exception as e:  # noqa: BLE001 - any failure here means no usable NCCL
        out.append(Check("nccl", FAIL, f"not usable: {e}", "a CUDA build of torch ships NCCL; check LD_LIBRARY_PATH"))
    return out


def _hub_cached(repo_id: str, kind: str) -> bool:
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id, repo_type=kind, local_files_only=True)
        return True
    except Exception:  # noqa: BLE001 - not in the cache, or no huggingface_hub
        return False


def _check_remote(name: str, ref: str, kind: str) -> Check:
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    if _hub_cached(ref, kind):
        return Check(name, OK, f"{ref} (in the Hugging Face cache{', HF_HUB_OFFLINE=1' if offline else ''})")
    dl = f"huggingface-cli download {'--repo-type dataset ' if kind == 'dataset' else ''}{ref}"
    if offline:
        return Check(name, FAIL, f"{ref} is not in the Hugging Face cache and HF_HUB_OFFLINE=1",
                     f"on a node with internet: {dl} (same HF_HOME as the compute nodes)")
    return Check(name, WARN, f"{ref} is not cached: every node would download it at start",
                 f"pre-fetch it ({dl}) into a shared HF_HOME and set HF_HUB_OFFLINE=1 on compute nodes "
                 f"(they often have no internet)")


def check_model(cfg: RunConfig) -> Check:
    p = cfg.model.path
    if not p:
        return Check("model", OK, "the tiny model is built from the config")
    local = Path(p).expanduser()
    if local.exists():
        missing = [f for f in ("config.json",) if not (local / f).exists()]
        if not missing:
            from .jsonfile import check_safetensors, read_json_object

            try:
                read_json_object(local / "config.json", "the model's config")
                for f in sorted(local.glob("*.safetensors")):
                    check_safetensors(f)
            except ValueError as e:
                return Check("model", FAIL, str(e), "re-copy or re-save the model directory")
        return Check("model", FAIL if missing else OK, f"{local}" + (f" lacks {missing}" if missing else ""),
                     "point model.path at a Hugging Face model directory")
    if p.startswith(("/", "./", "../", "~", "runs/")) or p.count("/") != 1:
        return Check("model", FAIL, f"{p}: no such directory",
                     "train the previous stage first, or fix model.path")
    return _check_remote("model", p, "model")


def check_data(cfg: RunConfig) -> list[Check]:
    from .data.loader import BUNDLED

    out = []
    for key in ("train", "eval"):
        spec = getattr(cfg.data, key)
        if key == "eval" and cfg.backend != "local" and not cfg.openrlhf.eval_dataset:
            continue
        if spec == "synthetic" or spec in BUNDLED:
            out.append(Check(f"data.{key}", OK, spec))
        elif spec.startswith("hf:"):
            out.append(_check_remote(f"data.{key}", spec[3:], "dataset"))
        else:
            ok = Path(spec).expanduser().is_file()
            out.append(Check(f"data.{key}", OK if ok else FAIL, spec if ok else f"{spec}: no such file",
                             "a .jsonl/.json/.parquet file, a bundled name, synthetic, or hf:<dataset id>"))
    return out


def model_params(cfg: RunConfig) -> float | None:
    """Parameters of the policy: from the local config.json, the name ("...-7B"), or the tiny config."""
    from .cluster.sbatch import model_size_billions

    if not cfg.model.path:
        m = cfg.model
        per_layer = 4 * m.hidden_size**2 + 3 * m.hidden_size * m.intermediate_size
        return float(m.num_layers * per_layer + 2 * 260 * m.hidden_size)
    cfgjson = Path(cfg.model.path).expanduser() / "config.json"
    if cfgjson.is_file():
        from .jsonfile import read_json_object

        try:
            c = read_json_object(cfgjson)
        except ValueError:  # check_model reports the damaged file; sizes fall back to the name
            c = {}
        h, L, i, v = (c.get(k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"))
        if all(isinstance(x, int) for x in (h, L, i, v)):
            return float(L * (4 * h * h + 3 * h * i) + 2 * v * h)
    b = model_size_billions(cfg.model.path)
    return b * 1e9 if b else None


def check_output_dir(cfg: RunConfig, out: str | None = None) -> list[Check]:
    d = Path(out or cfg.output_dir).expanduser().resolve()
    clash = next((p for p in (d, *d.parents) if p.exists() and not p.is_dir()), None)
    if clash is not None:
        return [Check("output_dir", FAIL, f"{d}: {clash} is a file, not a directory",
                      "choose an output_dir that is (or can be created as) a directory")]
    probe = d if d.exists() else next((p for p in d.parents if p.exists()), Path("/"))
    if not os.access(probe, os.W_OK):
        return [Check("output_dir", FAIL, f"{d}: {probe} is not writable", "choose a writable output_dir")]
    free = shutil.disk_usage(probe).free
    n = model_params(cfg)
    if n is None:
        return [Check("output_dir", OK, f"{d} writable, {free / 2**30:.0f} GiB free (checkpoint size unknown)")]
    need = (cfg.trainer.keep_last + 1) * n * CKPT_BYTES_PER_PARAM  # +1: the one being written
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    msg = (f"{d}: {free / 2**30:.1f} GiB free; {cfg.trainer.keep_last} checkpoints + the one in flight of "
           f"~{size} params need ~{need / 2**30:.2f} GiB ({CKPT_BYTES_PER_PARAM} B/param)")
    if free < need:
        return [Check("output_dir", FAIL, msg, "free disk, lower trainer.keep_last, or use a larger filesystem")]
    return [Check("output_dir", WARN if free < 2 * need else OK, msg,
                  "little headroom: logs, samples and the final model need space too")]


def check_slurm_lead(cfg: RunConfig) -> Check:
    from .cluster.sbatch import signal_lead_seconds

    lead = signal_lead_seconds(cfg)
    step = cfg.slurm.expected_step_s
    if step is None:
        return Check("slurm signal lead", OK, f"USR1 {lead} s before the time limit (set slurm.expected_step_s "
                                              f"to check it against a measured step time)")
    if lead < step + 120:
        return Check("slurm signal lead", FAIL, f"{lead} s, but a step takes ~{step:.0f} s: the step in flight "
                                                f"cannot finish and checkpoint before the kill",
                     f"set slurm.signal_lead_s >= {int(1.5 * step + 300)}")
    return Check("slurm signal lead", OK, f"{lead} s for a ~{step:.0f} s step")


def check_vllm_memory(cfg: RunConfig) -> Check | None:
    if cfg.backend == "local":
        return None
    o = cfg.openrlhf
    share = o.vllm_gpu_memory_utilization
    if not o.colocate_all and share < 0.7:
        return Check("vllm memory", WARN, f"the engines have their own GPUs but may use only {share:.0%} of them",
                     "set openrlhf.vllm_gpu_memory_utilization to 0.85-0.9 (more KV cache, larger batches)")
    return Check("vllm memory", OK, f"{share:.0%} of each engine GPU ({'colocated' if o.colocate_all else 'dedicated'})")


def check_network(interface: str | None) -> Check:
    from .cluster.ray_cluster import interface_ip

    if interface:
        try:
            return Check("ray head address", OK, f"{interface} -> {interface_ip(interface)}")
        except ValueError as e:
            return Check("ray head address", FAIL, str(e), "pass an interface of this node to --ray-interface")
    try:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: picks the default route's source address
            ip = s.getsockname()[0]
    except OSError:
        ip = "127.0.0.1"
    return Check("ray head address", OK, f"{ip} (the default route's; on clusters whose fast network is another "
                                         f"interface pass hapo submit --ray-interface, e.g. ib0)")


def run_checks(cfg: RunConfig, *, static: bool = False, output_dir: str | None = None,
               interface: str | None = None) -> list[Check]:
    checks = [check_python(), *check_packages(cfg)]
    if not static:
        checks += check_cuda(cfg)
    checks += [check_model(cfg), *check_data(cfg), *check_output_dir(cfg, output_dir), check_slurm_lead(cfg)]
    vm = check_vllm_memory(cfg)
    if vm:
        checks.append(vm)
    if cfg.backend != "local" and not static:
        checks.append(check_network(interface))
    return checks


def report(checks: list[Check], as_json: bool = False) -> str:
    if as_json:
        return json.dumps({"ok": not any(c.status == FAIL for c in checks), "checks": [asdict(c) for c in checks]},
                          indent=1)
    bad = sum(c.status == FAIL for c in checks)
    warn = sum(c.status == WARN for c in checks)
    tail = f"{bad} blocking problem(s), {warn} warning(s)" if bad or warn else "all checks passed"
    return "\n".join([c.line() for c in checks] + [tail])


# --------------------------------------------------------------------- GPU smoke
def smoke_run_config(model_dir: str | Path, backend: str = "openrlhf", gpus: int = 1,
                     flash_attn: bool = True) -> dict[str, Any]:
    """The run config of the smoke's OpenRLHF loop: a tiny warmed-up Qwen2 (head dim 64),
    2 global steps of 4 prompts x 4 samples, HAPO, a CUDA vLLM engine colocated with the
    actor in sleep mode (weights synced over CUDA IPC), or, for ``megatron``, the Megatron
    actor at TP=1 (packed THD micro-batches by a 128-token budget, FlashCoreAttention) with
    the engine on a second GPU."""
    megatron = backend == "megatron"
    return {
        "run_name": f"gpu_smoke_{backend}", "seed": 7, "backend": backend, "model": {"path": str(model_dir)},
        "data": {"train": "synthetic", "template": "tiny",
                 "synthetic": {"n_terms": 3, "digits": 1, "ops": "+-", "train_size": 16, "eval_size": 8}},
        "warmup": {"steps": 0},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "temperature": 1.0, "top_p": 1.0,
                    "max_new_tokens": 24},
        "algorithm": {"estimator": "hapo", "estimator_params": {"alpha": 0.2, "phi": 2.0}, "loss": "ppo",
                      "loss_params": {"eps_low": 0.2, "eps_high": 0.28}, "overlong": {"enable": True, "cache_len": 4}},
        "optim": {"lr": 1.0e-4},
        "trainer": {"steps": 2, "save_every": 1, "keep_last": 4},
        "openrlhf": {
            "actor_num_nodes": 1, "actor_gpus_per_node": 1, "vllm_num_engines": 1,
            "colocate_all": not megatron, "vllm_enable_sleep": not megatron,
            "vllm_gpu_memory_utilization": 0.5 if megatron else 0.3, "vllm_enforce_eager": True,
            "zero_stage": 2, "param_dtype": "bf16",
            "attn_implementation": "flash_attention_2" if flash_attn and not megatron else "sdpa",
            "packing_samples": flash_attn or megatron, "gradient_checkpointing": False, "max_len": 96,
            **({"dynamic_batch": True, "max_tokens_per_gpu": 128} if megatron else {}),
            "train_batch_size": 16, "micro_train_batch_size": 4, "micro_rollout_batch_size": 4, "num_episodes": 4,
            "lr_scheduler": "constant"},
        **({"megatron": {"tensor_parallel": 1, "pipeline_parallel": 1, "params_dtype": "bf16"}} if megatron else {}),
    }


def _run(cmd: list[str], log: Path, timeout: int = 900, env: dict | None = None) -> int:
    import subprocess

    with open(log, "ab") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, **(env or {})}).returncode


def _smoke_warm_model(work: Path) -> Path:
    out = work / "warm"
    if not (out / "final_model" / "config.json").exists():
        rc = _run([sys.executable, "-m", "hapo_openrlhf", "train", "--config", str(_repo_config("cpu_tiny.yaml")),
                   "--output-dir", str(out), "--set", "warmup.steps=150", "--set", "trainer.steps=0",
                   "--set", "data.synthetic.eval_size=16", "--set", "model.hidden_size=128",
                   "--set", "model.num_heads=2", "--set", "model.num_kv_heads=2"], work / "warm.log")
        if rc:
            raise RuntimeError(f"the warm-up of the smoke model failed (rc {rc}, {work / 'warm.log'})")
    return out / "final_model"


def _repo_config(name: str) -> Path:
    p = Path(__file__).resolve().parent.parent / "configs" / name
    if not p.exists():
        raise FileNotFoundError(f"{p}: the GPU smoke runs from a checkout of the repository")
    return p


def _smoke_openrlhf_loop(work: Path, backend: str = "openrlhf") -> dict:
    """OpenRLHF's loop for 2 steps, then a stop (exit 85) after step 3 and a resume to step 4."""
    import torch
    import yaml

    from .preemption import EXIT_PREEMPTED, request_flag

    if backend == "megatron" and torch.cuda.device_count() < 2:
        return {"ok": True, "skipped": "the Megatron actor needs a second GPU for the vLLM engine (it has no sleep "
                                       "mode, so backend megatron refuses colocation)"}
    model = _smoke_warm_model(work)
    try:
        import flash_attn  # noqa: F401
        fa = True
    except ImportError:
        fa = False
    cfg_path = work / f"smoke_{backend}.yaml"
    cfg_path.write_text(yaml.safe_dump(smoke_run_config(model, backend, flash_attn=fa)))
    out, log = work / f"run_{backend}", work / f"run_{backend}.log"
    train = [sys.executable, "-m", "hapo_openrlhf.integrations.openrlhf.train", "--config", str(cfg_path),
             "--output-dir", str(out)]
    t0 = time.perf_counter()
    rc1 = _run(train, log)
    t_two = time.perf_counter() - t0
    request_flag(out).touch()
    rc2 = _run([*train, "--set", "trainer.steps=4"], log)
    request_flag(out).unlink(missing_ok=True)
    rc3 = _run([*train, "--set", "trainer.steps=4"], log)
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    text = log.read_text(errors="replace")
    return {"returncodes": [rc1, rc2, rc3], "steps": steps, "two_steps_s": round(t_two, 1), "flash_attn": fa,
            "ok": rc1 == 0 and rc2 == EXIT_PREEMPTED and rc3 == 0 and steps == [1, 2, 3, 4]
            and "Loading the checkpoint" in text and (out / "final" / "config.json").exists(),
            "log": str(log)}


def gpu_smoke(output_dir: str | Path | None = None) -> dict[str, Any]:
    """The one-GPU acceptance run (docs/status.md). Without CUDA it reports that and stops."""
    import tempfile

    import torch

    if not torch.cuda.is_available():
        return {"ok": False, "cuda": False, "error": "no CUDA GPU visible: the GPU smoke needs one "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})", "results": []}
    work = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="hapo_gpu_smoke_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for name, fn in (("fused_head_bf16_vs_naive", _smoke_fused_head), ("weight_grad_bf16_gemm", _smoke_weight_gemm),
                     ("flash_attn_varlen_vs_padded", _smoke_flash_varlen), ("algos_on_cuda", _smoke_algos),
                     ("megatron_attention_vs_local", lambda: _smoke_megatron_attention(work)),
                     ("openrlhf_loop_vllm_sleep_stop_resume", lambda: _smoke_openrlhf_loop(work)),
                     ("megatron_tp1_loop", lambda: _smoke_openrlhf_loop(work, "megatron"))):
        t0 = time.perf_counter()
        try:
            r = fn()
            r.setdefault("ok", True)
        except Exception as e:  # noqa: BLE001 - each step reports its own failure
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        r.update(name=name, wall_s=round(time.perf_counter() - t0, 2))
        results.append(r)
    summary = {"ok": all(r["ok"] for r in results), "cuda": True, "device": torch.cuda.get_device_name(0),
               "torch": torch.__version__, "results": results, "work_dir": str(work)}
    (work / "gpu_smoke.json").write_text(json.dumps(summary, indent=1))
    return summary


def _peak(fn):
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**20, time.perf_counter() - t0


def _smoke_fused_head(tokens: int = 16384, hidden: int = 1536, vocab: int = 151936) -> dict:
    """Fused bf16 head vs the naive [T, V] fp32 logits, forward + backward: values, memory, time."""
    import torch

    from .algos import fused_logprobs_entropy, logprobs_and_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(tokens, hidden, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(True)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_(True)
    lab = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)

    def fused():
        lp, ent = fused_logprobs_entropy(h, w, lab, chunk_size=1024)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()

    def naive():
        lp, ent = logprobs_and_entropy((h @ w.t()).float(), lab, chunk_size=tokens)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()

    (a, mem_f, t_f) = _peak(fused)
    h.grad = w.grad = None
    (b, mem_n, t_n) = _peak(naive)
    err = {k: float((x.float() - y.float()).abs().max()) for k, x, y in zip(("logp", "entropy"), a[:2], b[:2])}
    rel_w = float((a[3].float() - b[3].float()).norm() / b[3].float().norm())
    return {"tokens": tokens, "peak_mib_fused": round(mem_f), "peak_mib_naive": round(mem_n),
            "mem_ratio": round(mem_f / mem_n, 3), "time_ratio": round(t_f / t_n, 3), "max_abs_err": err,
            "weight_grad_rel_err": rel_w, "ok": err["logp"] < 5e-2 and err["entropy"] < 5e-2 and rel_w < 2e-2}


def _smoke_weight_gemm() -> dict:
    import torch

    from .algos.fused import weight_grad_gemm

    g = torch.Generator(device="cuda").manual_seed(1)
    gz = torch.randn(4096, 8192, device="cuda", generator=g) * 1e-3
    hh = torch.randn(4096, 2048, device="cuda", generator=g)
    ref = gz.double().t() @ hh.double()
    got = weight_grad_gemm(gz, hh, torch.bfloat16)
    rel = float((got.double() - ref).norm() / ref.norm())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        weight_grad_gemm(gz, hh, torch.bfloat16)
    torch.cuda.synchronize()
    t_bf16 = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(5):
        weight_grad_gemm(gz, hh, torch.float32)
    torch.cuda.synchronize()
    return {"rel_err": rel, "dtype": str(got.dtype), "speedup_vs_fp32": round((time.perf_counter() - t0) / t_bf16, 2),
            "ok": got.dtype == torch.float32 and rel < 1e-2}


def _smoke_flash_varlen() -> dict:
    import torch
    import torch.nn.functional as F

    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        return {"ok": False, "error": f"flash-attn not importable: {e} (pip install flash-attn==2.8.3 "
                                      f"--no-build-isolation)"}
    g = torch.Generator(device="cuda").manual_seed(2)
    lens = [700, 1500, 300]
    H, Hkv, D = 8, 2, 64
    q = [torch.randn(n, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for n in lens]
    k = [torch.randn(n, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16) for n in lens]
    v = [torch.randn(n, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    packed = flash_attn_varlen_func(torch.cat(q), torch.cat(k), torch.cat(v), cu, cu, max(lens), max(lens), causal=True)
    err = 0.0
    for i, n in enumerate(lens):
        ref = F.scaled_dot_product_attention(q[i].transpose(0, 1)[None], k[i].transpose(0, 1)[None],
                                             v[i].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        err = max(err, float((packed[cu[i]:cu[i + 1]] - ref[0].transpose(0, 1)).abs().max()))
    return {"max_abs_err": err, "ok": err < 2e-2}


def _smoke_megatron_attention(work: Path) -> dict:
    """benchmarks/megatron_attention.py on the GPU (bf16, flash-attn when installed):
    FlashCoreAttention's peak memory and time vs Megatron's local attention at 8k tokens,
    THD vs padded log-probs. Needs megatron-core and a source checkout (the script)."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "megatron_attention.py"
    if importlib.util.find_spec("megatron") is None or not script.is_file():
        return {"ok": True, "skipped": f"needs megatron-core and {script}"}
    log = work / "megatron_attention.log"
    rc = _run([sys.executable, str(script), "--seq-len", "8192", "--lengths", "2048,4096,8192", "--hidden", "1024",
               "--heads", "16", "--kv-heads", "2", "--eq-len", "2048"], log, timeout=900)
    lines = log.read_text().strip().splitlines() if log.exists() else []
    try:
        res = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "error": f"exit {rc}; see {log}"}
    err = res.get("thd_vs_padded_max_abs_err")
    mem = res.get("peak_mem_ratio_vs_local")
    return {**{k: res.get(k) for k in ("peak_mem_ratio_vs_local", "time_ratio_vs_local", "peak_mem_ratio_by_len",
                                        "thd_vs_padded_max_abs_err", "thd_vs_masked_max_abs_err")},
            "ok": rc == 0 and mem is not None and mem <= 0.25 and err is not None and err < 5e-2}


def _smoke_algos() -> dict:
    """Every estimator and loss on CUDA tensors (the device-safety test's CPU proxy, for real)."""
    import torch

    from . import algos

    B, T = 8, 32
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(3)
    inputs = algos.AdvantageInputs(
        rewards=torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0], device=dev), response_mask=torch.ones(B, T, device=dev),
        entropy=torch.rand(B, T, device=dev, generator=g), group_index=torch.arange(2, device=dev).repeat_interleave(4),
        correct=torch.tensor([1, 0, 0, 1, 1, 1, 0, 0], device=dev, dtype=torch.bool))
    done = []
    for name in algos.list_estimators():
        algos.run_estimator(name, inputs)
        done.append(name)
    lp = -torch.rand(B, T, device=dev, generator=g)
    for name in algos.list_losses():
        kw = {"kl_cov": {"k_ratio": 0.1}, "clip_cov": {"clip_ratio": 0.1, "cov_lb": -9.0, "cov_ub": 9.0}}.get(name, {})
        algos.compute_policy_loss(name, lp, lp + 0.01, torch.randn(B, T, device=dev, generator=g),
                                  torch.ones(B, T, device=dev), entropy=torch.rand(B, T, device=dev, generator=g),
                                  generator=torch.Generator().manual_seed(0), **kw)
        done.append(name)
    return {"ran": done}


def smoke_table(summary: dict) -> str:
    if not summary.get("cuda"):
        return f"gpu smoke: {summary['error']}"
    rows = ["| check | ok | s | figures |", "|---|---|---|---|"]
    for r in summary["results"]:
        figs = {k: v for k, v in r.items() if k not in ("name", "ok", "wall_s")}
        rows.append(f"| {r['name']} | {'yes' if r['ok'] else 'NO'} | {r['wall_s']} | {json.dumps(figs)} |")
    return "\n".join([f"gpu smoke on {summary['device']} (torch {summary['torch']})", *rows])
