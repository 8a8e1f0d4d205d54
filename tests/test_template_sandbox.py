"""Request chat templates are parsed and rendered only in a bounded child process: the bounds as
seen from inside the child, and hostile templates sent to a real server, which answers each
with a 400 while /health keeps answering and its own memory stays put."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
import time

import httpx
import pytest

from tests import sandbox_probe
from tests.test_server_support import start_server, stop_server
from tokenmill.server.sandbox import Bounds, Sandbox, SandboxError, SandboxTimeout
from tokenmill.server.template_process import IsolatedRenderer
from tokenmill.tokenizer import ChatTemplateError

LINUX = sys.platform.startswith("linux")
BOUNDS = Bounds(timeout=10.0, memory_bytes=256 << 20, file_bytes=64 << 10)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """(what the child reported as held, what each attempt inside it did, the request)."""
    tmp = tmp_path_factory.mktemp("sandbox")
    (tmp / "secret.txt").write_text("the server's own file")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        request = {"op": "probe", "port": listener.getsockname()[1],
                   "outside": str(tmp / "written.txt"), "secret": str(tmp / "secret.txt"),
                   "too_large": 2 * BOUNDS.file_bytes, "allocate": 2 * BOUNDS.memory_bytes}
        box = Sandbox(sandbox_probe.probe, BOUNDS, 1 << 20)
        try:
            result = box.call(request)
            held = dict(box.held)
        finally:
            box.close()
    assert not (tmp / "written.txt").exists()
    assert not os.path.exists(result["cwd"]["ok"])  # its directory went with it
    return held, result, request


def test_child_runs_in_its_own_directory_with_only_its_pipe(probed):
    held, r, _ = probed
    assert held["fds"] and held["workdir"] and held["rlimits"]
    assert os.path.basename(r["cwd"]["ok"]).startswith("tokenmill-sandbox-")
    assert os.path.dirname(r["cwd"]["ok"]) == tempfile.gettempdir()
    fds = r["fds"]["ok"]
    assert len(fds) == 4 and fds[:3] == [0, 1, 2], fds  # stdio and the pipe to the server
    assert r["null_fds"]["ok"] == [True, True, True]
    assert r["write_inside"]["ok"] == 1000
    assert r["write_too_large"]["errno"] == 27  # EFBIG: RLIMIT_FSIZE (SIGXFSZ ignored)
    assert r["allocate"]["error"] == "MemoryError"
    assert r["lazy_import"]["ok"] == "email.mime.text"  # Python's own library stays readable


@pytest.mark.skipif(not LINUX, reason="Linux bounds")
def test_child_has_no_new_privileges_no_network_and_no_new_processes(probed):
    held, r, _ = probed
    assert held["no_new_privs"] and r["no_new_privs"]["ok"] == 1
    assert "error" in r["connect"], r["connect"]  # nothing reaches the server's listener
    assert "error" in r["fork"] and "error" in r["exec"]
    if held["seccomp"]:
        assert r["socket"]["errno"] == 13  # EACCES: no socket of any family
    if held["netns"]:
        assert r["net_namespace"]["ok"] != os.readlink("/proc/self/ns/net")
    if not (held["seccomp"] or held["netns"] or held["landlock"] >= 4):
        pytest.fail(f"no network bound held here: {held}")


@pytest.mark.skipif(not LINUX, reason="Landlock is Linux's")
def test_child_writes_and_reads_no_file_outside_its_directory(probed):
    held, r, _ = probed
    if not held["landlock"]:
        pytest.skip("this kernel has no Landlock: only RLIMIT_FSIZE bounds writes")
    assert r["write_outside"]["errno"] == 13, r["write_outside"]
    assert r["read_outside"]["errno"] == 13, r["read_outside"]


def test_a_call_that_overruns_is_killed_and_the_next_gets_a_new_child():
    box = Sandbox(sandbox_probe.probe, Bounds(timeout=1.0, memory_bytes=256 << 20), 1 << 10)
    try:
        first = box.call({"op": "pid"})
        start = time.monotonic()
        with pytest.raises(SandboxTimeout, match="within 1 s"):
            box.call({"op": "spin"})
        assert time.monotonic() - start < 8
        second = box.call({"op": "pid"})
        assert second != first
        with pytest.raises(SandboxError, match="ended"):  # more than the parent reads
            box.call({"op": "reply", "chars": 4096})
        assert box.call({"op": "pid"}) not in (first, second)
    finally:
        box.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the cleaner is a forked process")
def test_a_server_killed_outright_leaves_no_sandbox_directory(tmp_path):
    """A process holding a Sandbox is SIGKILLed (no clean-up of its own, as when a server is
    killed): the child's directory still goes, removed by the cleaner the child forked before
    its bounds (the child itself may not remove it)."""
    import signal
    import subprocess

    code = ("import json, sys\n"
            "from tests import sandbox_probe\n"
            "from tokenmill.server.sandbox import Bounds, Sandbox\n"
            "box = Sandbox(sandbox_probe.probe, Bounds(10.0, 256 << 20), 1 << 20)\n"
            "stopped = Sandbox(sandbox_probe.probe, Bounds(10.0, 256 << 20), 1 << 20)\n"
            "stopped.call({'op': 'pid'}); stopped.close()\n"
            "print(json.dumps(box.call({'op': 'probe', 'port': 1, 'outside': '/x',"
            " 'secret': '/x', 'too_large': 1, 'allocate': 1})['cwd']['ok']), flush=True)\n"
            "sys.stdin.read()\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        workdir = json.loads(holder.stdout.readline())
        assert os.path.isdir(workdir) and os.path.dirname(workdir) == str(tmp_path)
        assert len(os.listdir(tmp_path)) == 1  # the stopped one's is gone already
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    deadline = time.monotonic() + 10
    while os.path.exists(workdir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(workdir)


def test_isolated_renderer_scans_and_renders_in_the_child():
    renderer = IsolatedRenderer(timeout=10.0, max_chars=1000, memory_bytes=512 << 20)
    source = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}" \
             "{% if tools %}{{ tools | length }} tools{% endif %}"
    messages = [{"role": "user", "content": "hé \U0001F600"}]  # JSON-escaped both ways
    try:
        assert renderer.variables(source) == {"messages", "tools"}
        assert renderer.handles_tools(source) and not renderer.handles_tools("{{ messages }}")
        assert renderer.render(source, messages, add_generation_prompt=True, tools=[{}],
                               variables={}) == "user: hé \U0001F600\n1 tools"
        with pytest.raises(ChatTemplateError, match="out of memory"):
            renderer.render("{{ 'a'|center(1000000000) }}", messages,
                            add_generation_prompt=True, tools=None, variables={})
        with pytest.raises(ChatTemplateError, match="more than 1000 characters"):
            renderer.render("{{ '%20000s' % 'a' }}", messages, add_generation_prompt=True,
                            tools=None, variables={})
    finally:
        renderer.close()


def test_clients_templates_need_a_jinja2_without_known_escapes():
    from tokenmill.server.template_process import check_jinja2

    for version in ("3.1.6", "3.1.10", "3.2.0", "4.0.0.dev1"):
        check_jinja2(version)
    for version in ("3.1.5", "3.0.3", "2.11.3"):
        with pytest.raises(ChatTemplateError, match="CVE|escapes"):
            check_jinja2(version)


# ----- end to end: a server that trusts request templates ---------------------------------------

CHAT = [{"role": "user", "content": "Name three colors."}]
NESTED_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = [
    ("{{ 'a'|center(1000000000) }}", "out of memory"),  # folded by jinja's parser
    ("{{ 'a'|center(10**9) }}", "out of memory"),
    ("{{ '%20000000s' % 'a' }}", "more than"),
    ("{{ '%2000000000s' % 'a' }}", "out of memory"),
    (NESTED_LOOP, "did not finish within 2 s"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory, "--trust-request-chat-template",
                     "--chat-template-timeout", "2")
    yield s
    stop_server(s)


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (the peak) of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def chat(server, template: str) -> httpx.Response:
    body = {"messages": CHAT, "chat_template": template, "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


class HealthPoller(threading.Thread):
    """GETs /health every 20 ms with a 1 s timeout until stopped; records latencies and
    failures."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.latencies, self.failures = url, [], []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            start = time.monotonic()
            try:
                status = httpx.get(f"{self.url}/health", timeout=1.0).status_code
                if status != 200:
                    self.failures.append(status)
            except httpx.HTTPError as e:
                self.failures.append(type(e).__name__)
            self.latencies.append(time.monotonic() - start)
            time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="reads /proc/<pid>/status")
