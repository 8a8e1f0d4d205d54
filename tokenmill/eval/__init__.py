"""Quality checks anyone can run: ``tokenmill eval perplexity`` (``perplexity.py``) scores a
model on a fixed text (``data/eval.txt``) through the engine's own forward and KV cache, so the
cost of each weight format and KV cache dtype is one number."""
