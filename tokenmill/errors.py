"""Exceptions that cross layer boundaries. Each carries a message a user can act on."""


class TokenmillError(Exception):
    """Base class for errors tokenmill raises on purpose."""


class ModelLoadError(TokenmillError):
    """A model could not be found, read or understood (bad path, corrupt or unsupported file)."""


class LoRAError(TokenmillError, ValueError):
    """A LoRA adapter that cannot be served: unknown, unreadable, or not fitting the base model
    (its rank, target modules or shapes); the message names what does not fit."""


class LoRALoadError(TokenmillError):
    """Adapters that were registered but could not be (re)loaded when a step needed them (their
    files went away while evicted); ``lora_ids`` lists them, so the engine can end their
    requests with an error and go on with the others."""

    def __init__(self, message: str, lora_ids: tuple[int, ...]):
        super().__init__(message)
        self.lora_ids = lora_ids
