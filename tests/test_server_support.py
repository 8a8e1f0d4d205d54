"""Starting the real ``tokenmill serve`` in a subprocess for the server tests (no tests here)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m-instruct"


_PORTS = random.SystemRandom()  # not the tests' seeded `random`: xdist workers differ


def _ephemeral_low() -> int:
    """The first port of the kernel's range for local ports of outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range where it can: outgoing connections
    (a rank's gloo mesh, an HTTP client polling /health) take their local ports from that
    range, so one could hold a port the kernel had handed out before the server, seconds later
    after loading its model, binds it (seen: a pipeline-parallel server's "address already in
    use"). From 20,000: Ray's workers take 10,002-19,999 (a Ray head's GCS port picked there
    was seen unreachable). 16 ports below the range are left for free_port_run's runs."""
    high = _ephemeral_low() - 16
    for _ in range(200 if high > 20000 else 0):
        port = _PORTS.randrange(20000, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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
