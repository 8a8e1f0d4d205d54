"""Tokenizer tests: the GGUF-built tokenizer against transformers' own GGUF tokenizer (the
reference), chat templates, the incremental detokenizer, HF directories and load errors.

One deliberate divergence from transformers: for ``tokenizer.ggml.pre = "smollm"`` llama.cpp
splits every digit off *before* the GPT-2 regex (the original SmolLM2 tokenizer.json does the
same with a ``Digits`` pre-tokenizer), while transformers' GGUF loader applies only the GPT-2
regex. The two differ when a run of 2+ whitespace characters precedes a digit ("  1"). We follow
llama.cpp, and check those cases against transformers' tokenizer with the original
pre-tokenizer restored.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from tokenmill.errors import ModelLoadError
from tokenmill.tokenizer import (ChatTemplateError, IncrementalDetokenizer, Tokenizer,
                                 load_tokenizer, read_gguf_metadata)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world! 123",
    "The quick brown fox jumps over the lazy dog.",
    "héllo café naïve résumé Ångström",
    "日本語のテキストです。中文也可以。한국어",
    "emoji 😀👍🏽 and ZWJ 👨‍👩‍👧‍👦 🏳️‍🌈 done",
    "def f(x):\n\tif x:\n\t\treturn x  # tab-indented\n    else:\n        pass\n",
    "spaces:   a    b     c\n\n\n\nnewlines\r\n\r\nend   ",
    "pi is 3.14159 and 1234567 is big; 2024-01-31 at 10:45",
    "don't I'M you'RE we'll it's THEY'D",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n",
    "",
    " leading space",
    "\ttrailing tab\t",
    "mixed<|endoftext|>special<jupyter_code>tokens",
]

# A whitespace run before a digit: where llama.cpp's smollm pre-tokenizer and transformers' differ.
DIGIT_AFTER_WHITESPACE = [
    "  1",
    "x = [\n    1,\n    2]",
    "|  1 |  2 |",
    "values:  12  and\t\t34",
    "\n\n2024",
]


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok(default_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path)


@pytest.fixture(scope="module")
def hf_ref(default_gguf_path: Path):
    """transformers' tokenizer built from the same GGUF file (loaded once: seconds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_gguf_path.parent),
                                         gguf_file=default_gguf_path.name)


