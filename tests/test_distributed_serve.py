"""``tokenmill serve`` over tensor / pipeline parallel ranks, through the official ``openai``
client: the default model at TP=3 and PP=2 against one process, two "nodes" on loopback, the
Ray backend on a local Ray cluster, and what a dead or hung rank does to a running request and
to the server. Every test starts servers (and their rank processes): all slow."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_distributed import write_tiny_llama
from tests.test_server_support import free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
# raw completion prompts, each under 16 tokens: bfloat16 linears of 16 rows and more may go
# through oneDNN from a row count each process times at load, which could differ between the
# one-process reference and a rank
HELD = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
        "The three primary colors are", "Water boils at", "My favourite book is",
        "To make a cup of tea,", "The largest planet in the solar system", "In 1969, humans",
        "A haiku about autumn:"]
TINY_PROMPTS = ["Once upon a time there was a", "tensor parallel ranks split heads",
                "0123456789 0123456789", "request number 4 says hello"]
MAX_TOKENS = 24
TINY_FLAGS = ("--dtype", "float32", "--kv-cache-memory", "256blocks")


# ----- processes --------------------------------------------------------------------------------

@dataclass
class Proc:
    """A ``tokenmill serve`` process (a server, or a headless node), its log, and the rank
    processes it reported, killed at the end whatever happened."""

    proc: subprocess.Popen
    log_path: Path
    url: str | None
    ranks: list[int] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def spawn(tmp_path: Path, model: str, *flags: str, http: bool = True,
          env: dict[str, str] | None = None) -> Proc:
    port = free_port() if http else None
    log_path = tmp_path / f"serve-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", model, *flags,
           *(["--port", str(port)] if http else [])]
    environ = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**environ, **(env or {})})
    return Proc(proc, log_path, f"http://127.0.0.1:{port}" if http else None)


def wait_healthy(p: Proc, timeout: float = 240.0) -> Proc:
    """Until /health answers 200; the rank processes' pids noted (for the clean-up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            pytest.fail(f"server exited with {p.proc.returncode}:\n{p.log()[-6000:]}")
        try:
            if httpx.get(f"{p.url}/health", timeout=1).status_code == 200:
                p.ranks = [r["pid"] for r in server_info(p)["parallel"]["ranks"].values()]
                return p
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail(f"server did not become healthy in {timeout:.0f} s:\n{p.log()[-6000:]}")


def server_info(p: Proc) -> dict:
    return httpx.get(f"{p.url}/server_info", timeout=10).json()


def is_rank(pid: int) -> bool:
    """Whether ``pid`` is still one of our rank processes (not a reused pid)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and (b"tokenmill.executor.rank" in cmd or b"_RankActor" in cmd)


def stop(p: Proc) -> None:
    """SIGTERM (a graceful stop, which stops the ranks), SIGKILL after 30 s; then any rank
    still there (a stopped one included) is killed."""
    if p.proc.poll() is None:
        p.ranks += rank_children(p.proc.pid)
        p.proc.terminate()
        try:
            p.proc.wait(30)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait(10)
    for pid in p.ranks:
        if is_rank(pid):  # SIGKILL ends a stopped process too
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextmanager
def serving(tmp_path: Path, model: str, *flags: str, env: dict[str, str] | None = None
            ) -> Iterator[Proc]:
    p = spawn(tmp_path, model, *flags, env=env)
    try:
        yield wait_healthy(p)
    finally:
        stop(p)


def client(p: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0)


def complete(p: Proc, prompts: list[str], one_by_one: bool = False) -> list[str]:
    """Greedy completions of ``prompts``: one request for all, or a request each."""
    c = client(p)
    model = c.models.list().data[0].id
    batches = [[x] for x in prompts] if one_by_one else [prompts]
    texts = []
    for batch in batches:
        r = c.completions.create(model=model, prompt=batch, max_tokens=MAX_TOKENS,
                                 temperature=0, extra_body={"ignore_eos": True})
        texts += [choice.text for choice in sorted(r.choices, key=lambda ch: ch.index)]
    return texts


def offline(llm, prompts: list[str], one_by_one: bool = False) -> list[str]:
    from tokenmill.params import SamplingParams

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    if one_by_one:
        return [llm.generate(x, greedy, use_tqdm=False)[0].outputs[0].text for x in prompts]
    return [r.outputs[0].text for r in llm.generate(prompts, greedy, use_tqdm=False)]


# ----- the default model -----------------------------------------------------------------------

def test_default_model_at_tp3_serves_one_process_greedy_output(tmp_path, fp32_llm):
    """float32: in bfloat16 the ranks' partial sums would round differently from one
    process's whole sums (a near tie can flip), in float32 only at 1e-6, below every gap."""
    with serving(tmp_path, MODEL, "--dtype", "float32", "--tensor-parallel-size", "3",
                 "--kv-cache-memory", "512blocks") as p:
        info = server_info(p)
        assert info["parallel"]["tensor_parallel_size"] == 3
        assert info["parallel"]["all_reduce"] == "shared memory"
        assert len(p.ranks) == 3 and all(is_rank(pid) for pid in p.ranks)
        texts = complete(p, HELD)
    assert texts == offline(fp32_llm, HELD)


