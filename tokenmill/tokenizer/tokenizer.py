"""The engine's tokenizer: a thin wrapper around a ``tokenizers.Tokenizer`` plus what the model's
files say about special tokens, stop ids and the chat template.

Built from a GGUF file's metadata (``from_gguf``) or a Hugging Face directory (``from_hf_dir``);
``load_tokenizer`` picks the right one for a model argument. Never imports torch or transformers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from tokenmill.errors import ModelLoadError
from tokenmill.model_source import resolve_model
from tokenmill.tokenizer.chat_template import (DEFAULT_TEMPLATE_NAME, render_chat,
                                               select_template)
from tokenmill.gguf_meta import read_gguf_metadata
from tokenmill.tokenizer.gguf_vocab import GGUFVocab, build_backend

# Longer texts are encoded through the batch call, which lets go of the GIL while it works (the
# single-text call holds it: a 500k-character prompt would stall every other thread for a second).
_GIL_FREE_CHARS = 4096

# Fill-in-the-middle tokens (prefix, suffix, middle) as StarCoder-style and Qwen-style vocabularies
# spell them.
_FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
               ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))

# Token texts llama.cpp treats as end-of-generation whatever the file's eos id says, so a chat
# model that ends a turn with e.g. <|im_end|> or <|eot_id|> stops there.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    def __init__(self, backend: HFTokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, unk_token: str | None = None,
                 pad_token: str | None = None, extra_eos_ids: Iterable[int] = (),
                 chat_template: str | Mapping[str, str] | Sequence[Any] | None = None) -> None:
        self._backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.unk_token, self.pad_token = unk_token, pad_token
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        stops = {self.eos_token_id, *extra_eos_ids} - {None}
        self.eos_token_ids: frozenset[int] = frozenset(stops)  # every id that ends generation
        self.chat_templates: dict[str, str] = _as_named_templates(chat_template)
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._token_texts: dict[int, str] = {}  # decode_token's memo: at most the vocabulary

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build from a GGUF file's tokenizer metadata (tensor data is not read)."""
        meta = read_gguf_metadata(path)
        vocab = GGUFVocab.from_metadata(meta)
        eog = {i for i, t in enumerate(vocab.tokens) if t in _EOG_TEXTS}
        return cls(build_backend(vocab), bos_token=vocab.token(vocab.bos_id),
                   eos_token=vocab.token(vocab.eos_id), unk_token=vocab.token(vocab.unk_id),
                   pad_token=vocab.token(vocab.pad_id), extra_eos_ids=(*vocab.extra_eog_ids, *eog),
                   chat_template=_gguf_templates(meta))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face model directory (tokenizer.json and its config files)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(f"{str(path)!r} has no tokenizer.json; tokenmill needs the fast "
                                 "(tokenizers) format of the tokenizer")
        try:
            backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot read {str(path / 'tokenizer.json')!r}: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        legacy_map = _read_json(path / "special_tokens_map.json")  # older exports keep them here
        tokens = {name: _token_content(config.get(name) or legacy_map.get(name))
                  for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        if tokens["eos_token"] is None and extra:
            tokens["eos_token"] = backend.id_to_token(extra[0])
        _apply_bos_eos_flags(backend, config, tokens["bos_token"], tokens["eos_token"])
        # BERT-style files pad and truncate every text (to 128 tokens for all-MiniLM): the
        # engine takes prompts as they are and refuses those too long, never cuts them.
        backend.no_padding()
        backend.no_truncation()
        return cls(backend, **tokens, extra_eos_ids=extra,
                   chat_template=_hf_chat_template(path, config))

    # -- the API the engine uses ------------------------------------------------------------

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (e.g. for grammar backends needing the vocab)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None when the model has none."""
        if len(self.chat_templates) == 1:
            return next(iter(self.chat_templates.values()))
        return self.chat_templates.get(DEFAULT_TEMPLATE_NAME)

    @cached_property
    def longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: n tokens never hold more text than n
        times this (byte-level entries spell one character per byte)."""
        return max((len(t) for t in self.get_vocab()), default=1)

    @cached_property
    def fim_tokens(self) -> tuple[str, str, str] | None:
        """(prefix, suffix, middle) fill-in-the-middle tokens, if the vocabulary has them."""
        vocab = self.get_vocab()
        return next((names for names in _FIM_TOKENS if all(n in vocab for n in names)), None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their ids."""
        if len(text) > _GIL_FREE_CHARS:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str) -> tuple[list[int], list[int]]:
        """A sentence pair as a cross-encoder reads it (BERT: ``[CLS] a [SEP] b [SEP]``, by
        the tokenizer's pair template): its token ids and each token's segment (0, then 1)."""
        encoding = self._backend.encode(text, pair)
        return encoding.ids, encoding.type_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # the detokenizer passes lists, once per token per sequence: no copy of those
        return self._backend.decode(ids if type(ids) is list else list(ids),
                                    skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """``decode([token_id], skip_special_tokens=False)``, remembered: the incremental
        detokenizer decodes most tokens alone once per step of every sequence."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], False)
        return text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary strings of ``ids`` (None for an id outside the vocabulary)."""
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, tools: Sequence[Any] | None = None,
                            chat_template: str | None = None, *,
                            renderer: Callable[..., str] | None = None,
                            max_chars: int | None = None, **kwargs: Any) -> str:
        """Render ``messages`` into a prompt string (not tokenized) the way transformers does.

        ``chat_template`` is a template name or a full template source; extra keyword arguments
        become template variables (e.g. ``enable_thinking=False``). ``renderer`` replaces
        ``render_chat`` (same arguments; e.g. one that runs in another process); a rendering
        longer than ``max_chars`` fails.
        """
        source = self.template_source(tools, chat_template)
        variables = {**self._special_token_variables(), **kwargs}
        return (renderer or render_chat)(source, messages,
                                         add_generation_prompt=add_generation_prompt,
                                         tools=tools, variables=variables, max_chars=max_chars)

    def template_source(self, tools: Sequence[Any] | None = None,
                        chat_template: str | None = None) -> str:
        """The template ``apply_chat_template`` renders: ``chat_template`` (a name, or a full
        template passed by the caller), else the model's tool or default template."""
        if chat_template is not None and chat_template not in self.chat_templates:
            return chat_template
        return select_template(self.chat_templates, tools, chat_template)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of a rendered conversation. The template already holds any BOS it wants,
        so no special tokens are added on top."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _special_token_variables(self) -> dict[str, str]:
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                 "unk_token": self.unk_token, "pad_token": self.pad_token}
        return {k: v for k, v in named.items() if v is not None}

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, stop_ids={sorted(self.eos_token_ids)})")


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a model argument: a known name, a ``.gguf`` file or a HF directory."""
    source = resolve_model(model)
    if source.kind == "gguf":
        return Tokenizer.from_gguf(source.path)
    return Tokenizer.from_hf_dir(source.path)


def _gguf_templates(meta: Mapping[str, Any]) -> dict[str, str]:
    """``tokenizer.chat_template`` plus llama.cpp's named extras (``...chat_template.tool_use``)."""
    prefix = "tokenizer.chat_template."
    templates = {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix)}
    if "tokenizer.chat_template" in meta:
        templates[DEFAULT_TEMPLATE_NAME] = meta["tokenizer.chat_template"]
    return templates


