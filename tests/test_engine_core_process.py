"""``tokenmill serve --engine-process``: the engine core in a process of its own
(``engine/core_proc.py``), the server talking to it over ZMQ (``engine/core_client.py``).

The real server with the official client: greedy text as the in-process engine gives it,
streams with n > 1, stop strings and logprobs rebuilt from the core's deltas, concurrent
requests, a 400 still answered by the frontend, a closed stream freeing its request in the
core; and how the processes end: SIGTERM drains the server and stops the core (exit 0), the
core killed fails in-flight requests with an error and ``/health`` (the server exits
non-zero), and a core whose server was killed outright stops on its own (no orphan).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import openai
import pytest

from tests.test_server_support import MODEL, start_server, stop_server, wait_idle

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def core_pids(server_pid: int) -> list[int]:
    """The engine core: the server's spawned child (not multiprocessing's resource tracker)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory, "--engine-process", "--max-num-seqs", "8")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_greedy_completion_is_the_in_process_engines(server, client):
    from tokenmill import LLM, SamplingParams

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  logprobs=2)
    choice = r.choices[0]
    llm = LLM(MODEL, max_model_len=2048)
    want = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0),
                        use_tqdm=False)[0].outputs[0]
    assert choice.text == want.text and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 5
    assert len(choice.logprobs.tokens) == 12
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    # a stop string ends the request in the core; the text is cut before it
    cut = want.text.index(".") if "." in want.text else None
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                        temperature=0, stop=["."]).choices[0]
    if cut is not None:
        assert stopped.text == want.text[:cut] and stopped.finish_reason == "stop"


def test_chat_stream_with_two_choices(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        temperature=0.8, seed=7, n=2, stream=True)
    text, finish = {0: "", 1: ""}, {}
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish) == {0, 1} and all(text.values())


def test_concurrent_requests_all_complete(client):
    def one(i: int) -> int:
        r = client.completions.create(model=MODEL, prompt=f"{i} + {i} =", max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(6))) == [6] * 6


def test_bad_request_is_refused_by_the_frontend(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5000)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[], max_tokens=4)


def test_closing_a_stream_frees_the_request_in_the_core(server, client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    m = wait_idle(server.url)
    assert m[("tokenmill:num_requests_running", ())] == 0
    assert m[("tokenmill:kv_cache_usage_perc", ())] == 0


def test_the_frontend_serves_without_torch(server, client):
    """The server's own process (HTTP, tokenizing, templates, grammars, output rebuilding)
    never loads torch: a JSON-schema chat, a forced tool call, a stream with logprobs and the
    admin routes leave no libtorch in its memory map (303 -> 121 MiB RSS on a Zen 3)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A number as JSON."}], max_tokens=16,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert r.choices[0].message.content.startswith("{")
    tool = {"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=32,
        tools=[tool], tool_choice={"type": "function", "function": {"name": "get"}})
    assert r.choices[0].message.tool_calls[0].function.name == "get"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                            logprobs=1, stream=True))
    assert chunks and all(c.choices[0].logprobs for c in chunks if c.choices[0].text)
    info = httpx.get(f"{server.url}/server_info", timeout=30).json()
    assert info["threads"] == info["plan"]["threads"]["count"] >= 1  # the core's threads
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200
    with open(f"/proc/{server.proc.pid}/maps") as f:
        mapped = f.read()
    assert "libtorch" not in mapped and "tokenmill_cpu_ops" not in mapped
    assert any(core_pids(server.proc.pid))  # the core is a child with torch of its own
    with open(f"/proc/{core_pids(server.proc.pid)[0]}/maps") as f:
        assert "libtorch" in f.read()


def test_sigterm_drains_then_stops_the_core(server, client):
    """Last on this server: a running request finishes, the server exits 0, the core with it."""
    [core] = core_pids(server.proc.pid)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.completions.create, model=MODEL, prompt=PROMPT,
                              max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        assert running.result().usage.completion_tokens == 16
    assert server.proc.wait(30) == 0
    assert wait_gone(core, 5), "the engine core outlived its server"


def test_a_server_killed_outright_leaves_no_core_and_no_sockets(tmp_path_factory, tmp_path,
                                                                monkeypatch):
    """SIGKILL the server (no clean-up of its own): the core sees its parent gone, stops, and
    removes the directory of the sockets the server made."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the server makes its socket directory
    s = start_server(tmp_path_factory, "--engine-process")
    try:
        [core] = core_pids(s.proc.pid)
        [sockets] = tmp_path.glob("tokenmill-core-*")
        assert {p.name for p in sockets.iterdir()} == {"commands", "outputs"}
        s.proc.kill()
        assert s.proc.wait(10) == -signal.SIGKILL
        assert wait_gone(core, 15), "the engine core outlived its server"
        assert not sockets.exists()
    finally:
        stop_server(s)


def test_killing_the_core_fails_requests_and_health(tmp_path_factory):
    """The core dies: in-flight requests end with an error, /health answers 503 and the server
    exits non-zero for its supervisor to restart it, as when a worker dies."""
    s = start_server(tmp_path_factory, "--engine-process")
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        [core] = core_pids(s.proc.pid)
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError):
            for i, _ in enumerate(stream):
                if i == 2:
                    os.kill(core, signal.SIGKILL)
        try:
            r = httpx.get(f"{s.url}/health", timeout=5)
            assert r.status_code == 503 and "engine core process exited" in r.text
        except httpx.HTTPError:  # already gone: the watchdog ended the server
            pass
        assert s.proc.wait(30) == 1
    finally:
        stop_server(s)


