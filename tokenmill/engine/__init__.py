"""The step loop (LLMEngine) and the offline API (LLM)."""
