"""The one place a built model gets its parallelism and the techniques that wrap it, in torchtitan's
order (``parallelize_llama``): tensor parallelism, activation checkpointing, ``torch.compile``, then
FSDP2 or DDP. No other module applies them; each technique's own mechanics live beside it
(``fitbench.worker.tensor_parallel``, ``fitbench.worker.hf_tensor_parallel``, ``fitbench.worker.parallel``).

- Tensor parallelism: a native model's weights are cut while the model is still on the meta device,
  so that no rank ever holds the whole model; the build asks for the cut (``tensor_parallel_cut``)
  and this module keeps its record. A transformers model is cut after its build, from rank 0's
  weights, broadcast (``fitbench.worker.hf_tensor_parallel``). Generation on native shards runs on
  plain local tensors (``local_shards``).
- Activation checkpointing, of the first ``checkpointed_layers`` decoder layers (every one when
  None), as each backend switches it on (``CausalLM.enable_activation_checkpointing``).
- Compile: under DDP and FSDP per decoder layer, so that their communication stays between compiled
  regions; a pipeline stage's own layers; else the whole module. Decoding then runs through the
  compiled modules eagerly, never captured in a CUDA graph.
- FSDP2 over the "dp_shard" dimension of the tensor-parallel mesh, or over every rank after rank 0's
  weights are broadcast; DDP over every rank (``fitbench.worker.parallel``).

What must already have happened to the model (``fitbench.worker.build``): float8 or quantization
converters, since both replace modules, and adapters, since DDP and FSDP take the parameters that
train as they find them. Call ``parallelize`` inside ``fitbench.worker.ranks.process_group``, after the
build and before the optimizer exists (``fitbench.worker.loops.make_step``), on every rank.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from fitbench.models.backends import CausalLM, HuggingFaceLM
from fitbench.models.native import NativeCausalLM, ShardWriter
from fitbench.precisions import PrecisionPolicy
from fitbench.worker.hf_tensor_parallel import parallelize_hf_tensor
from fitbench.worker.parallel import broadcast_weights, mixed_precision, shard_fsdp, wrap_ddp
from fitbench.worker.pipeline import PipelineLM
from fitbench.worker.ranks import Rank
from fitbench.worker.tensor_parallel import fuse_local_projections, localize, parallelize_tensor, write_shard
from fitbench.spec import Layout, LayoutError

# What a native model's tensor-parallel cut records of where its initial weights came from.
DRAWN_PER_RANK = "drawn on every rank from the seed, each keeping its shards"
BROADCAST = "rank 0's, broadcast"


def tensor_parallel_cut(mesh, device, applied: dict[str, Any], *, sequence_parallel: bool = False,
                        inference: bool = False) -> Callable[[NativeCausalLM], ShardWriter]:
    """For ``fitbench.worker.stages.build_stage``: the function that cuts a native model, still on the
    meta device, over ``mesh`` (the "tp" ranks), before its weights get storage on ``device``
    (``fitbench.worker.tensor_parallel.parallelize_tensor``), recording what it applied into ``applied``,
    and returns how each weight's shard is written from the whole weight."""
    def cut(model: NativeCausalLM) -> ShardWriter:
        applied.update(parallelize_tensor(model, mesh, device, sequence_parallel=sequence_parallel,
                                          inference=inference))
        return write_shard

    return cut


def local_shards(model: NativeCausalLM, applied: dict[str, Any]) -> None:
    """An inference model's DTensor shards swapped for plain local tensors, each layer's column-wise
    shards stacked into one matmul (``fitbench.worker.tensor_parallel``: ``localize``,
    ``fuse_local_projections``)."""
    localize(model)
    fuse_local_projections(model, kv_sharded=applied["kv_heads"] == "sharded")


