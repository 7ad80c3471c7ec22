"""The benchmark scripts run and report what docs/performance.md quotes (tiny sizes: the
figures themselves come from full-size runs, never from tests)."""

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO, run_python


def test_loss_head_script_reports_ratios_and_gradient_agreement():
    out = run_python(  # the parent only times and compares: each method's memory is its own subprocess's
        [REPO / "benchmarks" / "loss_head.py", "--tokens", "96", "--vocab", "3000", "--hidden", "32", "--chunk", "16",
         "--methods", "naive,chunked,fused,fused_fwdgrad"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for m in ("chunked", "fused", "fused_fwdgrad"):
        assert res[f"time_ratio_{m}_vs_naive"] > 0 and res[f"mem_ratio_{m}_vs_naive"] is not None
        assert res[f"{m}_max_rel_err_vs_naive"] < 1e-4, m
    assert {"mem_ratio_fused_vs_naive", "time_ratio_fused_vs_naive"} <= set(res)


def test_loss_head_script_names_a_failing_method():
    out = run_python([REPO / "benchmarks" / "loss_head.py", "--tokens", "8", "--vocab", "50", "--hidden", "8",
                      "--methods", "naive,nope"], timeout=300)
    assert out.returncode == 0
    assert "unknown method 'nope'" in out.stdout


def test_megatron_attention_script_reports_memory_time_and_thd_agreement(tmp_path):
    import importlib.util

    import pytest

    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core not installed (the megatron extra)")
    plot = tmp_path / "mem.png"
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "megatron_attention.py"), "--seq-len", "512", "--lengths", "512",
         "--hidden", "64", "--eq-len", "48", "--plot", str(plot)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(res["peak_mem_ratio_by_len"]) == {"512"}
    assert all(v is not None and v > 0 for v in res["peak_mem_ratio_by_len"].values()), res
    assert res["peak_mem_ratio_vs_local"] == res["peak_mem_ratio_by_len"]["512"]
    assert res["time_ratio_vs_local"] > 0
    assert res["thd_vs_padded_max_abs_err"] < 1e-4 and res["thd_vs_masked_max_abs_err"] < 1e-4
    assert plot.stat().st_size > 0


def test_megatron_head_script_reports_ratios_and_agreement_at_tp2(tmp_path):
    """Two gloo ranks, a vocabulary that does not divide by TP (padded): the fused head's
    values and gradients agree with the logits path's, and the JSON carries the ratios
    docs/performance.md quotes (their size is only meaningful at full size)."""
    plot = tmp_path / "head.png"
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "megatron_head.py"), "--tokens", "96", "--vocab", "3001",
         "--hidden", "32", "--chunk", "16", "--lengths", "96", "--plot", str(plot)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["tp"] == 2 and res["max_rel_err"] < 1e-5
    assert res["peak_mem_ratio_vs_unfused"] > 0 and res["time_ratio_vs_unfused"] > 0
    assert set(res["peak_mem_ratio_by_tokens"]) == {"96"} and plot.stat().st_size > 0


def test_timeline_script_reads_wall_busy_and_cpu(tmp_path):
    """benchmarks/test_timeline.py on a hand-made timeline (the format tests/conftest.py
    writes, with the worker's process id, and the older ones without it or without CPU): wall, busy
    time per worker, total CPU, failures."""
    f = tmp_path / "t.txt"
    f.write_text("gw0 100.00 160.00 cpu=50.5 pid=4242 tests/a.py::test_x\n"
                 "gw1 110.00 130.00 cpu=3.0 FAILED tests/b.py::test_y[1 2]\n"
                 "gw0 160.00 170.00 tests/c.py::test_old_format\n")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "test_timeline.py"), str(f), "--top", "2"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["wall_s"] == 70.0 and res["tests"] == 3 and res["failed"] == 1
    assert res["busy_s"] == {"gw0": 70, "gw1": 20} and res["cpu_s"] == 54
    assert "50.5 s  tests/a.py::test_x" in out.stdout


def test_competitors_cost_script_reports_a_ratio_to_grpo_per_method():
    out = run_python(
        [REPO / "benchmarks" / "competitors_cost.py", "--steps", "2", "--repeat", "1", "--warmup", "5",
         "--rows", "16", "--tokens", "64", "--head-tokens", "64", "--vocab", "500", "--hidden", "16",
         "--threads", "1"])  # one thread, as every process of the suite (tests/conftest.py): no OpenMP spinning
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["grpo"]["embedded_ratio"] == 1.0 and res["paper_batch"] == [16, 64] and res["threads"] == 1
    head = res["paec_head_signals"]["500"]
    assert res["loss_paec"]["paper_ratio"] > 0 and head["ratio_to_head"] > 0 and head["shape"] == [64, 16, 500]
    assert head["sorted_ratio_to_head"] > 0 and head["flat_ratio_to_head"] > 0
    for m in ("hapo", "eapo_entropic", "pepo", "less"):
        assert res[m]["embedded_ratio"] > 0 and res[m]["paper_ratio"] > 0
    assert res["loss_ppo"]["paper_ratio"] == 1.0 and res["loss_stare"]["paper_ratio"] > 0 and res["loss_rsi_s"]["paper_ratio"] > 0
    assert res["less_full_scan"]["equal"] is True and res["less_full_scan"]["paper_ms"] > 0


