"""Tool-call parsing (whole and streamed) and tool prompts; pure Python, no model."""

from __future__ import annotations

import copy
import itertools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.server.tools.parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    ParsedMessage,
    ToolCall,
    get_tool_parser,
    new_call_id,
)
from tokenmill.server.tools.prompt import (
    prepare_tool_messages,
    template_handles_tools,
)
from tokenmill.tokenizer.chat_template import render_chat

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOL_TEMPLATE = (
    "{% if tools %}{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def counting_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter):024x}"


def hermes() -> HermesToolParser:
    return HermesToolParser(id_factory=counting_ids())


def call_text(name: str, arguments: object, key: str = "arguments") -> str:
    return f'<tool_call>\n{json.dumps({"name": name, key: arguments})}\n</tool_call>'


# ---- parse ---------------------------------------------------------------------------------

def test_new_call_id_shape():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    for call_id in ids:
        assert call_id.startswith("call_") and len(call_id) == 29
        int(call_id[5:], 16)


def test_parse_without_calls_is_all_content():
    assert hermes().parse("  Hello there.\n") == ParsedMessage("Hello there.", [])
    assert hermes().parse(" \n ") == ParsedMessage(None, [])


def test_parse_one_call_has_no_content():
    parsed = hermes().parse(call_text("get_weather", {"city": "Paris"}))
    assert parsed.content is None
    assert parsed.tool_calls == [
        ToolCall("call_" + "0" * 24, "get_weather", '{"city": "Paris"}')]
    assert parsed.tool_calls[0].to_openai() == {
        "id": "call_" + "0" * 24, "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_parse_text_before_and_several_calls():
    text = ("Let me check both.\n" + call_text("get_weather", {"city": "Paris"}) + "\n"
            + call_text("get_time", {}) + "\n")
    parsed = hermes().parse(text)
    assert parsed.content == "Let me check both."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_parse_text_between_and_after_calls_is_joined():
    text = "A " + call_text("f", {}) + " B" + call_text("g", {}) + " C\n"
    assert hermes().parse(text).content == "A  B C"


def test_parse_accepts_parameters_alias_missing_and_encoded_arguments():
    text = (call_text("f", {"x": 1}, key="parameters")
            + '<tool_call>{"name": "g"}</tool_call>'
            + call_text("h", json.dumps({"y": [1, 2]})))
    calls = hermes().parse(text).tool_calls
    assert [(c.name, c.arguments) for c in calls] == [
        ("f", '{"x": 1}'), ("g", "{}"), ("h", '{"y": [1, 2]}')]


def test_parse_whitespace_around_json():
    text = '<tool_call>  \n\n {"name": "f", "arguments": {"a": true}} \n\t</tool_call>'
    assert hermes().parse(text).tool_calls[0].arguments == '{"a": true}'


def test_parse_nested_unicode_arguments_are_compact_json_without_escapes():
    args = {"city": "Zürich", "tags": ["東京", {"emoji": "☀️"}], "n": {"deep": [1.5, None]}}
    text = "<tool_call>" + json.dumps({"name": "f", "arguments": args}, indent=2) + "</tool_call>"
    call = hermes().parse(text).tool_calls[0]
    assert call.arguments == json.dumps(args, ensure_ascii=False)
    assert "Zürich" in call.arguments and json.loads(call.arguments) == args


@pytest.mark.parametrize("bad", [
    '<tool_call>{"name": "f", "arguments": {</tool_call>',  # broken JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
    '<tool_call>["f", {}]</tool_call>',  # not an object
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
])
def test_parse_malformed_block_stays_in_content(bad):
    text = "before " + bad + " " + call_text("ok", {})
    parsed = hermes().parse(text)
    assert parsed.content == "before " + bad
    assert [c.name for c in parsed.tool_calls] == ["ok"]


def test_parse_unterminated_final_call_is_a_call_only_if_its_json_is_complete():
    complete = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
    parsed = hermes().parse(complete)
    assert parsed.content == "Sure."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", '{"a": 1}')]
    cut = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a":'
    assert hermes().parse(cut) == ParsedMessage(cut, [])


def test_format_call_round_trips_through_parse():
    parser = hermes()
    text = parser.format_call("get_weather", {"city": "Zürich"})
    assert text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n' \
                   '</tool_call>'
    assert text.startswith(parser.start_marker) and text.endswith(parser.end_marker)
    call = parser.parse(text).tool_calls[0]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Zürich"})


# ---- streaming -----------------------------------------------------------------------------

def stream(parser, chunks):
    """Feed chunks, then reassemble the deltas the way an OpenAI client does."""
    streamer = parser.streamer()
    deltas = [d for chunk in chunks for d in streamer.feed(chunk)] + streamer.finish()
    content = ""
    calls: dict[int, dict] = {}
    for delta in deltas:
        assert len(delta) == 1 and set(delta) <= {"content", "tool_calls"}
        if "content" in delta:
            assert delta["content"]
            content += delta["content"]
            continue
        (entry,) = delta["tool_calls"]
        if "id" in entry:
            assert entry["index"] == len(calls) and entry["type"] == "function"
            assert entry["function"]["arguments"] == ""
            calls[entry["index"]] = {"id": entry["id"], "name": entry["function"]["name"],
                                     "arguments": ""}
        else:
            calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    return content, [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls.values()]


def is_subsequence(short, long) -> bool:
    it = iter(long)
    return all(any(x == y for y in it) for x in short)


def assert_like_parse(parsed: ParsedMessage, content: str, calls: list[ToolCall]) -> None:
    """A stream's message is ``parse``'s, except that a call opened and then cut off stays a
    call (ToolCallStreamer's docstring): then the stream has more calls, ``parse``'s among
    them, and its content is ``parse``'s without those blocks' text."""
    if (content, calls) == (parsed.content or "", parsed.tool_calls):
        return
    named = [(c.name, c.arguments) for c in calls]
    assert len(calls) > len(parsed.tool_calls)
    assert is_subsequence([(c.name, c.arguments) for c in parsed.tool_calls], named)
    assert is_subsequence(content, parsed.content or "")


def assert_stream_matches_parse(text, chunks, exact=True):
    """Every chunking streams the same message: ``parse``'s, or with ``exact`` off, ``parse``'s
    but for calls opened and then cut off."""
    assert "".join(chunks) == text
    whole = stream(hermes(), [text])
    assert stream(hermes(), chunks) == whole
    parsed = hermes().parse(text)
    if exact:
        assert whole == (parsed.content or "", parsed.tool_calls)
    assert_like_parse(parsed, *whole)


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


STREAM_CASES = [
    "",
    "   ",
    "Hello, world!",
    "a < b and b <tool c",
    "ends with a partial marker <tool",
    "ends with <",
    "<tool",
    "  <tool_call",
    call_text("get_weather", {"city": "Paris"}),
    "\n\nLet me look.\n\n" + call_text("f", {"a": [1, {"b": "ü"}]}) + "\n" + call_text("g", {}),
    "x" + call_text("f", {}) + "  y  " + call_text("g", {"k": "v"}, key="parameters") + " z \n",
    '<tool_call>{"name": "f", "arguments": {</tool_call> after',
    '<tool_call><tool_call>{"name": "f"}</tool_call>',
    '</tool_call> stray end marker ' + call_text("f", {}),
    'Sure <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n',
    'Sure <tool_call>\n{"name": "f", "arguments": {"a": ',
    call_text("f", {}) + "<tool_call",
    call_text("f", {}) + "<tool_call>",
    '<tool_call>{"name": "f", "arguments": {"s": "a <tool_call> inside"}}</tool_call>',
    "<<<tool_call>" + '{"name": "f"}' + "</tool_call>>>",
]
OPENED_THEN_CUT = {'<tool_call>{"name": "f", "arguments": {</tool_call> after',
                   'Sure <tool_call>\n{"name": "f", "arguments": {"a": '}


@pytest.mark.parametrize("text", STREAM_CASES)
def test_stream_char_by_char_matches_parse(text):
    assert_stream_matches_parse(text, list(text), exact=text not in OPENED_THEN_CUT)


@pytest.mark.parametrize("text", STREAM_CASES)
def test_stream_whole_text_and_random_splits_match_parse(text):
    exact = text not in OPENED_THEN_CUT
    assert_stream_matches_parse(text, [text], exact)
    rng = random.Random(1234)
    for _ in range(50):
        if len(text) > 1:
            assert_stream_matches_parse(text, random_split(text, rng), exact)


def test_stream_holds_back_a_possible_marker_then_releases_it():
    streamer = hermes().streamer()
    assert streamer.feed("a <") == [{"content": "a"}]
    assert streamer.feed("tool") == []
    assert streamer.feed("s ok") == [{"content": " <tools ok"}]
    assert streamer.feed(" <tool") == []
    assert streamer.finish() == [{"content": " <tool"}]


def test_stream_sends_arguments_while_the_model_writes_them():
    streamer = HermesToolParser(id_factory=lambda: "call_x").streamer()
    assert streamer.feed("Hi!\n<tool_call>\n") == [{"content": "Hi!"}]
    assert streamer.feed('{"name": "f", "arg') == []
    assert streamer.feed('uments": {"a": 1') == [
        {"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                         "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
    ]
    assert streamer.feed(', "s":"x') == [  # the number is sent once a delimiter ends it
        {"tool_calls": [{"index": 0, "function": {"arguments": '1, "s": "x'}}]}]
    assert streamer.feed('y"}}\n</tool') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'y"}'}}]}]
    assert streamer.feed("_call>\n") == []
    assert streamer.finish() == []


