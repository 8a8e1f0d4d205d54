"""``tokenmill router``: one OpenAI-compatible endpoint in front of many workers.

It talks HTTP to its workers (tokenmill, vLLM, SGLang, llama.cpp servers alike) and, where a
worker publishes them, reads its KV-cache events; it imports nothing of the engine.
"""
