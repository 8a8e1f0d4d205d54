"""Shared fixtures. Expensive references (transformers models) are loaded once per session."""

from __future__ import annotations

import fnmatch
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

# Without a GPU the Triton kernels' tests run under Triton's interpreter. Triton reads the
# variable when it is first imported, and libraries import it on their own (peft does), so it
# is set before any test module is collected, not by the Triton tests themselves.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _own_cores() -> None:
    """Under pytest-xdist (pyproject's addopts run ``-n``), each worker takes its share of this
    process's cores, and the servers and ranks its tests start inherit it: tokenmill sizes its
    threads by the affinity mask (platform.usable_cores), so two workers on two cores run one
    thread each instead of four threads spinning over two cores (measured: 31 CPU minutes for the
    suite's 24, unpinned)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(
        "PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    # xdist numbers a worker that replaces a crashed one on from gw<count>: it takes the share
    # its number gives modulo the count (maybe a live worker's; an empty mask would fail this
    # import in every replacement, and the run would end in a loop of dead workers)
    index, count = int(worker.removeprefix("gw")), int(count)
    index %= count
    if len(cores) >= count:
        mine = cores[index::count]
        os.sched_setaffinity(0, mine)
        import torch

        torch.set_num_threads(len(mine))  # its default counts the machine's cores


_own_cores()


@pytest.fixture(scope="session")
def default_gguf_path():
    from tokenmill.model_source import resolve_model

    return resolve_model("smollm2-135m-instruct").path


@contextmanager
def gguf_read_once():
    """Within it, gguf.GGUFReader parses each file once: transformers' GGUF loading builds a
    reader for the config, another for the weights and one per tokenizer, and the reader walks
    every string of the vocabulary through numpy (18 s a parse for Gemma 3's 262k tokens on a
    Zen 3 core; the readers are only read)."""
    import gguf

    readers, real = {}, gguf.GGUFReader

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        yield


@pytest.fixture(scope="session")
def hf_default_float32(default_gguf_path):
    """transformers' float32 load of the default GGUF and its tokenizer: the reference of the
    real-model tests (read once per session: about 13 s on 2 cores). Do not modify it; copy."""
    import torch

    transformers = pytest.importorskip("transformers")
    kw = dict(gguf_file=default_gguf_path.name)
    with gguf_read_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(default_gguf_path.parent), dtype=torch.float32, **kw).eval()
        tok = transformers.AutoTokenizer.from_pretrained(str(default_gguf_path.parent), **kw)
    return model, tok


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="device for model tests that support it (cpu or cuda)")


@pytest.fixture(scope="session")
def device(request) -> str:
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def fp32_llm():
    """The default model in float32: batching, chunking and draft verification change GEMM
    shapes, which must not change a single greedy token there (bfloat16 is tested within its
    precision in test_engine_real). Shared by the engine and speculative decoding tests."""
    from tokenmill import LLM

    return LLM("smollm2-135m-instruct", num_blocks=512, block_size=16, dtype="float32")


@pytest.fixture(scope="session")
def fp32_alone(fp32_llm):
    """Greedy output of each of test_engine_real's prompts, run by itself."""
    from tests.test_engine_real import GREEDY, PROMPTS

    return [fp32_llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0] for p in PROMPTS]


# Fixtures that load the real default model or start a server, by the names the tests give them:
# a test using one (directly or through another fixture) is `slow` without saying so; tests that
# load the model in other ways carry the mark themselves. `pytest -m "not slow"` is the fast loop.
SLOW_FIXTURES = frozenset({"fp32_llm", "fp32_alone", "llm", "int8_llm", "hf_gguf", "server"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _stable_global_seed(request):
    """Code that draws from the global generators (Python's, torch's) gets the same numbers in
    every run of a test, so a failure replays."""
    import random

    import torch

    from tests.seeding import stable_seed

    seed = stable_seed(request.node.nodeid)
    random.seed(seed)
    torch.manual_seed(seed)


# ----- CI strictness (set by .ci/run; a user's plain `pytest` is unaffected) -------------------
# TOKENMILL_REQUIRE_KERNELS=1: the run stops at once when the C++ CPU kernels do not load, instead
#   of skipping their tests and passing on the PyTorch reference paths.
# TOKENMILL_STRICT_SKIPS=1: the run fails when a test skips that tests/expected_skips.txt does not
#   list with its reason.

EXPECTED_SKIPS = Path(__file__).parent / "expected_skips.txt"


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def pytest_sessionstart(session):
    if not _flag("TOKENMILL_REQUIRE_KERNELS"):
        return
    from tokenmill.kernels import cpu

    if cpu.load() is None:
        pytest.exit("TOKENMILL_REQUIRE_KERNELS is set and the C++ CPU kernels did not load "
                    "(the reason is logged above)", returncode=pytest.ExitCode.USAGE_ERROR)


def load_expected_skips(path: Path = EXPECTED_SKIPS) -> list[tuple[str, str]]:
    """``(node id pattern, reason substring)`` per line ``pattern | reason``; # comments."""
    rules = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pattern, _, reason = (part.strip() for part in line.partition("|"))
            rules.append((pattern, reason))
    return rules


def unexpected_skips(skips: dict[str, str], rules: list[tuple[str, str]]) -> dict[str, str]:
    """The skips (node id -> reason) no rule allows."""
    return {node: why for node, why in skips.items()
            if not any(fnmatch.fnmatchcase(node, pattern) and reason in why
                       for pattern, reason in rules)}


_skipped: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        _skipped[report.nodeid] = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.skipped:
        _skipped[report.nodeid] = str(report.longrepr)


def pytest_collectreport(report):
    if report.skipped:  # a whole module skipped (importorskip)
        _skipped[report.nodeid] = str(report.longrepr[2] if isinstance(report.longrepr, tuple)
                                      else report.longrepr).removeprefix("Skipped: ")


def pytest_sessionfinish(session, exitstatus):
    if not _flag("TOKENMILL_STRICT_SKIPS") or not _skipped:
        return
    unexpected = unexpected_skips(_skipped, load_expected_skips())
    if not unexpected:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reporter.write_sep("=", f"{len(unexpected)} unexpected skips (not in "
                            f"tests/expected_skips.txt)", red=True)
    for node, why in sorted(unexpected.items()):
        reporter.write_line(f"{node}: {why}")
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
