#!/usr/bin/env bash
# Create (or reuse) the virtual environment at .venv and install aiayn with its test and interop
# extras (the interop tests compare with Hugging Face transformers and CTranslate2).
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
        "$VENV/bin/pip" install "torch>=2.5"
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
    "$VENV/bin/pip" install -e ".[test,interop]"
    touch "$stamp"
fi
# The embedded corpus (aiayn prepare --corpus bible, aiayn demo) is read from Debian's SWORD
# modules of the World English Bible and the Reina-Valera 1909 (both public domain).
SWORD_CONF=/usr/share/sword/mods.d
if [ ! -f "$SWORD_CONF/engWEB2015eb.conf" ] || [ ! -f "$SWORD_CONF/spaRV1909eb.conf" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "aiayn: installing the SWORD Bible modules sword-text-web and sword-text-sparv" >&2
        export DEBIAN_FRONTEND=noninteractive
        if ! apt-get install -y -q sword-text-web sword-text-sparv >/dev/null; then
            if ! { apt-get update -q >/dev/null &&
                apt-get install -y -q sword-text-web sword-text-sparv >/dev/null; }; then
                echo "aiayn: could not install sword-text-web and sword-text-sparv;" \
                    "the Bible corpus will not be available (continuing)" >&2
            fi
        fi
    else
        echo "aiayn: the embedded Bible corpus needs the Debian/Ubuntu packages sword-text-web and" \
            "sword-text-sparv (as root: apt-get install sword-text-web sword-text-sparv), or" \
            "'aiayn prepare --corpus bible --download'; continuing without them" >&2
    fi
fi
# The browser test of aiayn serve's page (tests/serving/test_browser.py) drives Debian's
# chromium through chromium-driver with Selenium; without them it is skipped and says why.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "aiayn: installing chromium and chromium-driver for the browser test" >&2
        export DEBIAN_FRONTEND=noninteractive
        if ! apt-get install -y -q chromium chromium-driver >/dev/null; then
            if ! { apt-get update -q >/dev/null &&
                apt-get install -y -q chromium chromium-driver >/dev/null; }; then
                echo "aiayn: could not install chromium and chromium-driver;" \
                    "the browser test will be skipped (continuing)" >&2
            fi
        fi
    else
        echo "aiayn: the browser test needs the Debian/Ubuntu packages chromium and" \
            "chromium-driver (as root: apt-get install chromium chromium-driver);" \
            "without them it is skipped" >&2
    fi
fi
