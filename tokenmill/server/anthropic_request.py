"""The bodies of Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``, and
their content in chat terms: system text, messages of content blocks (text, ``tool_use``,
``tool_result``, ``thinking``) as chat messages, Anthropic tools and ``tool_choice`` as chat
ones. Every malformed block is a 400 naming it (``messages[1].content[0].tool_use_id``).

What a local model cannot take (images, documents, server tools, MCP servers, containers) is
refused by name rather than dropped.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import Field, model_validator

from tokenmill.params import StructuredOutputs
from tokenmill.server.protocol import APIError, ChatMessage, SamplingFields, invalid

_ROLES = ("user", "assistant")


def bad(param: str, why: str) -> APIError:
    return invalid(param, f"{param}: {why}")


def unsupported(param: str, what: str) -> APIError:
    return invalid(param, f"{param}: {what} is not supported by tokenmill",
                   "unsupported_parameter")


class MessagesRequest(SamplingFields):
    """``POST /v1/messages``. vLLM's sampling extras of the other endpoints (``seed``,
    ``min_p``, ``repetition_penalty``, ``structured_outputs``...) are taken too, as extra body
    fields; ``stop_sequences`` is Anthropic's name for ``stop``."""

    implemented: ClassVar[frozenset[str]] = frozenset({"service_tier"})

    @model_validator(mode="before")
    @classmethod
    def _stop_sequences(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stop") is not None:
            raise ValueError("stop is not a Messages API field: use stop_sequences")
        return data

    @model_validator(mode="after")
    def _as_stop(self) -> MessagesRequest:
        self.stop = self.stop_sequences  # what the sampling rules read
        return self

    max_tokens: int
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format: a JSON schema the answer keeps
    # vLLM's extras, as on chat: template variables and the model's other templates
    chat_template_kwargs: dict[str, Any] | None = None
    # Taken only where they ask for nothing a local server lacks (refuse_unsupported).
    service_tier: str | None = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages body without ``max_tokens``."""

    max_tokens: int = 1


def refuse_unsupported(req: MessagesRequest) -> None:
    if req.service_tier not in (None, "auto", "standard_only"):
        raise bad("service_tier", "must be 'auto' or 'standard_only'")
    for name in ("container", "mcp_servers", "context_management"):
        if getattr(req, name) not in (None, [], {}):
            raise unsupported(name, name)
    if req.max_tokens < 1:
        raise bad("max_tokens", f"must be at least 1, got {req.max_tokens}")
    if req.n != 1:
        raise unsupported("n", "more than one answer per request")
    budget = thinking_enabled(req.thinking)[1]
    if budget is not None and budget >= req.max_tokens:
        raise bad("thinking.budget_tokens", f"must be less than max_tokens ({req.max_tokens}), "
                  f"got {budget}")
    user = (req.metadata or {}).get("user_id")
    if user is not None and not isinstance(user, str):
        raise bad("metadata.user_id", "must be a string")


# ----- content blocks -> chat messages --------------------------------------------------------

def _string(block: dict[str, Any], key: str, where: str, empty: bool = False) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not (value or empty):
        raise bad(f"{where}.{key}", "a non-empty string is required" if not empty
                  else "a string is required")
    return value


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """Content as a list of blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad(f"{where}[{j}]", "a content block is an object with a 'type'")
    return content


def text_of(content: Any, where: str) -> str:
    """Text-only content (the system prompt, a tool result) as one string."""
    texts = []
    for j, block in enumerate(_blocks(content, where)):
        if block["type"] != "text":
            raise unsupported(f"{where}[{j}]", f"{block['type']!r} content here (only text)")
        texts.append(_string(block, "text", f"{where}[{j}]", empty=True))
    return "".join(texts)


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content")
    text = "" if content is None else text_of(content, f"{where}.content")
    if block.get("is_error") is True:  # the model must learn the call failed
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
            "content": text}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise bad(f"{where}.input", "must be an object")
    return {"id": _string(block, "id", where), "type": "function",
            "function": {"name": _string(block, "name", where),
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results (each a chat ``tool`` message), then its text."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if block["type"] == "tool_result":
            results.append(_tool_result(block, at))
        elif block["type"] == "text":
            texts.append(_string(block, "text", at, empty=True))
        else:
            raise unsupported(at, f"{block['type']!r} content in a user turn (only text "
                              f"and tool_result)")
    text = "".join(texts)
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """An assistant turn: its text, its calls, and its thinking as the template's reasoning."""
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}[{j}]", block["type"]
        if kind == "text":
            texts.append(_string(block, "text", at, empty=True))
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", at, empty=True))
        elif kind != "redacted_thinking":  # encrypted elsewhere: nothing to show a model
            raise unsupported(at, f"{kind!r} content in an assistant turn (only text, "
                              f"tool_use and thinking)")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning"] = "".join(thoughts)
    return message


def chat_messages(req: MessagesRequest) -> list[ChatMessage]:
    """The system prompt and the turns as chat messages, validated, each naming its field."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}].role", f"must be 'user' or 'assistant', got {role!r}")
        if "content" not in m:
            raise bad(f"messages[{i}].content", "is required")
        blocks = _blocks(m["content"], f"messages[{i}].content")
        if role == "user" and not blocks or blocks == [{"type": "text", "text": ""}]:
            raise bad(f"messages[{i}].content", f"{role} messages must have non-empty content")
        if role == "user":
            out += _user(blocks, f"messages[{i}].content")
        else:
            out.append(_assistant(blocks, f"messages[{i}].content"))
    return [ChatMessage(**m) for m in out]


def prefill(req: MessagesRequest) -> str | None:
    """The text of a final assistant turn, which the answer continues; None without one."""
    last = req.messages[-1]
    if last.get("role") != "assistant":
        return None
    return text_of(last.get("content"), f"messages[{len(req.messages) - 1}].content")


# ----- tools --------------------------------------------------------------------------------

def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Client tools as chat function tools; Anthropic's server tools are refused."""
    out = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(where, "a tool must be an object")
        if tool.get("type") not in (None, "custom"):
            raise unsupported(f"{where}.type", f"the server tool {tool.get('type')!r} (only "
                              f"client tools with an input_schema)")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad(f"{where}.input_schema", "a JSON schema object is required")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise bad(f"{where}.description", "must be a string")
        function = {"name": _string(tool, "name", where), "parameters": schema}
        if description:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(choice: dict[str, Any] | None, has_tools: bool) -> tuple[Any, bool]:
    """Anthropic's ``tool_choice`` as (the chat tool_choice, parallel tool calls)."""
    if choice is None:
        return ("auto" if has_tools else None), True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "auto":
        return ("auto" if has_tools else None), parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", True
    if kind == "tool":
        name = _string(choice, "name", "tool_choice")
        return {"type": "function", "function": {"name": name}}, False
    raise bad("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', got {kind!r}")


def thinking_enabled(thinking: dict[str, Any] | None) -> tuple[bool | None, int | None]:
    """(whether thinking is asked for, None where nothing was said; its token budget)."""
    if thinking is None:
        return None, None
    kind = thinking.get("type")
    if kind == "disabled":
        return False, None
    if kind == "adaptive":
        return True, None
    if kind != "enabled":
        raise bad("thinking.type", f"must be 'enabled', 'disabled' or 'adaptive', got {kind!r}")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise bad("thinking.budget_tokens", "a positive integer is required")
    return True, budget


def output_format(config: dict[str, Any] | None) -> StructuredOutputs | None:
    """``output_config.format`` (a JSON schema the text must keep) as a constraint; its other
    settings (``effort``) are refused by name: nothing here would honour them."""
    for key in sorted(set(config or {}) - {"format"}):
        raise bad(f"output_config.{key}", "is not supported by this server")
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad("output_config.format.type", "must be 'json_schema'")
    if not isinstance(fmt.get("schema"), dict):
        raise bad("output_config.format.schema", "a JSON schema object is required")
    return StructuredOutputs(json=fmt["schema"], param="output_config.format.schema")
