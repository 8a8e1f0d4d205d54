"""tokenmill: an LLM inference serving engine.

Importing the package is cheap on purpose (no torch, no server): heavy parts load on first use.
"""

from tokenmill.config import DEFAULT_MODEL

__version__ = "0.1.0"

__all__ = ["DEFAULT_MODEL", "__version__"]
