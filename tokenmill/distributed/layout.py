"""Which part of the model a rank holds: plain data, no torch (the load-time plan reads it).

Ranks are numbered stage-major: rank = pp_rank * tp_size + tp_rank, so a pipeline stage's
tensor-parallel ranks are neighbours and land on one node whenever a node holds whole stages.
Tensor parallelism splits attention heads, the MLP's intermediate features and the vocabulary
evenly; KV heads are split when there are at least as many as ranks, else each rank holds the
one KV head its query heads read (replicated over ``tp_size / num_kv_heads`` ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenmill.config import ModelConfig, ParallelConfig
from tokenmill.util import cdiv


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    pp_size: int = 1
    stage_layers: tuple[int, ...] = ()  # decoder layers per stage (empty: one stage of all)

    @classmethod
    def plan(cls, parallel: ParallelConfig, cfg: ModelConfig) -> ParallelLayout:
        """The layout ``parallel`` asks for, checked against the model's shape."""
        layout = cls(parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                     split_layers(cfg.num_layers, parallel.pipeline_parallel_size,
                                  parallel.pp_layer_partition))
        layout.check(cfg)
        return layout

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def check(self, cfg: ModelConfig) -> None:
        t = self.tp_size
        problems = []
        if cfg.num_heads % t:
            problems.append(f"{cfg.num_heads} attention heads")
        if cfg.num_kv_heads % t and t % cfg.num_kv_heads:
            problems.append(f"{cfg.num_kv_heads} KV heads (neither divides the other)")
        if cfg.intermediate_size % t:
            problems.append(f"{cfg.intermediate_size} intermediate features")
        if problems:
            raise ValueError(f"tensor_parallel_size {t} does not split the model's "
                             f"{' and '.join(problems)}")

    def position(self, rank: int) -> RankPosition:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        return RankPosition(self, rank)


@dataclass(frozen=True)
class RankPosition:
    """One rank's place in a layout and the slices of the model it holds."""

    layout: ParallelLayout
    rank: int

    @property
    def tp_rank(self) -> int:
        return self.rank % self.layout.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.layout.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The rank that hands the step's logits back: the last stage's first TP rank."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def layers(self) -> range:
        """The decoder layers (global indices) this rank's stage runs."""
        sizes = self.layout.stage_layers
        if not sizes:
            raise ValueError("a layout without stage sizes")
        start = sum(sizes[:self.pp_rank])
        return range(start, start + sizes[self.pp_rank])

    def peer(self, pp_rank: int) -> int:
        """The rank at the same tensor-parallel place in stage ``pp_rank``."""
        return pp_rank * self.layout.tp_size + self.tp_rank

    def tp_ranks(self) -> list[int]:
        """The ranks of this rank's stage (its tensor-parallel group)."""
        t = self.layout.tp_size
        return list(range(self.pp_rank * t, (self.pp_rank + 1) * t))

    # ----- the slices of the model -----------------------------------------------------------

    def head_range(self, cfg: ModelConfig) -> range:
        per = cfg.num_heads // self.layout.tp_size
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    def kv_head_range(self, cfg: ModelConfig) -> range:
        t, kv = self.layout.tp_size, cfg.num_kv_heads
        if kv >= t:
            per = kv // t
            return range(self.tp_rank * per, (self.tp_rank + 1) * per)
        first = self.tp_rank * kv // t  # the KV head this rank's query heads read
        return range(first, first + 1)

    def intermediate_range(self, cfg: ModelConfig) -> range:
        per = cfg.intermediate_size // self.layout.tp_size
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    def vocab_range(self, cfg: ModelConfig) -> range:
        """This rank's rows of the embedding and lm_head; the last rank's may run past the
        vocabulary (padding rows: zeros, their logits cut off)."""
        per = cdiv(cfg.vocab_size, self.layout.tp_size)
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shape of the model this rank builds: its heads, KV heads, intermediate features,
        vocabulary rows and stage layers (the KV cache is sized from it)."""
        return replace(cfg, num_heads=len(self.head_range(cfg)),
                       num_kv_heads=len(self.kv_head_range(cfg)),
                       intermediate_size=len(self.intermediate_range(cfg)),
                       vocab_size=len(self.vocab_range(cfg)), num_layers=len(self.layers))


def split_layers(num_layers: int, stages: int,
                 partition: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Decoder layers per pipeline stage: ``partition`` when given (checked), else as even as
    possible with the earlier stages taking the extra layers (the last also runs lm_head)."""
    if partition is not None:
        if len(partition) != stages or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(f"pp_layer_partition {list(partition)} does not split "
                             f"{num_layers} layers into {stages} non-empty stages")
        return tuple(partition)
    if stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {stages} exceeds the model's {num_layers} "
                         "layers")
    base, extra = divmod(num_layers, stages)
    return tuple(base + (s < extra) for s in range(stages))
