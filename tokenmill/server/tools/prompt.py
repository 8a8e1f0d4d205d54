"""Get tools and tool-call history into a prompt, whether or not the chat template knows tools.

Templates written for tool use (Qwen, Hermes) read a ``tools`` variable and render assistant
``tool_calls`` themselves; they only need the arguments as dicts. Templates that know nothing of
tools (SmolLM2's ChatML) would silently drop both, so for them the tools are described in the
system message and the calls and results are rewritten as plain text in the parser's syntax.

No torch and no tokenizer (the template is only parsed, by ``chat_template``). Every malformed
input raises ``ValueError`` naming the offending field, which the server returns as a 400.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.server.tools.parsers import ToolCallParser
from tokenmill.tokenizer.chat_template import template_variables


def template_handles_tools(source: str) -> bool:
    """Whether a Jinja chat template reads the ``tools`` variable."""
    return "tools" in template_variables(source)


def prepare_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          parser: ToolCallParser,
                          template_handles_tools: bool) -> list[dict[str, Any]]:
    """Messages ready for the chat template; the inputs are not modified.

    With a tool-aware template: the messages as given, except that assistant ``tool_calls``
    carry their arguments as dicts. Otherwise: every message has string content, the tools are
    described in the (first, possibly new) system message, assistant calls are written out in the
    parser's syntax after any text, and ``tool`` results become ``user`` turns of
    ``<tool_response>`` blocks (consecutive results share one turn).
    """
    tools = tools or []
    check_tools(tools)
    if template_handles_tools:
        return [_decode_tool_calls(m, i) for i, m in enumerate(messages)]
    out = _as_plain_messages(messages, parser)
    if tools:
        _add_tool_section(out, tools, parser)
    return out


def _as_plain_messages(messages: list[dict[str, Any]],
                       parser: ToolCallParser) -> list[dict[str, Any]]:
    """Calls and results rewritten as text, for a template that only prints content."""
    out: list[dict[str, Any]] = []
    previous_role = None
    for i, message in enumerate(messages):
        role = _role(message, i)
        if role == "tool":
            block = f"<tool_response>\n{_tool_result(message, i)}\n</tool_response>"
            # Results of parallel calls go back in one user turn.
            if previous_role == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant" and message.get("tool_calls"):
            out.append(_assistant_as_text(message, i, parser))
        else:
            out.append({**message, "content": _text(message.get("content"), f"messages[{i}]")})
        previous_role = role
    return out


def tool_section(tools: list[dict[str, Any]], parser: ToolCallParser) -> str:
    """The system-prompt text that tells a model without a tool template about the tools."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    example = parser.format_call("<function-name>", {"<argument-name>": "<value>"})
    return (
        "# Tools\n\n"
        "You may call the functions described below, one JSON description per line:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call a function, reply with a block like the following, filling in the name of the "
        f"function and a JSON object of its arguments ({parser.several_calls}):\n{example}\n"
        "The result of each call will be sent back to you inside <tool_response></tool_response> "
        "tags."
    )


class ToolsError(ValueError):
    """Malformed ``tools``; ``param`` names the offending field (the server's 400 reports it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_tools(tools: list[dict[str, Any]]) -> None:
    """OpenAI function tools: ``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}``, names unique. Raises ``ToolsError`` naming the field."""
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolsError(f"{where} must be {{'type': 'function', 'function': {{...}}}}",
                             where)
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ToolsError(f"{where}.function.name is required", f"{where}.function.name")
        if name in names:
            raise ToolsError(f"{where}.function.name {name!r} is offered twice",
                             f"{where}.function.name")
        names.add(name)
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolsError(f"{where}.function.parameters must be a JSON schema object",
                             f"{where}.function.parameters")


def _add_tool_section(out: list[dict[str, Any]], tools: list[dict[str, Any]],
                      parser: ToolCallParser) -> None:
    section = tool_section(tools, parser)
    if out and out[0].get("role") == "system":
        existing = out[0]["content"]
        out[0] = {**out[0], "content": f"{existing}\n\n{section}" if existing else section}
    else:
        out.insert(0, {"role": "system", "content": section})


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _role(message: Any, i: int) -> str:
    _require(isinstance(message, dict) and isinstance(message.get("role"), str),
             f"messages[{i}].role is required")
    return message["role"]


def _text(content: Any, where: str) -> str:
    """Message content as one string: None is empty, text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"{where}.content must be a string or a list of text parts")


def _tool_result(message: dict[str, Any], i: int) -> str:
    _require(message.get("content") is not None,
             f"messages[{i}].content is required for a tool message")
    return _text(message["content"], f"messages[{i}]")


def _assistant_as_text(message: dict[str, Any], i: int, parser: ToolCallParser) -> dict[str, Any]:
    parts = [_text(message.get("content"), f"messages[{i}]"),
             parser.format_calls(_calls(message, i))]
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": "\n".join(p for p in parts if p)}


def _decode_tool_calls(message: Any, i: int) -> dict[str, Any]:
    role = _role(message, i)
    if role == "tool":
        _tool_result(message, i)
    if role != "assistant" or not message.get("tool_calls"):
        return message
    decoded = _calls(message, i)
    calls = [{**call, "function": {**call["function"], "arguments": arguments}}
             for call, (_, arguments) in zip(message["tool_calls"], decoded, strict=True)]
    return {**message, "tool_calls": calls}


def _calls(message: dict[str, Any], i: int) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call in an assistant message, validated."""
    calls = message["tool_calls"]
    _require(isinstance(calls, list), f"messages[{i}].tool_calls must be a list")
    return [_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]


def _call(call: Any, where: str) -> tuple[str, dict[str, Any]]:
    function = call.get("function") if isinstance(call, dict) else None
    _require(isinstance(function, dict), f"{where}.function is required")
    name = function.get("name")
    _require(isinstance(name, str) and bool(name), f"{where}.function.name is required")
    return name, _arguments(function.get("arguments"), f"{where}.function.arguments")


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    # Already decoded (a client that sends a dict) is accepted; "" or missing means no arguments.
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raise ValueError(f"{where} is not valid JSON") from None
    _require(isinstance(raw, dict), f"{where} must be a JSON object")
    return raw
