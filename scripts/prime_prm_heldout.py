"""Does PRIME's implicit PRM learn to predict outcomes on responses it has not trained on? On the
embedded default (``configs/cpu_tiny_prime.yaml``, its warm-up), with the policy held fixed at the
warm start: ``--heldout`` filtered batches are set aside, then the PRM takes one step (the
config's ``prm.update`` order) on each of ``--steps`` fresh filtered batches, and every ``--every``
steps its q is scored on the held-out batches: the AUC of sum q against the outcome, and the
recipe's pairwise accuracy within groups (``compute_dpo_accuracy``), averaged over the batches.
The PRIME run itself logs the same measures on each batch before the PRM trains on it
(``prm/auc_heldout``, ``prm/acc_heldout``), while the policy moves under it.

    python scripts/prime_prm_heldout.py [--steps 60 --every 10 --heldout 4 --set prm.lr=1e-3 ...]

Last line: one JSON object (the curve).
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from hapo_openrlhf.algos import prime as P
from hapo_openrlhf.config import load_config
from hapo_openrlhf.local.trainer import LocalTrainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--heldout", type=int, default=4)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    torch.set_num_threads(2)
    cfg = load_config("configs/cpu_tiny_prime.yaml", ["trainer.steps=0", "trainer.save_every=0", *a.set])
    run_dir = tempfile.TemporaryDirectory(prefix="hapo_prm_heldout_")  # removed at exit
    t = LocalTrainer(cfg, run_dir.name)
    t.run_warmup()
    held = [t.collect()[0] for _ in range(a.heldout)]
    t.prm = t._build_prm()

    def measure() -> tuple[float, float]:
        auc, acc = [], []
        for b in held:
            q, m = t.prm.score(b.rollout), b.rollout.response_mask_BR
            auc.append(P.outcome_auc(q, b.correct, m))
            acc.append(P.pairwise_accuracy(q, b.correct, m, b.group_index))
        return sum(auc) / len(auc), sum(acc) / len(acc)

    curve = []
    for step in range(a.steps + 1):
        if step % a.every == 0:
            auc, acc = measure()
            curve.append({"prm_steps": step, "auc": round(auc, 4), "pairwise_acc": round(acc, 4)})
            print(f"after {step:4d} PRM steps: held-out AUC {auc:.3f}, pairwise accuracy {acc:.3f}", flush=True)
        if step < a.steps:
            b = t.collect()[0]
            t.prm.step(b.rollout, b.correct, b.group_index)
    t.close()
    print(json.dumps({"heldout_batches": a.heldout, "lr": cfg.prm.lr, "update": cfg.prm.update, "curve": curve}))


if __name__ == "__main__":
    main()
