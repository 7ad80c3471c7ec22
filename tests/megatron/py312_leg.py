"""Which Megatron tests the README's suite runs a second time under megatron-core 0.19.2 on
Python 3.12 (``.venv-py312``, beside the main run; scripts/test.sh), and why the others do not
(issue 57: the leg runs what differs between the versions, not the whole of tests/megatron again).
``bash scripts/test_py312.sh`` still runs every test of tests/megatron (and more) under 0.19.2.

    python tests/megatron/py312_leg.py    # the leg's files, one line

tests/test_suite_layout.py checks that every tests/megatron/test_*.py is in exactly one of the two.
"""


# what megatron-core's version changes: the compat layer, the checkpoint format and resumes through
# dist_checkpointing, DDP and its optimizers (the stream wait, the buckets, TE's FusedAdam), MoE
# (the router replay API, the aux loss's TP x CP scaling), one actor step through its schedule, its
# TE layer spec, and its parallel state under the full-size dry run
LEG = (
    "test_compat.py",
    "test_checkpoint.py",
    "test_elastic.py",
    "test_ddp.py",
    "test_te_fused_adam.py",
    "test_moe.py",
    "test_moe_train.py",
    "test_schedule.py",
    "test_te_spec.py",
    "test_dryrun.py",
)
NOT_IN_LEG = {
    "test_cross_version.py": "runs in the main leg: it writes a checkpoint under 0.16.1 and resumes it under 0.19.2 "
                             "(HAPO_MC_OTHER_PYTHON), and the refusal back",
    "test_attention.py": "hapo's FlashCoreAttention over torch's SDPA; megatron-core supplies only the module "
                         "interface, which every model the leg builds (test_schedule, test_moe) runs through",
    "test_head.py": "hapo's fused vocabulary-parallel head: torch.distributed collectives of its own; the leg runs "
                    "it inside the model (test_schedule at TP=2 against Hugging Face)",
    "test_head_signals.py": "PAEC's head signals, computed by hapo's head from its own shards (as test_head.py)",
    "test_tensor_parallel.py": "TP=2 == TP=1 == Hugging Face for megatron-core's GPTModel: the leg checks the same "
                               "model at TP=2 against Hugging Face through the schedule (test_schedule)",
    "test_convert.py": "Hugging Face <-> Megatron state-dict renaming and slicing: pure tensors, no megatron-core API",
    "test_hf_save.py": "the final save's safetensors writing of converted tensors: no megatron-core API",
    "test_stream.py": "the weight stream's collectives are hapo's over torch.distributed; megatron-core's parallel "
                      "state it reads is in the leg (test_ddp, test_schedule)",
    "test_memory.py": "memory arithmetic: no megatron-core API",
    "test_optim.py": "fp32 accumulation over 64 micro-batches in megatron-core's DDP buffers: the buffers are in the "
                     "leg through test_ddp.py's steps; this one adds only length",
    "test_te_standin.py": "the TE stand-in against Transformer Engine's own source: independent of megatron-core",
}


def leg_files() -> list[str]:
    return [f"tests/megatron/{name}" for name in LEG]


if __name__ == "__main__":
    assert not set(LEG) & set(NOT_IN_LEG)
    print(" ".join(leg_files()))
