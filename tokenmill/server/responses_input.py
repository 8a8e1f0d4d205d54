"""A Responses request in chat terms: input items (after those of its previous responses) as
chat messages, its function tools and ``tool_choice`` as a ``ToolSetup``, and ``text.format``
as an output constraint. Every malformed item or tool is a 400 naming it (``input[2].role``,
``tools[0].parameters``)."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.params import ConstraintError, StructuredOutputs
from tokenmill.server.protocol import ChatMessage, field_error, invalid, open_objects
from tokenmill.server.responses_request import ResponsesRequest, bad
from tokenmill.server.tools.choice import ToolSetup, check_tool_choice
from tokenmill.server.tools.parsers import ToolCallParser
from tokenmill.server.tools.prompt import ToolsError
from tokenmill.structured.spec import from_request

_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
          "developer": "system"}  # open-model templates know no developer role
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


# ----- input items -> chat messages ---------------------------------------------------------------

def input_items(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value


def _text_content(content: Any, param: str) -> str:
    """Content as one string: a string, or text parts (no images, files or audio)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(param, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise invalid(param, f"{param}[{j}]: only text parts are supported (input_text, "
                          f"output_text), got {kind!r}", "unsupported_parameter")
        if not isinstance(part.get(key), str):
            raise bad(f"{param}[{j}].{key}", "a string is required")
        texts.append(part[key])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad(f"{where}.{key}", "a non-empty string is required")
    return value


def _item_message(item: Any, where: str) -> dict[str, Any] | None:
    """One input item as a chat message dict (None for items that are not replayed)."""
    if not isinstance(item, dict):
        raise bad(where, "an input item must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad(f"{where}.role", f"must be one of {sorted(_ROLES)}, got {role!r}")
        return {"role": _ROLES[role],
                "content": _text_content(item.get("content"), f"{where}.content")}
    if kind == "function_call":
        arguments = item.get("arguments")
        try:
            ok = isinstance(json.loads(arguments), dict)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise bad(f"{where}.arguments", "must be a JSON object encoded as a string")
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": _string(item, "call_id", where),
                "content": _text_content(item.get("output"), f"{where}.output")}
    if kind == "reasoning":  # another model's private reasoning: templates drop it as well
        return None
    raise invalid(where, f"{where}: input items of type {kind!r} are not supported (message, "
                  f"function_call, function_call_output)", "unsupported_parameter")


def chat_messages(history: list[dict[str, Any]], items: list[dict[str, Any]],
                   instructions: str | None) -> list[ChatMessage]:
    """Instructions first, then the stored history and the new items (validated, naming
    ``input[i]``); a function call joins the assistant message before it."""
    converted = [_item_message(item, "previous_response") for item in history]
    converted += [_item_message(item, f"input[{i}]") for i, item in enumerate(items)]
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    for m in converted:
        if m is None:
            continue
        last = messages[-1] if messages else None
        if m.get("tool_calls") and last is not None and last["role"] == "assistant":
            last["tool_calls"] = (last.get("tool_calls") or []) + m["tool_calls"]
        else:
            messages.append(m)
    if not messages:
        raise bad("input", "the conversation is empty: give input (or instructions)")
    return [ChatMessage(**m) for m in messages]


# ----- tools and output constraints ---------------------------------------------------------------

def _function_tool(tool: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Responses function tool as (chat tool, echo); other tool types are refused."""
    if not isinstance(tool, dict):
        raise bad(where, "a tool must be an object")
    if tool.get("type") != "function":
        raise invalid(f"{where}.type", f"{where}.type: {tool.get('type')!r} tools are not "
                      f"supported, only 'function'", "unsupported_parameter")
    name = _string(tool, "name", where)
    parameters, description = tool.get("parameters"), tool.get("description")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad(f"{where}.parameters", "must be a JSON schema object")
    if description is not None and not isinstance(description, str):
        raise bad(f"{where}.description", "must be a string")
    if tool.get("strict") not in (None, True, False):
        raise bad(f"{where}.strict", "must be a boolean")
    for key, ok in (("defer_loading", not tool.get("defer_loading")),
                    ("async", not tool.get("async")),
                    ("output_schema", tool.get("output_schema") is None),
                    ("allowed_callers", tool.get("allowed_callers") in (None, [], ["direct"]))):
        if not ok:
            raise invalid(f"{where}.{key}", f"{where}.{key} is not supported",
                          "unsupported_parameter")
    function = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    echo = {"type": "function", "name": name, "description": description,
            "parameters": parameters, "strict": tool.get("strict")}
    return {"type": "function", "function": function}, echo


def responses_tools(req: ResponsesRequest) -> tuple[ToolSetup, list[dict[str, Any]]]:
    """The request's tools in chat terms, and as the response object lists them."""
    pairs = [_function_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools or ())]
    names = [chat["function"]["name"] for chat, _ in pairs]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad(f"tools[{i}].name", f"{name!r} is offered twice")
    chat = [c for c, _ in pairs] or None
    # "auto" without tools asks for nothing: no tool can be called either way.
    choice, allowed = _tool_choice(None if req.tool_choice == "auto" and not chat
                                   else req.tool_choice, names)
    choosable = chat if allowed is None else [c for c in chat or ()
                                              if c["function"]["name"] in allowed]
    try:
        mode = check_tool_choice(choosable or None, choice)
    except ToolsError as e:
        raise bad(e.param, str(e)) from None
    limit = _call_limit(req)
    if limit == 0 and mode in ("required", "named"):
        raise bad("max_tool_calls", f"0 allows no call, but tool_choice asks for one ({mode})")
    if limit == 0:  # no call may be made: the tools are not offered
        mode = "none"
    return ToolSetup(chat, choosable, choice, mode, limit), [e for _, e in pairs]


def _call_limit(req: ResponsesRequest) -> int | None:
    """The most function calls a response may make: ``max_tool_calls``, and one without
    ``parallel_tool_calls``; None: any number. Calls past it are dropped."""
    limits = [req.max_tool_calls, 1 if req.parallel_tool_calls is False else None]
    return min((n for n in limits if n is not None), default=None)


def _tool_choice(value: Any, offered: list[str]) -> tuple[Any, set[str] | None]:
    """(the chat tool_choice, the names ``allowed_tools`` narrows the choice to, or None)."""
    if value is None or value in ("none", "auto", "required"):
        return value, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}, None
    if kind == "allowed_tools" and value.get("mode") in ("auto", "required") \
            and isinstance(value.get("tools"), list):
        allowed = set()
        for j, tool in enumerate(value["tools"]):
            if not isinstance(tool, dict) or tool.get("type") != "function" \
                    or tool.get("name") not in offered:
                raise bad(f"tool_choice.tools[{j}]", "must name an offered function as "
                          "{'type': 'function', 'name': ...}")
            allowed.add(tool["name"])
        return value["mode"], allowed
    raise invalid("tool_choice", "tool_choice: must be 'none', 'auto', 'required', {'type': "
                  "'function', 'name': ...} or {'type': 'allowed_tools', 'mode': ..., 'tools': "
                  f"[...]}} of function tools; got {json.dumps(value)}", "unsupported_parameter")


