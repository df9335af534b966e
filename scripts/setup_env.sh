#!/usr/bin/env bash
# Create (or reuse) the virtual environment at .venv and install aiayn with its test extras.
# On a machine without an NVIDIA GPU, torch comes from the CPU-only wheel index, never as a
# multi-GB CUDA build. Safe to run repeatedly: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "aiayn: creating virtual environment in $VENV" >&2
    "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "aiayn: GPU found, installing torch (CUDA build)" >&2
        "$VENV/bin/pip" install "torch>=2.2"
    else
        echo "aiayn: no GPU found, installing the CPU build of torch" >&2
        # The +cpu build from PyTorch's CPU index (or a local wheel of it); --retries 0 keeps an
        # unreachable index from stalling each dependency look-up.
        "$VENV/bin/pip" install --retries 0 "torch==2.13.0+cpu" \
            --extra-index-url https://download.pytorch.org/whl/cpu
    fi
fi
stamp="$VENV/.aiayn-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$VENV/bin/pip" install -e ".[test]"
    touch "$stamp"
fi
