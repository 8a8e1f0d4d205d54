"""Reasoning parsers (server/reasoning.py) on synthetic outputs, whole and streamed in every
chunking, and the chat formatter's reasoning fields and deltas."""

from __future__ import annotations

import itertools

import pytest

from tokenmill.request import CompletionOutput, FinishReason, RequestOutput
from tokenmill.server.formatters import ChatFormatter
from tokenmill.server.reasoning import (REASONING_PARSERS, Mode, StartMode,
                                        get_reasoning_parser)
from tokenmill.server.tools.parsers import get_tool_parser

OPEN = StartMode(Mode.UNDECIDED, default_reasoning=True)  # the prompt opened <think>
CLOSED = StartMode(Mode.CONTENT)  # the prompt held an empty pair (thinking off)

# (parser, start (None: the family's own), output, reasoning, content)
CASES = [
    ("qwen3", None, "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    ("qwen3", None, "Paris.", None, "Paris."),
    ("qwen3", None, "  <think>a</think>b", "a", "b"),
    ("qwen3", None, "<think>cut off mid", "cut off mid", None),
    ("qwen3", None, "<think></think>", None, None),
    ("qwen3", None, "<thi", None, "<thi"),
    ("qwen3", None, "x <think>y</think>", None, "x <think>y</think>"),
    ("qwen3", OPEN, "so 2+2=4\n</think>\n\n4", "so 2+2=4", "4"),
    ("qwen3", OPEN, "<think>\nagain</think>ok", "again", "ok"),
    ("qwen3", CLOSED, "<think>x</think> y", None, "<think>x</think> y"),
    ("deepseek_r1", None, "no tag</think>\n\nanswer", "no tag", "answer"),
    ("deepseek_r1", None, "<think>t</think>a</think>", "t", "a</think>"),
    ("deepseek_r1", None, "all thinking, cut off </thi", "all thinking, cut off </thi", None),
    ("deepseek_r1", CLOSED, "answer only", None, "answer only"),
    ("deepseek_r1", None, "", None, None),
]


def chunkings(text: str, cuts: int = 2):
    """Every way to cut ``text`` into at most ``cuts + 1`` pieces, and one piece per
    character."""
    yield [text]
    for k in range(1, cuts + 1):
        for points in itertools.combinations(range(1, len(text)), k):
            bounds = (0, *points, len(text))
            yield [text[a:b] for a, b in zip(bounds, bounds[1:])]
    yield list(text)


def streamed(name: str, start: StartMode | None, pieces: list[str]):
    streamer = get_reasoning_parser(name).streamer(start)
    out = [p for piece in pieces for p in streamer.feed(piece)] + streamer.finish()
    reasoning = "".join(t for kind, t in out if kind == "reasoning")
    content = "".join(t for kind, t in out if kind == "content")
    if not streamer.reasoned:
        return None, content
    return reasoning or None, content or None


@pytest.mark.parametrize("name, start, text, reasoning, content", CASES)
def test_split_and_every_chunking(name, start, text, reasoning, content):
    parser = get_reasoning_parser(name)
    expected = (reasoning, content)
    if content is None and reasoning is None and not text:
        expected = (None, None) if parser.implicit_start else (None, "")
    assert parser.split(text, start) == expected
    for pieces in chunkings(text):
        assert streamed(name, start, pieces) == expected, pieces


def test_start_mode_reads_the_prompt():
    for name in REASONING_PARSERS:
        parser = get_reasoning_parser(name)
        assert parser.start_mode("<|im_start|>assistant\n<think>\n") == OPEN
        assert parser.start_mode("assistant\n<think>\n\n</think>\n\n") == CLOSED
        assert parser.start_mode("<think>old</think> user turn\nassistant\n") == \
            StartMode(Mode.UNDECIDED, parser.implicit_start)


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("nope")


# ----- the chat formatter ------------------------------------------------------------------------

def _output(text: str, finish: FinishReason | None = FinishReason.STOP) -> RequestOutput:
    c = CompletionOutput(index=0, text=text, token_ids=list(range(len(text))),
                         finish_reason=finish)
    return RequestOutput("r", [1, 2], [c], finished=finish is not None)


def _formatter(reasoning="qwen3", tools=False, include=True, start=None) -> ChatFormatter:
    from tokenmill.server.reasoning import ReasoningSetup

    parser = get_reasoning_parser(reasoning)
    setup = ReasoningSetup(parser, start or parser.start_mode(), include)
    ids = iter(f"call_{i}" for i in range(100))
    return ChatFormatter("id", "m", str, None, 1, None,
                         get_tool_parser("hermes", lambda: next(ids)) if tools else None,
                         None, setup)


async def _chunks(fmt: ChatFormatter, text: str, pieces: list[str]) -> list[dict]:
    async def outputs():
        for end in itertools.accumulate(map(len, pieces)):
            done = end == len(text)
            yield 0, _output(text[:end], FinishReason.STOP if done else None)
    return [chunk async for chunk in fmt.events(outputs())]


def _assembled(chunks: list[dict]) -> dict:
    """A streamed choice put together as a client library does."""
    message = {"reasoning": "", "reasoning_content": "", "content": "", "calls": {}}
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            for key in ("reasoning", "reasoning_content", "content"):
                message[key] += delta.get(key) or ""
            for call in delta.get("tool_calls", []):
                entry = message["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name", "")
                entry["arguments"] += call.get("function", {}).get("arguments", "")
            finish = choice["finish_reason"] or finish
    return {**message, "finish": finish}


THOUGHT_AND_CALL = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_chat_message_has_reasoning_under_both_names():
    body = _formatter().response([_output("<think>\nhmm\n</think>\n\nHello!")])
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "reasoning": "hmm", "reasoning_content": "hmm",
                       "content": "Hello!"}
    hidden = _formatter(include=False).response([_output("<think>hmm</think>Hi")])
    assert hidden["choices"][0]["message"]["reasoning"] is None
    assert hidden["choices"][0]["message"]["content"] == "Hi"


