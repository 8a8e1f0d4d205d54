"""Each tool-call syntax end to end on the default model: the tools described in its own syntax
in the prompt, the output forced (``required``, a named function) or checked (``auto``) by that
syntax's grammar, and the text parsed back into calls that match the offered schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenmill import SamplingParams
from tokenmill.server.tools.choice import tool_choice_constraint
from tokenmill.server.tools.parsers import TOOL_PARSERS, get_tool_parser
from tokenmill.server.tools.prompt import prepare_tool_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                  "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_forced_calls_in_every_syntax_parse_and_validate(fp32_llm, name):
    parser = get_tool_parser(name).for_tools(TOOLS)
    messages = prepare_tool_messages(ASK, TOOLS, parser, template_handles_tools=False)
    prompt = fp32_llm.tokenizer.encode_chat(messages)
    # Parallel calls stay off: this small model, once in a list of calls, repeats them.
    choices = [("required", False, None), ({"type": "function", "function": {"name": "add"}},
                                           False, "add")]
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=c)
              for c in (tool_choice_constraint(TOOLS, choice, parallel, parser)
                        for choice, parallel, _ in choices)]
    outs = fp32_llm.generate([prompt] * len(params), params, use_tqdm=False)
    for (choice, _, named), out in zip(choices, outs, strict=True):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        parsed = parser.parse(text)
        assert parsed.content is None and parsed.tool_calls, text
        for call in parsed.tool_calls:
            assert named in (None, call.name), text
            jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[call.name])
