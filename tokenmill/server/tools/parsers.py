"""Turn a model's text output into OpenAI tool calls, whole or while it streams: the registry
of call syntaxes that ``--tool-call-parser`` picks from.

============ ============================================================ =====================
name         the model writes                                             models
============ ============================================================ =====================
hermes       ``<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>`` SmolLM2, Qwen2.5/3,
                                                                          Hermes
llama3_json  ``{"name": .., "parameters": {..}}; {..}``                  Llama 3.1-3.3
mistral      ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]``       Mistral, Mixtral
qwen3_coder  ``<tool_call>\\n<function=..>\\n<parameter=..>\\n..``         Qwen3-Coder
pythonic     ``[name(key=value, ..), ..]``                                Llama 3.2/4, ToolACE
============ ============================================================ =====================

How a text is split into content and calls, and how the streamer keeps to the same split, is in
``base.py``; each family's syntax in ``markers.py``, ``xml_calls.py`` and ``leading.py``.
Streamed calls send their arguments while the model writes them (hermes, llama3_json, mistral,
qwen3_coder: ``json_stream.py``'s readers, and ``xml_calls.XmlCallReader``), re-written as the
non-streamed arguments are, so the deltas add up to them; pythonic calls go out when their list
closes.
"""

from __future__ import annotations

from tokenmill.server.tools.base import (
    IdFactory,
    ParsedMessage,
    ToolCall,
    ToolCallParser,
    ToolCallStreamer,
    new_call_id,
)
from tokenmill.server.tools.leading import Llama3JsonToolParser, PythonicToolParser
from tokenmill.server.tools.markers import HermesToolParser, MistralToolParser
from tokenmill.server.tools.xml_calls import Qwen3CoderToolParser

__all__ = [
    "TOOL_PARSERS", "HermesToolParser", "IdFactory", "Llama3JsonToolParser", "MistralToolParser",
    "ParsedMessage", "PythonicToolParser", "Qwen3CoderToolParser", "ToolCall", "ToolCallParser",
    "ToolCallStreamer", "get_tool_parser", "new_call_id",
]

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                              Qwen3CoderToolParser, PythonicToolParser)
}


def get_tool_parser(name: str, id_factory: IdFactory | None = None) -> ToolCallParser:
    """A parser by its registry name; ValueError listing the known names if there is none."""
    try:
        cls = TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known parsers: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
    return cls(id_factory)
