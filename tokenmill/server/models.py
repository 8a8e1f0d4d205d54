"""What a request's ``model`` may name: the served base model, or a LoRA adapter the engine
holds (by its name, or ``<base>:<adapter>``); ``/v1/models``; and, with
``--allow-runtime-lora``, loading and unloading adapters over HTTP.

The engine keeps the one registry of adapters (``AsyncEngine.loras()``); this module only
reads it, so an adapter loaded from the command line, by ``LLM``, or over HTTP is named
the same way everywhere. An adapter unloaded while its requests run does not disturb them:
they hold their ``LoRARequest`` and the engine drops the weights after the last one ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import LoRAError
from tokenmill.request import LoRARequest
from tokenmill.server.protocol import (APIError, LoadLoRAAdapterRequest,
                                       UnloadLoRAAdapterRequest, printable)

logger = logging.getLogger("tokenmill.server")


@dataclass(frozen=True)
class ModelChoice:
    """What a request's ``model`` resolved to: the name its answer carries (the one the client
    sent, the base name when it sent none) and the adapter to run under (None: the base)."""

    name: str
    lora: LoRARequest | None = None


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{printable(model)[:256]}` does not exist.",
                    "not_found_error", "model", "model_not_found")


class ServedModels:
    """The base model and the engine's adapters, under the names clients use for them."""

    def __init__(self, engine: AsyncEngine, base_name: str, max_model_len: int):
        self.engine = engine
        self.base_name = base_name
        self.max_model_len = max_model_len
        self.created = int(time.time())

    def resolve(self, model: str | None) -> ModelChoice:
        """The base model for None or its name, else the adapter ``model`` names; anything
        else is a 404 in OpenAI's shape (``param: model``)."""
        if model is None or model == self.base_name:
            return ModelChoice(self.base_name)
        lora = self.find_adapter(model)
        if lora is None:
            raise model_not_found(model)
        return ModelChoice(model, lora)

    def find_adapter(self, model: str) -> LoRARequest | None:
        """The adapter named ``model`` itself or ``<parent>:<name>`` (its parent is the base
        model, or the ``base_model_name`` it was registered with)."""
        for lora in self.engine.loras():
            if model == lora.lora_name or model in self._qualified_names(lora):
                return lora
        return None

    def _qualified_names(self, lora: LoRARequest) -> set[str]:
        return {f"{parent}:{lora.lora_name}" for parent in (self.base_name, self.parent(lora))}

    def parent(self, lora: LoRARequest) -> str:
        return lora.base_model_name or self.base_name

    # ----- /v1/models ---------------------------------------------------------------------------

    def cards(self) -> list[dict[str, Any]]:
        """The base model's card, then one per adapter (vLLM's shape: ``root`` is the
        adapter's path, ``parent`` the model it adapts)."""
        return [self.card(ModelChoice(self.base_name)),
                *(self.card(ModelChoice(lora.lora_name, lora)) for lora in self.engine.loras())]

    def card(self, choice: ModelChoice) -> dict[str, Any]:
        lora = choice.lora
        return {"id": lora.lora_name if lora else self.base_name, "object": "model",
                "created": self.created, "owned_by": "tokenmill",
                "root": lora.lora_path if lora else self.base_name,
                "parent": self.parent(lora) if lora else None,
                "max_model_len": self.max_model_len}

    # ----- runtime loading ----------------------------------------------------------------------

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        """Register the adapter (read and checked on the engine's side, off the event loop);
        a name in use or an adapter that does not fit the base model is a 400."""
        name = req.lora_name
        if name == self.base_name or name.startswith(f"{self.base_name}:"):
            raise _lora_error(f"lora_name: `{name}` would shadow the base model's name",
                              "lora_name")
        if any(lora.lora_name == name for lora in self.engine.loras()):
            raise _lora_error(f"The LoRA adapter `{name}` is already loaded (unload it "
                              f"first to replace it)", "lora_name", "lora_already_loaded")
        try:
            lora = await self.engine.add_lora(name, req.lora_path)
        except LoRAError as e:
            raise _lora_error(printable(str(e)), "lora_path") from None
        except OSError as e:  # a path the file system refuses outright (too long, no access)
            raise _lora_error(f"LoRA adapter {printable(req.lora_path)[:256]}: cannot be "
                              f"read ({e.strerror or type(e).__name__})", "lora_path") from None
        logger.info("loaded LoRA adapter %s from %s", lora.lora_name, lora.lora_path)
        return f"Success: LoRA adapter '{name}' loaded."

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        """Unregister the adapter: new requests naming it are 404s from now on; those running
        finish under it. An adapter not loaded is a 404."""
        name = req.lora_name
        missing = APIError(404, f"The LoRA adapter `{printable(name)}` is not loaded.",
                           "not_found_error", "lora_name", "lora_not_found")
        if not any(lora.lora_name == name for lora in self.engine.loras()):
            raise missing
        try:
            await self.engine.remove_lora(name)
        except LoRAError:  # unloaded by another request meanwhile
            raise missing from None
        logger.info("unloaded LoRA adapter %s", name)
        return f"Success: LoRA adapter '{name}' unloaded."


def _lora_error(message: str, param: str, code: str = "invalid_lora_adapter") -> APIError:
    return APIError(400, message, param=param, code=code)


def add_model_routes(app: FastAPI, models: ServedModels, runtime_lora: bool) -> None:
    """``/v1/models`` and ``/v1/models/{id}``; the adapter routes only with
    ``runtime_lora`` (``--allow-runtime-lora``): without it they do not exist (404), as in
    vLLM."""

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": models.cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return models.card(models.resolve(model_id))

    if not runtime_lora:
        return

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        return await models.load(req)

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        return await models.unload(req)
