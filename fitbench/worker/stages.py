"""One pipeline stage of the native model, built from the meta device: only the stage's modules get
storage, on its device, with the weights the single-process build of the same seed draws for them.
Below both pipeline parallelism (``fitbench.worker.pipeline``), which runs the stages, and tensor
parallelism (``fitbench.worker.tensor_parallel``), which cuts a stage's weights into shards.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fitbench.models.architecture import Architecture
from fitbench.models.native import NativeCausalLM, ShardWriter, empty_on, materialize, meta_model, replay_random_weights
from fitbench.spec import Stage


def prune(model: NativeCausalLM, stage: Stage) -> None:
    """Drop every module of another stage (placeholders keep the layers' indices, so each module keeps
    its name in the whole model: ``model.layers.5`` is layer 5 on any stage)."""
    for i in range(len(model.model.layers)):
        if i not in stage.layers:
            model.model.layers[i] = nn.Identity()
    if not stage.first:
        model.model.embed_tokens = nn.Identity()
        if hasattr(model.model, "embed_positions"):
            del model.model.embed_positions
    if not stage.last:
        model.model.norm = nn.Identity()
        model.lm_head = nn.Identity()


def stage_modules(model: NativeCausalLM, stage: Stage) -> list[nn.Module]:
    """The modules of ``stage`` in the whole model ``model``: the first stage's embeddings (tokens, and
    learned positions where the model has them), its layers, the last stage's final norm and head."""
    parts = [model.model.layers[i] for i in stage.layers]
    if stage.first:
        parts[:0] = [model.model.embed_tokens, *([model.model.embed_positions]
                                                 if hasattr(model.model, "embed_positions") else [])]
    if stage.last:
        parts += [model.model.norm, model.lm_head]
    return parts


def build_stage(arch: Architecture, stage: Stage, device: torch.device | str, dtype: torch.dtype,
                shard: Callable[[NativeCausalLM], ShardWriter] | None = None) -> NativeCausalLM:
    """The native model with only ``stage``'s modules, on ``device`` in ``dtype``, with the weights that
    ``fitbench.models.native.build_native`` draws for them from the same generator state: materialize
    the stage's modules, replay the whole model's random initialization over them
    (``fitbench.models.native.replay_random_weights``), then drop what belongs to other stages. A
    tied embedding and output projection on two stages are two copies, drawn alike. ``shard``: tensor
    parallelism, applied to the model while it is on the meta device, so that only this rank's
    shards get storage; it returns how each weight's shard is written from the whole weight
    (``fitbench.worker.build.build_tensor_parallel``, through
    ``fitbench.worker.parallelize.tensor_parallel_cut``)."""
    model = meta_model(arch, dtype)
    writer = shard(model) if shard is not None else None
    tied = arch.tie_embeddings
    embedding = model.model.embed_tokens
    if tied and stage.first:
        # materialize gives the embedding new storage and leaves the head holding the meta weight: untie
        # for the allocation (one, as in build_native), tie again after
        model.lm_head.weight = nn.Parameter(torch.empty(0, device="meta", dtype=dtype))
    elif tied and stage.last:
        # the head's copy is this stage's; the embedding's stays on the meta device, drawing into scratch
        embedding.weight = nn.Parameter(torch.empty(embedding.weight.shape, device="meta", dtype=dtype))
    for part in stage_modules(model, stage):
        materialize(part, device)
    if tied and stage.first:
        model.lm_head.weight = embedding.weight
    model.rope_cos, model.rope_sin = empty_on(model.rope_cos, device), empty_on(model.rope_sin, device)
    replay_random_weights([model], device, shard_writer=writer)
    model.reset_rope()
    prune(model, stage)
    return model
