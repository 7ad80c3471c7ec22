"""``hapo doctor``: a preflight of a run config on this machine.

    hapo doctor --config CONFIG [--json] [--static]
    hapo doctor --gpu-smoke [--json] [--output-dir DIR]

Each check gives one line: ``ok``, ``warn`` (the run starts but something is off) or
``fail`` (the run cannot start, or would stop or hang on the cluster), with the fix.
The exit status is 1 when any check fails. ``--static`` leaves out what only a compute
node can answer (CUDA, GPU count, NCCL): ``hapo submit`` runs those checks on the login
node before ``sbatch``; the job runs the full set before it starts Ray.

What the checks cannot see here is what ``--gpu-smoke`` measures on one GPU
(:mod:`hapo_openrlhf.gpu_smoke`; docs/status.md records each run of it).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import RunConfig
from ..megatron import compat as megatron_compat

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
# packages accepted over a range: [lowest, first refused), and the versions CI runs
RANGES = {"megatron-core": (*megatron_compat.SUPPORTED, megatron_compat.TESTED)}
# the Transformer Engine whose FusedAdam semantics the CPU tests mirror (tests/megatron/te_standin.py)
TE_MIRRORED = "2.20.2"
# Python versions CI runs (pyproject's requires-python declares exactly these): 3.11 everything,
# 3.12 the algorithms, config, Megatron (megatron-core 0.19.2) and embedded-trainer layers
TESTED_PYTHONS = ((3, 11), (3, 12))
# bytes per parameter a checkpoint holds: bf16 weights + fp32 masters + Adam m and v
CKPT_BYTES_PER_PARAM = 2 + 4 + 4 + 4
PRM_BYTES_PER_PARAM = 4 + 4 + 4 + 4  # PRIME's PRM: weights, its frozen reference, AdamW's two moments


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
    ok = (v.major, v.minor) in TESTED_PYTHONS
    return Check("python", OK if ok else WARN, f"{v.major}.{v.minor}.{v.micro}",
                 "" if ok else "CI runs Python 3.11 (everything) and 3.12 (algorithms, config, embedded trainer, "
                               "Megatron; not the OpenRLHF/Ray/vLLM path)")


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
                   "transformer-engine": "install the image's transformer-engine (docs/cluster.md 1b), or use "
                                         "megatron.layer_spec: local",
                   }.get(dist, f"pip install {dist}=={pin}")
            out.append(Check(f"package {dist}", FAIL, f"not installed (needed for {why})",
                             f"{fix}; the ordered install is in {INSTALL_DOC}"))
        elif dist in RANGES:
            out.append(_range_check(dist, have))
        elif pin is not None and _base(have) != pin:
            out.append(Check(f"package {dist}", WARN, f"{have}, the project is tested with {pin}",
                             f"pip install {dist}=={pin}"))
        else:
            out.append(Check(f"package {dist}", OK, have))
    m = cfg.megatron
    te = _version("transformer-engine") or _version("transformer_engine")
    if cfg.backend == "megatron" and m.context_parallel > 1 and te is not None:
        from ..megatron.context_parallel import TE_MIN_VERSION, te_problem

        problem = te_problem(m.cp_comm_type, te)
        out.append(Check("context parallelism", FAIL if problem else OK,
                         problem or f"cp_comm_type {m.cp_comm_type} on transformer-engine {te} "
                                    f"(needs >= {TE_MIN_VERSION[m.cp_comm_type]})",
                         "install a newer transformer-engine, or megatron.cp_comm_type: p2p" if problem else ""))
    return out


def _range_check(dist: str, have: str) -> Check:
    lo, hi, tested = RANGES[dist]
    if not megatron_compat.release(lo) <= megatron_compat.release(have) < megatron_compat.release(hi):
        return Check(f"package {dist}", FAIL, f"{have}, outside the supported range >={lo},<{hi}",
                     f"pip install '{dist}>={lo},<{hi}' (CI runs {', '.join(tested)})")
    if _base(have) not in tested:
        return Check(f"package {dist}", WARN, f"{have}: inside >={lo},<{hi}, but CI runs {', '.join(tested)}",
                     f"pip install {dist}=={tested[-1]}")
    return Check(f"package {dist}", OK, f"{have} (tested)")


def _imports(module: str) -> str | None:
    """None when ``module`` imports, else the error in one line."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a broken build raises more than ImportError (OSError, undefined symbols)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def check_matrix() -> list[Check]:
    """One line per package of the tested matrix -- Python, torch, megatron-core, Transformer
    Engine, flash-attn, vLLM -- against what this project runs in CI, whatever the config
    needs; known-bad combinations fail with the reason (docs/cluster.md, the matrix)."""
    v = sys.version_info
    here = f"{v.major}.{v.minor}.{v.micro}" + (" (the OpenRLHF/Ray/vLLM path is tested on 3.11 only)"
                                               if (v.major, v.minor) == (3, 12) else "")
    out = [Check("matrix python", OK if (v.major, v.minor) in TESTED_PYTHONS else WARN, here,
                 f"CI runs Python {', '.join('.'.join(map(str, t)) for t in TESTED_PYTHONS)}")]
    torch_v, mc = _version("torch"), _version("megatron-core")
    out.append(Check("matrix torch", OK if torch_v and _base(torch_v) == PINS["torch"] else WARN,
                     torch_v or "not installed", f"CI runs torch {PINS['torch']}"))
    if mc is None:
        out.append(Check("matrix megatron-core", OK, "not installed (backend: megatron needs it)"))
    else:
        c = _range_check("megatron-core", mc)
        out.append(Check("matrix megatron-core", c.status, c.message, c.fix))
        if megatron_compat.release(mc) >= (0, 17) and (v.major, v.minor) < (3, 12):
            out.append(Check("matrix megatron-core/python", WARN, f"megatron-core {mc} declares Python >= 3.12, this is "
                             f"{v.major}.{v.minor}", "it installs with --ignore-requires-python and its files parse "
                             "here, but CI runs 0.19.x on Python 3.12 (docs/megatron.md, 'megatron-core versions')"))
    te = _version("transformer-engine") or _version("transformer_engine")
    if te is None:
        out.append(Check("matrix transformer-engine", OK, "not installed (megatron-core then builds torch's AdamW)"))
    else:
        err = _imports("transformer_engine.pytorch")
        if err:  # megatron-core imports it unguarded by anything but ImportError: a broken build stops every run
            out.append(Check("matrix transformer-engine", FAIL, f"{te} is installed but does not import ({err})",
                             "rebuild it against this torch, or uninstall it (megatron-core then uses torch's AdamW)"))
        else:
            out.append(Check("matrix transformer-engine", OK if _base(te) == TE_MIRRORED else WARN,
                             f"{te}: megatron-core builds its optimizer on TE's FusedAdam; layer_spec: te available",
                             f"CI checks TE {TE_MIRRORED}'s FusedAdam and layer-spec semantics on a CPU stand-in; "
                             f"run hapo doctor --gpu-smoke"))
    for dist, module in (("flash-attn", "flash_attn"), ("vllm", "vllm")):
        have = _version(dist)
        if have is None:
            out.append(Check(f"matrix {dist}", OK, "not installed"))
            continue
        err = _imports(module)
        if err:
            out.append(Check(f"matrix {dist}", FAIL, f"{have} is installed but does not import ({err})",
                             f"reinstall {dist}=={PINS[dist]} against torch {torch_v}"))
        else:
            out.append(Check(f"matrix {dist}", OK if _base(have) == PINS[dist] else WARN, have,
                             f"the project integrates with {dist} {PINS[dist]}"))
    return out