def test_stream_keeps_a_call_cut_off_after_it_opened():
    """parse sees the whole text and keeps the broken block as content; the stream had already
    opened the call, and keeps it with the arguments sent (ToolCallStreamer's docstring)."""
    cut = 'Sure <tool_call>\n{"name": "f", "arguments": {"a": "xy'
    assert hermes().parse(cut) == ParsedMessage(cut, [])
    for chunks in ([cut], list(cut)):
        content, calls = stream(hermes(), chunks)
        assert (content, [(c.name, c.arguments) for c in calls]) == ("Sure", [("f", '{"a": "xy')])
    broken = '<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call> after'
    content, calls = stream(hermes(), list(broken))
    assert (content, [(c.name, c.arguments) for c in calls]) == ("after", [("f", '{"a": 1}')])


def test_stream_opens_no_call_before_its_arguments_begin():
    """A block broken before its arguments began is content, as parse has it."""
    for text in ('<tool_call>{"name": "f", "x": [</tool_call>', '<tool_call>{"name": 3, "arguments'
                 '": {"a": 1}}</tool_call>', '<tool_call>{"arguments": "{}", </tool_call>'):
        assert stream(hermes(), list(text)) == (text, [])


def test_stream_unterminated_call_is_decided_at_finish():
    streamer = hermes().streamer()
    assert streamer.feed('<tool_call>{"name": "f"}') == []
    assert [d["tool_calls"][0]["function"] for d in streamer.finish()] == [
        {"name": "f", "arguments": ""}, {"arguments": "{}"}]
    streamer = hermes().streamer()
    assert streamer.feed('<tool_call>{"name": "f",') == []
    assert streamer.finish() == [{"content": '<tool_call>{"name": "f",'}]