def test_hostile_request_templates_are_400s_while_the_server_stays_responsive(server):
    ok = chat(server, "{% for m in messages %}{{ m.content }}{% endfor %}")  # child up, warm
    assert ok.status_code == 200, ok.text
    before = memory_kib(server.proc.pid)
    poller = HealthPoller(server.url)
    poller.start()
    try:
        for template, words in HOSTILE:
            r = chat(server, template)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["param"] == "chat_template" and words in err["message"], err
    finally:
        poller.done.set()
        poller.join()
    after = memory_kib(server.proc.pid)
    assert not poller.failures and max(poller.latencies) < 1.0, \
        (poller.failures, max(poller.latencies))
    assert len(poller.latencies) > 20
    grown = {k: (after[k] - before[k]) / 1024 for k in before}  # MiB
    assert grown["VmRSS"] < 50 and grown["VmHWM"] < 50, grown
    assert chat(server, "{{ messages[0].content }}").status_code == 200
    print(json.dumps({"health_max_s": round(max(poller.latencies), 3), "grown_mib": grown}))


@pytest.mark.slow
def test_a_request_template_that_reads_tools_is_handed_them(server):
    """Whether a template reads ``tools`` decides how tools reach the prompt; for a request's
    template the child finds out, and the template then renders the tools itself."""
    template = "{% if tools %}{{ tools | length }} tool: {{ tools[0].function.name }}. " \
               "{% endif %}{{ messages[-1].content }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    got = httpx.post(f"{server.url}/tokenize", timeout=60,
                     json={"messages": CHAT, "tools": tools, "chat_template": template})
    want = httpx.post(f"{server.url}/tokenize", timeout=60, json={
        "prompt": "1 tool: get_weather. Name three colors.", "add_special_tokens": False})
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == want.json()["tokens"]
