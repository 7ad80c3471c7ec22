#!/usr/bin/env bash
# The Python 3.12 layers in full: the algorithms, the config, checkpoints, the embedded trainer
# and the Megatron back end (megatron-core 0.19.2), in .venv-py312 (scripts/py312_venv.sh). The
# README's test command runs only the Megatron layer on 3.12 (beside the main run, for the suite's
# time); this runs the rest as well (about 7 minutes on 2 cores).
#
#   bash scripts/test_py312.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
source scripts/py312_venv.sh
build_py312
export HAPO_REQUIRE_MEGATRON=1
if [ "$#" -gt 0 ]; then
    exec "$PY312" -m pytest -q -p no:cacheprovider "$@"
fi
exec "$PY312" -m pytest -q -p no:cacheprovider tests/algos tests/test_config.py tests/test_checkpoint.py tests/local tests/generation \
    tests/megatron
