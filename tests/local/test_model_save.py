"""The embedded trainer's model save (``local/model.py``) writes what ``save_pretrained`` writes,
without importing DeepSpeed in a process that never used it (issue 57: 1.5 s of CPU per save)."""

import subprocess
import sys

from tests.conftest import REPO

PROBE = r"""
import filecmp, sys
from pathlib import Path
from types import SimpleNamespace
import accelerate.utils.other as other
from hapo_openrlhf.local.model import build_model, build_tokenizer, save_hf
out = Path(sys.argv[1])
tok = build_tokenizer()
model = build_model(SimpleNamespace(family="qwen2", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
                                    intermediate_size=128, max_position_embeddings=128,
                                    tie_word_embeddings=False), tok, seed=0)
real = other.is_deepspeed_available
save_hf(model, tok, out / "ours")
assert "deepspeed" not in sys.modules, "saving imported DeepSpeed"
assert other.is_deepspeed_available is real, "accelerate's check was not put back"
assert real(), "this environment has DeepSpeed installed: the case under test"
model.save_pretrained(str(out / "plain"))  # transformers' own path: imports DeepSpeed to unwrap
assert "deepspeed" in sys.modules
names = sorted(p.name for p in (out / "plain").iterdir())
ours = sorted(p.name for p in (out / "ours").iterdir() if p.name in names)
assert ours == names, (ours, names)
_, mismatch, errors = filecmp.cmpfiles(out / "plain", out / "ours", names, shallow=False)
assert not mismatch and not errors, (mismatch, errors)
print("same", names)
"""


def test_the_save_writes_save_pretrained_s_files_without_importing_deepspeed(tmp_path):
    p = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "model.safetensors" in p.stdout and "config.json" in p.stdout
