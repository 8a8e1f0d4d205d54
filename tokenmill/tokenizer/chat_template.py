"""Render a model's Jinja chat template the way ``transformers`` does.

Templates ship with models and are untrusted code, so they run in jinja2's immutable sandbox.
The environment matches transformers (trim_blocks, lstrip_blocks, loop controls, a
``raise_exception`` global, a ``tojson`` that keeps non-ASCII, ``strftime_now``), so a prompt
rendered here is byte-for-byte the prompt the model was fine-tuned on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenmill.errors import TokenmillError

DEFAULT_TEMPLATE_NAME = "default"
TOOL_TEMPLATE_NAME = "tool_use"


class ChatTemplateError(TokenmillError):
    """A chat template is missing, does not compile, or fails while rendering."""


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker).

    We never compute assistant masks, so the block just renders its body; without this tag the
    templates that use it would not even compile.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes and forces ASCII, which changes the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# The sandbox keeps a template from reaching Python's internals, not from asking for a string of
# 10^10 characters or a number of 10^9 digits. Templates repeat a separator or indent a few
# times; nothing real comes near these bounds.
MAX_REPEAT_ITEMS = 1 << 20
MAX_POWER_BITS = 1 << 16


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with ``*`` and ``**`` bounded. Intercepting them also keeps jinja
    from evaluating constant expressions while it compiles (or scans) a template."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                        and len(seq) * times > MAX_REPEAT_ITEMS:
                    raise jinja2.exceptions.SecurityError(
                        f"the template repeats a sequence to more than {MAX_REPEAT_ITEMS} items")
        elif isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1 and right * max(abs(left).bit_length(), 1) > MAX_POWER_BITS:
            raise jinja2.exceptions.SecurityError("the template computes a power too large")
        return super().call_binop(context, operator, left, right)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def scan_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its context (none for one that does not compile:
    rendering reports that). Scanning runs jinja's constant folding: ``'a'|center(1000000000)``
    builds its string right here, so a template a request sends is scanned only in the
    sandboxed child (``server/template_process.py``), never in the server."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.TemplateSyntaxError:
        return frozenset()


def compile_template(source: str) -> jinja2.Template:
    """A template ready to render (compiling folds constants too: see ``scan_variables``)."""
    env = _environment()
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        message = f"chat template does not compile: {exc} (line {exc.lineno})"
        raise ChatTemplateError(message) from exc


# The model's own templates (a few, used by every chat request) are scanned and compiled once.
# A request's own template never reaches these caches: the sandboxed child calls the functions
# above, so no request can keep templates alive here.
template_variables = lru_cache(maxsize=32)(scan_variables)
_compile = lru_cache(maxsize=32)(compile_template)


def select_template(templates: Mapping[str, str], tools: Sequence[Any] | None,
                    name: str | None = None) -> str:
    """Pick a template by name, else ``tool_use`` when tools are given, else ``default``."""
    if not templates:
        raise ChatTemplateError("this model has no chat template; pass a prompt instead of "
                                "messages, or a model whose tokenizer carries a chat template")
    if name is not None:
        if name not in templates:
            raise ChatTemplateError(f"no chat template named {name!r}; have {sorted(templates)}")
        return templates[name]
    if tools is not None and TOOL_TEMPLATE_NAME in templates:
        return templates[TOOL_TEMPLATE_NAME]
    if DEFAULT_TEMPLATE_NAME in templates:
        return templates[DEFAULT_TEMPLATE_NAME]
    raise ChatTemplateError(f"the model has several chat templates and none is named "
                            f"{DEFAULT_TEMPLATE_NAME!r}; choose one of {sorted(templates)}")


def render_chat(source: str | jinja2.Template, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool, tools: Sequence[Any] | None,
                variables: Mapping[str, Any], max_chars: int | None = None) -> str:
    """Render one conversation; every template failure becomes a ChatTemplateError, and so does
    an output longer than ``max_chars`` (checked as the template writes it). ``source`` is a
    template's text (compiled once and cached) or what ``compile_template`` returned."""
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    # OpenAI clients send e.g. content=None; templates handle a missing key but print "None".
    chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    template = _compile(source) if isinstance(source, str) else source
    # transformers always defines `documents` (None by default); `is not none` tests depend on it.
    context = {"documents": None, **variables, "messages": chat,
               "tools": list(tools) if tools is not None else None,
               "add_generation_prompt": add_generation_prompt}
    try:
        if max_chars is None:
            return template.render(**context)
        pieces, total = [], 0
        for piece in template.generate(**context):
            total += len(piece)
            if total > max_chars:
                raise ChatTemplateError(f"the chat template wrote more than {max_chars} "
                                        f"characters")
            pieces.append(piece)
        return "".join(pieces)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    except RecursionError as exc:
        raise ChatTemplateError("chat template failed: it recursed too deeply") from exc
    except MemoryError as exc:
        raise ChatTemplateError("chat template failed: it ran out of memory") from exc
    except Exception as exc:  # a template is code: whatever it raises fails this render only
        raise ChatTemplateError(f"chat template failed on these messages: "
                                f"{type(exc).__name__}: {exc}") from exc
