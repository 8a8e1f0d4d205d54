"""Build a ``tokenizers.Tokenizer`` from the vocabulary a GGUF file carries in its metadata.

A GGUF has no tokenizer.json: it stores tokens, token types, merges (or scores) and flags under
llama.cpp's key names, and llama.cpp is the reference for what they mean. Two model types:

* ``gpt2``: byte-level BPE. The text is first cut into words by a list of regexes chosen by
  ``tokenizer.ggml.pre`` (each regex further splits the pieces of the previous one, keeping
  unmatched stretches as pieces), then each word's UTF-8 bytes are merged by rank.
* ``llama``: SentencePiece-style BPE. Spaces become U+2581 (and one is prepended), the merge
  order follows the score of the merged token, and characters missing from the vocabulary fall
  back to ``<0xNN>`` byte tokens.

Control (type 3) tokens become special added tokens and user-defined (type 4) tokens plain added
tokens, so ``<|im_start|>`` in text encodes to its one id, as llama.cpp does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from tokenmill.errors import ModelLoadError

# llama.cpp's token types (enum llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPM_SPACE = "\u2581"  # SentencePiece's visible space

# Split regexes, written as the models' own tokenizer.json has them (the tokenizers library runs
# Oniguruma, so the case-insensitive groups llama.cpp had to rewrite can stay as they were).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp pre-tokenizes one family of ``tokenizer.ggml.pre`` values."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is taken whole (llama3)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token flag


_GPT2_SPEC = PreTokenizerSpec((_GPT2,))
_SMOLLM_SPEC = PreTokenizerSpec((r"\p{N}", _GPT2))  # every digit alone, then GPT-2's split
_LLAMA3_SPEC = PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_SPEC = PreTokenizerSpec((_QWEN2,))
_GPT4O_SPEC = PreTokenizerSpec((_GPT4O,))
_DEFAULT_SPEC = PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": _DEFAULT_SPEC,
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4", "gigachat",
                     "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "mellum", "modern-bert",
                     "trillion", "granite-docling", "roberta-bpe"), _GPT2_SPEC),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), _SMOLLM_SPEC),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"), _LLAMA3_SPEC),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizerSpec((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan"), _QWEN2_SPEC),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "minimax-m2"), _GPT4O_SPEC),
}

SUPPORTED_MODELS = ("gpt2", "llama")


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer-related metadata of a GGUF file, with llama.cpp's defaults applied."""

    model: str
    pre: str
    tokens: Sequence[str]
    token_types: Sequence[int]
    merges: Sequence[str]
    scores: Sequence[float]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    extra_eog_ids: tuple[int, ...]  # end-of-turn / end-of-message ids the file names
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> GGUFVocab:
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelLoadError("GGUF file carries no tokenizer (tokenizer.ggml.model is missing)")
        if model not in SUPPORTED_MODELS:
            raise ModelLoadError(f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml."
                                 f"model); tokenmill supports {list(SUPPORTED_MODELS)}")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError("GGUF file has no vocabulary (tokenizer.ggml.tokens)")
        pre = meta.get("tokenizer.ggml.pre") or "default"
        is_bpe = model == "gpt2"
        spec_add_bos = _pre_spec(pre).add_bos if is_bpe else True
        key = "tokenizer.ggml."
        return cls(
            model=model, pre=pre, tokens=tokens,
            token_types=meta.get(key + "token_type") or [NORMAL] * len(tokens),
            merges=meta.get(key + "merges") or [], scores=meta.get(key + "scores") or [],
            bos_id=meta.get(key + "bos_token_id"), eos_id=meta.get(key + "eos_token_id"),
            unk_id=meta.get(key + "unknown_token_id"), pad_id=meta.get(key + "padding_token_id"),
            extra_eog_ids=tuple(meta[k] for k in (key + "eot_token_id", key + "eom_token_id")
                                if 0 <= meta.get(k, -1) < len(tokens)),
            add_bos=bool(meta.get(key + "add_bos_token", spec_add_bos)),
            add_eos=bool(meta.get(key + "add_eos_token", False)),
            add_space_prefix=bool(meta.get(key + "add_space_prefix", not is_bpe)),
        )

    def token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def _pre_spec(pre: str) -> PreTokenizerSpec:
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:  # llama.cpp refuses these too rather than tokenize subtly wrong
        raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                             f"tokenmill knows {sorted(PRE_TOKENIZERS)}")
    return spec


