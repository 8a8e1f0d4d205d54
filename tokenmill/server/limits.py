"""How much one request may ask for: each bound has a ``serve`` flag, and every check runs before
any work is done (tokenizing, rendering, queueing), answering a 400 that names the field (413 for
the body, checked by the app as it arrives)."""

from __future__ import annotations

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