def test_tool_calls_after_reasoning_whole_and_streamed():
    body = _formatter(tools=True).response([_output(THOUGHT_AND_CALL)])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] == "The user wants weather."
    assert choice["message"]["content"] == "Let me check."
    call = choice["message"]["tool_calls"][0]["function"]
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Paris"}')
    text = THOUGHT_AND_CALL
    for cut in range(1, len(text)):
        for pieces in ([text[:cut], text[cut:]], ):
            got = _assembled(_run(_chunks(_formatter(tools=True), text, pieces)))
            assert got["reasoning"] == got["reasoning_content"] == "The user wants weather."
            assert got["content"] == "Let me check."
            assert got["calls"] == {0: {"name": "get_weather",
                                        "arguments": '{"city": "Paris"}'}}
            assert got["finish"] == "tool_calls"


def test_streamed_reasoning_comes_as_its_own_deltas():
    text = "<think>\nstep one, step two\n</think>\n\nDone."
    chunks = _run(_chunks(_formatter(), text, list(text)))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert all(not ("reasoning" in d and "content" in d and d["content"]) for d in deltas)
    first_content = next(i for i, d in enumerate(deltas[1:], 1) if d.get("content"))
    assert all("reasoning" not in d for d in deltas[first_content:])
    got = _assembled(chunks)
    assert (got["reasoning"], got["content"], got["finish"]) == \
        ("step one, step two", "Done.", "stop")
    hidden = _assembled(_run(_chunks(_formatter(include=False), text, list(text))))
    assert (hidden["reasoning"], hidden["content"]) == ("", "Done.")


def _run(coro):
    import asyncio

    return asyncio.run(coro)


# ----- the responses formatter -------------------------------------------------------------------

