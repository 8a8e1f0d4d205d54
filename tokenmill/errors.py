"""Exceptions that cross layer boundaries. Each carries a message a user can act on."""


class TokenmillError(Exception):
    """Base class for errors tokenmill raises on purpose."""


class ModelLoadError(TokenmillError):
    """A model could not be found, read or understood (bad path, corrupt or unsupported file)."""
