"""Output constraints from request fields: ``from_request`` turns OpenAI's ``response_format``,
vLLM's ``structured_outputs`` and the older ``guided_*`` fields into one ``StructuredOutputs``.

The constraint itself (``StructuredOutputs``, ``ConstraintError``) is pure data and lives in
``tokenmill.params`` beside ``SamplingParams``, which holds it; it is re-exported here for the
importers that know it by this path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.params import KINDS, ConstraintError, StructuredOutputs

__all__ = ["KINDS", "ConstraintError", "StructuredOutputs", "from_request"]


def from_request(*, response_format: Mapping[str, Any] | None = None,
                 structured_outputs: Mapping[str, Any] | None = None,
                 guided_json: str | Mapping[str, Any] | None = None,
                 guided_regex: str | None = None, guided_choice: Sequence[str] | None = None,
                 guided_grammar: str | None = None, guided_whitespace_pattern: str | None = None
                 ) -> StructuredOutputs | None:
    """The constraint of an OpenAI / vLLM request: ``response_format`` (OpenAI), the
    ``structured_outputs`` object (vLLM) or the older ``guided_*`` fields; at most one."""
    found: list[StructuredOutputs] = []
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            found.append(spec)
    if structured_outputs is not None:
        spec = StructuredOutputs.from_dict(structured_outputs)
        if spec is not None:
            found.append(spec)
    guided = {"json": guided_json, "regex": guided_regex, "choice": guided_choice,
              "grammar": guided_grammar}
    for kind, value in guided.items():
        if value is not None:
            ws = guided_whitespace_pattern if kind == "json" else None
            found.append(StructuredOutputs(**{kind: value}, whitespace_pattern=ws,
                                           param=f"guided_{kind}"))
    if len(found) > 1:
        raise ConstraintError(f"give one output constraint, got {len(found)} "
                              f"({', '.join(s.param for s in found)})", found[1].param)
    return found[0] if found else None


def _response_format(rf: Mapping[str, Any]) -> StructuredOutputs | None:
    param = "response_format"
    if not isinstance(rf, Mapping):
        raise ConstraintError("must be an object", param)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param=param)
    if kind == "json_schema":
        body = rf.get("json_schema")
        if not isinstance(body, Mapping) or not isinstance(body.get("name"), str):
            raise ConstraintError("json_schema must be an object with a name and a schema",
                                  f"{param}.json_schema")
        schema = body.get("schema")
        if not isinstance(schema, Mapping):
            raise ConstraintError("schema must be a JSON schema object",
                                  f"{param}.json_schema.schema")
        return StructuredOutputs(json=schema, param=f"{param}.json_schema.schema")
    raise ConstraintError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          f"{param}.type")
