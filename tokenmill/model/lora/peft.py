"""Read a LoRA adapter saved by PEFT (``adapter_config.json`` + ``adapter_model.safetensors``)
and check it against the base model, turning it into tokenmill's per-layer ``ModuleLoRA``s.

PEFT adapts each Hugging Face linear on its own (q_proj, k_proj, ... down_proj); tokenmill fuses
q/k/v into one qkv linear and gate/up into one gate_up linear, so every PEFT module becomes one
slice of its tokenmill linear, at the output rows the base model's fused weight gives it, with its
own rank and its own scale (``alpha / r``, or ``alpha / sqrt(r)`` under rsLoRA) folded into B.
Anything tokenmill would serve differently from PEFT is refused with a ``LoRAError`` naming it.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import LoRAError
from tokenmill.model.lora.weights import LoRASlice, ModuleLoRA

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# PEFT module name -> (its parent in a decoder layer, the tokenmill linear it is part of, its
# place among that linear's outputs: ShardedLinear's order, q/k/v and gate/up)
PEFT_MODULES: dict[str, tuple[str, str, int]] = {
    "q_proj": ("self_attn", "qkv", 0), "k_proj": ("self_attn", "qkv", 1),
    "v_proj": ("self_attn", "qkv", 2), "o_proj": ("self_attn", "o", 0),
    "gate_proj": ("mlp", "gate_up", 0), "up_proj": ("mlp", "gate_up", 1),
    "down_proj": ("mlp", "down", 0),
}
_ADAPTABLE = ", ".join(PEFT_MODULES)

# settings of a PEFT LoRA config that change what the adapter computes in ways tokenmill does
# not implement: refused whenever they are set (truthy)
_REFUSED = {
    "use_dora": "DoRA adapters (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters (LoRA on parameters, not modules)",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "use_bdlora",
    "megatron_config": "megatron_config",
}

# a tensor of the weights file: <module>.lora_A|lora_B[.<adapter name>].weight
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.lora_(?P<ab>[AB])"
                  r"(?:\.[^.]+)?\.weight$")
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<name>\w+)$")


@dataclass
class LoadedAdapter:
    """One adapter read and checked against the base model; ``weights`` keyed by (layer index,
    tokenmill linear), in the compute dtype, on the CPU."""

    rank: int  # the largest r of its modules
    alpha: float
    targets: tuple[str, ...]  # the PEFT module names it adapts (q_proj, ..., down_proj)
    weights: dict[tuple[int, str], ModuleLoRA]
    fingerprint: str  # sha256 of adapter_config.json + the weights file, hex[:16]

    def nbytes(self) -> int:
        return sum(m.nbytes() for m in self.weights.values())


@dataclass(frozen=True)
class _Settings:
    """What ``adapter_config.json`` says about which modules are adapted and how."""

    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: tuple[str, ...] | str
    exclude_modules: tuple[str, ...] | str
    layers: frozenset[int] | None  # layers_to_transform (None: every layer)
    max_rank: int  # --max-lora-rank

    def rank(self, key: str) -> int:
        rank = self.rank_pattern.get(_pattern_key(self.rank_pattern, key), self.r)
        if rank > self.max_rank:
            raise LoRAError(f"{key}: rank {rank} exceeds --max-lora-rank {self.max_rank}")
        return rank

    def scale(self, key: str) -> float:
        alpha = float(self.alpha_pattern.get(_pattern_key(self.alpha_pattern, key), self.alpha))
        r = self.rank(key)
        return alpha / math.sqrt(r) if self.rslora else alpha / r

    def targets(self, key: str, layer: int) -> bool:
        """Whether PEFT puts a LoRA on the module ``key`` (``model.layers.3.self_attn.q_proj``)."""
        if _names(self.exclude_modules, key):
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, key) is not None
        if key in self.target_modules:  # a full module name: PEFT takes it in any layer
            return True
        return _names(self.target_modules, key) and (self.layers is None or layer in self.layers)


def _names(names: tuple[str, ...] | str, key: str) -> bool:
    """PEFT's matching: a regex over the whole module name, or a list of names that the module
    name equals or ends with."""
    if isinstance(names, str):
        return re.fullmatch(names, key) is not None
    return any(key == n or key.endswith("." + n) for n in names)


def _pattern_key(patterns: dict, key: str) -> str | None:
    """The rank_pattern / alpha_pattern entry for module ``key``, as PEFT picks it: the first
    whose regex matches a dotted suffix of the name."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), None)