def _responses(text_pieces: list[str], stream: bool) -> dict | list[dict]:
    from tokenmill.server.reasoning import ReasoningSetup
    from tokenmill.server.responses_format import ResponseHead, ResponsesFormatter
    from tokenmill.server.responses_request import ResponsesRequest

    parser = get_reasoning_parser("qwen3")
    head = ResponseHead("resp_1", "m", ResponsesRequest(input="hi"), [], {}, [])
    fmt = ResponsesFormatter(head, str, None, None, None, lambda *_: None,
                             ReasoningSetup(parser, parser.start_mode()))
    text = "".join(text_pieces)
    if not stream:
        return fmt.response([_output(text)])
    return _run(_chunks(fmt, text, text_pieces))


def test_responses_reasoning_item_then_message():
    text = "<think>\nweighing it\n</think>\n\nYes."
    body = _responses([text], stream=False)
    thought, message = body["output"]
    assert thought["type"] == "reasoning" and thought["status"] == "completed"
    assert thought["content"] == [{"type": "reasoning_text", "text": "weighing it"}]
    assert message["content"][0]["text"] == "Yes."
    events = _responses(list(text), stream=True)
    kinds = [e["type"] for e in events]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == "weighing it"
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    def without_ids(items):
        return [{k: v for k, v in item.items() if k != "id"} for item in items]

    assert without_ids(events[-1]["response"]["output"]) == without_ids(body["output"])
    only_thought = _responses(["<think>cut off"], stream=False)["output"]
    assert [i["type"] for i in only_thought] == ["reasoning", "message"]  # an empty answer


# ----- thinking_token_budget in the sampler ------------------------------------------------------

def _budget(tokens: int, starts_open: bool):
    from types import SimpleNamespace

    # params.ThinkingBudget's fields (a namespace: the processor reads only these)
    return SimpleNamespace(tokens=tokens, start_ids=(7,), end_ids=(8, 9),
                           starts_open=starts_open)


@pytest.mark.parametrize("output, tokens, starts_open, forced", [
    ([1, 2], 3, True, None),  # still within the budget
    ([1, 2, 3], 3, True, 8),  # spent: the tag's first token
    ([1, 2, 3, 8], 3, True, 9),  # then the rest of it
    ([1, 2, 3, 8, 9], 3, True, None),  # closed
    ([8, 9, 1, 2, 3, 4], 3, True, None),  # closed by itself early
    ([], 0, True, 8),  # no thinking at all
    ([1, 2, 3], 2, False, None),  # thinking never opened
    ([7, 1, 2], 2, False, 8),
    ([7, 1, 8], 2, False, 9),  # the model began the tag itself
    ([7, 8, 9, 1, 2, 3], 2, False, None),
])
def test_forced_close_token(output, tokens, starts_open, forced):
    from tokenmill.runner.logits_processors import forced_close_token

    assert forced_close_token(output, _budget(tokens, starts_open)) == forced


def test_budget_processor_forces_only_its_rows():
    import dataclasses

    import torch

    from tokenmill.params import SamplingParams
    from tokenmill.runner.logits_processors import ThinkingBudgetCap, process_logits
    from tokenmill.runner.rows import SamplingRow

    plain = SamplingParams(temperature=0)
    capped = SamplingParams(temperature=0.7)
    if "thinking_budget" in {f.name for f in dataclasses.fields(SamplingParams)}:
        capped = dataclasses.replace(capped, thinking_budget=_budget(1, True))
    else:  # until params.py has the field (the processor reads it by name)
        object.__setattr__(capped, "thinking_budget", _budget(1, True))
    rows = [SamplingRow("a", plain, [1], [5], frozenset()),
            SamplingRow("b", capped, [1], [5], frozenset()),
            SamplingRow("c", capped, [1], [], frozenset())]
    logits = torch.randn(3, 16)
    out = process_logits(logits, rows, [ThinkingBudgetCap()])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1].argmax() == 8 and torch.isinf(out[1]).sum() == 15
