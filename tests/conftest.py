"""Shared fixtures. Expensive references (transformers models) are loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_gguf_path():
    from tokenmill.model_source import resolve_model

    return resolve_model("smollm2-135m-instruct").path


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
