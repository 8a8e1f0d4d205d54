"""The command line: `tokenmill generate` and the interactive `tokenmill chat` in a real terminal."""

from __future__ import annotations

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


def test_generate_greedy():
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "--chat",
                          "--prompt", "What is the capital of France?", "--max-tokens", "12",
                          "--kv-cache-memory", "64blocks"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "KV cache 1008 tokens" in out.stderr


def test_interactive_chat_streams_and_keeps_conversation():
    # room for a long reply: the one interrupted below must still be streaming when Ctrl-C
    # lands (a short one can end before a busy test process has read its first word)
    child = pexpect.spawn(sys.executable, ["-m", "tokenmill.cli", "chat", "--max-tokens", "1000",
                                           "--kv-cache-memory", "256blocks"],
                          encoding="utf-8", timeout=180, dimensions=(40, 120))
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
        child.sendline("List the numbers from 1 to 300, one per line.")
        child.expect("per line\\.\r\n")  # the echo of the input line
        child.expect(r"\w")  # the reply has begun streaming
        child.sendintr()  # Ctrl-C stops this reply, not the session
        child.expect(r"\[stopped\]\r\n>>> ")
        child.sendeof()  # Ctrl-D ends the session cleanly
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
