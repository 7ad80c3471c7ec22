# Sourced by scripts/test.sh and scripts/test_py312.sh: build .venv-py312, a Python 3.12
# environment with megatron-core 0.19.2 (the newest of the range, which declares Python >= 3.12)
# and this project with its [megatron] extra. torch==2.13.0 for 3.12 comes from PyPI as the CUDA
# build (~4.7 GB installed; it runs on the CPU): measured 65 s for torch and 53 s for the rest
# on the development machine (docs/performance.md). Python 3.12 is found under pyenv, else as
# python3.12 on PATH (run to check it). Sets PY312 to the venv's python, or leaves it empty and says why.
PY312=""
py312_ok() {
    .venv-py312/bin/python - 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
assert sys.version_info[:2] == (3, 12) and version("megatron-core") == "0.19.2" and version("torch") == "2.13.0"
import hapo_openrlhf, psutil, pytest  # noqa: F401  (the project, the checkpoint writer's import, the runner)
PY
}
find_python312() {
    # pyenv's versions first: a pyenv shim named python3.12 can be on PATH without running
    local root c
    root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
    for c in $(ls -d "$root"/versions/3.12*/bin/python 2>/dev/null | sort -Vr) "$(command -v python3.12 2>/dev/null)"; do
        if [ -n "$c" ] && "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
            echo "$c"
            return 0
        fi
    done
    return 1
}
build_py312() {
    if [ -x .venv-py312/bin/python ] && py312_ok; then
        PY312="$PWD/.venv-py312/bin/python"
        return 0
    fi
    local base
    if ! base="$(find_python312)"; then
        echo "hapo tests: no Python 3.12 here (python3.12 or pyenv): the Python 3.12 leg does not run"
        return 1
    fi
    rm -rf .venv-py312
    if "$base" -m venv .venv-py312 \
            && .venv-py312/bin/python -m pip install --quiet torch==2.13.0 \
            && .venv-py312/bin/python -m pip install --quiet -e ".[megatron]" megatron-core==0.19.2 \
                "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" \
            && py312_ok; then
        PY312="$PWD/.venv-py312/bin/python"
        return 0
    fi
    echo "hapo tests: could not build .venv-py312 (Python 3.12, torch 2.13.0, megatron-core 0.19.2): the Python 3.12 leg does not run"
    return 1
}
