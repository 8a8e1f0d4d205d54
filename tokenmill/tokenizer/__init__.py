"""Tokenizers for the engine: GGUF or tokenizer.json vocabularies, chat templates and an
incremental detokenizer. Imports tokenizers/jinja2 only (never torch or transformers)."""

from tokenmill.tokenizer.chat_template import ChatTemplateError
from tokenmill.tokenizer.detokenizer import IncrementalDetokenizer
from tokenmill.gguf_meta import read_gguf_metadata
from tokenmill.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer", "load_tokenizer",
           "read_gguf_metadata"]
