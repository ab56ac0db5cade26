"""A row-wise matmul of tensor-parallel shards and the all-reduce that sums its partial products, as
one operator that writes the product straight into symmetric memory and sums it with PyTorch's
two-shot all-reduce.

Under TP a decoder layer's attention output projection and MLP down projection multiply the rank's
columns of the input by its columns of the weight: each rank's product is a partial sum of the whole
output, which an all-reduce adds up. At batch 1 that message is batch x hidden x 2 bytes, and its
time is latency. Symmetric memory's two-shot all-reduce (``torch.ops.symm_mem.two_shot_all_reduce_out``)
has each rank add its 1/g of every peer's buffer, read over NVLink, and write that slice of the sum to
every peer, with one barrier before and one after; ``benchmarks/tp_allreduce.py`` times it against
the one-shot kernel inductor lowers small sums to and NCCL's. Its input must lie in a buffer every
rank of the group maps; inductor (torch 2.11) places a matmul's output there only for its own one-shot
lowering, so a traced two-shot call on the product fails. Here the matmul writes into a buffer each
group allocates once (``allocate``) and the sum goes to a fresh tensor, inside one custom operator
that compiled code calls as an opaque kernel and a CUDA graph captures.

A product larger than the buffer, or any product where no buffer was allocated (CPU ranks, GPUs
without peer access, a spec that turns symmetric memory off), is summed by ``dist.all_reduce`` in
place, which inductor lowers to its one-shot kernel or NCCL's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# This rank's symmetric buffer of each process group that has one, by the group's name.
_BUFFERS: dict[str, torch.Tensor] = {}


def allocate(group, device: torch.device, capacity_bytes: int) -> None:
    """Allocate ``capacity_bytes`` of symmetric memory for ``group`` on ``device`` and exchange its
    handles with the group's other ranks (a collective: every rank of the group calls it)."""
    from torch.distributed import _symmetric_memory as symmetric_memory

    buffer = symmetric_memory.empty(capacity_bytes, dtype=torch.uint8, device=device)
    symmetric_memory.rendezvous(buffer, group.group_name)
    _BUFFERS[group.group_name] = buffer


def product_bytes(x: torch.Tensor, weight: torch.Tensor) -> int:
    """Bytes of the product of ``x`` (..., K) and ``weight`` (N, K): rows x N x the element size."""
    return x.numel() // x.shape[-1] * weight.shape[0] * x.element_size()


def fits(x: torch.Tensor, weight: torch.Tensor, group_name: str) -> bool:
    """Whether ``group_name`` has a buffer the product of ``x`` and ``weight`` fits in."""
    buffer = _BUFFERS.get(group_name)
    return buffer is not None and product_bytes(x, weight) <= buffer.numel()


@torch.library.custom_op("fitbench::matmul_two_shot_sum", mutates_args=())
def matmul_two_shot_sum(x: torch.Tensor, weight: torch.Tensor, group_name: str) -> torch.Tensor:
    """x @ weight.T summed over the ranks of ``group_name``: the product written into the group's
    symmetric buffer, then two-shot all-reduced into a new tensor."""
    rows = x.reshape(-1, x.shape[-1])
    shape = (rows.shape[0], weight.shape[0])
    partial = _BUFFERS[group_name][:product_bytes(x, weight)].view(x.dtype).view(shape)
    torch.mm(rows, weight.t(), out=partial)
    total = torch.empty(shape, dtype=x.dtype, device=x.device)
    torch.ops.symm_mem.two_shot_all_reduce_out(partial, "sum", group_name, total)
    return total.view(*x.shape[:-1], weight.shape[0])


@matmul_two_shot_sum.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, group_name: str) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class RowShardLinear(nn.Linear):
    """A row-wise matmul's local shard (``in_features`` this rank's columns of the input, no bias)
    whose output is the whole sum over ``group``: through ``matmul_two_shot_sum`` where the product
    fits the group's buffer and the weight is a plain tensor of the input's dtype, else ``F.linear``
    and an all-reduce."""

    group: Any
    group_name: str

    @classmethod
    def convert(cls, linear: nn.Linear, group) -> None:
        """Turn ``linear``, a row-wise shard summed over ``group``, into one."""
        linear.__class__ = cls
        linear.group = group
        linear.group_name = group.group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (type(weight) in (nn.Parameter, torch.Tensor) and x.dtype == weight.dtype
                and fits(x, weight, self.group_name)):
            return torch.ops.fitbench.matmul_two_shot_sum(x, weight, self.group_name)
        output = F.linear(x, weight, self.bias)
        dist.all_reduce(output, group=self.group)
        return output
