"""TEST-ONLY driver: OpenRLHF's PPO loop on CPU with hapo's subclasses (see hapo_cpu_shim).

    python run_e2e.py CONFIG OUT_DIR [--engine cpu|vllm] [--set k=v ...]

Starts a real local Ray cluster (4 logical GPUs only, so OpenRLHF's ``num_gpus=1``
actors schedule), installs the CPU shim in the driver and -- through
``worker_process_setup_hook`` -- in every worker (each patch when its module is imported), then calls the same
``hapo_openrlhf.integrations.openrlhf.launch.train.launch`` that ``hapo train --backend
openrlhf`` calls (``hapo_openrlhf.integrations.openrlhf.launch.train.main``).
"""

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parents[3]))  # the repository root (tests.megatron.cuda_shim)

import hapo_cpu_shim  # noqa: E402
import ray_zygote  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--gpus", type=int, default=4, help="logical GPUs for Ray: actors + vLLM engines")
    ap.add_argument("--engine", choices=("cpu", "vllm"), default="cpu",
                    help="cpu: the shim's Hugging Face rollout engine; vllm: OpenRLHF's real vLLM engines")
    a = ap.parse_args()
    hapo_cpu_shim.install_driver(a.engine)
    # no idle Python workers prestarted for the driver (Ray starts num_cpus of them; every
    # actor here has a runtime_env, so none of them could ever be used: measured, 2-4 idle
    # processes per launch importing Ray on the suite's two cores)
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    # Ray's workers (every actor here) run at nice 15 by default: starved beside the other
    # test processes (tests/conftest.py sets this too)
    os.environ.setdefault("RAY_worker_niceness", "0")
    import ray

    from hapo_openrlhf.integrations.openrlhf.launch.train import main as train_main

    # the repository root: the Megatron CPU shim lives in tests/megatron/cuda_shim.py
    # HAPO_SHIM_TE=1: the Transformer Engine stand-in (tests/megatron/te_stub) first on the workers' path,
    # so megatron-core in the actors builds on it as on an installed TE (megatron.layer_spec: te, CP)
    te = [str(HERE.parents[2] / "megatron" / "te_stub")] if os.environ.get("HAPO_SHIM_TE") == "1" else []
    pythonpath = os.pathsep.join([*te, str(HERE), str(HERE.parents[3]), *hapo_cpu_shim.stub_path(),
                                  os.environ.get("PYTHONPATH", "")])
    env = {k: os.environ[k] for k in ("HAPO_OPENRLHF_DUMP_DIR", "TORCH_EXTENSIONS_DIR", "HF_HUB_OFFLINE",
                                      "TRANSFORMERS_OFFLINE", "OMP_NUM_THREADS", "HAPO_SHIM_MEGATRON",
                                      "HAPO_SHIM_ROUTE_BIAS", "HAPO_SHIM_STOP_AT_STEP")
           if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")})  # vLLM's CPU back end
    env.update(PYTHONPATH=pythonpath, DS_BUILD_OPS="0", TOKENIZERS_PARALLELISM="false",
               RAY_ENABLE_ZERO_COPY_TORCH_TENSORS="1")
    runtime_env = {"env_vars": env, "worker_process_setup_hook": "hapo_cpu_shim.install_worker"}
    with ray_zygote.started(env) as zygote:  # the workers forked from one that imported upstream once
        if zygote is not None:
            runtime_env.update(py_executable=zygote.py_executable)
            env.update(zygote.env)
        ray.init(address="local", num_cpus=4, num_gpus=a.gpus, include_dashboard=False, log_to_driver=True,
                 runtime_env=runtime_env)
        try:  # the same entry point as `hapo train --backend openrlhf` (exit 85: preempted)
            return train_main(["--config", a.config, "--output-dir", a.out,
                               *[x for kv in a.set for x in ("--set", kv)]])
        finally:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
