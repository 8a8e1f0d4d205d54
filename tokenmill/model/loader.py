"""Build a model from local files: resolve the source, read its config, load its weights."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention import AttentionBackend, default_backend, get_backend
from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.kernels.cpu import load as load_cpu_kernels
from tokenmill.model.layers import Embedding, Linear, dense_rows_from, pack_linear_weights
from tokenmill.model.layers import route_to_onednn, time_packed_and_dense
from tokenmill.model.quant import INT4_GROUP, QUANTIZATIONS, QuantWeight, concat_rows
from tokenmill.model.quant import quantize_fp8
from tokenmill.model.quant import dequantize
from tokenmill.model.quant import quantize_int4, quantize_int8, takes_int8_activations
from tokenmill.model.quant import use_int8_activations
from tokenmill.model.registry import model_class
from tokenmill.model_source import ModelSource, resolve_model
from tokenmill.platform import cpu_features

log = logging.getLogger("tokenmill.model")

# Quantized weights in groups of 32 (int8, int4, and GGUF's Q8_0 / Q4_0 / Q4_1 under auto)
# multiply int8 activations (dynamic per-token scales) where the CPU has int8 dot products
# (AVX512-VNNI), as llama.cpp multiplies its blocks with activations quantized to 8 bits
INT8_ACTIVATIONS = True

# checkpoint sub-name -> (fused parameter sub-name, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


# float32 on the CPU kernels keeps a GGUF's quantized blocks in their bits (load_model); off,
# they are dequantized at load (the same sums, 4-5x the memory)
FLOAT32_IN_BITS = True

# When to time the packed GEMM against oneDNN's at load and send batches of enough rows (decode
# or prompt) to whichever is faster (choose_onednn_rows): "amx", a bf16 model on a CPU with AMX,
# whose tiles oneDNN uses and the packed GEMM (vdpbf16ps) does not; "always", any model with
# packed weights; "never"
ONEDNN_TRIAL = "amx"


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    source: ModelSource
    quantization: str = "none"  # the linear weights' formats as loaded (quantize_model)


def load_model(model: str, device: str = "cpu", dtype: str = "float32",
               attention_backend: str = "auto", quantization: str = "none") -> LoadedModel:
    """Load ``model`` (a path or known name) onto ``device`` with weights in ``dtype``;
    attention by the named backend (``auto``: ``default_backend(device)``); linear weights
    quantized as ``quantization`` says (model/quant.py)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of "
                         f"{', '.join(QUANTIZATIONS)}")
    on_gpu = torch.device(device).type == "cuda"
    if quantization == "fp8":
        check_fp8(device, dtype)
    elif quantization != "none" and torch.device(device).type != "cpu":
        log.warning("--quantization %s runs on CPUs only for now: on %s the weights are "
                    "dequantized at load", quantization, device)
        quantization = "none"
    if quantization == "fp8" and not on_gpu:
        log.warning("--quantization fp8 is meant for GPUs (Hopper); on %s it runs through "
                    "PyTorch's reference fp8 matmul", device)
    if attention_backend == "auto":
        attention_backend = default_backend(device)
    backend = get_backend(attention_backend)
    ops = getattr(backend, "ops", None)  # the compiled CPU kernels also fuse the layers' steps
    # float32 with the kernels' float32 GEMM: a GGUF's quantized blocks stay in their bits even
    # unquantized ("none"), packed for that GEMM, whose sums are then the float32 weight's bit
    # for bit (csrc/f32_gemm.h): the same model in a quarter of the memory, read 3-5x faster
    in_bits = (FLOAT32_IN_BITS and quantization == "none" and dtype == "float32"
               and ops is not None and getattr(ops, "f32_pack_cols", 0) > 0
               and torch.device(device).type == "cpu")
    source = resolve_model(model)
    if source.kind == "gguf":
        from tokenmill.model.gguf_file import gguf_model_config, gguf_weights, open_gguf

        reader = open_gguf(source.path)
        cfg = gguf_model_config(reader, source.path).with_dtype(dtype)
        weights = gguf_weights(reader, cfg, source.path,
                               keep_quantized=quantization == "auto" or in_bits)
    else:
        from tokenmill.model.hf_files import hf_model_config, hf_weights

        cfg = hf_model_config(source.path).with_dtype(dtype)
        weights = hf_weights(source.path)
    module = build_model(cfg, device, backend)
    load_weights(module, weights, str(source.path))
    described = quantize_model(module, quantization)
    # where ONEDNN_TRIAL says, the dense weights stay beside the packed ones until
    # choose_onednn_rows has timed both kernels
    onednn_trial = ops is not None and not on_gpu and (ONEDNN_TRIAL == "always" or (
        ONEDNN_TRIAL == "amx" and cfg.dtype == "bfloat16"
        and getattr(ops, "has_bf16_gemm", False) and "amx_bf16" in cpu_features()))
    pack_linear_weights(module, ops, getattr(torch, cfg.dtype), keep_dense=onednn_trial)
    if quantization == "none":
        described = unpack_leftovers(module, ops)
    else:
        described += int8_activations_note(module)
    for layer in module.modules():
        if hasattr(layer, "cpu_ops"):
            layer.cpu_ops = ops
    for layer in module.modules():
        if hasattr(layer, "fuse_activation"):
            layer.fuse_activation()
    if onednn_trial:
        route_to_onednn(module, choose_onednn_rows(module))
    return LoadedModel(module, cfg, source, described)


