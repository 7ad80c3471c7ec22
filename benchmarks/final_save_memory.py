"""Peak host memory of the Megatron actor's final Hugging Face save, as a ratio to the
state dict it writes (issue 43, item 6).

Rank 0 holds the gathered state dict (``convert.gather_hf_state_dict``); the save then

* ``from_config`` (before): builds and randomly initialises a second full model, loads the
  state dict into it (a copy) and ``save_pretrained``s it;
* ``meta`` (now, ``megatron/hf_save.py``): builds the model on the meta device and assigns
  the state dict's tensors to it (no copy), then ``save_pretrained``.

With ``--moe`` (a Qwen3-MoE state dict in the checkpoint's per-expert names):

* ``fused`` (before): transformers' fused experts -- each layer's experts stacked into [E, 2F, H]
  and [E, H, F] (``moe.to_fused_names``) and assigned to a meta model, ``save_pretrained``;
* ``per_expert`` (now, ``hf_save.save_moe_state_dict``): safetensors shards of the per-expert
  tensors as they are.

Each path runs in a fresh process, after one tiny save by the same path (the modules
``save_pretrained`` imports on first use are loaded in the actor already): the process's
resident memory before the state dict is made is the baseline, the peak is read from ``VmHWM`` after resetting it (``clear_refs``)
once the state dict exists. Printed: (peak - baseline) / state-dict bytes.

    python benchmarks/final_save_memory.py [--hidden 768 --layers 12 --vocab 32000] [--moe]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _moe_config(hidden: int, layers: int, vocab: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                          num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, head_dim=64,
                          num_experts=16, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
                          tie_word_embeddings=False)


def _child(path: str, hidden: int, layers: int, vocab: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                      tie_word_embeddings=False)
    if path in ("fused", "per_expert"):
        cfg = _moe_config(hidden, layers, vocab)

    def save(sd, cfg, out):
        if path == "fused":  # the MoE save before: experts stacked into transformers' fused parameters
            from hapo_openrlhf.megatron.moe import to_fused_names

            with torch.device("meta"):
                hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            hf.load_state_dict(to_fused_names(sd, cfg), strict=False, assign=True)
            hf.save_pretrained(out)
        elif path == "from_config":
            hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            hf.load_state_dict(sd, strict=False)
            hf.save_pretrained(out)
        else:
            from hapo_openrlhf.megatron.hf_save import save_hf_state_dict

            save_hf_state_dict(sd, cfg, torch.bfloat16, out)

    # a tiny save first: the modules save_pretrained imports on first use (~76 MB here) are
    # already loaded in the actor, and are not the save's memory
    from hapo_openrlhf.megatron.convert import hf_shapes

    tiny = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if path in ("fused", "per_expert"):
        tiny = _moe_config(128, 1, 300)
    with tempfile.TemporaryDirectory() as out:
        save({k: torch.zeros(s, dtype=torch.bfloat16) for k, s in hf_shapes(tiny).items()}, tiny, out)
    shapes = hf_shapes(cfg)  # the checkpoint's names (per expert for a MoE): what the gather hands over
    base = _status("VmRSS")
    sd = {k: torch.randn(s, dtype=torch.bfloat16) for k, s in shapes.items()}  # what the gather hands over
    sd_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    with tempfile.TemporaryDirectory() as out:
        save(sd, cfg, out)
        peak = _status("VmHWM")
    return {"path": path, "sd_mb": sd_bytes / 2**20, "ratio": (peak - base) / sd_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE (16 experts): the fused vs per-expert paths")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.hidden, a.layers, a.vocab)))
        return
    rows = []
    paths = ("fused", "per_expert") if a.moe else ("from_config", "meta")
    for path in paths:
        out = subprocess.run([sys.executable, __file__, "--child", path, "--hidden", str(a.hidden), "--layers",
                              str(a.layers), "--vocab", str(a.vocab)], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    family = "Qwen3-MoE (16 experts)" if a.moe else "Qwen2"
    print(f"state dict: {rows[0]['sd_mb']:.0f} MB (bf16, {family} {a.layers} layers x {a.hidden}, vocab {a.vocab})")
    for r in rows:
        print(f"  {r['path']:<12} peak host memory = {r['ratio']:.2f} x the state dict")
    print(f"  {paths[1]} / {paths[0]} = {rows[1]['ratio'] / rows[0]['ratio']:.2f}")


if __name__ == "__main__":
    main()
