"""The install and CI rules themselves: the lock covers what pyproject.toml asks for, and the
expected-skip list matches what it should and nothing else."""

from __future__ import annotations

import ast
import os
import re
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


# Instruction sets a CI machine may lack: both the AVX2-only EPYCs and the AVX512-BF16 / AMX
# Xeons run CI, so a skip for any of these happens on one of them. A reason that names AVX2 is
# met by every CI machine.
MAY_LACK = re.compile(r"AVX512|AMX|VNNI|bf16 GEMM|bfloat16 GEMM")


def literal_skip_reasons(path: Path) -> set[str]:
    """The string literals a test file gives as skip reasons: ``skipif(..., reason=...)`` and
    ``pytest.skip(...)`` (a reason built at run time is not seen)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        texts = ([k.value for k in node.keywords if k.arg == "reason"] if name == "skipif"
                 else node.args[:1] if name == "skip" else [])
        found |= {t.value for t in texts
                  if isinstance(t, ast.Constant) and isinstance(t.value, str)}
    return found


def unlisted_instruction_set_skips(rules: list[tuple[str, str]]) -> list[str]:
    """``file | reason`` for every skip reason naming an instruction set a CI machine may lack
    that no rule of ``rules`` could allow (the rule's file part matches and its text is in the
    reason): the skips that fail a strict run on the machines without it."""
    file_rules = [(pattern.split("::")[0], reason) for pattern, reason in rules]
    missing = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        name = f"tests/{path.name}"
        for why in sorted(literal_skip_reasons(path)):
            if MAY_LACK.search(why) and "AVX2" not in why \
                    and unexpected_skips({name: why}, file_rules):
                missing.append(f"{name} | {why}")
    return missing


def test_every_instruction_set_skip_is_listed():
    """CI machines differ (AVX2-only or AVX512-BF16 / AMX): a test that skips for an instruction
    set on one of them must be listed, or CI fails only there. Checked from the sources, so a
    run on either machine catches it."""
    assert unlisted_instruction_set_skips(load_expected_skips()) == []


def test_the_instruction_set_check_finds_an_unlisted_skip():
    """Without the rules for AVX512-BF16 the check names those skips (it has teeth)."""
    rules = [(p, r) for p, r in load_expected_skips() if "AVX512-BF16" not in r]
    missing = unlisted_instruction_set_skips(rules)
    assert "tests/test_attention_wide.py | the two routes need the kernels built for " \
        "AVX512-BF16" in missing
    assert "tests/test_cpu_kernels.py | needs AVX512-BF16" in missing


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


@pytest.mark.parametrize("worker,share", [("gw0", [0, 2]), ("gw1", [1, 3]), ("gw2", [0, 2]),
                                          ("gw5", [1, 3])])
def test_a_replacement_worker_gets_cores(worker, share, monkeypatch):
    """A worker xdist starts after one crashed (gw2, gw3, ... in a 2-worker run) takes a share
    of the cores as the first ones do, never an empty mask (which the kernel refuses: conftest
    failed to import in every replacement)."""
    import torch

    from tests import conftest

    def set_affinity(pid, mask):
        if not mask:
            raise OSError(22, "Invalid argument")
        pinned.append(sorted(mask))

    pinned, threads = [], []
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", set_affinity, raising=False)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    conftest._own_cores()
    assert pinned == [share] and threads == [2]