@pytest.fixture(scope="module")
def original_ref(hf_ref) -> HFTokenizer:
    """The transformers tokenizer with SmolLM2's original tokenizer.json pre-tokenizer."""
    backend = HFTokenizer.from_str(hf_ref.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


def _write_gguf(path: Path, arch: str, kv: dict) -> Path:
    """A GGUF file with metadata only (no tensors)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (kind, value) in kv.items():  # kind names a GGUFWriter.add_<kind> method
        getattr(writer, f"add_{kind}")(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- GGUF metadata ------------------------------------------------------------------------------

def test_metadata_reader_matches_gguf_reader(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "types.gguf", "llama", {
        "t.string": ("string", "héllo 日本"), "t.u32": ("uint32", 7), "t.bool": ("bool", True),
        "t.i8": ("int8", -3), "t.u64": ("uint64", 2**40), "t.f32": ("float32", 0.5),
        "t.f64": ("float64", -1.25), "t.i64": ("int64", -(2**40)),
        "t.strings": ("array", ["a", "", "Ġ t", "<|im_end|>", "😀"]),
        "t.ints": ("array", [1, 3, 3, 4, 6]), "t.floats": ("array", [-1.5, 0.0, 2.25]),
        "t.empty": ("array", []),
    })
    ours = read_gguf_metadata(path)
    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours == fields
    assert ours["t.string"] == "héllo 日本" and ours["t.u64"] == 2**40


def test_load_reads_only_metadata_quickly(default_gguf_path: Path) -> None:
    start = time.perf_counter()
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    elapsed = time.perf_counter() - start
    assert tokenizer.vocab_size == 49152
    assert elapsed < 5.0, f"loading the tokenizer took {elapsed:.1f}s"


# -- encode / decode against transformers --------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tok: Tokenizer, hf_ref, text: str) -> None:
    assert tok.encode(text) == hf_ref.encode(text)
    bare = hf_ref.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=False) == bare


@pytest.mark.parametrize("text", DIGIT_AFTER_WHITESPACE)
def test_digits_split_like_llama_cpp(tok: Tokenizer, original_ref: HFTokenizer, text: str) -> None:
    assert tok.encode(text) == original_ref.encode(text).ids


def test_digit_split_example(tok: Tokenizer) -> None:
    # llama.cpp's smollm rule: "\p{N}" pieces first, so "  " stays one piece -> token "ĠĠ".
    assert tok.convert_ids_to_tokens(tok.encode("  1")) == ["ĠĠ", "1"]


def test_random_text_matches_original_pretokenizer(tok: Tokenizer,
                                                    original_ref: HFTokenizer) -> None:
    rng = random.Random(1234)
    atoms = ["a", "Z", "word", " the", "é", "ß", "日本", "😀", "👍🏽", "\u200d", " ", "  ", "\t",
             "\n", "\r\n", "0", "42", "3.14", "'s", "'LL", "!", ",", "...", "<|im_end|>", "{",
             "-->", "\u00a0"]
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12)))
        assert tok.encode(text) == original_ref.encode(text).ids, repr(text)


@pytest.mark.parametrize("text", TEXTS + DIGIT_AFTER_WHITESPACE)
def test_decode_round_trip(tok: Tokenizer, hf_ref, text: str) -> None:
    ids = tok.encode(text)
    shown = tok.decode(ids, skip_special_tokens=False)
    assert shown == text == hf_ref.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids) == hf_ref.decode(ids, skip_special_tokens=True)


def test_special_tokens(tok: Tokenizer, hf_ref) -> None:
    assert tok.encode("<|im_start|>") == [1]
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.eos_token_id == hf_ref.eos_token_id
    # llama.cpp also stops on <|endoftext|>: end-of-generation by token text.
    assert tok.eos_token_ids == frozenset({0, 2})
    assert tok.all_special_ids == frozenset(range(17))
    assert tok.convert_ids_to_tokens([1, 19556, 2]) == hf_ref.convert_ids_to_tokens([1, 19556, 2])
    assert tok.vocab_size == len(hf_ref)


# -- chat templates ----------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Tell me a joke."},
     {"role": "assistant", "content": "Why did the chicken cross the road?"},
     {"role": "user", "content": "Why? 🤔 ça va"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok: Tokenizer, hf_ref, messages) -> None:
    expected = hf_ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    no_prompt = hf_ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == no_prompt


def test_chat_template_environment(tok: Tokenizer) -> None:
    template = ("{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% if loop.index > 0 %}"
                "{% continue %}{% endif %}{% endfor %}{{ strftime_now('%Y') | length }}"
                "{% if tools %}{{ tools[0].name }}{% endif %}")
    out = tok.apply_chat_template([{"role": "user", "content": "çé<b>"}], chat_template=template,
                                  tools=[{"name": "search"}])
    assert out == '<|im_start|>{"role": "user", "content": "çé<b>"}4search'


def test_chat_template_errors(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="no roles"):
        tok.apply_chat_template([{"role": "x", "content": ""}],
                                chat_template="{{ raise_exception('no roles') }}")
    with pytest.raises(ChatTemplateError, match="compile"):
        tok.apply_chat_template([{"role": "user", "content": ""}], chat_template="{% for %}")
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])
    bare = Tokenizer(HFTokenizer.from_str(tok.backend.to_str()))
    assert bare.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


# -- incremental detokenizer -------------------------------------------------------------------

def _stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("text", [TEXTS[3], TEXTS[4], "mañana 🇯🇵 東京 ✓ ok", TEXTS[5]])
def test_detokenizer_deltas_concatenate_to_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_detokenizer_holds_back_split_characters(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1 and tok.decode(ids[:1]).endswith("\ufffd")  # the case is real
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]
    partial = IncrementalDetokenizer(tok)
    assert partial.add(ids[0]) == ""
    assert partial.finish() == tok.decode(ids[:1])  # a broken tail is flushed at the end


def test_detokenizer_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nSure 👍<|im_end|>")
    assert "".join(_stream(tok, ids, skip=True)) == tok.decode(ids) == "assistant\nSure 👍"
    shown = "".join(_stream(tok, ids, skip=False))
    assert shown == tok.decode(ids, skip_special_tokens=False)
    assert shown == "<|im_start|>assistant\nSure 👍<|im_end|>"


def test_detokenizer_random_ids(tok: Tokenizer) -> None:
    rng = random.Random(7)
    for _ in range(20):  # random ids include byte fragments that never form valid UTF-8
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        for skip in (True, False):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_window_is_bounded(tok: Tokenizer) -> None:
    longest = 0

    class Counting(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            nonlocal longest
            longest = max(longest, len(ids))
            return super().decode(ids, skip_special_tokens)

    counting = Counting(tok.backend)
    ids = tok.encode("Streaming 東京 text 🎉 goes on and on. " * 200)
    detok = IncrementalDetokenizer(counting)
    text = "".join(detok.add(i) for i in ids) + detok.finish()
    assert text == tok.decode(ids)
    assert longest <= 8 and len(detok._ids) <= 80


def test_detokenizer_context_ids(tok: Tokenizer) -> None:
    prompt, completion = tok.encode("Say hi:"), tok.encode(" hello there")
    detok = IncrementalDetokenizer(tok, context_ids=prompt)
    text = detok.add_many(completion) + detok.finish()
    assert text == " hello there"


# -- other GGUF vocabularies -------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_bpe_kv(default_gguf_path: Path) -> dict:
    """SmolLM2's vocabulary cut to its first 2,000 merges, so transformers loads it fast.

    Token 252 + i is the result of merge i, and every byte character sits below id 252. SmolLM2
    never merges digits, so a few digit merges are added: they tell the regexes' digit rules apart.
    """
    meta = read_gguf_metadata(default_gguf_path)
    merges, digits = 2000, {"12": "1 2", "123": "12 3", "45": "4 5"}
    size = 252 + merges
    return {
        "tokenizer.ggml.model": ("string", "gpt2"),
        "tokenizer.ggml.tokens": ("array", meta["tokenizer.ggml.tokens"][:size] + [*digits]),
        "tokenizer.ggml.token_type": ("array", meta["tokenizer.ggml.token_type"][:size]
                                      + [1] * len(digits)),
        "tokenizer.ggml.merges": ("array", meta["tokenizer.ggml.merges"][:merges]
                                  + [*digits.values()]),
        "tokenizer.ggml.bos_token_id": ("uint32", 1), "tokenizer.ggml.eos_token_id": ("uint32", 2),
        "tokenizer.ggml.add_bos_token": ("bool", False),
    }


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_other_pretokenizers_match_transformers(tmp_path: Path, small_bpe_kv: dict,
                                                pre: str) -> None:
    """The split regexes of other ``tokenizer.ggml.pre`` types agree with transformers'."""
    from transformers import AutoTokenizer

    kv = {**small_bpe_kv, "tokenizer.ggml.pre": ("string", pre)}
    path = _write_gguf(tmp_path / "vocab.gguf", "llama", kv)
    ours = Tokenizer.from_gguf(path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.vocab_size == len(ref) == 2255
    for text in TEXTS + DIGIT_AFTER_WHITESPACE + ["12345678 a\n\n\nb  \n c's 4512"]:
        assert ours.encode(text) == ref.encode(text), repr(text)


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> Path:
    """A tiny SentencePiece-style (``llama``) vocabulary with byte fallback."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for i, char in enumerate("▁abcdefghijklmnopqrstuvwxyzHW,.!'"):
        tokens.append(char), types.append(1), scores.append(-1000.0 - i)
    pieces = ["▁t", "he", "▁the", "▁a", "in", "▁in", "ll", "llo", "▁he", "▁hello", "▁w",
              "or",
              "▁wor", "ld", "▁world", "▁▁", "er", "▁H", "hi", "▁hi"]
    for i, piece in enumerate(pieces):
        tokens.append(piece), types.append(1), scores.append(-float(i))
    tokens.append("<|user|>"), types.append(4), scores.append(0.0)
    return _write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", "llama", {
        "tokenizer.ggml.model": ("string", "llama"),
        "tokenizer.ggml.tokens": ("array", tokens), "tokenizer.ggml.token_type": ("array", types),
        "tokenizer.ggml.scores": ("array", scores),
        "tokenizer.ggml.bos_token_id": ("uint32", 1), "tokenizer.ggml.eos_token_id": ("uint32", 2),
        "tokenizer.ggml.unknown_token_id": ("uint32", 0),
    })


def test_sentencepiece_vocab_matches_transformers(spm_gguf: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf(spm_gguf)
    ref = AutoTokenizer.from_pretrained(str(spm_gguf.parent), gguf_file=spm_gguf.name)
    for text in ["hello world", "Hello  world, the hi!", "héllo wörld 日本", "", "a<|user|>"]:
        assert ours.encode(text) == ref.encode(text), repr(text)
        assert ours.decode(ours.encode(text)) == text
    assert ours.bos_token_id == 1 and ours.encode("hi")[0] == 1  # SentencePiece adds BOS


def test_sentencepiece_space_prefix_follows_llama_cpp(spm_gguf: Path) -> None:
    """llama.cpp (and SentencePiece itself) prefix a space to every text fragment, including a
    leading-space text and the text after a special token; transformers' Metaspace does not."""
    ours = Tokenizer.from_gguf(spm_gguf)
    assert ours.convert_ids_to_tokens(ours.encode(" hi")) == ["<s>", "▁▁", "hi"]
    assert ours.convert_ids_to_tokens(ours.encode("<s>hi")) == ["<s>", "<s>", "▁hi"]
    assert ours.decode(ours.encode(" hi")) == " hi"


def test_sentencepiece_detokenizer(spm_gguf: Path) -> None:
    ours = Tokenizer.from_gguf(spm_gguf)
    ids = ours.encode("Hello  world, héllo 日本 the hi") + [2] + ours.encode("hi there", False)
    for skip in (True, False):
        assert "".join(_stream(ours, ids, skip)) == ours.decode(ids, skip_special_tokens=skip)
    assert all("\ufffd" not in d for d in _stream(ours, ids))
    # A word-initial piece right after the prompt keeps its space only with the prompt as context.
    detok = IncrementalDetokenizer(ours, context_ids=ours.encode("hi"))
    assert detok.add_many(ours.encode("hello", add_special_tokens=False)) == " hello"


# -- Hugging Face directories --------------------------------------------------------------------

def test_from_hf_dir_saved_by_transformers(tmp_path: Path, hf_ref) -> None:
    hf_ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS + DIGIT_AFTER_WHITESPACE:  # same tokenizer.json, so the same ids
        assert ours.encode(text) == hf_ref.encode(text), repr(text)
    assert ours.eos_token_id == 2 and ours.eos_token_ids == frozenset({0, 2})
    assert ours.apply_chat_template(CONVERSATIONS[2]) == hf_ref.apply_chat_template(
        CONVERSATIONS[2], tokenize=False, add_generation_prompt=True)


def test_from_hf_dir_config_variants(tmp_path: Path, tok: Tokenizer) -> None:
    (tmp_path / "tokenizer.json").write_text(tok.backend.to_str())
    (tmp_path / "config.json").write_text("{}")  # makes it a model directory for resolve_model
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|endoftext|>",
        "add_bos_token": True,
        "chat_template": [{"name": "default", "template": "D{{ messages[0].content }}"},
                          {"name": "tool_use", "template": "T{{ tools | length }}"}],
    }))
    ours = load_tokenizer(str(tmp_path))
    assert ours.encode("hi") == [1, *tok.encode("hi")]
    assert ours.encode("hi", add_special_tokens=False) == tok.encode("hi")
    assert (ours.eos_token_id, ours.eos_token_ids) == (0, frozenset({0, 2}))
    assert ours.chat_template == "D{{ messages[0].content }}"
    msgs = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(msgs) == "Dx"
    assert ours.apply_chat_template(msgs, tools=[{"name": "a"}, {"name": "b"}]) == "T2"
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template(msgs) == "J<|endoftext|>"


