#!/usr/bin/env bash
# Regenerates requirements/lock.txt: exact versions of every runtime, test and bench dependency,
# resolved from pyproject.toml's ranges and requirements/pins.in for CPython 3.11 on x86-64 Linux.
# scripts/setup.sh installs through it (as pip constraints), so a fresh install gets these
# versions whatever PyPI's newest are that day. Needs uv (`pip install uv`).
set -euo pipefail
cd "$(dirname "$0")/.."
uv pip compile pyproject.toml requirements/pins.in --all-extras --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 --custom-compile-command scripts/lock.sh \
    --upgrade -o requirements/lock.txt "$@"