_PIECES = ["<tool_call>", "</tool_call>", "<tool", "_call>", "</", "<", ">", " ", "\n", "a",
           "ü", '{"name": "f"}', '{"name": "g", "arguments": {"x": [1, "y"]}}', '{"name": ',
           '"parameters": {}}', "{", "}"]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES), max_size=20), seed=st.integers(0, 2**32))
def test_stream_matches_parse_on_generated_text(pieces, seed):
    text = "".join(pieces)
    rng = random.Random(seed)
    assert_stream_matches_parse(text, random_split(text, rng) if len(text) > 1 else [text],
                                exact=False)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                              max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(value=st.dictionaries(st.text(max_size=5), _JSON, max_size=5),
       indent=st.sampled_from([None, 0, 2]), ascii_only=st.booleans(),
       seed=st.integers(0, 2**32))
def test_json_rewriter_writes_what_parse_writes_in_any_chunking(value, indent, ascii_only, seed):
    """However a model lays out and escapes a JSON object, and however it arrives, the pieces
    re-written as they come add up to the arguments ``parse`` returns for it."""
    from tokenmill.server.tools.base import arguments_json
    from tokenmill.server.tools.json_stream import JsonRewriter

    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    reader = JsonRewriter()
    pieces = []
    for chunk in random_split(text, random.Random(seed)) if len(text) > 1 else [text]:
        reader.feed(chunk)
        pieces += [piece for _, piece in reader.take() if piece is not None]
    assert reader.done and "".join(pieces) == arguments_json(json.loads(text))