def parallelize(lm: CausalLM, layout: Layout, policy: PrecisionPolicy, rank: Rank, *,
                tensor_parallel: dict[str, Any] | None = None, mesh=None, activation_checkpointing: bool = False,
                checkpointed_layers: int | None = None, compile: bool = False, offload: bool = False,
                microbatches: int | None = None) -> dict[str, Any] | None:
    """Apply ``layout`` and the techniques asked for to ``lm`` in place, in the module docstring's order
    (DDP replaces ``lm.module`` by its wrapper); return what was applied, for the result row's
    ``parallel`` (None for one process and for replicas, which share nothing).

    ``tensor_parallel``, ``mesh``: what a native model's tensor-parallel cut applied and its device
    mesh (``fitbench.worker.build``); FSDP then shards over its "dp_shard" dimension. ``offload``
    (FSDP): the shards, their gradients and the optimizer state live in CPU memory
    (``fitbench.worker.parallel.shard_fsdp``). ``microbatches``: a pipeline's GPipe microbatches in
    training (None in inference), for its record."""
    data_parallel = layout.dp_replicate > 1 or layout.dp_shard > 1
    applied = _tensor_parallel(lm, layout, rank, tensor_parallel, microbatches)
    if activation_checkpointing:
        lm.enable_activation_checkpointing(checkpointed_layers)
    if compile:
        _compile(lm, per_layer=data_parallel)
    if layout.pp > 1:
        return applied
    checkpointing = {"activation_checkpointing": activation_checkpointing,
                     "checkpointed_layers": checkpointed_layers if activation_checkpointing else None}
    if data_parallel:
        shards = mesh["dp_shard"] if mesh is not None else None
        return {**_data_parallel(lm, layout.strategy, policy, rank, offload, shards,
                                 {**checkpointing, "compile_per_layer": compile}), **(applied or {})}
    if applied is None:
        return None
    if isinstance(lm, HuggingFaceLM):
        return {**applied, "activation_checkpointing": activation_checkpointing, "compile": compile}
    return {**applied, **checkpointing, "compile": compile}


def _tensor_parallel(lm: CausalLM, layout: Layout, rank: Rank, cut: dict[str, Any] | None,
                     microbatches: int | None) -> dict[str, Any] | None:
    """The first step: a pipeline stage's record (its tensor parallelism, if any, cut at its build), a
    transformers model cut over every rank now, a native model's cut recorded; None without tensor
    parallelism."""
    if layout.pp > 1:
        return lm.applied(microbatches)
    if layout.tp == 1:
        return None
    whole = {"strategy": layout.strategy, "world_size": rank.world_size}
    if not isinstance(lm, HuggingFaceLM):
        return {**whole, **cut}
    if layout.tp != layout.world_size:
        raise LayoutError(f"the hf backend's tensor parallelism runs alone over every rank; {layout.label} also "
                          f"asks for data parallelism or pipeline stages")
    return {**whole, **parallelize_hf_tensor(lm.module, layout.tp, rank.device.type), "initial_weights": BROADCAST}


def _compile(lm: CausalLM, per_layer: bool) -> None:
    """``torch.compile`` per decoder layer (under DDP and FSDP: the graph of a layer is the same for every
    layer, and their communication stays between compiled regions), a pipeline stage's own layers, or
    the whole module; decoding then runs through the compiled modules eagerly."""
    if per_layer:
        for layer in lm.module.model.layers:
            layer.compile()
        return
    if isinstance(lm, PipelineLM):
        for i in lm.stage.layers:
            lm.module.model.layers[i].compile()
        lm.decode_eagerly("--compile: decoding runs through the compiled layers, eagerly")
        return
    lm.module.compile()
    if hasattr(lm, "decode_eagerly"):
        lm.decode_eagerly("--compile: decoding runs through the compiled module, eagerly")


def _data_parallel(lm: CausalLM, strategy: str, policy: PrecisionPolicy, rank: Rank, offload: bool, mesh,
                   techniques: dict[str, Any]) -> dict[str, Any]:
    """DDP (``strategy`` ddp), or FSDP2 over ``mesh`` (by default every rank, after rank 0's weights are
    broadcast)."""
    model: nn.Module = lm.module
    applied = {"strategy": strategy, "world_size": rank.world_size, **techniques, "initial_weights": BROADCAST}
    if strategy == "ddp":
        lm.module = wrap_ddp(model, rank)
        return applied
    if mesh is None:
        broadcast_weights(model)
    units = shard_fsdp(model, policy, rank, offload, mesh)
    mp = mixed_precision(policy)
    return {**applied, "fsdp_units": units, "offload": offload,
            "param_dtype": _dtype_name(mp.param_dtype), "reduce_dtype": _dtype_name(mp.reduce_dtype)}


def _dtype_name(dtype) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None