def test_a_core_whose_server_is_gone_stops():
    """No orphan: a core whose parent died (the server killed outright) stops on its own."""
    import zmq

    from tokenmill.engine.core_proc import CoreLoop

    class Idle:
        def has_pending_work(self) -> bool:
            return False

    ctx = zmq.Context()
    commands, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        loop = CoreLoop(Idle(), commands, outputs, parent_pid=os.getppid() + 1)
        started = time.monotonic()
        loop.run()  # returns: its "parent" is not its parent
        assert time.monotonic() - started < 2
    finally:
        commands.close(linger=0)
        outputs.close(linger=0)
        ctx.term()


def test_the_engine_process_default_follows_device_ranks_and_task():
    """Unasked, the core gets its own process for one worker generating text, on a GPU or a
    CPU, never behind parallel ranks, with a prefill/decode role or for a pooling task; asked,
    as asked. The task comes from the model's metadata without loading it."""
    import argparse

    from tokenmill.engine.core_client import engine_process_choice

    args = argparse.Namespace(engine_process=None, model="smollm2-135m-instruct")
    one = (True, "one worker generating text: HTTP apart from the step loop")
    assert engine_process_choice(args, {"device": "cuda"}) == one
    assert engine_process_choice(args, {}) == one  # the default device: the CPU
    assert not engine_process_choice(args, {"device": "cuda", "tensor_parallel_size": 2})[0]
    assert not engine_process_choice(args, {"pipeline_parallel_size": 2})[0]
    assert not engine_process_choice(args, {"kv_role": "producer"})[0]
    off, why = engine_process_choice(args, {"device": "cuda", "task": "embed"})
    assert not off and "embed" in why
    args.engine_process = True
    assert engine_process_choice(args, {}) == (True, "asked for")
    args.engine_process = False
    assert engine_process_choice(args, {"device": "cuda"}) == (False, "asked for")


def test_serve_starts_the_core_before_it_imports_torch_or_the_server():
    """``serve`` spawns the core first and imports the HTTP server (torch among its imports)
    while the core starts: reading the model's metadata to choose the process, the flags and
    the parser import neither."""
    code = """
import sys
import tokenmill.cli as cli
import tokenmill.engine.core_client as core_client

class Launched(Exception):
    pass

def launch_core(args, options, served_model_name):
    raise Launched(sorted(m for m in ("torch", "fastapi", "tokenmill.server.app")
                          if m in sys.modules))

core_client.launch_core = launch_core
try:
    cli.main(["serve", "%s", "--port", "0"])
except Launched as e:
    print("imported before the launch:", e.args[0])
""" % MODEL
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "imported before the launch: []" in done.stdout, done.stdout + done.stderr


def test_an_abandoned_launch_leaves_no_process_and_no_socket_dir(tmp_path):
    """The server failing to start after the core was spawned (a bad flag found late, Ctrl-C
    while it imports) kills the core at once, mid-import, and removes its sockets."""
    import argparse

    from tokenmill.engine.core_client import launch_core

    args = argparse.Namespace(model=MODEL, lora_modules=[], test_faults=None,
                              log_level="warning")
    launch = launch_core(args, {}, MODEL)
    workdir, process = launch.channel.workdir, launch.channel.process
    assert os.path.isdir(workdir) and process.is_alive()
    started = time.monotonic()
    launch.abandon()
    assert time.monotonic() - started < 5  # not the 10 s a STOP would wait for
    assert not process.is_alive() and not os.path.exists(workdir)