def test_default_model_at_pp2_serves_bit_identical_greedy_output(tmp_path):
    """The default dtype: a stage runs its layers exactly as one process does (a request at a
    time: one micro-batch, the same GEMM shapes), so not one bit differs."""
    from tokenmill.engine.llm import LLM

    llm = LLM(MODEL, num_blocks=512, block_size=16)
    try:
        want = offline(llm, HELD, one_by_one=True)
        dtype = llm.engine.info.dtype
    finally:
        llm.engine.shutdown()
    with serving(tmp_path, MODEL, "--pipeline-parallel-size", "2",
                 "--kv-cache-memory", "512blocks") as p:
        info = server_info(p)
        assert info["dtype"] == dtype
        assert info["parallel"]["stage_layers"] == [15, 15]
        assert complete(p, HELD, one_by_one=True) == want


# ----- the tiny model: nodes, Ray, failures -----------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny"), 4))


@pytest.fixture(scope="module")
def tiny_want(tiny) -> list[str]:
    """One process's greedy completions of TINY_PROMPTS."""
    from tokenmill.engine.llm import LLM

    llm = LLM(tiny, dtype="float32", num_blocks=256)
    try:
        return offline(llm, TINY_PROMPTS)
    finally:
        llm.engine.shutdown()


def free_port_run(n: int) -> int:
    """A port with the ``n - 1`` after it free too (--master-port and the control plane's)."""
    for _ in range(50):
        base = free_port()
        if base + n < 65536 and all(_free(base + i) for i in range(1, n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def two_nodes(tmp_path: Path, model: str, node1_flags: tuple[str, ...] = ()
              ) -> tuple[Proc, Proc]:
    port = free_port_run(4)
    common = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--tensor-parallel-size", "2", *TINY_FLAGS)
    node0 = spawn(tmp_path, model, *common, "--node-rank", "0")
    node1 = spawn(tmp_path, model, *common, "--node-rank", "1", *node1_flags, http=False)
    return node0, node1


def rank_children(pid: int) -> list[int]:
    """The rank processes ``pid`` started."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid and is_rank(int(entry.name)):
                out.append(int(entry.name))
    return out


def test_two_nodes_on_loopback_serve_one_process_output(tmp_path, tiny, tiny_want):
    node0, node1 = two_nodes(tmp_path, tiny)
    try:
        wait_healthy(node0)
        assert node0.ranks == [*rank_children(node0.proc.pid), *rank_children(node1.proc.pid)]
        assert complete(node0, TINY_PROMPTS) == tiny_want
        stop(node0)  # the engine stops every node's ranks; the headless node then ends
        assert node1.proc.wait(20) == 0, node1.log()[-3000:]
    finally:
        stop(node0)
        stop(node1)


def test_nodes_started_with_other_settings_are_refused_naming_the_difference(tmp_path, tiny):
    node0, node1 = two_nodes(tmp_path, tiny, ("--max-model-len", "64"))
    try:
        assert node0.proc.wait(120) != 0, node0.log()[-3000:]
        assert node1.proc.wait(60) != 0, node1.log()[-3000:]
        log = node0.log()
        assert "SettingsMismatch" in log and "max_model_len: rank 0 has 128, rank 1 has 64" \
            in log, log[-3000:]
    finally:
        stop(node0)
        stop(node1)


@contextmanager
def ray_cluster(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A local Ray head (4 CPUs) for the test alone; the environment that reaches it. Token
    authentication off: the cluster lives on loopback for this test only."""
    ray = Path(sys.executable).with_name("ray")
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths are limited
    log = open(tmp_path / "ray.log", "w")
    head = subprocess.Popen([str(ray), "start", "--head", "--num-cpus", "4", "--port", str(port),
                             "--include-dashboard=false", "--temp-dir", temp, "--block"],
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        yield {"RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "disabled",
               "RAY_USAGE_STATS_ENABLED": "0"}
    finally:
        end_group(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def end_group(head: subprocess.Popen) -> None:
    """The Ray head's process group is the cluster (its actors' workers included). Ray's own
    SIGTERM drains for 30 s: after 5 s, SIGKILL; then until the last member is gone."""
    try:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        head.poll()  # reap the head (its children are init's to reap)
        time.sleep(0.2)


def test_ray_backend_serves_one_process_output(tmp_path, tiny, tiny_want):
    with ray_cluster(tmp_path) as env, serving(
            tmp_path, tiny, "--distributed-executor-backend", "ray",
            "--tensor-parallel-size", "2", *TINY_FLAGS, env=env) as p:
        info = server_info(p)["parallel"]
        assert info["kind"] == "2 ranks (Ray actors)"
        assert all(is_rank(pid) for pid in p.ranks)
        assert complete(p, TINY_PROMPTS) == tiny_want


def stream_until_broken(p: Proc, victim: int, sig: int) -> tuple[int, Exception | None, float]:
    """A long greedy stream; after its first event ``victim`` gets ``sig``. The events read,
    the error that ended the stream (None: it ended normally) and when, after the signal."""
    c = client(p)
    stream = c.completions.create(model=c.models.list().data[0].id, prompt=TINY_PROMPTS[0],
                                  max_tokens=90, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    events, sent = 0, None
    try:
        for _ in stream:
            events += 1
            if sent is None:
                os.kill(victim, sig)
                sent = time.monotonic()
    except Exception as e:  # noqa: BLE001 -- what the client raised is the result
        if sent is None:
            raise
        return events, e, time.monotonic() - sent
    if sent is None:
        pytest.fail("the stream sent no event")
    return events, None, time.monotonic() - sent


def assert_server_ends_broken(p: Proc, within: float) -> None:
    start = time.monotonic()
    try:
        code = p.proc.wait(within)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server still runs {within:.0f} s after its rank broke:\n"
                    f"{p.log()[-3000:]}")
    assert code != 0, p.log()[-3000:]
    deadline = start + 10
    while any(is_rank(pid) for pid in p.ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(is_rank(pid) for pid in p.ranks), "a rank outlived its server"


def test_a_killed_rank_fails_the_stream_and_ends_the_server(tmp_path, tiny, tiny_want):
    with serving(tmp_path, tiny, "--tensor-parallel-size", "2", *TINY_FLAGS) as p:
        assert sorted(p.ranks) == sorted(rank_children(p.proc.pid))
        assert complete(p, TINY_PROMPTS) == tiny_want
        ages = [line for line in httpx.get(f"{p.url}/metrics").text.splitlines()
                if line.startswith("tokenmill:worker_heartbeat_age_seconds{")]
        assert len(ages) == 2 and all(float(a.rsplit(" ", 1)[1]) < 5 for a in ages), ages
        events, error, after = stream_until_broken(p, p.ranks[1], signal.SIGKILL)
        assert isinstance(error, openai.APIError) and \
            not isinstance(error, openai.APIConnectionError), (events, error)
        assert "rank 1" in str(error) and events < 90, (events, error)
        assert_server_ends_broken(p, within=10 - after)


def test_a_hung_rank_fails_the_request_and_ends_the_server(tmp_path, tiny, tiny_want):
    """SIGSTOP: the rank lives but says nothing; after --worker-timeout (3 s) it counts as
    hung. On a pipeline: the last stage stops."""
    with serving(tmp_path, tiny, "--pipeline-parallel-size", "2", "--worker-timeout", "3",
                 *TINY_FLAGS) as p:
        assert complete(p, TINY_PROMPTS) == tiny_want
        events, error, after = stream_until_broken(p, p.ranks[1], signal.SIGSTOP)
        assert isinstance(error, openai.APIError) and \
            not isinstance(error, openai.APIConnectionError), (events, error)
        assert "rank 1" in str(error) and "heartbeat" in str(error), error
        assert 2.0 < after < 10, after  # the last beat came up to 0.5 s before the stop
        assert_server_ends_broken(p, within=10)
