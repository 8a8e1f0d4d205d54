"""Structured output: constraints from request fields (``spec``; the constraint itself,
``StructuredOutputs``, is pure data in ``tokenmill.params``), grammars on llguidance
(``backend``) and the engine's per-sequence state and masks (``manager``). Only ``spec`` is
imported here: the rest loads the grammar library."""

from tokenmill.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