# ---- registry ------------------------------------------------------------------------------

def test_registry_returns_a_fresh_parser():
    assert TOOL_PARSERS["hermes"] is HermesToolParser
    parser = get_tool_parser("hermes", id_factory=lambda: "call_fixed")
    assert isinstance(parser, HermesToolParser) and parser.name == "hermes"
    assert parser.parse(call_text("f", {})).tool_calls[0].id == "call_fixed"


def test_registry_unknown_name_lists_known_parsers():
    with pytest.raises(ValueError, match=r"unknown tool parser 'gorilla'.*hermes"):
        get_tool_parser("gorilla")


# ---- template_handles_tools ----------------------------------------------------------------

def test_template_handles_tools():
    assert template_handles_tools(CHATML) is False
    assert template_handles_tools(TOOL_TEMPLATE) is True
    assert template_handles_tools("{% if tools is defined %}x{% endif %}") is True
    # A local variable named tools is not the tools the caller passes.
    assert template_handles_tools("{% set tools = [] %}{{ tools }}") is False
    # The transformers-only {% generation %} tag must not stop the analysis.
    assert template_handles_tools(
        "{% for t in tools %}{{ t }}{% endfor %}{% generation %}x{% endgeneration %}") is True
    assert template_handles_tools("{% for x in %}") is False


# ---- prepare_tool_messages -----------------------------------------------------------------

def history():
    return [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "21C"},
        {"role": "assistant", "content": "Paris 18C, Rome 21C."},
        {"role": "user", "content": "Thanks"},
    ]


def test_plain_template_gets_tool_section_in_a_new_system_message():
    parser = hermes()
    out = prepare_tool_messages(history(), [WEATHER_TOOL], parser, template_handles_tools=False)
    system = out[0]
    assert system["role"] == "system"
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>" in system["content"]
    assert "<tool_call>" in system["content"] and "</tool_call>" in system["content"]
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert all(isinstance(m["content"], str) for m in out)
    assert all("tool_calls" not in m for m in out)


def test_plain_template_rewrites_calls_and_results_as_text():
    parser = hermes()
    out = prepare_tool_messages(history(), None, parser, template_handles_tools=False)
    assert out[1]["content"] == (parser.format_call("get_weather", {"city": "Paris"}) + "\n"
                                 + parser.format_call("get_weather", {"city": "Rome"}))
    # What we put in the history is what the parser reads back.
    calls = parser.parse(out[1]["content"]).tool_calls
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert out[2] == {"role": "user", "content": "<tool_response>\n18C, sunny\n</tool_response>\n"
                                                 "<tool_response>\n21C\n</tool_response>"}
    assert out[3]["content"] == "Paris 18C, Rome 21C."


def test_plain_template_keeps_assistant_text_before_calls():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "c", "type": "function",
                     "function": {"name": "f", "arguments": ""}}]}]
    out = prepare_tool_messages(messages, None, hermes(), template_handles_tools=False)
    assert out[1]["content"] == "Checking.\n" + hermes().format_call("f", {})


