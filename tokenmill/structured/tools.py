"""Tool choice as a constraint: ``required`` and a named function are enforced by a grammar of
the model family's call syntax (``ToolCallParser.call_grammar``) around each offered function's
``parameters`` schema; ``auto`` and ``none`` leave the model free (``auto`` output is parsed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.structured.backend import closed_objects
from tokenmill.structured.spec import StructuredOutputs
from tokenmill.structured.tool_parsers import ToolCallParser

_ANY_ARGUMENTS = {"type": "object"}


def function_name(tool_choice: Any) -> str | None:
    """The function a ``{"type": "function", "function": {"name": ...}}`` choice names."""
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        if tool_choice.get("type") == "function" and isinstance(function, Mapping) \
                and isinstance(function.get("name"), str):
            return function["name"]
    return None


def check_tool_choice(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any) -> str:
    """``tool_choice`` as one of ``none``, ``auto``, ``required``, ``named``; ``ValueError``
    (naming the field) for a value OpenAI does not define or a function not offered."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return tool_choice
    name = function_name(tool_choice)
    if name is None:
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    offered = [t["function"]["name"] for t in tools or ()]
    if name not in offered:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools "
                         f"offered ({', '.join(offered) or 'none'})")
    return "named"


def tool_choice_constraint(tools: Sequence[Mapping[str, Any]], tool_choice: Any,
                           parallel_tool_calls: bool, parser: ToolCallParser
                           ) -> StructuredOutputs | None:
    """The grammar a ``required`` or named tool choice puts on the output; None otherwise.
    ``required`` allows one call of any offered function, or several when
    ``parallel_tool_calls``; a named choice allows exactly one call of that function."""
    mode = check_tool_choice(tools, tool_choice)
    if mode in ("none", "auto"):
        return None
    if mode == "named":
        name = function_name(tool_choice)
        tools = [t for t in tools if t["function"]["name"] == name]
    bodies = [parser.call_schema(t["function"]["name"],
                                 closed_objects(t["function"].get("parameters") or _ANY_ARGUMENTS))
              for t in tools]
    body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    body["x-guidance"] = {"whitespace_flexible": False}  # compact, as in json outputs
    repeat = ' ("\\n" call)*' if mode == "required" and parallel_tool_calls else ""
    grammar = f"start: call{repeat}\ncall: {parser.call_grammar(body)}\n"
    return StructuredOutputs(grammar=grammar, param="tool_choice")
