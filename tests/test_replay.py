"""``tokenmill bench replay``'s planning, without a server: which logged requests go out again,
when, with which body, and prompts rebuilt from token counts to exactly those counts (the
replay against a real server is in tests/test_request_log.py)."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.replay import PromptBuilder, build_items, read_log


@pytest.fixture(scope="module")
def prompts() -> PromptBuilder:
    from tokenmill.tokenizer import load_tokenizer

    return PromptBuilder(load_tokenizer("smollm2-135m-instruct"), seed=3)


def line(time: float, path: str = "/v1/completions", status: int = 200, **body) -> dict:
    return {"time": time, "path": path, "status": status, "prompt_tokens": 7,
            "requests": [{"prompt_tokens": 7, "output_tokens": [5]}],
            "body": {"model": "m", "max_tokens": 16, **body}}


def test_prompts_of_the_logged_lengths(prompts):
    tok = prompts.tok
    for n in (1, 2, 17, 130):
        assert len(tok.encode(prompts.text(n), add_special_tokens=False)) == n
    messages = prompts.messages([{"role": "system", "tokens": 9}, {"role": "user", "tokens": 4}])
    assert [m["role"] for m in messages] == ["system", "user"]
    assert [len(tok.encode(m["content"], add_special_tokens=False)) for m in messages] == [9, 4]


def test_what_is_sent_and_when(prompts):
    entries = [line(100.0), line(100.5, status=400), line(101.0, path="/v1/embeddings"),
               line(102.0, "/v1/chat/completions", stream=True,
                    messages=[{"role": "user", "tokens": 3}], stop=["\n"]),
               line(103.0, prompt="kept as logged", tools={"count": 2}, tool_choice="auto")]
    items, skipped = build_items(entries, prompts, time_scale=0.5)
    assert skipped == 2  # a refused request and an endpoint the client does not speak
    assert [i.offset for i in items] == [0.0, 1.0, 1.5]
    assert [i.kind for i in items] == ["completions", "chat", "completions"]
    first, chat, verbatim = (i.body for i in items)
    assert len(prompts.tok.encode(first["prompt"], add_special_tokens=True)) == 7
    assert (first["max_tokens"], first["ignore_eos"], first["stream"]) == (5, True, True)
    assert first["stream_options"] == {"include_usage": True}
    assert "stop" not in chat and len(chat["messages"][0]["content"]) > 0
    assert verbatim["prompt"] == "kept as logged"
    assert "tools" not in verbatim and "tool_choice" not in verbatim
    kept, _ = build_items(entries[:1], prompts, keep_max_tokens=True, model="other")
    assert (kept[0].body["max_tokens"], kept[0].body["model"]) == (16, "other")
    assert "ignore_eos" not in kept[0].body


def test_read_log_takes_rotated_files_in_arrival_order(tmp_path):
    (tmp_path / "requests.jsonl.1").write_text(json.dumps(line(1.0)) + "\n" +
                                               json.dumps(line(3.0)) + "\n")
    (tmp_path / "requests.jsonl").write_text(json.dumps(line(2.0)) + "\n{cut sh")
    assert [e["time"] for e in read_log(tmp_path)] == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="no requests.jsonl"):
        read_log(tmp_path / "missing")
