"""The tool-call syntaxes beyond hermes (llama3_json, mistral, qwen3_coder, pythonic): parsing
synthetic outputs, streaming them in every chunking, writing calls, and the grammars that force
or check calls in each syntax. Pure Python and the tokenizer; no model."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.server.tools.choice import tool_choice_constraint
from tokenmill.server.tools.parsers import TOOL_PARSERS, ParsedMessage, get_tool_parser
from tokenmill.server.tools.xml_calls import typed_value

FAMILIES = sorted(TOOL_PARSERS)
NEW = ["llama3_json", "mistral", "pythonic", "qwen3_coder"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer"}},
    "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, ADD, NOW]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("add", {"a": 1, "b": -2}),
         ("now", {})]
TRICKY = {"text": 'a "quoted" ] } ) \\ \n line', "nested": {"k": [1, 2.5, None, True]},
          "unicode": "é ü 日本"}


def parser(name: str):
    counter = itertools.count()
    return get_tool_parser(name, id_factory=lambda: f"id{next(counter)}").for_tools(TOOLS)


def calls_of(parsed: ParsedMessage) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


# ---- parse ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_written_calls_parse_back(name):
    p = parser(name)
    for calls in (CALLS[:1], CALLS, [("f", TRICKY)]):
        text = p.format_calls(calls)
        parsed = p.parse(text)
        assert parsed.content is None, text
        assert calls_of(parsed) == calls, text


@pytest.mark.parametrize("name", FAMILIES)
def test_text_without_calls_is_content(name):
    for text in ("Hello there.", "  The answer is 42.\n", "a < b and {x} [y]",
                 "Look: {not json", "[1, 2, 3] are numbers"):
        assert parser(name).parse(text) == ParsedMessage(text.strip(), [])


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ('<|python_tag|>{"name": "now", "arguments": {}}', None, [("now", {})]),
    (' {"name": "add", "parameters": {"a": 1}} ; {"name": "now", "parameters": {}}\nDone.',
     "Done.", [("add", {"a": 1}), ("now", {})]),
    ('{"name": "add", "parameters": {"a": 1}};', ";", [("add", {"a": 1})]),
    ('{"name": "add", "parameters": {"a": 1}}; {"name": 5}', None, []),  # invalid: all text
    ('{"name": "add", "parameters": {"a": 1}}; {"name": "now"', '; {"name": "now"',
     [("add", {"a": 1})]),  # cut off mid-call: the complete call stays a call
    ('Sure. {"name": "add", "parameters": {}}', 'Sure. {"name": "add", "parameters": {}}', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
])
def test_llama3_json(text, content, calls):
    parsed = parser("llama3_json").parse(text)
    if calls:
        assert (parsed.content, calls_of(parsed)) == (content, calls)
    else:
        assert parsed == ParsedMessage(text.strip(), [])


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "now"}]', None,
     [("add", {"a": 1}), ("now", {})]),
    ('Let me check.[TOOL_CALLS] {"name": "now", "arguments": "{}"} Anything else?',
     "Let me check. Anything else?", [("now", {})]),
    ('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]now[ARGS]{}', None,
     [("add", {"a": 1, "b": 2}), ("now", {})]),  # v11 tokenizers
    ('[TOOL_CALLS] sorry', "[TOOL_CALLS] sorry", []),
    ('x [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}', 'x [TOOL_CALLS][{"name": "add", '
     '"arguments": {"a": 1}', []),
    ('[TOOL_CALLS][{"name": "add", "arguments": [1]}]',
     '[TOOL_CALLS][{"name": "add", "arguments": [1]}]', []),
])
def test_mistral(text, content, calls):
    parsed = parser("mistral").parse(text)
    if calls:
        assert (parsed.content, calls_of(parsed)) == (content, calls)
    else:
        assert parsed == ParsedMessage(content, [])


def test_mistral_ids_are_nine_letters_or_digits():
    call = get_tool_parser("mistral").parse('[TOOL_CALLS][{"name": "now"}]').tool_calls[0]
    assert len(call.id) == 9 and call.id.isalnum()


@pytest.mark.parametrize("text, content, calls", [
    ('[get_weather(city="Paris", days=3), now()]', None,
     [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]),
    ("[f(a=True, b=None, c={'k': [1, -2.5]}, d=false, e=null)]  Done", "Done",
     [("f", {"a": True, "b": None, "c": {"k": [1, -2.5]}, "d": False, "e": None})]),
    ('[tools.search(q="x")]', None, [("tools.search", {"q": "x"})]),
    ('[f("positional")]', None, []),
    ("[f(a=open('x'))]", None, []),
    ("[f(**kw)]", None, []),
    ("[f(a=1)", None, []),  # cut off
    ("I'd say [f(a=1)]", None, []),  # calls open the answer, or there are none
])
def test_pythonic(text, content, calls):
    parsed = parser("pythonic").parse(text)
    if calls:
        assert (parsed.content, calls_of(parsed)) == (content, calls)
    else:
        assert parsed == ParsedMessage(text.strip(), [])


def qwen_call(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_types_values_by_the_schema():
    text = "I'll look.\n" + qwen_call("get_weather", {"city": "1984", "days": "3"}) + "\n" + \
        qwen_call("add", {"a": "1", "b": "2"})
    parsed = parser("qwen3_coder").parse(text)
    assert parsed.content == "I'll look."
    assert calls_of(parsed) == [("get_weather", {"city": "1984", "days": 3}),
                                ("add", {"a": 1, "b": 2})]
    # Without the request's schemas a value reads as JSON where it can.
    unbound = get_tool_parser("qwen3_coder").parse(text)
    assert calls_of(unbound)[0] == ("get_weather", {"city": 1984, "days": 3})


def test_qwen3_coder_multiline_text_and_bad_blocks():
    multi = qwen_call("f", {"code": "def f():\n    return 1\n"})
    assert calls_of(parser("qwen3_coder").parse(multi)) == [
        ("f", {"code": "def f():\n    return 1\n"})]
    for bad in ("<tool_call>\n<function=f>\nstray<parameter=a>\n1\n</parameter>\n</function>\n"
                "</tool_call>", "<tool_call>\nno function\n</tool_call>",
                "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"):
        assert parser("qwen3_coder").parse(bad) == ParsedMessage(bad.strip(), [])


@pytest.mark.parametrize("raw, schema, value", [
    ("3", {"type": "string"}, "3"), ("3", {"type": "integer"}, 3), ("2.5", None, 2.5),
    ("true", {"type": "boolean"}, True), ("null", {"type": "integer"}, None),
    ("Paris", None, "Paris"), ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),
    ("{1, 2}", {"type": "array"}, "{1, 2}"),
    ("{'a': [1, None]}", {"type": "object"}, {"a": [1, None]}),
    ('[1, "x"]', {"type": "array"}, [1, "x"]), (" x ", {"type": "string"}, " x "),
])
def test_qwen3_coder_typed_values(raw, schema, value):
    assert typed_value(raw, schema) == value


# ---- streaming -----------------------------------------------------------------------------

def reassemble(name: str, chunks: list[str]) -> ParsedMessage:
    """Run the streamer over ``chunks``; rebuild the message a client would see."""
    streamer = parser(name).streamer()
    deltas = [d for c in chunks for d in streamer.feed(c)] + streamer.finish()
    content, calls = "", {}
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"} and len(d) == 1, d
        content += d.get("content", "")
        for tc in d.get("tool_calls", ()):
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = tc.get("id", call["id"])
            call["name"] = tc.get("function", {}).get("name", call["name"])
            call["arguments"] += tc["function"]["arguments"]
    assert list(calls) == list(range(len(calls)))
    from tokenmill.server.tools.parsers import ToolCall
    return ParsedMessage(content or None,
                         [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls.values()])


def samples(name: str) -> list[str]:
    p = parser(name)
    written = p.format_calls(CALLS)
    return [written, p.format_calls(CALLS[1:2]), f"  {written}  \nThat's all.",
            f"Let me see. {p.format_calls(CALLS[:1])} ok", p.format_calls([("f", TRICKY)]),
            "plain [text] {here}", " ", written[: len(written) * 2 // 3], written[:-1]]


CUT = 7  # samples from here on may cut a call off after it opened (ToolCallStreamer)


def like_parse(parsed: ParsedMessage, streamed: ParsedMessage) -> bool:
    """``parse``'s message, but for calls opened and then cut off: more calls, ``parse``'s
    among them in order, and less content."""
    if streamed == parsed:
        return True
    it = iter((c.name, c.arguments) for c in streamed.tool_calls)
    return (len(streamed.tool_calls) > len(parsed.tool_calls)
            and all(any((c.name, c.arguments) == s for s in it) for c in parsed.tool_calls)
            and len(streamed.content or "") < len(parsed.content or ""))


def _check_chunkings(name: str, text: str, chunkings, exact: bool = True) -> None:
    whole = reassemble(name, [text])
    expected = parser(name).parse(text)
    assert whole == expected if exact else like_parse(expected, whole), (name, text)
    for chunks in chunkings:
        assert reassemble(name, chunks) == whole, (name, chunks)


@pytest.mark.parametrize("name", FAMILIES)
def test_stream_in_every_one_or_two_cut_chunking_matches_parse(name):
    for i, text in enumerate(samples(name)):
        n = len(text)
        chunkings = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, n)]
        if n <= 60:  # every chunking into three pieces as well
            chunkings += [[text[:i], text[i:j], text[j:]]
                          for i in range(1, n) for j in range(i + 1, n)]
        _check_chunkings(name, text, chunkings, exact=i < CUT)


@pytest.mark.parametrize("name", FAMILIES)
def test_stream_in_random_chunkings_matches_parse(name):
    rng = random.Random(7)
    for i, text in enumerate(samples(name)):
        chunkings = []
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, max(len(text), 2)), min(len(text) - 1, 6)))
            chunkings.append([text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])])
        _check_chunkings(name, text, chunkings, exact=i < CUT)


_PIECES = {
    "llama3_json": ['{"name": "add", "parameters": {"a": 1}}', ";", " ", "<|python_tag|>",
                    '{"name": "f"', "}", "{", "x", "\n"],
    "mistral": ["[TOOL_CALLS]", '[{"name": "add", "arguments": {"a": 1}}]', "add[ARGS]{}",
                "[", "]", "{", "}", " ", "x", "[TOOL"],
    "pythonic": ['[add(a=1, b=2)]', "[", "now()", ", ", "]", "(", "'", '"', " ", "x"],
    "qwen3_coder": ["<tool_call>", "\n<function=add>\n", "<parameter=a>\n1\n</parameter>\n",
                    "</function>\n", "</tool_call>", "<tool", " ", "x"],
    "hermes": ["<tool_call>", '\n{"name": "add", "arguments": {}}\n', "</tool_call>", " ", "x"],
}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FAMILIES), st.data())
def test_stream_matches_parse_on_generated_text(name, data):
    pieces = data.draw(st.lists(st.sampled_from(_PIECES[name]), max_size=10))
    text = "".join(pieces)
    rng = random.Random(data.draw(st.integers(0, 1000)))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4))) if text else []
    chunks = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    whole = reassemble(name, [text])
    assert reassemble(name, chunks) == whole
    assert like_parse(parser(name).parse(text), whole)


STREAMING = ["hermes", "llama3_json", "mistral", "qwen3_coder"]  # arguments sent as written
TEXTY = [("get_weather", {"city": 'a "quoted" \\ line\n\nnext </param é\n', "days": 12}),
         ("f", TRICKY)]


@pytest.mark.parametrize("name", STREAMING)
def test_stream_sends_arguments_while_they_are_written(name):
    text = parser(name).format_calls(TEXTY)
    streamer = parser(name).streamer()
    sent = []  # (characters fed so far, call index) of each arguments delta
    for i, ch in enumerate(text):
        for delta in streamer.feed(ch):
            for call in delta.get("tool_calls", ()):
                if call["function"]["arguments"]:
                    sent.append((i, call["index"]))
    first_call_end = len(parser(name).format_calls(TEXTY[:1]))
    early = [i for i, index in sent if index == 0 and i < first_call_end - 1]
    assert len(early) > 10, sent  # the first call's arguments went out in many pieces
    assert reassemble(name, list(text)) == parser(name).parse(text)


@pytest.mark.parametrize("name", STREAMING)
def test_stream_cut_anywhere_sends_a_prefix_of_the_arguments(name):
    """Output cut off at every character: the calls streamed are the whole text's calls, the
    last one's arguments a prefix of its arguments (or, before it opened, parse's content)."""
    written = parser(name).format_calls(CALLS + TEXTY)
    full = [(c.name, c.arguments) for c in parser(name).parse(written).tool_calls]
    for n in range(len(written) + 1):
        streamed = reassemble(name, [written[:n]])
        calls = [(c.name, c.arguments) for c in streamed.tool_calls]
        assert [c[0] for c in calls] == [c[0] for c in full[:len(calls)]], (n, calls)
        assert calls[:-1] == full[:max(len(calls) - 1, 0)]
        if calls:
            assert full[len(calls) - 1][1].startswith(calls[-1][1]), (n, calls[-1])
        assert streamed.content in (None, parser(name).parse(written[:n]).content), n
        if n % 7 == 0:
            assert reassemble(name, list(written[:n])) == streamed


def test_stream_sends_a_call_as_soon_as_its_block_closes():
    s = parser("pythonic").streamer()
    assert s.feed("[add(a=1, b=2)") == []
    sent = s.feed("]")
    assert sent[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert json.loads(sent[1]["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert s.feed(" Done ") == [{"content": "Done"}] and s.finish() == []
    m = parser("mistral").streamer()
    assert m.feed("Hi [TOOL") == [{"content": "Hi"}]  # the marker's prefix is held back
    assert m.feed('_CALLS][{"name": "now"}') == []
    assert len(m.feed("]")) == 2


# ---- grammars ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def backend():
    from tokenmill.structured.backend import GrammarBackend
    from tokenmill.tokenizer import load_tokenizer
    tok = load_tokenizer("smollm2-135m-instruct")
    return tok, GrammarBackend(tok.backend.to_str(), 49152, [2])


def compact(name: str, calls) -> str:
    """The calls as a constrained model writes them: JSON without free whitespace."""
    text = parser(name).format_calls(calls)
    return text.replace('": ', '":').replace(', "', ',"') if name in (
        "hermes", "mistral", "llama3_json") else text


NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize("name", FAMILIES)
def test_forced_grammars_allow_exactly_calls_of_offered_functions(backend, name):
    tok, b = backend

    def valid(grammar, text):
        ids = tok.encode(text, add_special_tokens=False)
        return grammar.matcher().valid_prefix(ids) == len(ids)
    one, many = compact(name, CALLS[1:2]), compact(name, CALLS)
    for choice, parallel, many_ok in (("required", True, True), ("required", False, False),
                                      (NAMED, True, False)):
        g = b.compile(tool_choice_constraint(TOOLS, choice, parallel, parser(name)))
        assert valid(g, one) and valid(g, many) == many_ok
        assert not valid(g, "Hello") and not valid(g, compact(name, [("sub", {"a": 1})]))
        assert not valid(g, compact(name, [("add", {"a": "one", "b": 2})]))
        assert not valid(g, one + " and more text")
    g = b.compile(tool_choice_constraint(TOOLS, NAMED, False, parser(name)))
    assert not valid(g, compact(name, CALLS[:1]))  # not the named function


@pytest.mark.parametrize("name", FAMILIES)
def test_auto_grammars_leave_text_free_and_check_calls(backend, name):
    tok, b = backend

    def valid(grammar, text):
        ids = tok.encode(text, add_special_tokens=False)
        return grammar.matcher().valid_prefix(ids) == len(ids)
    for parallel in (True, False):
        g = b.compile(tool_choice_constraint(TOOLS, "auto", parallel, parser(name)))
        assert valid(g, "Just text, a < b, <tool and all.")
        assert valid(g, compact(name, CALLS[1:2])) and valid(g, compact(name, CALLS[1:2]) + " ok")
        assert not valid(g, compact(name, [("sub", {"a": 1})]))
        assert not valid(g, compact(name, [("add", {"a": "one", "b": 2})]))
        assert valid(g, compact(name, CALLS)) == (parallel or name not in ("mistral", "pythonic",
                                                                            "llama3_json"))


def test_qwen3_coder_grammar_keeps_schema_order_and_optional_parameters(backend):
    tok, b = backend
    g = b.compile(tool_choice_constraint(TOOLS, "required", False, parser("qwen3_coder")))

    def valid(text):
        ids = tok.encode(text, add_special_tokens=False)
        return g.matcher().valid_prefix(ids) == len(ids)
    assert valid(qwen_call("get_weather", {"city": "Rome\nItaly </para", "unit": "celsius"}))
    assert not valid(qwen_call("get_weather", {"unit": "celsius"}))  # city is required
    assert not valid(qwen_call("get_weather", {"city": "Rome", "unit": "kelvin"}))
    assert not valid(qwen_call("get_weather", {"unit": "celsius", "city": "Rome"}))
    assert valid(qwen_call("now", {"anything": "goes"}))  # no properties: any parameter
