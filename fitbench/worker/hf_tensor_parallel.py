"""Tensor parallelism of a built transformers model, through transformers' own plan for its family.

A transformers model whose config carries a ``base_model_tp_plan`` (Llama, Mistral, Qwen2 in
transformers 5) names a DTensor style for each of its modules: q, k, v, gate and up column-wise, o
and down row-wise, the embedding sharded over the vocabulary and the output projection column-wise
with its logits gathered (``colwise_gather_output``), so generation and the loss see whole logits.
``PreTrainedModel.maybe_distribute_model`` applies that plan over a device mesh; ``from_pretrained``
calls it on a model still on the meta device, before loading each rank's shards. fitbench calls it
on a built model instead, whose whole weights each rank holds: the styles' ``distribute_tensor``
with no source rank keeps each rank's own rows or columns, so every rank must hold the same weights
first, and they are rank 0's, broadcast (as data parallelism does, ``fitbench.worker.parallel``): each
rank holds the whole model until the plan shards it, unlike the native decoder's ranks, which build
only their shards (``fitbench.worker.tensor_parallel``). The job's logits are then one process's with
the same weights.

What the plan does not do, fitbench refuses before launch (``fitbench.spec.Layout.problem``):
families without a plan (Falcon, GPT-2), which run over pipeline stages instead; kv heads that do not
divide by the degree (the plan cuts k and v column-wise, by whole heads only when they divide);
quantized weights. There is no sequence parallelism: the plan has no style for the norms, which stay
replicated.

The KV cache needs nothing of its own: transformers' ``StaticCache`` and ``DynamicCache`` take their
shapes from the first keys they are given, this rank's ``n_kv_heads / tp`` heads.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fitbench.worker.parallel import broadcast_weights
from fitbench.spec import LayoutError


def plan_mesh(tp: int, device_type: str):
    """The mesh ``maybe_distribute_model`` reads, every rank on "tp". Recent transformers (5.23)
    takes its own ``TransformersDeviceMesh``: a dense view (pp, dp_replicate, fsdp, tp) of the job and
    an expert view, which a dense model never uses. Earlier 5.x releases (5.17, which the pin admits)
    take a plain torch ``DeviceMesh``, whose "tp" dimension they use when it has several. Whether
    transformers has the class tells which, not its version number, which says nothing of backports."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import utils

    mesh_manager = getattr(utils, "TransformersDeviceMesh", None)
    if mesh_manager is None:
        return init_device_mesh(device_type, (tp,), mesh_dim_names=("tp",))
    dense = init_device_mesh(device_type, (1, 1, 1, tp), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    experts = init_device_mesh(device_type, (1, 1, tp, 1), mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    return mesh_manager(dense, experts)


def parallelize_hf_tensor(model: nn.Module, tp: int, device_type: str) -> dict[str, Any]:
    """Shard ``model`` (a transformers ``PreTrainedModel``) over ``tp`` ranks with its family's plan, in
    place; every rank of the job calls it. Returns what was applied, for the result row."""
    from transformers.distributed import DistributedConfig

    if not model.supports_tp_plan:
        raise LayoutError(f"transformers has no tensor-parallel plan for {type(model).__name__}: run it as "
                          f"pipeline stages (--strategy pipeline)")
    config = model.config
    broadcast_weights(model)
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = output is not None and output.weight is embedding.weight
    if tied:
        # The plan names the output projection's weight and the embedding's apart, and a tied pair is
        # one parameter, listed once: untie for the sharding, each style cutting the same rows of
        # the vocabulary, and tie the shards again.
        output.weight = nn.Parameter(embedding.weight.data)
    sharded = type(model).maybe_distribute_model(model, DistributedConfig(tp_size=tp), plan_mesh(tp, device_type))
    if tied:
        sharded.tie_weights()
    return {"tensor_parallel": tp, "sequence_parallel": False, "kv_heads": "sharded",
            "kv_heads_per_rank": config.num_key_value_heads // tp,
            "query_heads_per_rank": config.num_attention_heads // tp,
            "plan": "transformers' base_model_tp_plan"}