def module_key(layer: int, name: str) -> str:
    """The Hugging Face name of PEFT module ``name`` of decoder layer ``layer``."""
    return f"model.layers.{layer}.{PEFT_MODULES[name][0]}.{name}"


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each PEFT module of the base model."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_peft_adapter(path: str | Path, cfg: ModelConfig, dtype: torch.dtype,
                      max_rank: int) -> LoadedAdapter:
    """The adapter in directory ``path`` for a base model shaped ``cfg``, in ``dtype``; a
    ``LoRAError`` naming the first thing that does not fit (a missing or unreadable file, a
    setting tokenmill does not serve, a rank above ``max_rank``, a target it cannot adapt, a
    layer or shape the base model does not have)."""
    directory = Path(path)
    try:
        config_bytes, weights_name, weights_bytes = _read_files(directory)
        settings = _settings(_parse_json(config_bytes), max_rank)
        _check_target_names(settings.target_modules)
        pairs = _module_pairs(_load_tensors(weights_name, weights_bytes), weights_name, cfg)
        _check_targets(settings, pairs, cfg, weights_name)
        weights = _fuse(_scaled_modules(settings, pairs, cfg), cfg, dtype)
    except re.error as e:
        raise LoRAError(f"LoRA adapter {directory}: a pattern of {CONFIG_FILE} (target_modules, "
                        f"rank_pattern, ...) is not a valid regex: {e}") from e
    except LoRAError as e:
        raise LoRAError(f"LoRA adapter {directory}: {e}") from e
    rank = max(a.shape[0] for a, _ in pairs.values())
    targets = tuple(n for n in PEFT_MODULES if any(name == n for _, name in pairs))
    return LoadedAdapter(rank, settings.alpha, targets, weights,
                         _fingerprint(config_bytes, weights_bytes))


def adapter_fingerprint(path: str | Path) -> str:
    """The fingerprint ``read_peft_adapter`` gives the adapter in ``path`` (its files' hash)."""
    try:
        config_bytes, _, weights_bytes = _read_files(Path(path))
    except LoRAError as e:
        raise LoRAError(f"LoRA adapter {path}: {e}") from e
    return _fingerprint(config_bytes, weights_bytes)


def _fingerprint(config_bytes: bytes, weights_bytes: bytes) -> str:
    return hashlib.sha256(config_bytes + weights_bytes).hexdigest()[:16]


def _read_files(directory: Path) -> tuple[bytes, str, bytes]:
    """adapter_config.json's bytes, the weights file's name and its bytes (safetensors first).
    Any path the OS refuses to look at (too long, not searchable) is a LoRAError too."""
    try:
        return _read_files_of(directory)
    except OSError as e:
        raise LoRAError(f"cannot read its files: {e.strerror or e}") from e


def _read_files_of(directory: Path) -> tuple[bytes, str, bytes]:
    if not directory.is_dir():
        raise LoRAError("no such directory")
    config = directory / CONFIG_FILE
    weights = next((directory / n for n in WEIGHT_FILES if (directory / n).is_file()), None)
    if not config.is_file():
        raise LoRAError(f"{CONFIG_FILE} is missing")
    if weights is None:
        raise LoRAError(f"{WEIGHT_FILES[0]} is missing (nor is there an {WEIGHT_FILES[1]})")
    return config.read_bytes(), weights.name, weights.read_bytes()


def _parse_json(data: bytes) -> dict:
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAError(f"{CONFIG_FILE} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise LoRAError(f"{CONFIG_FILE} is not a JSON object")
    return raw


def _settings(raw: dict, max_rank: int) -> _Settings:
    """The config's settings, refusing those tokenmill does not serve."""
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"peft_type is {peft_type!r}; tokenmill serves LORA adapters only")
    if raw.get("bias", "none") != "none":
        raise LoRAError(f"bias={raw['bias']!r}: adapters that train biases are not supported "
                        "(bias must be 'none')")
    for key, what in _REFUSED.items():
        if raw.get(key):
            raise LoRAError(f"{what} is not supported ({key}={raw[key]!r})")
    try:
        r, alpha = int(raw["r"]), float(raw.get("lora_alpha", 8))
        rank_pattern = {str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()}
        alpha_pattern = {str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()}
    except KeyError as e:
        raise LoRAError(f"{CONFIG_FILE} lacks {e}") from e
    except (TypeError, ValueError, AttributeError) as e:
        raise LoRAError(f"{CONFIG_FILE}: r, lora_alpha, rank_pattern or alpha_pattern is not "
                        f"a number: {e}") from e
    if min([r, *rank_pattern.values()]) < 1:
        raise LoRAError(f"{CONFIG_FILE} gives a rank below 1")
    return _Settings(r, alpha, bool(raw.get("use_rslora")), rank_pattern, alpha_pattern,
                     _target_modules(raw), _name_list(raw.get("exclude_modules"),
                                                      "exclude_modules"), _layers(raw), max_rank)


