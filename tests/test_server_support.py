"""Starting the real ``tokenmill serve`` in a subprocess for the server tests (no tests here)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def start_server(tmp_path_factory, *extra: str, timeout: float = 120.0,
                 model: str = MODEL) -> Server:
    """``tokenmill serve model`` on a free port; flags in ``extra`` come after (and override)
    the defaults here."""
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("server") / "server.log")
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", model, "--port", str(port),
           "--kv-cache-memory", "512blocks", "--max-model-len", "2048", *extra]
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail(f"server did not become healthy in {timeout}s:\n{server.log()}")


def server_fixtures(*flags: str):
    """Module-scoped ``server`` (``tokenmill serve`` with ``flags``) and ``client`` (the
    official OpenAI client on it) fixtures: ``server, client = server_fixtures(...)``."""
    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        s = start_server(tmp_path_factory, *flags)
        yield s
        stop_server(s)

    @pytest.fixture(scope="module")
    def client(server):
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    return server, client


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(10)


def metrics(url: str, headers: dict | None = None) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels without model_name): value}``."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def wait_idle(url: str, timeout: float = 15.0) -> dict:
    """Poll /metrics until nothing runs, waits or holds KV blocks; returns the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (m[("tokenmill:num_requests_running", ())] == 0
                and m[("tokenmill:num_requests_waiting", ())] == 0
                and m[("tokenmill:kv_cache_usage_perc", ())] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)