def build_backend(vocab: GGUFVocab) -> HFTokenizer:
    """The ``tokenizers.Tokenizer`` that encodes and decodes like llama.cpp for this vocabulary."""
    ids = _first_ids(vocab.tokens)
    if vocab.model == "gpt2":
        backend = _byte_level_bpe(vocab, ids)
    else:
        backend = _sentencepiece_bpe(vocab, ids)
    _add_special_tokens(backend, vocab, ids)
    backend.post_processor = _bos_eos_processor(vocab)
    return backend


def _first_ids(tokens: Sequence[str]) -> dict[str, int]:
    """token -> id, keeping the first id when a (broken) vocabulary repeats a string."""
    ids: dict[str, int] = {}
    for index, token in enumerate(tokens):
        ids.setdefault(token, index)
    return ids


def _byte_level_bpe(vocab: GGUFVocab, ids: dict[str, int]) -> HFTokenizer:
    spec = _pre_spec(vocab.pre)
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    model = models.BPE(vocab=ids, merges=merges,
                       ignore_merges=spec.ignore_merges)
    backend = HFTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(vocab: GGUFVocab, ids: dict[str, int]) -> HFTokenizer:
    if vocab.merges:
        merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    else:
        merges = _merges_from_scores(vocab, ids)
    unk = vocab.token(vocab.unk_id)
    model = models.BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = HFTokenizer(model)
    # No pre-tokenizer: SentencePiece merges across the whole (space-escaped) text.
    steps = [normalizers.Replace(" ", SPM_SPACE)]
    if vocab.add_space_prefix:  # per text fragment, so also after each special token (llama.cpp)
        steps.insert(0, normalizers.Prepend(SPM_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        decode_steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend


def _merges_from_scores(vocab: GGUFVocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Recover BPE merges from SentencePiece scores.

    SentencePiece merges the adjacent pair whose concatenation is the highest-scoring token, so
    every split of a normal token into two normal tokens is a merge, ranked by the merged
    token's score (ties by the ids of the parts, like transformers' converter).
    """
    normal = {t: i for t, i in ids.items() if vocab.token_types[i] in (NORMAL, USER_DEFINED)}
    ranked = []
    for merged, merged_id in normal.items():
        score = vocab.scores[merged_id] if vocab.scores else -merged_id
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in normal and right in normal:
                ranked.append((-score, normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: HFTokenizer, vocab: GGUFVocab, ids: dict[str, int]) -> None:
    """Make control tokens special and user-defined tokens whole-matching added tokens.

    Their strings are already in the model's vocabulary, so the ids stay those of the file.
    """
    special, plain = [], []
    for index, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types)):
        if kind not in (CONTROL, UNKNOWN, USER_DEFINED) or not token or ids[token] != index:
            continue
        added = AddedToken(token, special=kind != USER_DEFINED, normalized=False)
        (plain if kind == USER_DEFINED else special).append(added)
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _bos_eos_processor(vocab: GGUFVocab) -> processors.PostProcessor | None:
    bos, eos = vocab.token(vocab.bos_id), vocab.token(vocab.eos_id)
    add_bos, add_eos = vocab.add_bos and bos is not None, vocab.add_eos and eos is not None
    if not (add_bos or add_eos):
        return None
    single = [*([bos] if add_bos else []), "$A", *([eos] if add_eos else [])]
    flags = ((bos, vocab.bos_id, add_bos), (eos, vocab.eos_id, add_eos))
    used = [(token, token_id) for token, token_id, on in flags if on]
    return processors.TemplateProcessing(single=single, pair=[*single, "$B:1"], special_tokens=used)