def _name_list(value, what: str) -> tuple[str, ...] | str:
    if value is None:
        return ()
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise LoRAError(f"{what} is neither a list of module names nor a regex: {value!r}")


def _target_modules(raw: dict) -> tuple[str, ...] | str:
    targets = _name_list(raw.get("target_modules"), "target_modules")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        return tuple(PEFT_MODULES)  # every linear of the layers; PEFT leaves lm_head out
    if not targets:
        raise LoRAError("target_modules is empty")
    return targets


def _layers(raw: dict) -> frozenset[int] | None:
    """layers_to_transform, where it applies; refused where tokenmill could not follow it."""
    layers = raw.get("layers_to_transform")
    if layers is None or layers == []:
        return None
    if isinstance(raw.get("target_modules"), str):
        raise LoRAError("layers_to_transform with a regex target_modules (PEFT refuses it too)")
    pattern = raw.get("layers_pattern")
    patterns = [pattern] if isinstance(pattern, str) else list(pattern or [])
    if patterns and "layers" not in patterns:
        raise LoRAError(f"layers_pattern {pattern!r} does not name the model's 'layers'")
    try:
        return frozenset([int(layers)] if isinstance(layers, int) else map(int, layers))
    except (TypeError, ValueError) as e:
        raise LoRAError(f"layers_to_transform is not a list of layer indices: {layers!r}") from e


def _load_tensors(name: str, data: bytes) -> dict[str, torch.Tensor]:
    if name.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            return load(data)
        except (SafetensorError, ValueError, OSError) as e:
            raise LoRAError(f"{name} is not a readable safetensors file: {e}") from e
    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- a pickle refused or broken fails in many ways
        raise LoRAError(f"{name} cannot be loaded as plain tensors ({e}); save the adapter "
                        "as adapter_model.safetensors") from e
    if not isinstance(tensors, dict) or \
            not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise LoRAError(f"{name} is not a dict of tensors; save the adapter as "
                        "adapter_model.safetensors")
    return tensors


Pairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, PEFT name) -> (A, B)


def _module_pairs(tensors: dict[str, torch.Tensor], file_name: str, cfg: ModelConfig) -> Pairs:
    """The weights file's (A, B) per (layer, PEFT module), every key and layer checked."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, name, ab = _parse_key(key, file_name, cfg)
        halves.setdefault((layer, name), {})[ab] = tensor
    pairs: Pairs = {}
    for (layer, name), ab in sorted(halves.items()):
        for have, lack in (("A", "B"), ("B", "A")):
            if lack not in ab:
                raise LoRAError(f"layer {layer} {name} has lora_{have} but no lora_{lack} "
                                f"in {file_name}")
        pairs[layer, name] = ab["A"], ab["B"]
    if not pairs:
        raise LoRAError(f"{file_name} holds no LoRA weights")
    return pairs


def _parse_key(key: str, file_name: str, cfg: ModelConfig) -> tuple[int, str, str]:
    m = _KEY.match(key)
    if m is None:
        raise LoRAError(f"{file_name} holds {key!r}, which is not a lora_A / lora_B weight "
                        "of a linear module (DoRA magnitudes, LoRA biases and embedding "
                        "adapters are not supported)")
    module = m["module"]
    layer = _LAYER_MODULE.match(module)
    if layer is None or PEFT_MODULES.get(layer["name"], ("",))[0] != layer["parent"]:
        raise LoRAError(f"target module {module!r} cannot be adapted: tokenmill adapts "
                        f"{_ADAPTABLE} of the decoder layers")
    index = int(layer["layer"])
    if index >= cfg.num_layers:
        raise LoRAError(f"layer {index} {layer['name']}: the base model has {cfg.num_layers} "
                        "layers")
    return index, layer["name"], m["ab"]


def _check_targets(settings: _Settings, pairs: Pairs, cfg: ModelConfig, file_name: str) -> None:
    """The weights file holds exactly the modules the config's target_modules select."""
    for layer in range(cfg.num_layers):
        for name in PEFT_MODULES:
            wanted = settings.targets(module_key(layer, name), layer)
            if wanted and (layer, name) not in pairs:
                raise LoRAError(f"{file_name} lacks lora_A / lora_B of layer {layer} {name}, "
                                "which target_modules selects")
            if not wanted and (layer, name) in pairs:
                raise LoRAError(f"{file_name} has weights for layer {layer} {name}, which "
                                f"{CONFIG_FILE}'s target_modules does not select")


