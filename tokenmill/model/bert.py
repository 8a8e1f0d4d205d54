"""BERT-style encoders: ``BertModel`` (sentence embeddings: all-MiniLM and its kin) and
``BertForSequenceClassification`` (cross-encoders that score a text pair).

Differences from the decoders: word + absolute position + token type embeddings, each layer
post-LayerNorm (residual add, then the norm), GELU MLP, and bidirectional attention within
each sequence of the flat batch. Nothing is cached between steps: the scheduler hands an
encoder's prompt over whole (``Request.bidirectional``), so attention reads only the step's own
K/V and the paged cache, the backend and the block tables are not used. The sequences of a
step are padded to the longest one for attention only (one SDPA call per layer with a key
mask); every other op runs on the flat (tokens, hidden) rows.

Checkpoints name q/k/v ``attention.self.query`` etc.; ``checkpoint_weights`` renames them to
the fused ``qkv_proj``'s shards and drops what an encoder does not run (``position_ids``,
an MLM head, the pooler of an embedding model).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.model.layers import Embedding, Linear, ShardedLinear, empty_param

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# checkpoint sub-names -> ours (the loader then maps q/k/v_proj into qkv_proj's shards)
_RENAMES = ((".attention.self.query.", ".attention.q_proj."),
            (".attention.self.key.", ".attention.k_proj."),
            (".attention.self.value.", ".attention.v_proj."),
            ("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))


def hf_config(raw: dict, cfg: ModelConfig) -> ModelConfig:
    """config.json's BERT settings: an encoder (``causal`` False) that embeds, or scores pairs
    when its architecture is a sequence classifier (family ``bert_classifier``)."""
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(f"BERT position embeddings {raw['position_embedding_type']!r} "
                             "are not supported (only absolute)")
    act = raw.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ModelLoadError(f"BERT activation {act!r} is not supported "
                             f"({', '.join(_ACTIVATIONS)})")
    classifier = any(a.endswith("ForSequenceClassification")
                     for a in raw.get("architectures") or ())
    extra = {"type_vocab_size": raw.get("type_vocab_size", 2), "hidden_act": act,
             "layer_norm_eps": raw.get("layer_norm_eps", 1e-12),
             "num_labels": len(raw.get("id2label") or {}) or raw.get("num_labels", 1)}
    return replace(cfg, architecture="bert_classifier" if classifier else "bert", causal=False,
                   task="score" if classifier else "embed", eos_token_ids=(), extra=extra)


class LayerNorm(nn.Module):
    """LayerNorm with a bias (PyTorch's kernel sums bf16 rows in float32 already)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = empty_param(size)
        self.bias = empty_param(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class SeqLayout:
    """Where each sequence of a flat batch lies, and its padded (batch, longest) form for
    attention: ``pad_rows`` gathers flat rows into the padded grid (padding repeats row 0,
    masked out as keys), ``flat_rows`` picks the real rows back out of it."""

    def __init__(self, seq_lens: Sequence[int], device: torch.device):
        self.lens = list(seq_lens)
        self.longest = max(self.lens)
        self.single = len(self.lens) == 1
        if self.single:
            return
        pad, flat, start = [], [], 0
        for i, n in enumerate(self.lens):
            pad += list(range(start, start + n)) + [0] * (self.longest - n)
            flat += range(i * self.longest, i * self.longest + n)
            start += n
        self.pad_rows = torch.tensor(pad, device=device)
        self.flat_rows = torch.tensor(flat, device=device)
        keys = torch.arange(self.longest, device=device)
        lens = torch.tensor(self.lens, device=device)
        self.mask = (keys[None, :] < lens[:, None])[:, None, None, :]  # (batch, 1, 1, longest)


class BertSelfOutput(nn.Module):
    """A sublayer's output projection, residual add and post-LayerNorm."""

    def __init__(self, cfg: ModelConfig, in_features: int):
        super().__init__()
        self.dense = Linear(in_features, cfg.hidden_size, bias=True)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.extra["layer_norm_eps"])

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        size = cfg.q_size
        self.qkv_proj = ShardedLinear(cfg.hidden_size, {"q": size, "k": size, "v": size},
                                      bias=True)
        self.output = BertSelfOutput(cfg, size)

    def forward(self, h: torch.Tensor, seqs: SeqLayout) -> torch.Tensor:
        n, heads, d = h.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(h)  # (tokens, 3 * heads * head_dim)
        if seqs.single:
            q, k, v = qkv.view(1, n, 3, heads, d).permute(2, 0, 3, 1, 4)  # (1, heads, n, d) each
            o = F.scaled_dot_product_attention(q, k, v)
            o = o.transpose(1, 2).reshape(n, heads * d)
        else:
            b, m = len(seqs.lens), seqs.longest
            padded = qkv.index_select(0, seqs.pad_rows).view(b, m, 3, heads, d)
            q, k, v = padded.permute(2, 0, 3, 1, 4)  # (batch, heads, longest, d) each
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=seqs.mask)
            o = o.transpose(1, 2).reshape(b * m, heads * d).index_select(0, seqs.flat_rows)
        return self.output(o, h)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.act = _ACTIVATIONS[cfg.extra["hidden_act"]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, seqs: SeqLayout) -> torch.Tensor:
        h = self.attention(h, seqs)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    @property
    def layers(self) -> nn.ModuleList:
        return self.layer


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = Embedding(cfg.extra["type_vocab_size"], cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.extra["layer_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions) \
            + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(h)


class BertPooler(nn.Module):
    """The classifier's input: the CLS row through a dense layer and tanh."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_rows))


class BertModel(nn.Module):
    """The encoder: a flat batch of whole sequences -> their final hidden states."""

    def __init__(self, cfg: ModelConfig, backend=None, with_pooler: bool = False):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg) if with_pooler else None

    @property
    def model(self) -> BertEncoder:
        """Where the load's oneDNN trial finds the layers it times (``model.layers``, as in a
        decoder): with AMX, a step's hundreds of rows multiply several times faster there."""
        return self.encoder

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        """Hidden states (tokens, hidden) of whole sequences of ``seq_lens`` tokens, laid end
        to end in ``input_ids`` with their ``positions`` (from 0) and segments."""
        seqs = SeqLayout(seq_lens, input_ids.device)
        h = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            h = layer(h, seqs)
        return h

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        return _checkpoint_names(weights, "", keep_pooler=self.pooler is not None)


class BertForSequenceClassification(nn.Module):
    """A cross-encoder: ``classify`` turns each pair's CLS row into its label logits."""

    def __init__(self, cfg: ModelConfig, backend=None):
        super().__init__()
        self.config = cfg
        self.bert = BertModel(cfg, with_pooler=True)
        self.classifier = Linear(cfg.hidden_size, cfg.extra["num_labels"], bias=True)

    @property
    def model(self) -> BertEncoder:
        """The layers the load's oneDNN trial times (as ``BertModel.model``)."""
        return self.bert.encoder

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        return self.bert(input_ids, positions, token_type_ids, seq_lens)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """(pairs, hidden) CLS rows -> (pairs, num_labels) float32 logits."""
        return self.classifier(self.bert.pooler(cls_rows)).float()

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        return _checkpoint_names(weights, "bert.", keep_pooler=True)


def _checkpoint_names(weights: Iterable[tuple[str, torch.Tensor]], prefix: str,
                      keep_pooler: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names as our modules have them (``prefix``: where the encoder sits)."""
    for name, tensor in weights:
        if name.startswith("bert."):
            name = name[len("bert."):]
        elif name.startswith("classifier."):
            yield name, tensor
            continue
        if name.startswith(("cls.", "embeddings.position_ids")) or (
                name.startswith("pooler.") and not keep_pooler):
            continue  # an MLM head, a buffer, or a pooler an embedding model does not run
        for old, new in _RENAMES:
            name = name.replace(old, new)
        yield prefix + name, tensor