def text_format(text: dict[str, Any] | None) -> tuple[StructuredOutputs | None, dict]:
    """``text.format`` as a constraint, and the ``text`` the response echoes."""
    text = text or {}
    if text.get("verbosity") not in (None, "medium"):
        raise invalid("text.verbosity", "text.verbosity: only 'medium' is supported",
                      "unsupported_parameter")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        spec = None
    elif kind == "json_object":
        spec = StructuredOutputs(json_object=True, param="text.format")
    elif kind == "json_schema":
        fmt = {"type": kind, "name": _string(fmt, "name", "text.format"),
               "schema": fmt.get("schema"), "description": fmt.get("description"),
               "strict": fmt.get("strict")}
        if not isinstance(fmt["schema"], dict):
            raise bad("text.format.schema", "a JSON schema object is required")
        if fmt["strict"] not in (None, True, False) \
                or not isinstance(fmt["description"], str | None):
            raise bad("text.format", "strict must be a boolean and description a string")
        # strict false: the schema as JSON Schema reads it, objects open (protocol.py)
        schema = open_objects(fmt["schema"]) if fmt["strict"] is False else fmt["schema"]
        spec = StructuredOutputs(json=schema, param="text.format.schema")
    else:
        raise bad("text.format.type", f"must be 'text', 'json_object' or 'json_schema', "
                  f"got {kind!r}")
    return spec, {"format": {"type": kind} if spec is None or kind == "json_object" else fmt,
                  "verbosity": "medium"}


def output_constraint(req: ResponsesRequest, text_spec: StructuredOutputs | None,
                      tools: ToolSetup, parser: ToolCallParser) -> StructuredOutputs | None:
    """One output constraint, as the chat endpoint picks it: ``text.format`` (or a vLLM
    extra), else the tool choice's grammar; a forced call cannot also be JSON text."""
    try:
        extra = from_request(
            structured_outputs=req.structured_outputs, guided_json=req.guided_json,
            guided_regex=req.guided_regex, guided_choice=req.guided_choice,
            guided_grammar=req.guided_grammar,
            guided_whitespace_pattern=req.guided_whitespace_pattern)
        if extra is not None and text_spec is not None:
            raise ConstraintError("give one output constraint (text.format or "
                                  f"{extra.param})", extra.param)
        return tools.constraint(extra or text_spec, parser)
    except ConstraintError as e:
        raise field_error(e) from None
