"""How much one request may ask for: each bound has a ``serve`` flag, and every check runs before
any work is done (tokenizing, rendering, queueing), answering a 400 that names the field (413 for
the body, checked by the app as it arrives)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

# The longest text ``n`` tokens can be is n times the longest token; a prompt longer than that
# cannot fit the context whatever it holds, so it is refused before it is tokenized.
MIN_PROMPT_CHARS = 4096


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 32 << 20
    max_prompt_chars: int | None = None  # None: max_model_len x the longest token's length
    max_n: int = 128
    max_request_tokens: int | None = None  # n x max_tokens; None: the KV cache's size in tokens
    max_stop: int = 16  # stop strings (and stop token ids: 4x this)
    max_stop_chars: int = 1024
    max_logit_bias: int = 1024
    max_logprobs: int = 20
    trust_request_chat_template: bool = False
    chat_template_timeout: float = 5.0  # seconds a request's own template may render

    def resolve(self, max_model_len: int, longest_token_chars: int,
                kv_cache_tokens: int) -> RequestLimits:
        """These limits with the derived defaults filled in."""
        prompt_chars = self.max_prompt_chars
        if prompt_chars is None:
            prompt_chars = max(MIN_PROMPT_CHARS, max_model_len * max(1, longest_token_chars))
        tokens = self.max_request_tokens
        if tokens is None:
            tokens = max(kv_cache_tokens, max_model_len)
        return dataclasses.replace(self, max_prompt_chars=prompt_chars, max_request_tokens=tokens)

    def check(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be > 0, got {value}")


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """``serve``'s flags for ``RequestLimits``."""
    d = RequestLimits()
    g = p.add_argument_group("request limits (each checked before any work; 400, or 413 for "
                             "the body)")
    g.add_argument("--max-request-bytes", dest="max_body_bytes", type=int,
                   default=d.max_body_bytes, help="request body size (default: 32 MiB)")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="characters of one prompt (or a conversation's messages) before "
                        "tokenizing (default: the longest text the context can hold, "
                        "max-model-len x the longest token)")
    g.add_argument("--max-n", type=int, default=d.max_n,
                   help=f"choices per request (default: {d.max_n})")
    g.add_argument("--max-request-tokens", type=int, default=None,
                   help="tokens one request may ask to generate: prompts x n x max_tokens "
                        "(default: the KV cache's size in tokens)")
    g.add_argument("--max-stop", type=int, default=d.max_stop,
                   help=f"stop strings per request (stop_token_ids: 4x; default: {d.max_stop})")
    g.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                   help=f"characters of one stop string (default: {d.max_stop_chars})")
    g.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias,
                   help=f"logit_bias entries (default: {d.max_logit_bias})")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help=f"logprobs / top_logprobs (default and most: {d.max_logprobs})")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render chat templates sent in requests (chat_template); they run in "
                        "a separate process under a time and memory bound. Off: such "
                        "requests get a 400")
    g.add_argument("--chat-template-timeout", type=float, default=d.chat_template_timeout,
                   help="seconds a request's own chat template may render (default: "
                        f"{d.chat_template_timeout:g})")


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """The ``RequestLimits`` the flags of ``add_limit_args`` ask for."""
    from tokenmill.params import MAX_LOGPROBS

    if args.max_logprobs > MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be <= {MAX_LOGPROBS}")
    limits = RequestLimits(
        max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
        max_n=args.max_n, max_request_tokens=args.max_request_tokens, max_stop=args.max_stop,
        max_stop_chars=args.max_stop_chars, max_logit_bias=args.max_logit_bias,
        max_logprobs=args.max_logprobs,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_timeout=args.chat_template_timeout)
    limits.check()
    return limits
