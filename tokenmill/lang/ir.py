"""What a program adds to its state: text, ``gen``, ``select`` and chat roles.

These are plain records; ``state.py`` runs them. ``"text" + gen(...)`` and lists of parts build
a ``Seq``, so a role can hold text and calls together: ``assistant("Answer: " + gen("a"))``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

ROLES = ("system", "user", "assistant")


class Expr:
    """Something a program can add to its state with ``+=``."""

    def __add__(self, other: Part) -> Seq:
        return Seq((self, other))

    def __radd__(self, other: Part) -> Seq:
        return Seq((other, self))


Part = Union[str, Expr, Sequence["Part"]]


@dataclass(frozen=True, eq=False)
class Seq(Expr):
    parts: tuple[Part, ...]


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    """Generated text, stored under ``name``. ``regex`` / ``json_schema`` constrain it through
    the server's structured output; ``extra`` goes into the request body as it is (seed,
    top_k, ignore_eos, ... of servers that take them)."""

    name: str | None
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    regex: str | None = None
    json_schema: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        """The sampling fields of a completion or chat request."""
        body: dict[str, Any] = {"max_tokens": self.max_tokens, **self.extra}
        for key in ("temperature", "top_p"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if self.stop:
            body["stop"] = list(self.stop)
        if self.regex is not None:
            body["structured_outputs"] = {"regex": self.regex}
        if self.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": self.name or "output", "schema": self.json_schema}}
        return body


@dataclass(frozen=True, eq=False)
class Select(Expr):
    """One of ``choices``, stored under ``name``. ``method``: ``"logprob"`` ranks the choices
    by their likelihood after the text so far (prompt logprobs, as SGLang does; mean per token
    when ``normalize``, else the sum), ``"choice"`` lets grammar-constrained decoding pick
    (greedy), ``"auto"`` the first when the server scores prompts, else the second."""

    name: str | None
    choices: tuple[str, ...]
    method: str = "auto"
    normalize: bool = True


@dataclass(frozen=True, eq=False)
class Role(Expr):
    """A chat message: ``system``, ``user`` or ``assistant`` around its content parts."""

    role: str
    content: Part


def gen(name: str | None = None, max_tokens: int = 128, stop: str | Sequence[str] = (),
        temperature: float | None = None, top_p: float | None = None,
        regex: str | None = None, json_schema: dict[str, Any] | None = None,
        choices: Sequence[str] | None = None, **extra: Any) -> Expr:
    """Generated text under ``name``; with ``choices``, the same as ``select`` by
    constrained decoding."""
    if choices is not None:
        return select(name, choices, method="choice")
    if sum(x is not None for x in (regex, json_schema)) > 1:
        raise ValueError("gen: regex and json_schema constrain the same text; give one")
    if max_tokens < 1:
        raise ValueError(f"gen: max_tokens must be >= 1, got {max_tokens}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    return Gen(name, max_tokens, stops, temperature, top_p, regex, json_schema, dict(extra))


def select(name: str | None, choices: Sequence[str], method: str = "auto",
           normalize: bool = True) -> Select:
    """One of ``choices`` under ``name`` (see ``Select``)."""
    if method not in ("auto", "logprob", "choice"):
        raise ValueError(f"select: method is auto, logprob or choice, got {method!r}")
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select: choices must be non-empty strings")
    return Select(name, tuple(choices), method, normalize)


def system(content: Part = "") -> Role:
    return Role("system", content)


def user(content: Part = "") -> Role:
    return Role("user", content)


def assistant(content: Part = "") -> Role:
    return Role("assistant", content)