def choose_onednn_rows(module: nn.Module) -> int | None:
    """The rows from which the first decoder layer's linears ran faster through oneDNN on
    their dense weights than on the packed ones (``time_packed_and_dense``), or None."""
    first = getattr(getattr(module, "model", None), "layers", [None])[0]
    layers = [m for m in first.modules()
              if isinstance(m, Linear) and m.packed_beside_dense()] if first else []
    if not layers:
        return None
    timings = time_packed_and_dense(layers)
    rows = dense_rows_from(timings)
    log.info("linear kernels, one layer's linears at %s: packed %s ms, oneDNN %s ms -> %s",
             "/".join(map(str, timings)), "/".join(f"{t[0] * 1e3:.2f}" for t in timings.values()),
             "/".join(f"{t[1] * 1e3:.2f}" for t in timings.values()),
             f"oneDNN from {rows} rows" if rows else "packed throughout")
    return rows


def check_fp8(device: str, dtype: str) -> None:
    """fp8 matmuls on CUDA need a GPU of compute capability 8.9 or above (Ada, Hopper), and
    their per-row scales a bfloat16 result."""
    if torch.device(device).type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"--quantization fp8 needs a GPU of compute capability 8.9 or "
                             f"above (Ada, Hopper); this one is {major}.{minor}")
        if dtype != "bfloat16":
            raise ValueError(f"--quantization fp8 on a GPU computes in bfloat16, not {dtype}; "
                             "use --dtype bfloat16 (or auto)")


def quantize_model(module: nn.Module, quantization: str) -> str:
    """Put the linear layers in their quantized form after loading: join the GGUF blocks kept
    by ``auto``, or quantize float weights for ``int8`` / ``int4``. The output layer gets int8
    in both (as llama.cpp keeps it at 6-8 bits: it decides every token); a tied embedding then
    looks its rows up from the same quantized table. Returns what the layers hold, e.g.
    "q4_1 x120, q8_0 x1", or "none"."""
    lm_head = getattr(module, "lm_head", None)
    tied = getattr(getattr(module, "config", None), "tie_word_embeddings", False)
    embeddings = [m for m in module.modules() if isinstance(m, Embedding)]
    for embedding in embeddings:  # auto: a quantized table in the file
        qw = embedding.quant_parts.pop(None, None)
        if qw is not None and tied and lm_head is not None:
            lm_head.set_quantized(qw)
        elif qw is not None:
            embedding.quant, embedding.weight = qw, None
    linears = [m for m in module.modules() if isinstance(m, Linear)]
    for layer in linears:
        layer.finish_quantized()
    if quantization == "fp8":
        # every linear layer but the output layer (it decides each token; vLLM's fp8 keeps it
        # in the compute dtype too)
        for layer in linears:
            if layer.weight is not None and layer is not lm_head:
                layer.set_quantized(quantize_fp8(layer.weight.detach()))
        kinds = Counter(layer.quant.kind for layer in linears if layer.quant is not None)
        return ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items()))
    if quantization in ("int8", "int4"):
        for layer in linears:
            if layer.weight is None:
                continue
            w = layer.weight.detach()
            four = quantization == "int4" and layer is not lm_head \
                and w.shape[1] % INT4_GROUP == 0
            # a slice of rows at a time: the float32 temporaries of a whole output layer
            # would add hundreds of MB to the peak
            quantize = quantize_int4 if four else quantize_int8
            joined = concat_rows([quantize(w[i:i + 4096]) for i in range(0, w.shape[0], 4096)])
            layer.set_quantized(joined or quantize(w))  # slices may differ in scale dtype
    if tied and lm_head is not None and lm_head.quant is not None:
        for embedding in embeddings:
            embedding.quant, embedding.weight = lm_head.quant, None
    kinds = Counter(layer.quant.kind for layer in linears if layer.quant is not None)
    if not kinds:
        return "none"
    ops = load_cpu_kernels()
    if ops is None:
        log.warning("quantized weights without the CPU kernels: every step dequantizes them "
                    "(slow); install a C++ compiler")
    for layer in linears:
        layer.quant_ops = ops
        qw = layer.quant
        # int8 activations: the VNNI kernels (any dtype, up to DENSE_ROWS rows), or float32's
        # packed GEMM (AVX2, every row: csrc/a8_gemm.h); a layer neither takes runs on the
        # weights-only kernels
        if (INT8_ACTIVATIONS and quantization != "none" and ops is not None
                and (ops.has_int8_dot or getattr(ops, "a8_pack_cols", 0))
                and qw is not None and takes_int8_activations(qw)):
            use_int8_activations(qw)
    return ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items()))