def _check_target_names(targets: tuple[str, ...] | str) -> None:
    """target_modules names only modules tokenmill adapts (a regex: selects none it cannot)."""
    keys = [module_key(0, n) for n in PEFT_MODULES]
    if isinstance(targets, str):
        for other in ("lm_head", "model.embed_tokens"):
            if re.fullmatch(targets, other):
                raise LoRAError(f"target_modules {targets!r} selects {other}, which tokenmill "
                                f"cannot adapt (it adapts {_ADAPTABLE})")
        return
    for target in targets:
        if not any(_names((target,), key) for key in keys):
            raise LoRAError(f"target module {target!r} cannot be adapted: tokenmill adapts "
                            f"{_ADAPTABLE} of the decoder layers")


# (layer, PEFT name) -> (A (r, in), B (out, r), scale), shapes checked
Scaled = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


def _scaled_modules(settings: _Settings, pairs: Pairs, cfg: ModelConfig) -> Scaled:
    shapes = module_shapes(cfg)
    out: Scaled = {}
    for (layer, name), (a, b) in pairs.items():
        key = module_key(layer, name)
        _check_shapes(f"layer {layer} {name}", a, b, shapes[name], settings.rank(key))
        out[layer, name] = a, b, settings.scale(key)
    return out


def _check_shapes(where: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, int],
                  rank: int) -> None:
    fan_in, fan_out = shape
    name = where.split()[-1]
    for label, t in (("lora_A", a), ("lora_B", b)):
        if t.dim() != 2 or not t.is_floating_point():
            raise LoRAError(f"{where} {label} is a {t.dim()}-D {t.dtype} tensor, not a "
                            "floating-point matrix")
    if a.shape[1] != fan_in:
        raise LoRAError(f"{where} lora_A is {tuple(a.shape)}; the base model's {name} has "
                        f"{fan_in} inputs")
    if b.shape[0] != fan_out:
        raise LoRAError(f"{where} lora_B is {tuple(b.shape)}; the base model's {name} has "
                        f"{fan_out} outputs")
    if a.shape[0] != rank or b.shape[1] != rank:
        raise LoRAError(f"{where} lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                        f"{CONFIG_FILE} gives it rank {rank}")


def _fuse(modules: Scaled, cfg: ModelConfig, dtype: torch.dtype
          ) -> dict[tuple[int, str], ModuleLoRA]:
    """One ``ModuleLoRA`` per (layer, tokenmill linear): its PEFT modules as slices, in the
    fused linear's output order."""
    shapes = module_shapes(cfg)
    grouped: dict[tuple[int, str], list[str]] = {}
    for layer, name in sorted(modules, key=lambda k: (k[0], PEFT_MODULES[k[1]][2])):
        grouped.setdefault((layer, PEFT_MODULES[name][1]), []).append(name)
    return {(layer, role): _module_lora([modules[layer, n] for n in names],
                                        [_out_range(shapes, role, n) for n in names],
                                        _role_outputs(shapes, role), dtype)
            for (layer, role), names in grouped.items()}


def _role_outputs(shapes: dict[str, tuple[int, int]], role: str) -> int:
    return sum(shapes[n][1] for n, (_, r, _) in PEFT_MODULES.items() if r == role)


def _out_range(shapes: dict[str, tuple[int, int]], role: str, name: str) -> tuple[int, int]:
    """(first output, size) of PEFT module ``name`` inside tokenmill linear ``role``: the
    modules before it in the fused order come first (ShardedLinear's offsets)."""
    place = PEFT_MODULES[name][2]
    start = sum(shapes[n][1] for n, (_, r, p) in PEFT_MODULES.items() if r == role and p < place)
    return start, shapes[name][1]


def _module_lora(parts: list[tuple[torch.Tensor, torch.Tensor, float]],
                 ranges: list[tuple[int, int]], outputs: int, dtype: torch.dtype) -> ModuleLoRA:
    total = sum(a.shape[0] for a, _, _ in parts)
    b_all = torch.zeros(total, outputs, dtype=torch.float32)  # (sum of ranks, out_features)
    slices, row = [], 0
    for (a, b, scale), (start, size) in zip(parts, ranges):
        rank = a.shape[0]
        # the scale is folded into B in float32, then rounded once to the compute dtype
        b_all[row:row + rank, start:start + size] = b.float().T * scale
        slices.append(LoRASlice(row, rank, start, size))
        row += rank
    a_all = torch.cat([a.float() for a, _, _ in parts])  # (sum of ranks, in_features)
    return ModuleLoRA(a_all.to(dtype).contiguous(), b_all.to(dtype).contiguous(), tuple(slices))
