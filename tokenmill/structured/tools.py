"""Tool choice as a constraint, a grammar of the model family's call syntax
(``ToolCallParser.call_grammar``) around each offered function's ``parameters`` schema:

- ``required``: the output is one call (or several, with ``parallel_tool_calls``);
- a named function: the output is one call of it;
- ``auto``: the text is free, but from the moment the model writes the call marker the call
  must be a valid call of an offered function (llguidance's lazy lexeme ends the free text at
  the first marker), so a call the model chooses to make always parses;
- ``none``: no constraint (the output is not parsed for calls).
"""

from __future__ import annotations

import json
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
    """The grammar a tool choice puts on the output (None for ``none``); see the module
    docstring. With ``auto`` and no ``parallel_tool_calls``, text after the first call is free
    (the parsed reply keeps that one call)."""
    mode = check_tool_choice(tools, tool_choice)
    if mode == "none":
        return None
    if mode == "named":
        name = function_name(tool_choice)
        tools = [t for t in tools if t["function"]["name"] == name]
    bodies = [parser.call_schema(t["function"]["name"],
                                 closed_objects(t["function"].get("parameters") or _ANY_ARGUMENTS))
              for t in tools]
    body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    body["x-guidance"] = {"whitespace_flexible": False}  # compact, as in json outputs
    if mode == "auto":
        # Free text up to each marker (lazy: it ends at the first one), a checked call after.
        grammar = (f"%llguidance {{}}\n"
                   f"start: call{'*' if parallel_tool_calls else '?'} text\n"
                   f"text: TEXT\n"
                   f"TEXT: /(.|\\n)*/\n"
                   f"marker[lazy]: TEXT {json.dumps(parser.start_marker)}\n"
                   f"call: marker {parser.after_marker_grammar(body)}\n")
        return StructuredOutputs(grammar=grammar, param="tools")
    repeat = ' ("\\n" call)*' if mode == "required" and parallel_tool_calls else ""
    grammar = f"start: call{repeat}\ncall: {parser.call_grammar(body)}\n"
    return StructuredOutputs(grammar=grammar, param="tool_choice")
