"""``serve --data-parallel-size N`` (``tokenmill/router/replicas.py``) and models started on
demand (``tokenmill/router/models.py``).

Most tests run fake OpenAI servers (``benchmarks/peers/fake_openai.py``) as the children, so
supervision, restarts, core sets and the LRU of models are checked in seconds; the ``slow``
ones start the real default model: two replicas behind the router through the ``openai``
client, and two named models sharing one slot behind ``tokenmill router``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from tokenmill.router.config import RouterConfig
from tokenmill.router.models import (ModelLauncher, ModelSpec, ModelUnavailable,
                                     load_models_file, parse_models)
from tokenmill.router.replicas import (ChildProcess, ChildStartError, DataParallelConfig,
                                       ReplicaSet, run_data_parallel, split_cores,
                                       strip_parent_flags)

REPO = Path(__file__).resolve().parents[1]
FAKE = str(REPO / "benchmarks" / "peers" / "fake_openai.py")


def fake_command(model: str = "fake-model"):
    """``command(rank_or_spec, port)``: a fake OpenAI server on ``port``."""
    return lambda _, port: [sys.executable, FAKE, "--port", str(port), "--model", model]


def wait_for(cond, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


# ----- core sets and command lines --------------------------------------------------------------

def test_cores_are_split_into_disjoint_sets() -> None:
    assert split_cores([0, 1], 2) == [(0,), (1,)]
    assert split_cores([3, 1, 2, 0, 4], 2) == [(0, 1, 2), (3, 4)]
    assert split_cores([0, 1, 2, 3], 1) == [(0, 1, 2, 3)]
    sets = split_cores(range(16), 3)
    flat = [c for s in sets for c in s]
    assert sorted(flat) == list(range(16)) and len(set(flat)) == 16


def test_more_replicas_than_cores_needs_a_deliberate_choice() -> None:
    with pytest.raises(ValueError, match="needs at least 3 usable cores.*--num-threads"):
        split_cores([0, 1], 3)
    assert split_cores([0, 1], 3, may_share=True) == [(0, 1)] * 3
    assert split_cores([0, 1], 2, may_share=True) == [(0,), (1,)]  # shared only when it must
    with pytest.raises(ValueError, match=">= 1"):
        split_cores([0, 1], 0)


def test_the_parent_flags_are_stripped_in_every_spelling() -> None:
    argv = ["smollm2-135m-instruct", "--data-parallel-size", "2", "--port=9000", "--ho",
            "0.0.0.0", "--router-policy", "round_robin", "--dtype", "float32", "--api-key",
            "k", "--max-n", "4"]
    assert strip_parent_flags(argv) == ["smollm2-135m-instruct", "--dtype", "float32",
                                        "--api-key", "k", "--max-n", "4"]


def test_a_replica_gets_loopback_its_port_and_kv_events() -> None:
    cfg = DataParallelConfig(size=2, serve_argv=("m", "--port", "80", "--data-parallel-size",
                                                 "2", "--num-threads", "1"),
                             router=RouterConfig())
    argv = cfg.replica_argv(1, 8123)
    assert argv[1:4] == ("-m", "tokenmill.cli", "serve")
    assert argv[4:7] == ("m", "--num-threads", "1")
    assert argv[7:11] == ("--host", "127.0.0.1", "--port", "8123")
    assert argv[11] == "--kv-events-config" and '"data_parallel_rank": 1' in argv[12]
    assert '"endpoint": "tcp://127.0.0.1:0"' in argv[12]
    no_events = DataParallelConfig(size=2, serve_argv=("m",), router=RouterConfig(),
                                   kv_events=False)
    assert "--kv-events-config" not in no_events.replica_argv(0, 1)


def test_the_serve_flags_parse_and_reach_the_replica_set(monkeypatch) -> None:
    """``tokenmill serve --data-parallel-size 2`` builds the config the replicas run from:
    cache_aware by default, the key checked at the router and sent on to the workers."""
    from tokenmill import cli

    seen: dict = {}
    monkeypatch.setattr("tokenmill.router.replicas.run_data_parallel",
                        lambda cfg, serve: seen.setdefault("cfg", cfg) and 0)
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("LRU_CACHE_CAPACITY", "256"),
                        ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")):  # serve sets them
        monkeypatch.setenv(name, os.environ.get(name, value))
    assert cli.main(["serve", "--data-parallel-size", "2", "--port", "9001", "--api-key", "sk",
                     "--dtype", "float32"]) == 0
    cfg = seen["cfg"]
    assert cfg.size == 2 and cfg.router.policy == "cache_aware" and cfg.router.port == 9001
    assert cfg.router.api_keys == ("sk",) and cfg.router.worker_api_key == "sk"
    assert cfg.serve_argv == ("--data-parallel-size", "2", "--port", "9001", "--api-key", "sk",
                              "--dtype", "float32")
    assert not cfg.may_share_cores and cfg.gpus is None
    assert cli.main(["serve", "--data-parallel-size", "2", "--tensor-parallel-size", "2"]) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    seen.clear()
    assert cli.main(["serve", "--data-parallel-size", "2", "--device", "cuda"]) == 0
    assert seen["cfg"].gpus == ("2", "3")
    assert cli.main(["serve", "--data-parallel-size", "2", "--device", "cuda:1"]) == 2


# ----- child processes --------------------------------------------------------------------------

def test_a_child_runs_on_its_cores_and_its_output_is_kept() -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    child = ChildProcess("probe", (sys.executable, "-c",
                                   "import os; print(sorted(os.sched_getaffinity(0)))"),
                         cores=(cpu,), echo=False)
    child.start()
    child.proc.wait(60)
    wait_for(lambda: child.tail() != "", 10, "the output")
    assert child.exit_code() == 0 and child.tail() == f"[{cpu}]"
    child.stop()


def test_a_child_dies_with_its_parent() -> None:
    """SIGKILL the parent (no atexit, no clean-up): the kernel's parent-death signal ends the
    child all the same."""
    script = textwrap.dedent("""
        import sys, time
        from tokenmill.router.replicas import ChildProcess
        c = ChildProcess("sleeper", ("/bin/sleep", "600"), echo=False)
        c.start()
        print(c.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        wait_for(lambda: Path(f"/proc/{child_pid}/cmdline").read_bytes().startswith(b"/bin/sl"),
                 30, "the exec")
        parent.kill()
        parent.wait(10)
        wait_for(lambda: gone(child_pid), 30, "the orphan to die")
    finally:
        parent.kill()


# ----- the replica set, with fake replicas ------------------------------------------------------

def _fake_set(size: int = 2) -> ReplicaSet:
    cfg = DataParallelConfig(size=size, serve_argv=(), router=RouterConfig(), may_share_cores=True,
                             restart_backoff_s=(0.2, 1.0), start_timeout_s=60)
    return ReplicaSet(cfg, command=fake_command())


def test_replicas_start_and_one_that_dies_is_restarted_on_its_url() -> None:
    replicas = _fake_set()
    replicas.start()
    try:
        assert all(healthy(u) for u in replicas.urls)
        victim = replicas.children[0]
        old_pid = victim.pid
        os.kill(old_pid, signal.SIGKILL)
        wait_for(lambda: victim.pid not in (None, old_pid), 30, "the restart")
        wait_for(lambda: healthy(replicas.urls[0]), 60, "the restarted replica's health")
        assert healthy(replicas.urls[1])
    finally:
        pids = [c.pid for c in replicas.children]
        replicas.stop()
    assert all(gone(p) for p in pids)


def test_each_gpu_replica_sees_its_own_gpu() -> None:
    cfg = DataParallelConfig(size=2, serve_argv=(), router=RouterConfig(), gpus=("3", "5"))
    probe = [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"]
    replicas = ReplicaSet(cfg, cpus=[0, 1], command=lambda rank, port: probe)
    for child in replicas.children:
        child.echo = False
        child.start()
        child.proc.wait(60)
        child.stop()
    assert [c.tail() for c in replicas.children] == ["3", "5"]
    with pytest.raises(ValueError, match="a GPU per replica"):
        ReplicaSet(DataParallelConfig(size=2, serve_argv=(), router=RouterConfig(),
                                      gpus=("0",)), cpus=[0, 1])


def test_a_replica_that_dies_at_start_stops_the_rest_and_is_named() -> None:
    cfg = DataParallelConfig(size=2, serve_argv=(), router=RouterConfig(), may_share_cores=True)

    def command(rank: int, port: int) -> list[str]:
        if rank == 1:
            return [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
        return fake_command()(rank, port)

    replicas = ReplicaSet(cfg, command=command)
    with pytest.raises(ChildStartError, match=r"(?s)replica 1 exited with status 3.*no such model"):
        replicas.start()
    assert all(c.proc is None for c in replicas.children)


def test_run_data_parallel_serves_the_router_on_the_replicas_and_stops_them() -> None:
    cfg = DataParallelConfig(size=2, serve_argv=(), router=RouterConfig(port=9999),
                             may_share_cores=True)
    seen: dict = {}

    def serve(router_cfg: RouterConfig) -> None:
        seen["cfg"] = router_cfg
        seen["healthy"] = [healthy(u) for u in router_cfg.workers]

    assert run_data_parallel(cfg, serve=serve, command=fake_command()) == 0
    assert seen["healthy"] == [True, True] and seen["cfg"].port == 9999
    assert len(seen["cfg"].workers) == 2
    assert not any(healthy(u) for u in seen["cfg"].workers)  # stopped on the way out


# ----- the models file --------------------------------------------------------------------------

def test_a_models_file_parses(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  chat: {model: smollm2-135m-instruct, args: [--max-num-seqs, 8],"
                    " preload: true}\n  other:\n    model: /m/x.gguf\n")
    specs = load_models_file(str(path))
    assert specs["chat"] == ModelSpec("chat", "smollm2-135m-instruct",
                                      ("--max-num-seqs", "8"), True)
    assert specs["other"] == ModelSpec("other", "/m/x.gguf")


@pytest.mark.parametrize("data, error", [
    ([], "one top-level key, 'models'"),
    ({"models": {}}, "non-empty mapping"),
    ({"models": {"a": {"model": "m"}}, "extra": 1}, "one top-level key"),
    ({"models": {"a": "m"}}, r"models\.a: expected a mapping"),
    ({"models": {"a": {"args": []}}}, r"models\.a\.model: required"),
    ({"models": {"a": {"model": "m", "args": "--x"}}}, r"models\.a\.args: must be a list"),
    ({"models": {"a": {"model": "m", "args": ["--port", "1"]}}}, "set by the router"),
    ({"models": {"a": {"model": "m", "preload": "yes"}}}, r"models\.a\.preload"),
    ({"models": {"a": {"model": "m", "gpu": 1}}}, r"unknown key\(s\) gpu"),
])
def test_a_bad_models_file_says_what_is_wrong(data, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_models(data, "models.yaml")


def test_unreadable_or_invalid_yaml_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the models file"):
        load_models_file(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_models_file(str(bad))


def test_more_preloads_than_slots_is_refused() -> None:
    specs = parse_models({"models": {"a": {"model": "m", "preload": True},
                                     "b": {"model": "m", "preload": True}}})
    with pytest.raises(ValueError, match="more than max_running_models"):
        ModelLauncher(specs, max_running_models=1)


# ----- the launcher, with fake workers ----------------------------------------------------------

class FakeWorker:
    def __init__(self, url: str):
        self.url = url
        self.in_flight = 0


class FakePool:
    """What the launcher uses of the router's WorkerPool."""

    def __init__(self) -> None:
        self.workers: dict[str, FakeWorker] = {}
        self.log: list[tuple[str, str]] = []

    def add(self, url: str, models=()) -> FakeWorker:
        self.log.append(("add", next(iter(models))))
        return self.workers.setdefault(url, FakeWorker(url))

    def remove(self, url: str) -> None:
        self.log.append(("remove", url))
        self.workers.pop(url, None)


def _launcher(max_running: int = 1, **kw) -> tuple[ModelLauncher, list[str]]:
    starts: list[str] = []

    def command(spec: ModelSpec, port: int) -> list[str]:
        starts.append(spec.name)
        return fake_command(spec.name)(spec, port)

    specs = parse_models({"models": {"a": {"model": "m"}, "b": {"model": "m"}}})
    return ModelLauncher(specs, max_running, command=command, idle_grace_s=0.0, **kw), starts


def test_a_cold_model_starts_once_for_concurrent_requests_and_lru_makes_room() -> None:
    launcher, starts = _launcher()
    pool = FakePool()

    async def scenario() -> None:
        await asyncio.gather(*(launcher.ensure("a", pool) for _ in range(4)))
        assert starts == ["a"] and launcher.running() == ["a"]
        url_a = next(iter(pool.workers))
        assert (await _get(f"{url_a}/v1/models"))["data"][0]["id"] == "a"
        await launcher.ensure("b", pool)  # one slot: a goes, b comes
        assert starts == ["a", "b"] and launcher.running() == ["b"]
        assert pool.log[:3] == [("add", "a"), ("remove", url_a), ("add", "b")]
        cards = {c["id"]: c["status"] for c in launcher.cards()}
        assert cards == {"a": "stopped", "b": "running"}
        await launcher.shutdown()

    asyncio.run(scenario())


def test_a_busy_model_is_never_stopped_and_the_wait_ends_in_503() -> None:
    launcher, starts = _launcher(busy_timeout_s=1.0)
    pool = FakePool()

    async def scenario() -> None:
        await launcher.ensure("a", pool)
        worker = next(iter(pool.workers.values()))
        worker.in_flight = 1
        with pytest.raises(ModelUnavailable, match="stayed busy") as e:
            await launcher.ensure("b", pool)
        assert e.value.status == 503 and e.value.retry_after > 0
        assert launcher.running() == ["a"] and starts == ["a"]
        # it finishes while b waits: b gets the slot
        waiting = asyncio.create_task(_ensure_later(launcher, "b", pool))
        await asyncio.sleep(0.3)
        worker.in_flight = 0
        await waiting
        assert launcher.running() == ["b"]
        await launcher.shutdown()

    asyncio.run(scenario())


async def _ensure_later(launcher: ModelLauncher, model: str, pool: FakePool) -> None:
    launcher.busy_timeout_s = 30.0
    await launcher.ensure(model, pool)


def test_a_model_that_fails_to_start_is_a_503_with_its_output() -> None:
    specs = parse_models({"models": {"bad": {"model": "m"}}})
    launcher = ModelLauncher(specs, 1, command=lambda s, p: [
        sys.executable, "-c", "import sys; print('cannot load m'); sys.exit(4)"])

    async def scenario() -> None:
        with pytest.raises(ModelUnavailable, match=r"(?s)status 4.*cannot load m"):
            await launcher.ensure("bad", FakePool())
        assert launcher.running() == [] and launcher.cards()[0]["status"] == "stopped"
        with pytest.raises(KeyError):
            await launcher.ensure("nope", FakePool())

    asyncio.run(scenario())


async def _get(url: str) -> dict:
    async with httpx.AsyncClient() as client:
        return (await client.get(url, timeout=10)).json()


def test_the_router_starts_models_on_demand_behind_one_port() -> None:
    """Through the real router app: a request for a cold model starts it; cards list both."""
    launcher, starts = _launcher()
    from tokenmill.router.app import build_app

    with _Uvicorn(build_app(RouterConfig(policy="round_robin"), launcher)) as url:
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert {m["id"] for m in models} == {"a", "b"}
        for name in ("a", "b", "a"):
            r = httpx.post(f"{url}/v1/completions", timeout=120,
                           json={"model": name, "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name
        assert starts == ["a", "b", "a"] and launcher.running() == ["a"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "zzz", "prompt": "hi"},
                       timeout=10)
        assert r.status_code == 404


class _Uvicorn:
    """An app served by uvicorn on a free port in a thread (its lifespan runs there)."""

    def __init__(self, app) -> None:
        import uvicorn

        from tokenmill.router.replicas import free_port

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        wait_for(lambda: self.server.started, 60, "the router")
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)


# ----- the real default model (slow) ------------------------------------------------------------

MODEL = "smollm2-135m-instruct"
SMALL = ("--max-model-len", "2048", "--kv-cache-memory", "512blocks")
_REPLICA = __import__("re").compile(r"(replica \d)(?:: http://\S+,| restarted:) pid (\d+)")


def _replica_pids(log: Path) -> dict[str, int]:
    """The latest pid the parent logged for each replica."""
    return {name: int(pid) for name, pid in _REPLICA.findall(log.read_text(errors="replace"))}


def _wait_router(proc: subprocess.Popen, url: str, log: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the router did not come up ({proc.poll()}):\n"
                        f"{log.read_text(errors='replace')[-6000:]}")
        time.sleep(0.5)


def _ask(client, stream: bool = False) -> str:
    if stream:
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
            temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    return r.choices[0].text


@pytest.mark.slow
def test_two_replicas_of_the_default_model_behind_one_port(tmp_path: Path) -> None:
    """One command, one port, one core each; the openai client through the router; SIGTERM
    stops everything. (A killed replica's restart is the same supervisor with any child:
    test_replicas_start_and_one_that_dies_is_restarted_on_its_url; a real worker killed under
    load behind the router: test_router_server.py.)"""
    import openai

    from tokenmill.router.replicas import free_port

    port, log = free_port(), tmp_path / "dp.log"
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "serve", "--data-parallel-size", "2",
             "--num-threads", "1", *SMALL, "--port", str(port), "--api-key", "sk-dp",
             "--router-policy", "round_robin"], stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    pids: dict[str, int] = {}
    try:
        _wait_router(proc, url, log)
        pids = _replica_pids(log)
        assert set(pids) == {"replica 0", "replica 1"}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-dp", max_retries=0,
                               timeout=120)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
        assert chat.choices[0].message.content
        assert _ask(client) and _ask(client, stream=True) and _ask(client)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        workers = httpx.get(f"{url}/workers", headers={"Authorization": "Bearer sk-dp"}).json()
        assert [w["routed"] > 0 for w in workers["workers"]] == [True, True]
    finally:
        pids.update(_replica_pids(log))
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(90) == 0
        finally:
            proc.kill()
    wait_for(lambda: all(gone(p) for p in pids.values()), 60, "the replicas to stop")


@pytest.mark.slow
def test_two_named_models_share_one_slot(tmp_path: Path) -> None:
    """A models file with the default model under two names and max_running_models 1: the
    second name's first request stops the first model and starts the second."""
    from tokenmill.router.app import build_app

    path = tmp_path / "models.yaml"
    args = ", ".join(["--num-threads", "1", *SMALL])
    path.write_text(f"models:\n  first: {{model: {MODEL}, args: [{args}]}}\n"
                    f"  second: {{model: {MODEL}, args: [{args}]}}\n")
    cfg = RouterConfig(models_file=str(path), max_running_models=1, policy="round_robin")
    launcher = ModelLauncher.from_config(cfg)
    with _Uvicorn(build_app(cfg, launcher)) as url:
        cards = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert {c["id"] for c in cards} == {"first", "second"}
        assert _complete(url, "first") and launcher.running() == ["first"]
        first_pid = launcher._running["first"].child.pid
        assert _complete(url, "second") and launcher.running() == ["second"]
        assert gone(first_pid)
        cards = {c["id"] for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert cards == {"first", "second"}
    assert launcher.running() == []


def _complete(url: str, model: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=400,
                   json={"model": model, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]
