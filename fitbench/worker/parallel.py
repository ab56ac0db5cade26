"""Data parallelism of a built native model, as ``fitbench.worker.parallelize`` applies it (after tensor
parallelism, activation checkpointing and compile):

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel``: a whole replica per rank; after each
  backward pass every gradient is averaged over the ranks (all-reduce) in buckets, overlapping the
  rest of the backward pass.
- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on each decoder layer, then on the root
  (embeddings, final norm, output projection): each rank keeps 1 / world_size of every weight, of its
  gradient and of its optimizer state; a layer's weights are gathered for its forward and backward
  and freed after, and its gradients are reduce-scattered.

Every rank starts from rank 0's weights, broadcast: DDP does it when it wraps the model, and
``fitbench.worker.parallelize`` does it before FSDP shards. Building from one seed on every rank gives the same
weights only where every rank runs the same random kernels with the same launch geometry (the same
GPU model, the same torch); the broadcast costs one pass over the weights at start-up and makes
identity hold everywhere, with checkpoints and mixed GPUs too. Each rank then trains on a batch of
its own (``data_seed``), so the job's global batch is world_size times the per-rank batch.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fitbench.models.native import NativeCausalLM
from fitbench.precisions import PrecisionPolicy
from fitbench.worker.ranks import Rank


def data_seed(seed: int, rank: int) -> int:
    """The seed of data-parallel rank ``rank``'s batch: ``seed + rank``. Rank 0 draws what a
    single-process run of the same seed draws, and the job's global batch is the ranks' batches in
    rank order."""
    return seed + rank


def mixed_precision(policy: PrecisionPolicy):
    """FSDP2's ``MixedPrecisionPolicy`` for ``policy``:

    - bf16 / fp16 (autocast over fp32 weights here): the fp32 shards are gathered as 16-bit weights
      (``param_dtype``) and gradients reduce-scattered in fp32 (``reduce_dtype``), so the shards,
      their gradients and AdamW's moments stay fp32 as on one device; autocast still decides which
      operations run in 16 bits;
    - fp32, tf32: nothing to cast;
    - bf16-pure and fp8 training: the weights already are bf16, and their gradients reduce in bf16,
      as DDP's all-reduce of bf16 gradients does.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy.autocast_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=policy.autocast_dtype, reduce_dtype=torch.float32)


def wrap_ddp(model: nn.Module, rank: Rank, **options: Any) -> nn.Module:
    """``model`` under DDP (``options``: ``DistributedDataParallel``'s keyword arguments, over the ones
    below; ``benchmarks/ddp_overlap.py`` times such variants against this construction):

    - ``gradient_as_bucket_view``: the gradients are views into the all-reduce buckets, so no second
      copy of every gradient exists (the buckets are the gradients);
    - ``static_graph``: every step runs the same graph with every parameter used, which lets DDP
      skip the search for unused parameters and cope with activation checkpointing;
    - buffers are not broadcast before each forward: the native model's only buffers are the rotary
      tables, computed from the config, equal on every rank (torch 2.13 renamed ``broadcast_buffers``
      to ``forward_sync_buffers`` and warns on the old name; 2.11 has only the old one);
    - buckets of DDP's default size (25 MiB, the first 1 MiB: ``_DEFAULT_BUCKET_CAP_MB`` in
      ``torch.nn.parallel.distributed`` and ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), whose
      all-reduces overlap the backward pass.
    """
    from torch.nn.parallel import DistributedDataParallel

    no_buffer_sync = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                      else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=[rank.local_rank] if rank.device.type == "cuda" else None,
                                   **{"gradient_as_bucket_view": True, "static_graph": True, **no_buffer_sync,
                                      **options})


@torch.no_grad()
def broadcast_weights(model: nn.Module) -> None:
    """Every parameter (a tied one once) and buffer from rank 0, in place, as DDP does when it wraps."""
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            dist.broadcast(tensor.data, src=0)


def shard_fsdp(model: NativeCausalLM, policy: PrecisionPolicy, rank: Rank, offload: bool, mesh=None) -> int:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm and output projection,
    one unit since a tied output projection shares the embedding's weight); returns the number of
    units. Over ``mesh``, by default a 1-D mesh of every rank: FSDP, not HSDP. The layers reshard after their forward
    (gathered again for the backward); the root keeps its weights gathered from its forward to its
    backward, since the output projection is the first thing the backward pass needs (FSDP2's
    defaults).

    ``offload``: the shards, their gradients and the optimizer state live in CPU memory
    (``CPUOffloadPolicy``, pinned on a GPU machine); each layer is copied to the GPU to be gathered,
    and the optimizer steps on the CPU.

    FSDP shards a model built whole: until ``fully_shard`` has run, every rank holds all the weights
    in their build dtype (weights x bytes per element), freed as each unit is sharded. That is the
    rank's peak when the sharded training state (weights, gradients, optimizer state / world_size,
    plus activations) is smaller."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if mesh is None:
        mesh = init_device_mesh(rank.device.type, (rank.world_size,), mesh_dim_names=("dp_shard",))
    # pinned host memory needs a GPU to pin for
    offload_policy = CPUOffloadPolicy(pin_memory=rank.device.type == "cuda") if offload else OffloadPolicy()
    options = {"mesh": mesh, "mp_policy": mixed_precision(policy), "offload_policy": offload_policy}
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return len(model.model.layers) + 1
