"""The request log (``serve --request-log DIR``), its replay and the crash / watchdog dumps.

The server tests run one real ``tokenmill serve`` whose steps slow down or fail where a test
asks (the hidden ``--test-faults`` flag, rules keyed by X-Request-Id): some traffic is logged,
``tokenmill bench replay`` sends it again to the same server (which logs the copies too), a
slow step trips the watchdog and a failing one kills the engine. The crash stays last.
The log's rotation and what it keeps of a body are checked on the writer alone.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server_support import MODEL, start_server, stop_server
from tokenmill.server.request_log import LOG_NAME, RequestLog

FAULTS = "forward:slow-:sleep=2.5;step:fatal-:raise"
MARK = "Zebraquokka"  # a word of every prompt: it must never reach the log
# (path, body) in the order they are sent; the third is refused (400)
TRAFFIC = [
    ("/v1/completions", {"prompt": f"{MARK} one", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": f"{MARK} be brief"},
                                           {"role": "user", "content": f"{MARK} hello there"}],
                              "max_tokens": 4, "stream": True}),
    ("/v1/completions", {"prompt": f"{MARK} refused", "max_tokens": -1}),
    ("/v1/completions", {"prompt": f"{MARK} " + "two words " * 6, "max_tokens": 5}),
    ("/v1/completions", {"prompt": [f"{MARK} a", f"{MARK} b c d"], "max_tokens": 2}),
]


def read_lines(log_dir: Path, at_least: int, timeout: float = 15.0) -> list[dict]:
    """The log's lines by arrival, once there are ``at_least``."""
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(log_dir.glob(f"{LOG_NAME}*"))
        lines = [json.loads(x) for f in files for x in f.read_text().splitlines()]
        if len(lines) >= at_least or time.monotonic() > deadline:
            return sorted(lines, key=lambda e: e["time"])
        time.sleep(0.1)


def wait_for_file(directory: Path, pattern: str, timeout: float = 15.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(directory.glob(pattern))
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no {pattern} in {directory}: {sorted(directory.iterdir())}")


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("request-log")


@pytest.fixture(scope="module")
def server(tmp_path_factory, log_dir):
    # in one process: the watchdog's dump reads the scheduler's queues beside the stalled step
    # (with the core in its own process the dump has no queues: dumps.scheduler_state)
    s = start_server(tmp_path_factory, "--request-log", str(log_dir), "--step-timeout", "1",
                     "--no-engine-process",
                     "--test-faults", FAULTS, timeout=300)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def original(server, log_dir) -> tuple[list[httpx.Response], list[dict]]:
    """The traffic, sent one request after another; its responses and log lines."""
    responses = []
    for path, body in TRAFFIC:
        responses.append(httpx.post(f"{server.url}{path}", json={"model": MODEL, **body},
                                    timeout=60))
        time.sleep(0.1)
    return responses, read_lines(log_dir, len(TRAFFIC))


def usage_of(response: httpx.Response) -> dict:
    if response.headers["content-type"].startswith("text/event-stream"):
        return {}  # the stream asked for no usage
    return response.json()["usage"]


@pytest.mark.slow
def test_each_request_is_a_line_without_its_text(original, log_dir):
    responses, lines = original
    assert [r.status_code for r in responses] == [200, 200, 400, 200, 200]
    assert [line["path"] for line in lines] == [path for path, _ in TRAFFIC]
    assert [line["status"] for line in lines] == [r.status_code for r in responses]
    assert MARK not in "".join(f.read_text() for f in log_dir.glob(f"{LOG_NAME}*"))
    for line, response in zip(lines, responses):
        if line["status"] != 200:
            assert line["outcome"] == "error" and line["requests"] == []
            continue
        assert line["outcome"] == "ok"
        assert "prompt" not in line["body"] and line["body"]["max_tokens"] > 0
        usage = usage_of(response)
        if usage:
            assert line["prompt_tokens"] == usage["prompt_tokens"]
            assert line["completion_tokens"] == usage["completion_tokens"]
        assert 0 < line["ttft"] <= line["duration"]
        for part in line["requests"]:
            assert 0 <= part["queue"] <= part["ttft"] <= part["e2e"]
            assert part["finish_reasons"] == ["length"]
    chat = lines[1]["body"]["messages"]
    assert [m["role"] for m in chat] == ["system", "user"]
    assert all(m["tokens"] > 0 and "content" not in m for m in chat)
    assert len(lines[4]["requests"]) == 2  # a batch of two prompts: one line, two parts


@pytest.mark.slow
def test_replay_reproduces_count_lengths_and_order(server, original, log_dir, tmp_path):
    from tokenmill.cli import main

    _, before = original
    result = tmp_path / "replay.json"
    assert main(["bench", "replay", str(log_dir), "--base-url", server.url,
                 "--result-file", str(result), "--no-progress"]) == 0
    summary = json.loads(result.read_text())
    assert (summary["replayed"], summary["skipped"], summary["completed"]) == (4, 1, 4)
    after = read_lines(log_dir, len(before) + 4)[len(before):]

    def shape(lines: list[dict]) -> list[tuple]:
        return [(x["path"], [r["prompt_tokens"] for r in x["requests"]],
                 [r["output_tokens"] for r in x["requests"]]) for x in lines
                if x["status"] == 200]

    assert shape(after) == shape(before)  # the same requests, lengths and order
    gaps = [b["time"] - a["time"] for a, b in zip(after, after[1:])]
    assert min(gaps) > 0.05  # sent apart, as they first arrived


@pytest.mark.slow
def test_a_stalled_step_writes_a_watchdog_dump(server, original, log_dir):
    slow = threading.Thread(target=httpx.post, args=(f"{server.url}/v1/completions",), kwargs=dict(
        json={"model": MODEL, "prompt": "slow", "max_tokens": 1},
        headers={"X-Request-Id": "slow-1"}, timeout=60))
    slow.start()
    dump = json.loads(wait_for_file(log_dir, "dump-*-watchdog.json").read_text())
    slow.join()
    assert dump["reason"] == "watchdog" and "--step-timeout" in dump["problem"]
    assert dump["engine"]["alive"] and dump["engine"]["step_seconds"] > 1
    assert [r["id"].startswith("cmpl-slow-1-") for r in dump["scheduler"]["running"]] == [True]
    assert [r["id"] for r in dump["in_flight"]] == ["cmpl-slow-1"]
    assert len(dump["recent"]) >= len(original[1])
    assert dump["info"]["plan"] and dump["info"]["max_model_len"] == 2048


@pytest.mark.slow
def test_a_dead_engine_writes_a_crash_dump(server, original, log_dir):
    """Stops the engine: stays last."""
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                   headers={"X-Request-Id": "fatal-1"}, timeout=60)
    assert r.status_code == 503
    dump = json.loads(wait_for_file(log_dir, "dump-*-crash.json").read_text())
    assert dump["reason"] == "crash" and "InjectedFault" in dump["engine"]["error"]
    assert not dump["engine"]["alive"]
    assert MARK not in json.dumps(dump["recent"])
    assert {x["path"] for x in dump["recent"]} >= {"/v1/completions", "/v1/chat/completions"}