def test_plain_template_appends_to_an_existing_system_message():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = prepare_tool_messages(messages, [WEATHER_TOOL], hermes(), template_handles_tools=False)
    assert len(out) == 2
    assert out[0]["content"].startswith("Be brief.\n\n")
    assert "get_weather" in out[0]["content"]
    assert messages[0]["content"] == "Be brief."  # the caller's list is not modified


def test_no_tools_and_no_calls_leaves_messages_alone():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    out = prepare_tool_messages(messages, [], hermes(), template_handles_tools=False)
    assert out == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]


def test_plain_messages_render_with_the_chatml_template():
    out = prepare_tool_messages(history(), [WEATHER_TOOL], hermes(), template_handles_tools=False)
    prompt = render_chat(CHATML, out, add_generation_prompt=True, tools=None, variables={})
    assert prompt.startswith("<|im_start|>system\n# Tools")
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather"' in prompt
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tool_template_gets_decoded_arguments_and_nothing_else_changes():
    messages = history()
    before = copy.deepcopy(messages)
    out = prepare_tool_messages(messages, [WEATHER_TOOL], hermes(), template_handles_tools=True)
    assert messages == before
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [
        {"city": "Paris"}, {"city": "Rome"}]
    assert out[1]["tool_calls"][0]["id"] == "call_1"
    assert out[0] == messages[0] and out[2:] == messages[2:]


@pytest.mark.parametrize("handles", [False, True])
@pytest.mark.parametrize("mutate, message", [
    (lambda m, t: t[0]["function"].pop("name"), r"tools\[0\]\.function\.name is required"),
    (lambda m, t: t.append({"type": "function"}), r"tools\[1\]\.function\.name is required"),
    (lambda m, t: m[1]["tool_calls"][1]["function"].update(arguments="{city: Rome}"),
     r"messages\[1\]\.tool_calls\[1\]\.function\.arguments is not valid JSON"),
    (lambda m, t: m[1]["tool_calls"][0]["function"].update(arguments="[1]"),
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON object"),
    (lambda m, t: m[1]["tool_calls"][0]["function"].pop("name"),
     r"messages\[1\]\.tool_calls\[0\]\.function\.name is required"),
    (lambda m, t: m[1]["tool_calls"][0].pop("function"),
     r"messages\[1\]\.tool_calls\[0\]\.function is required"),
    (lambda m, t: m[3].pop("content"), r"messages\[3\]\.content is required for a tool message"),
    (lambda m, t: m[0].pop("role"), r"messages\[0\]\.role is required"),
])
def test_malformed_input_raises_naming_the_field(mutate, message, handles):
    messages, tools = history(), [copy.deepcopy(WEATHER_TOOL)]
    mutate(messages, tools)
    with pytest.raises(ValueError, match=message):
        prepare_tool_messages(messages, tools, hermes(), template_handles_tools=handles)


def test_escaped_lone_surrogate_in_arguments_stays_escaped():
    """A model may write "\\ud800" inside a call: the arguments stay valid UTF-8 text (a lone
    surrogate could not be sent in a response) and mean the same JSON."""
    from tokenmill.server.tools.parsers import get_tool_parser

    [call] = get_tool_parser("hermes").make_calls(
        '{"name": "f", "arguments": {"a": "\\ud800 é", "b": 1}}')
    call.arguments.encode("utf-8")
    assert json.loads(call.arguments) == {"a": "\ud800 é", "b": 1}
    [plain] = get_tool_parser("hermes").make_calls('{"name": "f", "arguments": {"a": "é"}}')
    assert plain.arguments == '{"a": "é"}'  # non-ASCII text is kept as it is
    text = '<tool_call>{"name": "f", "arguments": {"a": "\\ud800 é", "b": 1}}</tool_call>'
    _, [streamed] = stream(hermes(), list(text))  # streamed, the same text
    assert streamed.arguments == call.arguments
