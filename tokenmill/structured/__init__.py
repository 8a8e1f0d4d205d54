"""Structured output: constraints (``spec``), grammars on llguidance (``backend``), the engine's
per-sequence state and masks (``manager``), and tool calling (``tools``, ``tool_parsers``,
``tool_prompt``). Only ``spec`` is imported here: the rest loads the grammar library."""

from tokenmill.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