def gpus_needed(cfg: RunConfig) -> int:
    """GPUs per node the layout uses (actors, plus vLLM's own when not colocated)."""
    if cfg.backend == "local":
        return 0
    from .sbatch import default_gpus_per_node

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
            from ..rundir.jsonfile import check_safetensors, read_json_object

            try:
                meta = read_json_object(local / "config.json", "the model's config")
                for f in sorted(local.glob("*.safetensors")):
                    check_safetensors(f)
                if cfg.backend == "megatron":  # the family and its variant (RoPE scaling, biases, sliding window)
                    from types import SimpleNamespace

                    from ..megatron.families import check_actor_family

                    check_actor_family(SimpleNamespace(**meta), cfg.megatron)
            except ValueError as e:
                return Check("model", FAIL, str(e), "re-copy or re-save the model directory, or choose a supported "
                                                    "model / back end")
        return Check("model", FAIL if missing else OK, f"{local}" + (f" lacks {missing}" if missing else ""),
                     "point model.path at a Hugging Face model directory")
    if p.startswith(("/", "./", "../", "~", "runs/")) or p.count("/") != 1:
        return Check("model", FAIL, f"{p}: no such directory",
                     "train the previous stage first, or fix model.path")
    return _check_remote("model", p, "model")


def check_data(cfg: RunConfig) -> list[Check]:
    from ..data.loader import BUNDLED

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
    from .sbatch import model_size_billions

    if not cfg.model.path:
        m = cfg.model
        per_layer = 4 * m.hidden_size**2 + 3 * m.hidden_size * m.intermediate_size
        return float(m.num_layers * per_layer + 2 * 260 * m.hidden_size)
    cfgjson = Path(cfg.model.path).expanduser() / "config.json"
    if cfgjson.is_file():
        from ..rundir.jsonfile import read_json_object

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
    # PRIME's implicit PRM is checkpointed beside the policy: its fp32 weights, its reference's, AdamW's moments
    per_param = CKPT_BYTES_PER_PARAM + (PRM_BYTES_PER_PARAM if cfg.trains_prm else 0)
    need = (cfg.trainer.keep_last + 1) * n * per_param  # +1: the one being written
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    msg = (f"{d}: {free / 2**30:.1f} GiB free; {cfg.trainer.keep_last} checkpoints + the one in flight of "
           f"~{size} params need ~{need / 2**30:.2f} GiB ({per_param} B/param"
           f"{', the implicit PRM included' if per_param != CKPT_BYTES_PER_PARAM else ''})")
    if free < need:
        return [Check("output_dir", FAIL, msg, "free disk, lower trainer.keep_last, or use a larger filesystem")]
    return [Check("output_dir", WARN if free < 2 * need else OK, msg,
                  "little headroom: logs, samples and the final model need space too")]