def int8_activations_note(module: nn.Module) -> str:
    """" (int8 activations: N layers)" for the layers that multiply x rounded to int8 (packed
    for float32's GEMM, or left to the VNNI kernels), else ""."""
    n = sum(1 for m in module.modules() if isinstance(m, Linear) and (
        (m.packed_f32 is not None and m.packed_f32.dtype == torch.int8)
        or (m.quant is not None and m.quant.int8_activations
            and getattr(m.quant_ops, "has_int8_dot", False))))
    return f" (int8 activations: {n} layers)" if n else ""


def unpack_leftovers(module: nn.Module, ops) -> str:
    """Unquantized ("none") with a GGUF's blocks kept for the float32 GEMM: a layer that GEMM
    could not take in its bits gets its float32 weight after all. Returns the description of
    the weights: "none", or "none (float32 from q4_1 x120, q8_0 x1 kept in their bits)"."""
    kinds: Counter = Counter()
    for layer in module.modules():
        if not isinstance(layer, Linear):
            continue
        if layer.quant is not None:
            layer.weight = nn.Parameter(dequantize(layer.quant), requires_grad=False)
            layer.quant = None
            layer.pack_for_cpu(keep_dense=False, ops=ops)
        elif layer.packed_kind is not None:
            kinds[layer.packed_kind] += 1
    if not kinds:
        return "none"
    held = ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items()))
    return f"none (float32 from {held} kept in their bits)"


def build_model(cfg: ModelConfig, device: str, backend: AttentionBackend) -> nn.Module:
    # Parameters are created directly in the compute dtype on the device; RoPE tables ask
    # for float32 explicitly and stay that way.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, cfg.dtype))
    try:
        with torch.device(device):
            module = model_class(cfg.architecture)(cfg, backend)
    finally:
        torch.set_default_dtype(previous)
    return module.eval()


def load_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 origin: str) -> None:
    """Copy checkpoint tensors into parameters through each parameter's weight_loader."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and getattr(module.config, "tie_word_embeddings", False):
            continue  # tied: the embedding is the output projection
        target, shard = _target(name)
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"{origin}: checkpoint tensor {name!r} has no place in the model")
        if isinstance(tensor, QuantWeight):  # kept quantized where the layer takes it
            owner = module.get_submodule(target.rpartition(".")[0])
            if target.endswith(".weight") and hasattr(owner, "load_quantized"):
                try:
                    owner.load_quantized(tensor, shard)
                except ValueError as e:
                    raise ModelLoadError(f"{origin}: tensor {name!r}: {e}") from e
                loaded.add(f"{target}:{shard}")
                continue
            tensor = dequantize(tensor)
        try:
            with torch.no_grad():
                param.weight_loader(param, tensor.to(param.dtype), *([] if shard is None else [shard]))
        except ValueError as e:
            raise ModelLoadError(f"{origin}: tensor {name!r}: {e}") from e
        loaded.add(f"{target}:{shard}")
    _check_complete(module, loaded, origin)


def _target(name: str) -> tuple[str, object]:
    for part, (fused, shard) in _STACKED.items():
        if part in name:
            return name.replace(part, fused), shard
    return name, None


def _check_complete(module: nn.Module, loaded: set[str], origin: str) -> None:
    missing = []
    for name, param in module.named_parameters():
        offsets = getattr(getattr(param.weight_loader, "__self__", None), "offsets", None)
        shards = list(offsets) if offsets else [None]
        missing += [f"{name}[{s}]" if s is not None else name
                    for s in shards if f"{name}:{s}" not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{origin}: checkpoint lacks {len(missing)} tensors: {shown}")