def test_vs_trl_refuses_a_ratio_when_a_trainers_reward_never_moves():
    """benchmarks/vs_trl.py (TRL is not a test dependency: its rule alone): a run where either
    trainer's per-step reward is constant -- all 0, as TRL's was when its answers never matched --
    gives no ratio."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import vs_trl
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert vs_trl.constant([0.0] * 16) and vs_trl.constant([0.25, 0.25]) and vs_trl.constant([])
    assert not vs_trl.constant([0.0, 0.0625, 0.0])


def test_prime_cost_script_reports_each_update_order_as_a_ratio_to_grpo():
    out = run_python([REPO / "benchmarks" / "prime_cost.py", "--prompts", "2", "--repeat", "1", "--warmup", "2",
                      "--threads", "1"])
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["rows"] == 8 and res["grpo"]["ratio_to_grpo"] == 1.0 and res["oversample_rollout_ratio"] == 4.0
    for order in ("before", "after", "none"):
        assert res[f"prime_{order}"]["median_ms"] > 0
    assert res["paper_scale"]["training_side_ratio_before"] == 2.25 and res["threads"] == 1


def test_the_cost_scripts_refuse_a_thread_count_that_is_not_a_positive_integer():
    for script, bad in (("prime_cost.py", "0"), ("competitors_cost.py", "2\n; rm -rf /")):
        out = run_python([REPO / "benchmarks" / script, "--threads", bad], timeout=120)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-800:]
        assert f"argument --threads: must be a positive integer, got {bad!r}" in out.stderr


def test_machine_speed_script_reports_each_workload_and_their_index_to_the_reference():
    """benchmarks/machine_speed.py (printed by scripts/test.sh before and after the tests): each
    workload's median wall and CPU seconds, and the index: the geometric mean of the CPU seconds'
    ratios to the reference; a repeat count that is not a positive integer is argparse's one-line error."""
    import importlib.util
    import math

    script = REPO / "benchmarks" / "machine_speed.py"
    out = subprocess.run([sys.executable, str(script), "--repeats", "1"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    spec = importlib.util.spec_from_file_location("machine_speed", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ref = module.REFERENCE
    assert set(got) == {"repeats", "index", *ref} and got["repeats"] == 1
    for name in ref:  # one thread: its CPU seconds at most its wall seconds (less where others take the cores)
        assert 0 < got[name]["cpu_s"] <= got[name]["wall_s"] * 1.05 + 0.02, got
    want = math.prod(got[k]["cpu_s"] / ref[k] for k in ref) ** (1 / len(ref))
    assert got["index"] == pytest.approx(want, abs=2e-3)
    for bad in ("0", "two"):
        res = subprocess.run([sys.executable, str(script), "--repeats", bad], capture_output=True, text=True,
                             timeout=60, cwd=REPO)
        assert res.returncode == 2 and f"argument --repeats: must be a positive integer, got {bad!r}" in res.stderr


def test_chain_cost_script_times_runs_and_compares_two_directories(tmp_path):
    """benchmarks/chain_cost.py reduced to a few steps: it writes the experiment file from the
    decisive one, runs it in a subprocess, reads each job's wall time from experiment.json;
    --rerun times the RL runs again beside the kept warm start; --compare gives the ratios."""
    smoke = ["trainer.steps=1", "warmup.steps=5", "data.synthetic.eval_size=4", "data.synthetic.train_size=64",
             "eval.n_samples=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
             "rollout.max_new_tokens=8", "eval.max_new_tokens=8", "trainer.sample_every=0"]
    cmd = [REPO / "benchmarks" / "chain_cost.py", "--variants", "grpo", *[a for kv in smoke for a in ("--set", kv)]]
    for out, extra in ((tmp_path / "a", []), (tmp_path / "b", []), (tmp_path / "b", ["--rerun"])):
        res = run_python([*cmd, "--out", out, *extra])
        assert res.returncode == 0, res.stderr[-2000:]
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert set(got["jobs_s"]) == {"warm_start/seed_100", "grpo/seed_101"} and got["jobs_s"]["grpo/seed_101"] > 0
    assert (tmp_path / "b" / "runs.1" / "grpo").is_dir() and (tmp_path / "b" / "runs" / "grpo").is_dir()
    cmp = run_python([REPO / "benchmarks" / "chain_cost.py", "--compare", tmp_path / "a", tmp_path / "b"], timeout=120)
    ratios = json.loads(cmp.stdout)["ratio_head_over_base"]
    assert set(ratios) == {"warm_start/seed_100", "grpo/seed_101"} and all(r > 0 for r in ratios.values())


def test_nucleus_metric_script_reports_ratios_and_agreement():
    out = run_python(  # its memory is counted by a dispatch mode over the tensors, not the process's
        [REPO / "benchmarks" / "nucleus_metric.py", "--tokens", "512", "--vocab", "2000", "--hidden", "16",
         "--chunk", "256", "--repeat", "1"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["with_sorted_metric"] > 1 and res["with_masked_metric"] > 1 and res["sorted_vs_masked_time"] > 0
    # the sorted form holds the chunk's probabilities and their cumulative sums (the sort runs 64 rows
    # at a time, so its buffers stay below that at 256-row chunks): 2 blocks
    assert res["peak_blocks_sorted"] == pytest.approx(2.0, abs=0.1) and res["peak_blocks_masked"] >= 3.0
    assert res["max_abs_diff"] < 1e-3  # the two rules differ only on tied boundary groups


def test_final_save_memory_script_reports_both_paths():
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "final_save_memory.py"), "--hidden", "128", "--layers", "2",
         "--vocab", "4000"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "from_config  peak host memory" in out.stdout and "meta         peak host memory" in out.stdout


def test_head_signals_script_reports_both_paths_as_ratios_to_the_head():
    """benchmarks/head_signals.py (issue 61), small: each row kind's signals and metric with the top-k
    path and with every row sorted, as ratios to the fused head in the same run; the two paths agree;
    the peaked rows' nuclei lie in the top 64, the flat rows' do not (every row sorted)."""
    out = run_python([REPO / "benchmarks" / "head_signals.py", "--tokens", "128", "--hidden", "16", "--vocab", "3000",
                      "--chunk", "64", "--repeat", "1"], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    runs = {r["rows"]: r for r in res["runs"]}
    assert set(runs) == {"peaked", "flat"} and res["top_k"] == 64
    for r in runs.values():
        assert r["head_ms"] > 0 and r["signals_ratio"] > 0 and r["signals_sorted_ratio"] > 0 and r["metric_ratio"] > 0
        assert r["max_abs_entropy"] < 1e-5 and r["max_abs_logmass"] < 1e-5
    assert runs["peaked"]["nucleus_in_top_k_frac"] > 0.9 and runs["flat"]["nucleus_in_top_k_frac"] == 0.0


def test_suite_cpu_script_samples_processes_and_credits_each_sample_to_the_running_test(tmp_path):
    """benchmarks/suite_cpu.py (issue 57): ``sample`` writes each process's CPU since the last sample under
    a worker label -- an xdist worker's own as ``pid:N`` (its /proc environment has no gwN: xdist names
    it after it starts) -- and ``attribute`` credits each sample to the test that worker ran then,
    naming ``pid:N`` from the timeline's ``pid=``, hand-checked."""
    import time

    samples = tmp_path / "samples.txt"
    p = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "suite_cpu.py"), "sample", str(samples),
                          "--interval", "0.2"])
    try:
        time.sleep(1.0)  # the sampler's first pass (its baseline) before the burner starts
        # started the way execnet starts an xdist worker: its command line is what names it one; it
        # burns 1.5 s of CPU (not of wall: the machine may be busy)
        burn = subprocess.Popen([sys.executable, "-c", "import sys;exec(eval(sys.stdin.readline()))"],
                                stdin=subprocess.PIPE, text=True, env={**os.environ, "PYTEST_XDIST_WORKER": ""})
        burn.communicate(repr("import time\nwhile time.process_time() < 1.5: pass") + "\n", timeout=60)
        assert burn.returncode == 0
        time.sleep(0.5)
    finally:
        p.terminate()
        p.wait(timeout=30)
    rows = [ln.split() for ln in samples.read_text().splitlines()]
    assert rows and all(len(r) == 3 and float(r[2]) > 0 for r in rows)
    burner = sum(float(r[2]) for r in rows if r[1] == f"pid:{burn.pid}")
    assert burner > 1.0  # the burner's 1.5 s of CPU, most of it seen, under its process id
    # attribute, by hand: gw0 (process 4242) ran a then b; a sample at t belongs to the test running at
    # t, else to one that ended in the 3 s before it; gw0's sample at 200, gw9's (no test) and process
    # 999's (no worker of the timeline) are outside any test
    (tmp_path / "timeline.txt").write_text("gw0 100.0 110.0 cpu=1.0 pid=4242 tests/t.py::a\n"
                                           "gw0 110.5 120.0 cpu=1.0 pid=4242 tests/u.py::b\n")
    (tmp_path / "s.txt").write_text("105.0 gw0 1.0\n111.0 gw0 1.0\n112.0 gw0 3.0\n119.0 gw0 1.0\n122.0 gw0 1.0\n"
                                    "200.0 gw0 4.0\n150.0 gw9 2.0\n113.0 pid:4242 2.0\n150.0 pid:999 1.0\n")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "suite_cpu.py"), "attribute",
                          str(tmp_path / "timeline.txt"), str(tmp_path / "s.txt")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "16 CPU-s sampled; 9 in tests; outside any test: gw0 4, gw9 2, pid:999 1" in out.stdout
    lines = out.stdout.splitlines()
    assert "     8.0  tests/u.py::b" in lines and "     1.0  tests/t.py::a" in lines
