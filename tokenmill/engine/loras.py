"""The LoRA adapters an engine serves, by name, and the requests in flight under each.

An adapter is registered once (its weights loaded and checked by the executor's workers,
``Executor.add_lora``) and from then on a request names it (``LLMEngine.add_request(...,
lora_request=)``). Its ``lora_int_id`` counts from 1 and is never reused, so a name removed and
registered again is a new adapter for the workers' slots; its fingerprint (of its files) keys the
prefix cache. Removing an adapter refuses new requests under its name at once; its weights stay
until the last request that uses it ends (``release`` says when), so nothing in flight breaks.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace

from tokenmill.errors import LoRAError
from tokenmill.request import LoRARequest

__all__ = ["LoRARegistry", "LoRARequest"]

logger = logging.getLogger("tokenmill.engine")

# how a request may name its adapter: the registered LoRARequest (or one like it) or its name
LoRALike = LoRARequest | str


class LoRARegistry:
    """Adapters by name; ``enabled`` False (the engine was built without ``enable_lora``)
    refuses every adapter. ``unload`` (the executor's ``remove_lora``) drops an adapter's
    weights once it is removed and no request uses it."""

    def __init__(self, enabled: bool, unload: Callable[[int], None]) -> None:
        self.enabled = enabled
        self._unload = unload
        self._by_name: dict[str, LoRARequest] = {}
        self._in_flight: Counter[int] = Counter()  # lora_int_id -> unfinished requests
        self._removed: dict[int, LoRARequest] = {}  # removed, weights kept for their requests
        self._ids = itertools.count(1)

    def register(self, name: str, path: str, load: Callable[[LoRARequest], str],
                 base_model_name: str | None = None, reserved: Iterable[str] = ()
                 ) -> LoRARequest:
        """A new adapter under ``name``: ``load`` (the executor's) loads and checks it and
        returns its fingerprint. Raises ``LoRAError`` for a name taken or ``reserved`` (the
        base model's), or what ``load`` raises (nothing is registered then)."""
        self._check_enabled()
        if not isinstance(name, str) or not name.strip():
            raise LoRAError(f"a LoRA adapter needs a name, got {name!r}")
        if not isinstance(path, str) or not path:
            raise LoRAError(f"LoRA adapter {name!r} needs a path, got {path!r}")
        if name in reserved:
            raise LoRAError(f"{name!r} is the base model's name: give the adapter another one")
        if name in self._by_name:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded "
                            f"(from {self._by_name[name].lora_path}); unload it first")
        # an id is never reused, not even one whose load failed
        lora = LoRARequest(name, next(self._ids), path, base_model_name=base_model_name)
        lora = replace(lora, fingerprint=load(lora))
        self._by_name[name] = lora
        logger.info("LoRA adapter %r loaded from %s (id %d, fingerprint %s)", name, path,
                    lora.lora_int_id, lora.fingerprint)
        return lora

    def unregister(self, name: str) -> LoRARequest:
        """Refuse new requests under ``name`` from now on; its weights go now if no request
        uses it, else when the last one ends (``release``)."""
        lora = self._by_name.pop(name, None) if isinstance(name, str) else None
        if lora is None:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
        if self._in_flight[lora.lora_int_id]:
            self._removed[lora.lora_int_id] = lora
        else:
            self._drop(lora)
        return lora

    def resolve(self, lora: LoRALike | None) -> LoRARequest | None:
        """The registered adapter a request names (None: the base model). Raises
        ``LoRAError`` for a name not registered, or a ``LoRARequest`` of an adapter since
        replaced under its name by other weights."""
        if lora is None:
            return None
        self._check_enabled()
        name = lora if isinstance(lora, str) else lora.lora_name
        current = self._by_name.get(name)
        if current is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        if isinstance(lora, LoRARequest) and lora.fingerprint \
                and lora.fingerprint != current.fingerprint:
            raise LoRAError(f"LoRA adapter {name!r} was replaced by other weights since this "
                            "request named it")
        return current

    def acquire(self, lora: LoRARequest | None) -> None:
        """A request under ``lora`` was queued."""
        if lora is not None:
            self._in_flight[lora.lora_int_id] += 1

    def release(self, lora: LoRARequest | None) -> None:
        """A request under ``lora`` ended: a removed adapter's weights go with its last one."""
        if lora is None:
            return
        self._in_flight[lora.lora_int_id] -= 1
        if self._in_flight[lora.lora_int_id] <= 0 and lora.lora_int_id in self._removed:
            self._drop(self._removed.pop(lora.lora_int_id))

    def _drop(self, lora: LoRARequest) -> None:
        self._in_flight.pop(lora.lora_int_id, None)
        try:
            self._unload(lora.lora_int_id)
        except Exception:  # its weights stay loaded, but no request can name it any more
            logger.exception("unloading LoRA adapter %r failed", lora.lora_name)
            return
        logger.info("LoRA adapter %r (id %d) unloaded", lora.lora_name, lora.lora_int_id)

    def list(self) -> list[LoRARequest]:
        """The adapters requests may name, in the order they were registered."""
        return list(self._by_name.values())

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise LoRAError("this engine serves no LoRA adapters: start it with --enable-lora "
                            "(LLM(..., enable_lora=True))")
