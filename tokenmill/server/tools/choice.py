"""Tool choice as a constraint, a grammar of the model family's call syntax
(``ToolCallParser.forced_grammar`` / ``auto_grammar``) around each offered function's
``parameters`` schema:

- ``required``: the output is one call (or several, with ``parallel_tool_calls``);
- a named function: the output is one call of it;
- ``auto``: the text is free, but from the moment the model writes the call marker the call
  must be a valid call of an offered function (llguidance's lazy lexeme ends the free text at
  the first marker; families without a marker allow text that does not open like a call, or
  calls first), so a call the model chooses to make always parses;
- ``none``: no constraint (the output is not parsed for calls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.params import ConstraintError, StructuredOutputs
from tokenmill.server.tools.parsers import ToolCallParser
from tokenmill.server.tools.prompt import ToolsError
from tokenmill.structured.backend import closed_objects

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
    """``tool_choice`` as one of ``none``, ``auto``, ``required``, ``named``; ``ToolsError``
    (``param`` "tool_choice") for a value OpenAI does not define or a function not offered."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ToolsError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice
    name = function_name(tool_choice)
    if name is None:
        raise ToolsError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    offered = [t["function"]["name"] for t in tools or ()]
    if name not in offered:
        raise ToolsError(f"tool_choice names function {name!r}, which is not among the tools "
                         f"offered ({', '.join(offered) or 'none'})", "tool_choice")
    return "named"


def tool_choice_constraint(tools: Sequence[Mapping[str, Any]], tool_choice: Any,
                           parallel_tool_calls: bool, parser: ToolCallParser
                           ) -> StructuredOutputs | None:
    """The grammar a tool choice puts on the output (None for ``none``), in the family's own
    syntax (``ToolCallParser.forced_grammar`` / ``auto_grammar``); see the module docstring.
    With ``auto`` and no ``parallel_tool_calls``, text after the first call is free (the parsed
    reply keeps that one call)."""
    mode = check_tool_choice(tools, tool_choice)
    if mode == "none":
        return None
    if mode == "named":
        name = function_name(tool_choice)
        tools = [t for t in tools if t["function"]["name"] == name]
    functions = [(t["function"]["name"],
                  closed_objects(t["function"].get("parameters") or _ANY_ARGUMENTS))
                 for t in tools]
    if mode == "auto":
        return StructuredOutputs(grammar=parser.auto_grammar(functions, parallel_tool_calls),
                                 param="tools")
    grammar = parser.forced_grammar(functions, mode == "required" and parallel_tool_calls)
    return StructuredOutputs(grammar=grammar, param="tool_choice")


@dataclass(frozen=True)
class ToolSetup:
    """What a request's tools ask of one generation, in chat terms whatever API it came from:
    the functions the template is told about, those the model may call, the choice among them
    and how many calls are kept (the output is parsed for calls unless ``mode`` is none)."""

    offered: list[dict[str, Any]] | None  # chat-format function tools, validated
    choosable: list[dict[str, Any]] | None  # the ones the model may call
    choice: Any  # the chat ``tool_choice``
    mode: str  # none, auto, required or named (check_tool_choice)
    limit: int | None = None  # the most calls kept, later ones dropped; None: any number

    @classmethod
    def from_chat(cls, tools: list[dict[str, Any]] | None, tool_choice: Any,
                  parallel_tool_calls: bool) -> ToolSetup:
        """A Chat Completions request's tools (already checked by ``check_tools``)."""
        mode = check_tool_choice(tools, tool_choice)
        return cls(tools, tools, tool_choice, mode, None if parallel_tool_calls else 1)

    @property
    def active(self) -> bool:
        """Whether the output is parsed for calls (and the template sees the tools)."""
        return self.mode != "none"

    @property
    def parallel(self) -> bool:
        return self.limit is None or self.limit > 1

    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.offered if self.active else None

    def constraint(self, own: StructuredOutputs | None,
                   parser: ToolCallParser) -> StructuredOutputs | None:
        """The one output constraint: the request's ``own`` (response_format, text.format or a
        vLLM extra), else the tool choice's grammar. ``ConstraintError`` where a forced call
        would also have to be held to ``own``."""
        if own is not None and self.mode in ("required", "named"):
            raise ConstraintError(f"a {self.mode} tool choice cannot be combined with another "
                                  f"output constraint", own.param)
        if own is not None or not self.active:
            return own
        return tool_choice_constraint(self.choosable, self.choice, self.parallel, parser)
