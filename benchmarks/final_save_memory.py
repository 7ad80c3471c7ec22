"""Peak host memory of the Megatron actor's final Hugging Face save, as a ratio to the
state dict it writes (issue 43, item 6).

Rank 0 holds the gathered state dict (``convert.gather_hf_state_dict``); the save then

* ``from_config`` (before): builds and randomly initialises a second full model, loads the
  state dict into it (a copy) and ``save_pretrained``s it;
* ``meta`` (now, ``megatron/hf_save.py``): builds the model on the meta device and assigns
  the state dict's tensors to it (no copy), then ``save_pretrained``.

Each path runs in a fresh process, after one tiny save by the same path (the modules
``save_pretrained`` imports on first use are loaded in the actor already): the process's
resident memory before the state dict is made is the baseline, the peak is read from ``VmHWM`` after resetting it (``clear_refs``)
once the state dict exists. Printed: (peak - baseline) / state-dict bytes.

    python benchmarks/final_save_memory.py [--hidden 768 --layers 12 --vocab 32000]
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


def _child(path: str, hidden: int, layers: int, vocab: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                      tie_word_embeddings=False)
    def save(sd, cfg, out):
        if path == "from_config":
            hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            hf.load_state_dict(sd, strict=False)
            hf.save_pretrained(out)
        else:
            from hapo_openrlhf.megatron.hf_save import save_hf_state_dict

            save_hf_state_dict(sd, cfg, torch.bfloat16, out)

    # a tiny save first: the modules save_pretrained imports on first use (~76 MB here) are
    # already loaded in the actor, and are not the save's memory
    tiny = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as out:
        save(AutoModelForCausalLM.from_config(tiny, dtype=torch.bfloat16).state_dict(), tiny, out)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).state_dict().items()}
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
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.hidden, a.layers, a.vocab)))
        return
    rows = []
    for path in ("from_config", "meta"):
        out = subprocess.run([sys.executable, __file__, "--child", path, "--hidden", str(a.hidden), "--layers",
                              str(a.layers), "--vocab", str(a.vocab)], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"state dict: {rows[0]['sd_mb']:.0f} MB (bf16, Qwen2 {a.layers} layers x {a.hidden}, vocab {a.vocab})")
    for r in rows:
        print(f"  {r['path']:<12} peak host memory = {r['ratio']:.2f} x the state dict")
    print(f"  meta / from_config = {rows[1]['ratio'] / rows[0]['ratio']:.2f}")


if __name__ == "__main__":
    main()
