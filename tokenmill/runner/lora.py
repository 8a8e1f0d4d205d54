"""Which LoRA adapters are loaded, which sit in the compute's slots, and which rows of a step run
under which slot.

Three tiers, each a least-recently-used order:

    registered   every adapter the engine added (id -> LoRARequest), weights or not
    loaded       up to ``cpu_loras`` adapters' weights in memory (``LoadedAdapter``); one
                 evicted is read again from its files when a step needs it
    slots        up to ``max_loras`` loaded adapters installed in ``LoRASlots``; an adapter
                 keeps its slot while steps use it, a slot is taken back from the adapter
                 unused longest, never from one the current step needs

The scheduler admits at most ``max_loras`` distinct adapters per step, so a step always finds
its slots; more is a broken guarantee (RuntimeError), not something to recover from.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import replace
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from tokenmill.config import LoRAConfig, ModelConfig
from tokenmill.errors import LoRAError, LoRALoadError
from tokenmill.model.lora.peft import LoadedAdapter, read_peft_adapter
from tokenmill.model.lora.slots import LoRASlots
from tokenmill.request import LoRARequest
from tokenmill.runner.batch import SeqChunk


def chunk_lora(chunk: SeqChunk) -> LoRARequest | None:
    """The adapter a chunk runs under; None for the base model (and for plain ``Chunk``s,
    which have no request)."""
    request = getattr(chunk, "request", None)
    return None if request is None else request.lora


class LoRAManager:
    """The adapters of one model runner: ``add`` / ``remove`` them, and around each forward
    ``prepare`` (slots for the step's adapters, rows grouped by slot) then ``finish``."""

    def __init__(self, model: nn.Module, config: LoRAConfig, model_config: ModelConfig,
                 dtype: torch.dtype, ops=None) -> None:
        self.config = config
        self.model_config = model_config
        self.dtype = dtype
        self.slots = LoRASlots(model, config.max_loras, ops)
        # each with the fingerprint its files hashed to when added
        self._registered: dict[int, LoRARequest] = {}
        self._loaded: OrderedDict[int, LoadedAdapter] = OrderedDict()  # least recent first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter -> slot, least recent first
        self.load_seconds: dict[str, float] = {}  # per adapter name, its latest read

    def add(self, lora: LoRARequest) -> str:
        """Register ``lora`` and load it now, so that an adapter that does not fit the base
        model is refused here (``LoRAError``); its fingerprint. Adding an id again replaces
        the adapter it named."""
        adapter = self._read(lora)
        if lora.fingerprint and lora.fingerprint != adapter.fingerprint:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r}: its files at {lora.lora_path} "
                            f"changed (fingerprint {adapter.fingerprint}, registered as "
                            f"{lora.fingerprint})")
        self.remove(lora.lora_int_id)
        self._registered[lora.lora_int_id] = replace(lora, fingerprint=adapter.fingerprint)
        self._keep(lora.lora_int_id, adapter, frozenset())
        return adapter.fingerprint

    def remove(self, lora_int_id: int) -> None:
        """Forget adapter ``lora_int_id``: its weights and its slot (an unknown id: nothing)."""
        self._registered.pop(lora_int_id, None)
        self._unload(lora_int_id)

    def prepare(self, chunks: Sequence[SeqChunk], query_start: Sequence[int]) -> bool:
        """Before a forward over ``chunks`` (chunk i is rows ``query_start[i] ..
        query_start[i + 1]`` of the flat batch): a slot for each of their adapters, reading
        evicted ones again (``LoRALoadError`` naming those that fail), and the rows of each
        set on ``slots``. Returns whether any row runs under an adapter."""
        rows = self._rows_by_adapter(chunks, query_start)
        if len(rows) > self.config.max_loras:
            names = ", ".join(sorted(lora.lora_name for lora, _ in rows.values()))
            raise RuntimeError(f"a step with {len(rows)} LoRA adapters ({names}) but "
                               f"--max-loras {self.config.max_loras}: the scheduler must not "
                               "admit more")
        needed = frozenset(rows)
        self._ensure_loaded({i: lora for i, (lora, _) in rows.items()}, needed)
        groups = [(self._slot_for(i, needed), torch.tensor(r, dtype=torch.int64))
                  for i, (_, r) in rows.items()]
        self.slots.set_step(groups)
        return bool(groups)

    def finish(self) -> None:
        """After the forward: later forwards (a drafter's) run without LoRA until ``prepare``."""
        self.slots.clear_step()

    def describe(self) -> dict:
        names = {i: lora.lora_name for i, lora in self._registered.items()}
        return {
            "max_loras": self.config.max_loras,
            "max_cpu_loras": self.config.cpu_loras,
            "max_lora_rank": self.config.max_lora_rank,
            "registered": sorted(names.values()),
            "loaded": [names.get(i, str(i)) for i in self._loaded],
            "slots": {slot: names.get(i, str(i)) for i, slot in sorted(self._slot_of.items(),
                                                                        key=lambda x: x[1])},
            "loaded_bytes": sum(a.nbytes() for a in self._loaded.values()),
            "slot_bytes": self.slots.nbytes(),
            "load_seconds": dict(self.load_seconds),
        }

    def loaded_ids(self) -> list[int]:
        """Adapters whose weights are in memory, least recently used first."""
        return list(self._loaded)

    def slot_ids(self) -> dict[int, int]:
        """Adapter id -> the slot it occupies."""
        return dict(self._slot_of)

    def _read(self, lora: LoRARequest) -> LoadedAdapter:
        started = time.perf_counter()
        adapter = read_peft_adapter(lora.lora_path, self.model_config, self.dtype,
                                    self.config.max_lora_rank)
        self.load_seconds[lora.lora_name] = time.perf_counter() - started
        return adapter

    def _rows_by_adapter(self, chunks: Sequence[SeqChunk], query_start: Sequence[int]
                         ) -> dict[int, tuple[LoRARequest, list[int]]]:
        """Per adapter in the step (first appearance first): it and its rows, ascending."""
        rows: dict[int, tuple[LoRARequest, list[int]]] = {}
        for i, chunk in enumerate(chunks):
            lora = chunk_lora(chunk)
            if lora is not None:
                rows.setdefault(lora.lora_int_id, (lora, []))[1].extend(
                    range(query_start[i], query_start[i + 1]))
        return rows

    def _ensure_loaded(self, loras: Mapping[int, LoRARequest], needed: frozenset[int]) -> None:
        """Every adapter of the step in memory: evicted ones read again from their files, and
        one the runner never saw (a step is its first use) registered on the way."""
        failed: list[tuple[LoRARequest, str]] = []
        for i, lora in loras.items():
            if i in self._loaded:
                self._loaded.move_to_end(i)
                continue
            try:
                adapter = self._reload(self._registered.get(i, lora))
            except LoRAError as e:
                failed.append((lora, str(e)))
                continue
            self._registered.setdefault(i, replace(lora, fingerprint=adapter.fingerprint))
            self._keep(i, adapter, needed)
        if failed:
            raise LoRALoadError("; ".join(f"LoRA adapter {lora.lora_name!r} could not be "
                                          f"reloaded: {why}" for lora, why in failed),
                                tuple(lora.lora_int_id for lora, _ in failed))

    def _reload(self, lora: LoRARequest) -> LoadedAdapter:
        adapter = self._read(lora)
        expected = lora.fingerprint or adapter.fingerprint
        if adapter.fingerprint != expected:
            # its prefix-cache entries were keyed by the old fingerprint: serving the new
            # weights under them would mix two adapters' KV
            raise LoRAError(f"its files at {lora.lora_path} changed since it was added "
                            f"(fingerprint {adapter.fingerprint}, was {expected})")
        return adapter

    def _keep(self, lora_int_id: int, adapter: LoadedAdapter, needed: frozenset[int]) -> None:
        """Hold ``adapter`` in memory, evicting the least recently used adapters the step does
        not need while more than ``cpu_loras`` would be loaded: first those without a slot."""
        while len(self._loaded) >= self.config.cpu_loras:
            spare = [i for i in self._loaded if i not in needed]
            if not spare:
                break  # cannot happen while max_loras <= cpu_loras; never drop a needed one
            unslotted = [i for i in spare if i not in self._slot_of]
            self._unload((unslotted or spare)[0])
        self._loaded[lora_int_id] = adapter

    def _unload(self, lora_int_id: int) -> None:
        self._loaded.pop(lora_int_id, None)
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slots.clear_slot(slot)

    def _slot_for(self, lora_int_id: int, needed: frozenset[int]) -> int:
        """The slot of a loaded adapter, installing it in a free slot or in the one used
        longest ago by an adapter this step does not need."""
        slot = self._slot_of.get(lora_int_id)
        if slot is None:
            taken = set(self._slot_of.values())
            slot = next((s for s in range(self.config.max_loras) if s not in taken), None)
            if slot is None:
                victim = next(i for i in self._slot_of if i not in needed)
                slot = self._slot_of.pop(victim)
            self.slots.set_slot(slot, self._loaded[lora_int_id].weights)
            self._slot_of[lora_int_id] = slot
        self._slot_of.move_to_end(lora_int_id)
        return slot
