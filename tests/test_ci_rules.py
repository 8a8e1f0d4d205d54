"""The install and CI rules themselves: the lock covers what pyproject.toml asks for, and the
expected-skip list matches what it should and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import load_expected_skips, unexpected_skips

ROOT = Path(__file__).parent.parent


def locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_the_lock_pins_every_dependency_within_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values()
                                          for r in extra)]
    pins = locked()
    for spec in map(Requirement, wanted):
        name = canonicalize_name(spec.name)
        assert name in pins, f"{spec.name} is not in requirements/lock.txt: run scripts/lock.sh"
        assert spec.specifier.contains(pins[name], prereleases=True), \
            f"lock has {spec.name}=={pins[name]}, outside {spec}: run scripts/lock.sh"
    assert pins["torch"] == "2.13.0"  # the CPU build on this project's machines


def test_expected_skips_allow_only_what_they_name():
    rules = load_expected_skips()
    assert rules and all(pattern and reason for pattern, reason in rules)
    skips = {"tests/test_cuda_graphs.py::test_x": "needs CUDA",
             "tests/test_cpu_kernels.py::test_y[1]": "the packed bf16 GEMM needs AVX512-BF16",
             "tests/test_cpu_kernels.py::test_z": "no C++ compiler: the kernels fall back",
             "tests/test_triton_attention.py": "could not import 'triton'",
             "tests/test_server.py::test_w": "needs CUDA"}
    assert unexpected_skips(skips, rules) == {
        "tests/test_cpu_kernels.py::test_z": "no C++ compiler: the kernels fall back",
        "tests/test_triton_attention.py": "could not import 'triton'",
        "tests/test_server.py::test_w": "needs CUDA"}


def test_skipping_on_request():
    """Skips when told to (the run below); passes otherwise."""
    if os.environ.get("TOKENMILL_TEST_DELIBERATE_SKIP"):
        pytest.skip("deliberately skipped")


@pytest.mark.parametrize("strict,code", [("1", 1), ("0", 0)])
def test_an_unlisted_skip_fails_a_strict_run(strict, code):
    env = {**os.environ, "TOKENMILL_TEST_DELIBERATE_SKIP": "1", "TOKENMILL_STRICT_SKIPS": strict}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_ci_rules.py::test_skipping_on_request"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == code, run.stdout + run.stderr
    assert "deliberately skipped" in run.stdout  # -rs prints the reason
    assert ("unexpected skips" in run.stdout) == (strict == "1")
