"""What each rank holds of a model under its layout (``Parallelism``): tensor parallelism's shares of
every matrix and of the kv heads, and a pipeline stage's layers and edges.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitbench.models.architecture import Architecture
from fitbench.spec import Layout, Stage


@dataclass(frozen=True)
class Parallelism:
    """How one model is spread over GPUs: its ``Layout`` (data-parallel replicas and shards, tensor and
    pipeline degrees; ``fitbench.spec``), the very object the run is given, so a planned layout is the
    layout that runs; ``offload``: FSDP's CPU offload; ``microbatches``: of a pipeline's training
    step (by default one per stage). ``Parallelism("fsdp", 4)`` names one strategy over some GPUs;
    ``Parallelism(layout=...)`` any layout, combined ones included. A given layout stands unless
    ``strategy`` and ``gpus`` name another (``dataclasses.replace`` of either): then it is rebuilt
    from them."""

    strategy: str = "single"  # single, ddp, fsdp, tp, pipeline; or a combined layout's, e.g. tp+pipeline
    gpus: int = 1
    offload: bool = False
    layout: Layout | None = None
    microbatches: int | None = None

    def __post_init__(self) -> None:
        layout = self.layout
        named = (self.strategy, self.gpus) != ("single", 1)
        if layout is None or (named and (layout.strategy, layout.world_size) != (self.strategy, self.gpus)):
            layout = Layout.of_strategy(self.strategy, self.gpus)
            object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "strategy", layout.strategy)
        object.__setattr__(self, "gpus", layout.world_size)
        if self.offload and self.shards == 1:
            raise ValueError(f"CPU offload is FSDP's, over several GPUs; not {self.strategy} over {self.gpus}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"microbatches must be at least 1, got {self.microbatches}")

    @property
    def tensor(self) -> int:
        return self.layout.tp

    @property
    def stages(self) -> int:
        return self.layout.pp

    @property
    def shards(self) -> int:
        """How many ways weights, gradients and optimizer state are split across data-parallel ranks."""
        return self.layout.dp_shard

    @property
    def schedule_microbatches(self) -> int:
        """The microbatches of a pipeline's training step: ``microbatches``, by default one per stage."""
        return self.microbatches or self.stages

    def microbatches_of(self, batch: int) -> int:
        """The microbatches a step of ``batch`` sequences makes: no more than its sequences."""
        return min(self.schedule_microbatches, batch)


def pipeline_stage_list(arch: Architecture, stages: int) -> tuple[Stage, ...]:
    """Every stage of ``stages`` over ``arch``'s layers (``fitbench.spec.pipeline_stages``)."""
    return Stage.every(arch.num_layers, stages)


def kv_heads_split(arch: Architecture, tp: int) -> int:
    """How many ways tensor parallelism splits the kv heads: ``tp`` when they divide by it, else 1 (the
    k and v projections and the KV cache replicated on every rank)."""
    return tp if arch.num_kv_heads % tp == 0 else 1


ROW_WISE = ("o_proj", "down_proj", "dense", "dense_4h_to_h", "c_proj")
FUSED_QKV = ("query_key_value", "c_attn")


def tp_layer_matrices(arch: Architecture, tp: int) -> list[tuple[int, int, int]]:
    """(rows, columns, bias) of each layer matrix on one tensor-parallel rank: q, k, v, gate, up (and
    the fused qkv and MLP inputs) column-wise, their rows split; o and down row-wise, their columns
    split, their biases whole; k and v (the kv part of a fused qkv) whole where the kv heads do not
    divide by ``tp``."""
    kv_tp = kv_heads_split(arch, tp)
    q, k = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shares = []
    for matrix in arch.layer_matrices:
        bias = matrix.rows if matrix.bias else 0
        if matrix.name.rsplit(".", 1)[-1] in ROW_WISE:
            shares.append((matrix.rows, matrix.columns // tp, bias))
        elif matrix.name.endswith(("k_proj", "v_proj")):
            shares.append((matrix.rows // kv_tp, matrix.columns, bias // kv_tp))
        elif matrix.name.endswith(FUSED_QKV):
            rows = q // tp + 2 * k // kv_tp
            shares.append((rows, matrix.columns, rows if matrix.bias else 0))
        else:
            shares.append((matrix.rows // tp, matrix.columns, bias // tp))
    return shares


def rank_layer_params(arch: Architecture, tp: int) -> int:
    """One layer's parameters on one tensor-parallel rank (``tp_layer_matrices``; the norms replicated)."""
    return sum(rows * columns + bias for rows, columns, bias in tp_layer_matrices(arch, tp)) + \
        arch.norm_params_per_layer


def rank_edge_params(arch: Architecture, tp: int, stage: Stage) -> int:
    """The parameters outside the decoder layers on one rank of ``stage``: the token embedding on the
    first stage, split over the vocabulary by ``tp``, with a learned position table whole; the final
    norm (replicated) and the output projection (split over the vocabulary) on the last. A tied output
    projection is the embedding itself on one stage, a copy of its own on a last stage that is not the
    first."""
    table = arch.vocab_size * arch.hidden_size // tp
    first = table + arch.position_params if stage.first else 0
    output = table if not arch.tie_embeddings or not stage.first else 0
    last = arch.final_norm_params + output if stage.last else 0
    return first + last