# -- Hugging Face directory helpers --------------------------------------------------------------

def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(path)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{str(path)!r} should hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or a serialized AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _apply_bos_eos_flags(backend: HFTokenizer, config: Mapping[str, Any], bos: str | None,
                         eos: str | None) -> None:
    """Honour explicit add_bos_token / add_eos_token flags, as transformers does.

    Without a flag, tokenizer.json's own post-processor decides; with one, the flags rebuild it.
    """
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    add_bos = bool(config.get("add_bos_token")) and bos is not None
    add_eos = bool(config.get("add_eos_token")) and eos is not None
    single = [*([bos] if add_bos else []), "$A", *([eos] if add_eos else [])]
    used = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    if any(i is None for _, i in used):
        raise ModelLoadError(f"tokenizer_config.json names a bos/eos token missing from the "
                             f"vocabulary: {[t for t, i in used if i is None]}")
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=[*single, "$B:1"], special_tokens=used)


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja wins over tokenizer_config.json, as in transformers."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    legacy = _read_json(path / "chat_template.json").get("chat_template")
    return config.get("chat_template") or legacy


def _as_named_templates(template: str | Mapping[str, str] | Sequence[Any] | None) -> dict[str, str]:
    """Normalise a template given as a string, a name->source map or [{name, template}, ...]."""
    if template is None:
        return {}
    if isinstance(template, str):
        return {DEFAULT_TEMPLATE_NAME: template}
    if isinstance(template, Mapping):
        return dict(template)
    return {item["name"]: item["template"] for item in template}
