"""Serving benchmarks: workloads, an async OpenAI-compatible load generator, reports and plots.
Talks HTTP only (the tokenizer is used to count tokens)."""
