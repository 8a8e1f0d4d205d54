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