# ----- the writer alone ---------------------------------------------------------------------

def entry(i: int) -> dict:
    return {"time": time.time(), "id": f"cmpl-{i}", "path": "/v1/completions", "status": 200}


def test_rotation_by_size(tmp_path):
    log = RequestLog(str(tmp_path), len, max_bytes=700, keep=2)
    for i in range(40):
        log.put(entry(i), json.dumps({"prompt": "x" * 50, "max_tokens": i}).encode())
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".requests.lock", LOG_NAME, f"{LOG_NAME}.1", f"{LOG_NAME}.2"]
    ids = []
    for name in (f"{LOG_NAME}.2", f"{LOG_NAME}.1", LOG_NAME):  # oldest first
        data = (tmp_path / name).read_text()
        assert 0 < len(data.encode()) <= 700
        ids += [json.loads(x)["id"] for x in data.splitlines()]
    assert ids == [f"cmpl-{i}" for i in range(40 - len(ids), 40)]  # the newest, in order
    assert len(log.recent()) == 40  # the dumps' ring keeps every line of its window


def test_servers_sharing_a_directory_write_files_of_their_own(tmp_path):
    first = RequestLog(str(tmp_path), len)
    second = RequestLog(str(tmp_path), len)  # as another process would find the lock taken
    assert first.path.name == LOG_NAME
    assert second.path.name == f"requests-{os.getpid()}.jsonl"
    first.close()
    second.close()


def test_prompts_only_with_the_flag(tmp_path):
    body = {"model": "m", "prompt": "secret words", "suffix": "tail", "max_tokens": 3,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}],
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    raw = json.dumps(body).encode()
    count_chars = len  # a "tokenizer" that counts characters
    plain = RequestLog(None, count_chars)
    assert plain.body_view(raw) == {
        "model": "m", "max_tokens": 3, "messages": [{"role": "user", "tokens": 2}],
        "suffix": {"tokens": 4}, "tools": {"count": 1}}
    whole = RequestLog(None, count_chars, prompts=True)
    assert whole.body_view(raw) == body
    assert plain.body_view(b"{not json") == {"unparsed_bytes": 9}
    plain.close()
    whole.close()
