"""Which Megatron tests the README's suite runs a second time under megatron-core 0.19.2 on
Python 3.12 (``.venv-py312``, beside the main run; scripts/test.sh), and why the others do not
(issue 57: the leg runs what differs between the versions, not the whole of tests/megatron again).
``bash scripts/test_py312.sh`` still runs every test of tests/megatron (and more) under 0.19.2.

    python tests/megatron/py312_leg.py    # the leg's pytest arguments, one line

tests/test_suite_layout.py checks that every tests/megatron/test_*.py is in exactly one of the two,
and that every deselected case is a case pytest collects from a file of the leg.
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
    # context parallelism through megatron-core (its CP group, THD RoPE per CP rank, DDP and the
    # distributed optimizer over DP x CP, dist_checkpointing across CP) and YaRN (its YarnRotaryEmbedding)
    "test_context_parallel.py",
    "test_rope_scaling.py",
    # the ranks' fork servers import megatron-core's modules (and the actor) before the first fork: a
    # module that fails to import under 0.19.x would be skipped there without a word
    "test_fork_preload.py",
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
    "test_cp_split.py": "context parallelism's batch split (host-side index arithmetic) and the TE stand-in's "
                        "CP attention on it (the stand-in's own collectives): no megatron-core API",
    "test_hf_save.py": "the final save's safetensors writing of converted tensors: no megatron-core API",
    "test_stream.py": "the weight stream's collectives are hapo's over torch.distributed; megatron-core's parallel "
                      "state it reads is in the leg (test_ddp, test_schedule)",
    "test_memory.py": "memory arithmetic: no megatron-core API",
    "test_optim.py": "fp32 accumulation over 64 micro-batches in megatron-core's DDP buffers: the buffers are in the "
                     "leg through test_ddp.py's steps; this one adds only length",
    "test_te_standin.py": "the TE stand-in against Transformer Engine's own source: independent of megatron-core",
}


# cases of the leg's files that repeat, under 0.19.x, what another case of the leg already runs
# through the same megatron-core code (a second layout, dispatcher or config of one path), each with
# the case that carries it; the main leg runs all of them under 0.16.1
DESELECTED = {
    "test_dryrun.py::test_every_shipped_megatron_config_starts_every_rank_role_at_full_size"
    "[configs/deepscaler_1p5b_24k_hapo_megatron.yaml]":
        "a dense config: its parallel state and model build are the MoE config's kept case's without experts",
    "test_dryrun.py::test_every_shipped_megatron_config_starts_every_rank_role_at_full_size"
    "[configs/qwen25_math_7b_hapo_megatron.yaml]":
        "a dense config: as above, the 30B-A3B case (TP x PP x EP, the rank-order assertion) carries it",
    "test_dryrun.py::test_every_shipped_megatron_config_starts_every_rank_role_at_full_size"
    "[configs/qwen3_8b_base_hapo_megatron.yaml]":
        "a dense config: as above, the 30B-A3B case carries its parallel state and model build",
    "test_dryrun.py::test_the_30b_moe_layout_by_hand":
        "the 30B-A3B dry run again, its figures checked by hand: the shipped-config case runs the same ranks",
    "test_dryrun.py::test_a_layout_that_cannot_start_or_fit_fails_with_the_rank_and_reason":
        "two more dry runs through the module's CLI: the converter's refusal of TP 4 on two KV heads is hapo's "
        "(before megatron-core builds anything), and the 30B layout's peak is the kept 30B case's dry run, "
        "compared against another --gpu-gb by hapo's arithmetic",
    "test_dryrun.py::test_doctor_runs_the_dry_run_for_a_megatron_config":
        "the CLI's wiring of the dry run into the doctor (hapo's code); the dry run under 0.19 is the kept cases'",
    "test_elastic.py::test_checkpoint_resumes_under_another_layout[tp2xpp2xdp1-tp1xpp1xdp1-None]":
        "a third re-layout through the same dist_checkpointing load: PP2 x DP2 -> TP2 x DP2 and DP2 -> DP1 stay",
    "test_elastic.py::test_checkpoint_resumes_under_another_layout[tp1xpp2xdp1-tp2xpp1xdp1-None]":
        "PP2 -> TP2 without DP: the kept PP2 x DP2 -> TP2 x DP2 case is the same change with the optimizer shards",
    "test_te_fused_adam.py::test_a_te_fused_adam_run_resumes_bitwise[dp1_replicated]":
        "TE's FusedAdam without the distributed optimizer: the kept dp2 cases run its state_dict through 0.19's",
    "test_te_fused_adam.py::test_a_te_fused_adam_run_resumes_bitwise[dp2_dp_reshardable]":
        "the dp_reshardable format: test_ddp.py's resume at another DP (kept) writes it; fully_reshardable stays",
    "test_te_fused_adam.py::test_the_gpu_smokes_resume_check_runs_on_cpu[torch_adamw]":
        "the smoke check with torch's AdamW: the TE case (kept) runs the same check through megatron-core",
    "test_context_parallel.py::test_hapos_logprobs_and_entropy_at_cp2_equal_cp1_with_both_heads":
        "hapo's CPRows over the same CP=2 model the kept GPTModel case builds: the split and the gather are hapo's "
        "collectives, not megatron-core's; the kept two-step case runs CPRows through megatron-core's schedule",
    "test_context_parallel.py::test_tp2_x_cp2_with_sequence_parallelism_equals_hugging_face_with_both_heads":
        "four ranks of TP x CP: the kept CP=2 cases and test_te_spec.py's TP=2 sequence-parallel case carry each "
        "half through 0.19's parallel state and TE spec",
    "test_context_parallel.py::test_cp2_halves_the_attention_inputs_and_the_largest_activation_per_rank":
        "a measurement of the same CP=2 forward and backward the kept GPTModel case runs through 0.19's CP path",
    "test_context_parallel.py::test_the_gpu_smokes_cp2_check_runs_on_the_stand_in":
        "the GPU smoke's CP check: the kept GPTModel case runs the same model at CP 2 under 0.19",
    "test_context_parallel.py::test_the_nucleus_logmass_and_paecs_signals_at_cp2_equal_cp1":
        "the head's nucleus log-mass and PAEC's signals: hapo's head over the gathered values (as test_head.py)",
    "test_moe.py::test_grouped_gemm_experts_equal_sequential_ones_on_the_te_spec[ep1]":
        "grouped GEMM at EP=1: the kept EP=2 case builds the same TEGroupedMLP with expert parallelism",
    "test_moe.py::test_te_spec_moe_with_sequence_parallelism_equals_hf[tp2_ep1_allgather]":
        "the allgather dispatcher: test_moe_logprobs_entropy_and_grads_equal_hf[ep2_allgather_pre_softmax] and "
        "test_moe_train.py's ep2_padded_allgather (kept) run it",
}


def leg_files() -> list[str]:
    return [f"tests/megatron/{name}" for name in LEG]


def leg_args() -> list[str]:
    """The pytest arguments of the leg: its files, then a --deselect for each case above."""
    return [*leg_files(), *[a for node in DESELECTED for a in ("--deselect", f"tests/megatron/{node}")]]


if __name__ == "__main__":
    assert not set(LEG) & set(NOT_IN_LEG)
    assert all(node.split("::")[0] in LEG for node in DESELECTED)
    print(" ".join(leg_args()))
