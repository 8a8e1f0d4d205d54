"""How ``select`` picks one of its choices, from the strongest way the server offers to the
weakest:

1. ``logprob``: the likelihood of each choice after the prompt, from one ``echo`` request with
   ``max_tokens: 0`` (all choices as prompts of it, their shared prefix cached once). This is
   the ranking a model scoring would give; raw prompts only (a chat's rendered prompt is the
   server's).
2. ``choice``: grammar-constrained greedy decoding over the choices (``structured_outputs``,
   or vLLM's older ``guided_choice``): exact on the first token that tells the choices apart.
3. ``free``: the server constrains nothing; a short greedy answer mapped to the closest choice.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.lang.backend import Endpoint, EndpointError
from tokenmill.lang.ir import Select

Call = Callable[[dict[str, Any]], dict[str, Any]]  # sampling fields -> {"text", ...}

# The request fields that constrain output to a list of strings, newest first; a server that
# refuses one (400/422) is asked with the next, and the last asks for nothing.
_CONSTRAINTS: tuple[Callable[[list[str]], dict[str, Any]], ...] = (
    lambda choices: {"structured_outputs": {"choice": choices}},
    lambda choices: {"guided_choice": choices},
    lambda choices: {},
)


def choose(endpoint: Endpoint, sel: Select, context: str | None,
           call: Call) -> tuple[str, dict[str, Any]]:
    """The choice picked and how (``get_meta_info``): ``context`` is the raw prompt so far,
    None in a chat."""
    wants_logprob = sel.method == "logprob" or (
        sel.method == "auto" and context is not None and endpoint.supports("prompt_logprobs"))
    if not wants_logprob:
        return by_constraint(sel.choices, call)
    if context is None:
        raise EndpointError(0, "select(method='logprob') needs a raw prompt: in a chat the "
                               "server renders the prompt; use method='choice'")
    if not endpoint.supports("prompt_logprobs"):
        raise EndpointError(0, f"{endpoint.base_url} does not return prompt logprobs "
                               f"(echo with max_tokens 0); use method='choice'")
    return by_logprob(endpoint, sel, context)


def by_logprob(endpoint: Endpoint, sel: Select, context: str) -> tuple[str, dict[str, Any]]:
    scored = endpoint.score(context, sel.choices)
    keys = [s.mean if sel.normalize else s.logprob for s in scored]
    best = max(range(len(keys)), key=keys.__getitem__)
    return sel.choices[best], {
        "method": "logprob", "normalize": sel.normalize, "scores": keys,
        "logprobs": [s.logprob for s in scored], "num_tokens": [s.num_tokens for s in scored]}


def by_constraint(choices: Sequence[str], call: Call) -> tuple[str, dict[str, Any]]:
    # A token holds at least one character of these choices, so this many tokens always fit
    # the longest one; the constrained decoder stops at the choice's end.
    fields = {"max_tokens": max(len(c) for c in choices) + 2, "temperature": 0}
    for constraint in _CONSTRAINTS:
        extra = constraint(list(choices))
        try:
            text = call({**fields, **extra})["text"]
        except EndpointError as e:
            if e.status in (400, 422) and extra:
                continue  # the server does not know this field: try the next
            raise
        if extra and text in choices:
            return text, {"method": "choice"}
        return closest(text, choices), {"method": "free" if not extra else "choice",
                                        "text": text}
    raise AssertionError("unreachable: the last constraint asks for nothing")


def closest(text: str, choices: Sequence[str]) -> str:
    """The choice ``text`` names: the one it starts with (the longest), else the most similar."""
    stripped = text.strip()
    starts = [c for c in choices if stripped.startswith(c.strip()) or text.startswith(c)]
    if starts:
        return max(starts, key=len)
    ratio = [difflib.SequenceMatcher(None, stripped, c.strip()).ratio() for c in choices]
    return choices[max(range(len(choices)), key=ratio.__getitem__)]
