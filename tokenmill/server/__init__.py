"""The OpenAI-compatible HTTP server (``tokenmill serve``): FastAPI app, protocol, metrics."""
