"""The command line: `tokenmill generate` and the interactive `tokenmill chat` in a real
terminal."""

from __future__ import annotations

import re
import subprocess
import sys

import pexpect
import pytest

from tokenmill.cli import parse_kv_cache_memory


def test_parse_kv_cache_memory():
    assert parse_kv_cache_memory("4GiB") == (4 << 30, None)
    assert parse_kv_cache_memory("512MB") == (512 * 10**6, None)
    assert parse_kv_cache_memory("1000000") == (10**6, None)
    assert parse_kv_cache_memory("2048blocks") == (None, 2048)
    with pytest.raises(Exception, match="invalid KV cache size"):
        parse_kv_cache_memory("lots")


def test_generate_bad_model_is_one_clear_line():
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "/no/model.gguf",
                          "--prompt", "hi"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("tokenmill: error: model path '/no/model.gguf' does not")
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # the real model
def test_generate_greedy():
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "--chat",
                          "--prompt", "What is the capital of France?", "--max-tokens", "12",
                          "--kv-cache-memory", "64blocks"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "KV cache 1008 tokens" in out.stderr


def _generated_tokens(stderr: str) -> int:
    return int(re.search(r"^tokenmill: (\d+) tokens in ", stderr, re.M).group(1))


@pytest.mark.slow  # the real model
def test_generate_min_tokens_holds_back_the_end():
    cmd = [sys.executable, "-m", "tokenmill.cli", "generate", "--chat", "--prompt",
           "What is 2 + 2? Answer with the number only.", "--max-tokens", "40",
           "--kv-cache-memory", "64blocks"]
    # both at once: loading the model is mostly one core's work
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in (cmd, cmd + ["--min-tokens", "30"])]
    (_, alone), (_, held) = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], alone + held
    assert _generated_tokens(alone) < 30  # the model ends early on its own...
    assert _generated_tokens(held) >= 30  # ...and not before --min-tokens
    bad = subprocess.run(cmd + ["--min-tokens", "41"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "min_tokens must not exceed max_tokens" in bad.stderr


def _chat(*args: str) -> pexpect.spawn:
    return pexpect.spawn(sys.executable, ["-m", "tokenmill.cli", "chat", "--kv-cache-memory",
                                          "256blocks", *args],
                         encoding="utf-8", timeout=180, dimensions=(40, 120))


@pytest.mark.slow  # the real model
def test_interactive_chat_streams_and_keeps_conversation():
    child = _chat()
    try:
        child.expect(">>> ")
        child.sendline("My name is Ada. What is the capital of France?")
        child.expect("Paris")
        child.expect(">>> ")
        child.sendline("And of Italy?")
        child.expect(">>> ")
        child.sendline("/history")  # the conversation is kept, replies included
        child.expect(r"\[user\] My name is Ada\. What is the capital of France\?\s+"
                     r"\[assistant\] [^\r\n]*Paris[^\r\n]*\s+\[user\] And of Italy\?\s+"
                     r"\[assistant\] \S")
        child.expect(">>> ")
        child.sendeof()  # Ctrl-D ends the session cleanly
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


@pytest.mark.slow  # the real model
def test_interactive_chat_ctrl_c_stops_the_reply_not_the_session():
    # --ignore-eos: the reply cannot end on its own before Ctrl-C lands, however slow the test
    # process is to read it
    child = _chat("--ignore-eos", "--max-tokens", "3000")
    try:
        child.expect(">>> ")
        child.sendline("List the numbers from 1 to 300, one per line.")
        child.expect("per line\\.\r\n")  # the echo of the input line
        child.expect(r"\w")  # the reply has begun streaming
        child.sendintr()  # Ctrl-C stops this reply, not the session
        child.expect(r"\[stopped\]\r\n>>> ")
        child.sendline("/history")  # what was shown of the stopped reply is kept
        child.expect(r"\[user\] List the numbers from 1 to 300, one per line\.\s+"
                     r"\[assistant\] \S[^\r\n]*")
        child.expect(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


@pytest.mark.parametrize("flags, says", [
    (["--num-speculative-tokens", "3"], "num_speculative_tokens applies only with "
                                        "speculative_method ngram, draft or layerskip"),
    (["--no-speculative-adaptive"], "speculative_adaptive applies only with"),
    (["--speculative-method", "ngram", "--speculative-model", "m.gguf"],
     "speculative_model applies only with speculative_method draft (--speculative-method); "
     "got ngram"),
    (["--speculative-method", "draft", "--speculative-model", "m.gguf",
      "--prompt-lookup-max", "3"], "prompt_lookup_max applies only with speculative_method ngram"),
    (["--speculative-method", "ngram", "--speculative-draft-layers", "2"],
     "speculative_draft_layers applies only with speculative_method layerskip"),
    (["--device", "cuda", "--quantization", "int8"], "quantization 'int8' (--quantization) "
                                                     "runs on CPUs only for now; on cuda use"),
    (["--device", "cuda:1", "--quantization", "auto"], "quantization 'auto'"),
])
def test_flags_that_would_be_ignored_stop_the_start(flags, says):
    """A speculative flag without the method it belongs to, or a CPU-only quantization on a GPU,
    would be dropped quietly: refused with one line before anything is imported or loaded."""
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("tokenmill: error: ") and says in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "loaded" not in out.stderr


def test_speculative_flags_with_their_method_are_taken():
    from tokenmill.config import EngineConfig

    spec = EngineConfig.from_options(speculative_method="ngram", prompt_lookup_min=1,
                                     prompt_lookup_max=3, num_speculative_tokens=2,
                                     speculative_adaptive=False).speculative
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens,
            spec.speculative_adaptive) == (1, 3, 2, False)
    assert EngineConfig.from_options(speculative_method="layerskip",
                                     speculative_draft_layers=2).speculative \
        .speculative_draft_layers == 2
    assert EngineConfig.from_options(device="cuda", quantization="fp8").quantization == "fp8"