# -- import hygiene ---------------------------------------------------------------------------

def test_tokenizer_package_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys, tokenmill.tokenizer; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- errors ------------------------------------------------------------------------------------

def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "bert.gguf", "bert", {
        "tokenizer.ggml.model": ("string", "bert"),
        "tokenizer.ggml.tokens": ("array", ["[PAD]", "[UNK]", "hello"]),
    })
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 'bert'"):
        Tokenizer.from_gguf(path)


def test_unsupported_pretokenizer(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "odd.gguf", "llama", {
        "tokenizer.ggml.model": ("string", "gpt2"), "tokenizer.ggml.pre": ("string", "martian"),
        "tokenizer.ggml.tokens": ("array", ["a", "b"]), "tokenizer.ggml.merges": ("array", ["a b"]),
    })
    with pytest.raises(ModelLoadError, match="martian"):
        Tokenizer.from_gguf(path)


def test_bad_files(tmp_path: Path) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        Tokenizer.from_gguf(not_gguf)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8 + b"\x05\x00")
    with pytest.raises(ModelLoadError):
        Tokenizer.from_gguf(truncated)
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ----- templates are code: whatever one does fails that render alone ------------------------

@pytest.mark.parametrize("source,words", [
    ("{{ 1/0 }}", "ZeroDivisionError"),
    ("{{ messages[5].content }}", "failed"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
    ("{{ 'x' * 10 ** 10 }}", "repeats a sequence"),
    ("{{ [0] * 10 ** 9 }}", "repeats a sequence"),
    ("{{ 7 ** 100000000 }}", "power too large"),
    ("{% for i in range(10) %}{{ 'y' * 100 }}{% endfor %}", "more than 500 characters"),
])
def test_failing_templates_raise_chat_template_error_quickly(source, words):
    from tokenmill.tokenizer.chat_template import render_chat, template_variables

    start = time.monotonic()
    template_variables(source)  # scanning a template evaluates nothing
    with pytest.raises(ChatTemplateError, match=words):
        render_chat(source, [{"role": "user", "content": "hi"}], add_generation_prompt=True,
                    tools=None, variables={}, max_chars=500)
    assert time.monotonic() - start < 2


def test_a_template_compiled_apart_renders_without_entering_the_cache():
    """The sandboxed child renders a request's template this way: nothing of it stays."""
    from tokenmill.tokenizer.chat_template import _compile, compile_template, render_chat

    before = _compile.cache_info()
    out = render_chat(compile_template("{{ messages[0].content }} (compiled apart)"),
                      [{"role": "user", "content": "hi"}], add_generation_prompt=True,
                      tools=None, variables={})
    assert out == "hi (compiled apart)"
    assert _compile.cache_info() == before


def test_bounded_sandbox_keeps_ordinary_arithmetic():
    from tokenmill.tokenizer.chat_template import render_chat

    out = render_chat("{{ '-' * 3 }}{{ 2 ** 10 }}{{ [1] * 2 }}{{ 3 * 4 }}{{ 2.5 * 2 }}",
                      [{"role": "user", "content": "hi"}], add_generation_prompt=True,
                      tools=None, variables={})
    assert out == "---1024[1, 1]125.0"


def test_long_texts_encode_the_same_through_the_gil_free_path(tok: Tokenizer) -> None:
    from tokenmill.tokenizer.tokenizer import _GIL_FREE_CHARS

    text = "Once upon a time, 42 wolves ran. " * (2 * _GIL_FREE_CHARS // 30)
    assert len(text) > _GIL_FREE_CHARS
    assert tok.encode(text) == tok.backend.encode(text).ids
    assert tok.encode(text, add_special_tokens=False) == \
        tok.backend.encode(text, add_special_tokens=False).ids


def test_fill_in_the_middle_prompt_only_with_fim_tokens(tok: Tokenizer) -> None:
    from types import SimpleNamespace

    from tokenmill.server.protocol import APIError
    from tokenmill.server.serving import OpenAIServing

    assert tok.fim_tokens is None  # SmolLM2's vocabulary has none
    with pytest.raises(APIError, match="fill-in-the-middle") as e:
        OpenAIServing._infill(SimpleNamespace(tokenizer=tok), "def f(", "\n    return x")
    assert e.value.param == "suffix"
    words = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "a", "b"]
    backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fim = Tokenizer(backend)
    assert fim.fim_tokens == tuple(words[:3])
    prompt = OpenAIServing._infill(SimpleNamespace(tokenizer=fim), "a ", " b")
    assert prompt == "<|fim_prefix|>a <|fim_suffix|> b<|fim_middle|>"
