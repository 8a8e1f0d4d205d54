"""A non-hermes syntax through a real ``tokenmill serve --tool-call-parser qwen3_coder`` with
the official ``openai`` client: forced and automatic calls, streamed and whole, with the default
template (tools described in the system prompt) and with a tool-aware test template sent in the
request; bad tool input is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.test_server_support import MODEL, server_fixtures
from tests.test_structured_server import assert_stream_matches_whole
from tests.test_tool_parsers_model import ASK, SCHEMA_OF, TOOLS

pytestmark = pytest.mark.slow

# A tool-aware template in Qwen3-Coder's manner: tools listed, past calls written as XML.
XML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n"
    "{% for t in tools %}{{ t.function.name }}: {{ t.function.parameters | tojson }}\n"
    "{% endfor %}Call one as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}"
    "{% endif %}{%- if m.tool_calls %}{% for c in m.tool_calls %}\n<tool_call>\n"
    "<function={{ c.function.name }}>\n{% for k, v in c.function.arguments.items() %}"
    "<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

server, client = server_fixtures("--tool-call-parser", "qwen3_coder",
                                 "--trust-request-chat-template")


@pytest.mark.parametrize("template", [None, XML_TEMPLATE], ids=["default", "xml-template"])
@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_forced_xml_calls_parse_and_validate(client, tool_choice, template):
    extra = {"chat_template": template} if template else {}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice=tool_choice, temperature=0, max_tokens=120,
                                       parallel_tool_calls=False, extra_body=extra)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert isinstance(tool_choice, str) or call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_xml_calls_reassemble_to_the_same_calls(client, tool_choice):
    assert_stream_matches_whole(client, tool_choice, 120, TOOLS, ASK)


def test_call_history_through_the_xml_template(client):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    for template in (None, XML_TEMPLATE):
        extra = {"chat_template": template} if template else {}
        r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                           temperature=0, max_tokens=30, extra_body=extra)
        assert r.choices[0].message.content or r.choices[0].message.tool_calls


@pytest.mark.parametrize("change, param", ids=["unknown-function", "no-name", "bad-arguments"],
                         argvalues=[
    ({"tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]},
     "tools[0].function.name"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_input_is_a_400_naming_the_field(client, change, param):
    body = {**dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=5), **change}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == 400
    assert param in (e.value.body.get("param") or "") + e.value.body.get("message", ""), \
        e.value.body