def check_slurm_lead(cfg: RunConfig) -> Check:
    from .sbatch import signal_lead_seconds

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
    """The interface every node's Ray, gloo and NCCL traffic goes through (cluster/netif.py)."""
    from .netif import NetworkInterfaceError, candidates, interface_ip

    if interface:
        try:
            return Check("network interface", OK, f"{interface} -> {interface_ip(interface)} "
                                                  f"(Ray node address, GLOO/NCCL_SOCKET_IFNAME on every node)")
        except NetworkInterfaceError as e:
            return Check("network interface", FAIL, str(e), "pass an interface of this node to --network-interface")
    found = candidates()
    if len(found) > 1:
        listed = ", ".join(f"{n} ({a})" for n, a in found.items())
        return Check("network interface", WARN, f"this node has several interfaces ({listed}) and none is named: "
                                                f"Ray, gloo and NCCL may each pick another one, and one the "
                                                f"other nodes cannot reach hangs the first collective",
                     "pass hapo submit --network-interface NAME (the fast network every node shares, e.g. ib0)")
    listed = ", ".join(f"{n} ({a})" for n, a in found.items()) or "none but loopback"
    return Check("network interface", OK, f"one candidate: {listed}")


def gpu_memory_gb() -> float:
    """The memory of this node's smallest GPU, or 80 GB (an A100 / H100) where none is visible."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count():
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())) / 2**30
    return 80.0


def check_dry_run(cfg: RunConfig, gpu_gb: float | None = None) -> list[Check]:
    """backend megatron: every rank role of the layout started at full size on the meta device
    under a fake process group (megatron/dryrun.py), in a child process; one line per role with
    its memory, and the peak against ``gpu_gb``."""
    import subprocess
    import tempfile

    from ..config import dump_config
    from ..megatron.dryrun import RESERVE_GB

    gpu_gb = gpu_memory_gb() if gpu_gb is None else gpu_gb
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(dump_config(cfg))
        p = subprocess.run([sys.executable, "-m", "hapo_openrlhf.megatron.dryrun", "--config", str(path), "--json",
                            "--gpu-gb", str(gpu_gb)], capture_output=True, text=True, timeout=900)
    try:
        run = json.loads(p.stdout)
    except json.JSONDecodeError:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return [Check("dry run", FAIL, f"the full-size dry run did not finish (exit {p.returncode}): {last}",
                      "run python -m hapo_openrlhf.megatron.dryrun --config CONFIG for the whole output")]
    if run["error"]:
        return [Check("dry run", FAIL, f"{run['model']} at TP {run['layout']['tp']} x PP {run['layout']['pp']} x "
                                       f"EP {run['layout']['ep']} cannot start: {run['error']}",
                      "change the layout (docs/megatron.md, 'Full-size dry run')")]
    out = []
    for r in run["ranks"]:
        out.append(Check(f"dry run rank {r['rank']}", OK,
                         f"{r['role']}: {r['params'] / 1e9:.2f}B params, {r['tensors_checked']} checkpoint tensors "
                         f"fit; weights {r['weights_gb']:.1f} + grads {r['grads_gb']:.1f} + optimizer "
                         f"{r['optimizer_gb']:.1f} + activations {r['activations_gb']:.1f} = {r['total_gb']:.1f} GB"))
    msg = (f"peak {run['peak_gb']:.1f} GB per GPU + {RESERVE_GB:.0f} GB reserve vs {gpu_gb:.0f} GB "
           f"({run['tokens_per_micro_batch']} tokens per micro-batch, {run['model_source']})")
    out.append(Check("dry run memory", OK if run["fits"] else FAIL, msg,
                     "lower openrlhf.max_tokens_per_gpu, turn on megatron.recompute, or spread the model over more "
                     "GPUs (tensor / pipeline / expert parallelism)"))
    return out


def run_checks(cfg: RunConfig, *, static: bool = False, output_dir: str | None = None,
               interface: str | None = None, dry_run: bool = True, gpu_gb: float | None = None) -> list[Check]:
    checks = [check_python(), *check_packages(cfg), *check_matrix()]
    if not static:
        checks += check_cuda(cfg)
    model = check_model(cfg)
    checks += [model, *check_data(cfg), *check_output_dir(cfg, output_dir), check_slurm_lead(cfg)]
    if cfg.backend == "megatron" and dry_run:
        if model.status == FAIL and Path(cfg.model.path).expanduser().exists():
            checks.append(Check("dry run", FAIL, "not run: the model directory failed its check (above)",
                                "fix the model first"))
        elif _version("megatron-core") is None:
            checks.append(Check("dry run", WARN, "not run: megatron-core is not installed here",
                                "pip install -e '.[megatron]' to start every rank at full size before submitting"))
        else:
            checks += check_dry_run(cfg, gpu_gb)
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
