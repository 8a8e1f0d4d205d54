"""What a request constrains its output to: pure, validated, hashable data (no grammar library).

``StructuredOutputs`` is the offline API's ``SamplingParams.structured_outputs`` and what every
request field of the server (``response_format``, vLLM's ``structured_outputs`` and
``guided_*``, tool choice) turns into. Exactly one constraint is set. ``key`` identifies the
compiled grammar, so equal constraints share one compilation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


class ConstraintError(ValueError):
    """A constraint that is malformed or does not compile; ``param`` names the request field
    it came from (the server's 400 reports it)."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class StructuredOutputs:
    """One output constraint.

    - ``json``: a JSON schema (a dict or its JSON text);
    - ``regex``: the whole output matches it;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a context-free grammar, in Lark syntax or GBNF (``root ::= ...``);
    - ``json_object``: any JSON object.

    ``whitespace_pattern`` (JSON only) is a regex for the whitespace allowed between tokens of
    the JSON text. None (the default) allows none (compact ``,`` and ``:`` separators), so a
    model cannot pad blanks until ``max_tokens`` and the forced text between values (keys,
    quotes, braces) can be jumped over.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_pattern: str | None = None
    param: str = "structured_outputs"  # the request field it came from, for error messages

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            if not isinstance(self.json, Mapping):
                raise ConstraintError(f"a JSON schema must be an object, got "
                                      f"{type(self.json).__name__}", self.param)
            object.__setattr__(self, "json", json.dumps(self.json))  # key order is output order
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, Sequence) or not choice \
                    or not all(isinstance(c, str) and c for c in choice):
                raise ConstraintError(f"choice must be a non-empty list of non-empty strings, "
                                      f"got {choice!r}", self.param)
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConstraintError(f"{name} must be a non-empty string, got {value!r}",
                                      self.param)
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ConstraintError(f"exactly one of {', '.join(KINDS)} must be set, got "
                                  f"{set_kinds or 'none'}", self.param)
        if self.whitespace_pattern is not None and self.kind not in ("json", "json_object"):
            raise ConstraintError("whitespace_pattern applies to JSON only", self.param)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, str | None]:
        """Equal keys compile to the same grammar."""
        value = getattr(self, self.kind)
        text = json.dumps(value) if self.kind == "choice" else str(value)
        return self.kind, text, self.whitespace_pattern

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], param: str = "structured_outputs"
                  ) -> StructuredOutputs | None:
        """vLLM's ``structured_outputs`` object. Keys it defines that tokenmill does not
        implement are refused by name; an object with no constraint is None."""
        if not isinstance(data, Mapping):
            raise ConstraintError("must be an object", param)
        unknown = set(data) - _DICT_KEYS - _IGNORED_KEYS
        if unknown:
            raise ConstraintError(f"unsupported field(s) {sorted(unknown)}; supported: "
                                  f"{sorted(_DICT_KEYS)}", param)
        kw = {k: data[k] for k in _DICT_KEYS if data.get(k) not in (None, False)}
        if kw.pop("disable_any_whitespace", None) and "whitespace_pattern" in kw:
            raise ConstraintError("disable_any_whitespace and whitespace_pattern conflict", param)
        if not kw or set(kw) == {"whitespace_pattern"}:
            return None
        return cls(**kw, param=param)


# vLLM's StructuredOutputsParams fields. `disable_any_whitespace` asks for what is already the
# default here. Ignored: `backend` and `disable_fallback` choose among libraries, and tokenmill
# has one, which never falls back; `disable_additional_properties` tunes one library's handling
# of objects that say nothing about extra keys, which tokenmill always closes (backend.py).
_DICT_KEYS = {"json", "regex", "choice", "grammar", "json_object", "whitespace_pattern",
              "disable_any_whitespace"}
_IGNORED_KEYS = {"backend", "disable_fallback", "disable_additional_properties"}


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
