"""The native decoder's projections (``Linear``): ``F.linear``, except where compiled code multiplies a
single row of activations (a decode step at batch 1) by a 16-bit weight with many input features.
There the product is written as an elementwise multiply and a sum over the input features,

    y[n] = sum_k x[k] W[n, k]   (accumulated in fp32, as cuBLAS accumulates, then cast back)

which inductor turns into one reduction kernel of its own, fused with nothing but reading each
weight once. At one row a matmul is a read of the weight; cuBLAS's kernels for it tile the output
64 columns at a time, so a tensor-parallel shard with few output columns (13B's stacked q, k, v at
TP 4: 3,840) runs on fewer thread blocks than the GPU has SMs, and reads below the copy bandwidth.
The reduction spreads the columns over every SM. With few input features (a row-wise shard's, 1,280
at 13B's output projection under TP 4) each column's sum is short and cuBLAS's split of the input
is the faster: hence ``ROW_REDUCTION_MIN_FEATURES``. ``benchmarks/gemv.py`` times both at the
presets' shard shapes.

Nowhere else does it apply: eager code would materialize the product, several rows read the weight
once per row, and a quantized weight (a tensor subclass) has kernels of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The fewest input features K at which the reduction reads a bf16 weight faster than cuBLAS at one
# row (``benchmarks/gemv.py`` on an H100, torch 2.11: faster or even from K = 3,456 up, slower at
# K = 1,280 and 2,048).
ROW_REDUCTION_MIN_FEATURES = 4096
ROW_REDUCTION_DEVICES = ("cuda",)
ROW_REDUCTION_DTYPES = (torch.bfloat16, torch.float16)


def reduces_as_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` runs as ``row_product``: compiled code (Dynamo tracing it), one
    row of x, a plain 16-bit weight of x's dtype with at least ``ROW_REDUCTION_MIN_FEATURES`` columns,
    on a device of ``ROW_REDUCTION_DEVICES``."""
    return (torch.compiler.is_compiling() and x.device.type in ROW_REDUCTION_DEVICES
            and x.shape[:-1].numel() == 1 and type(weight) in (torch.Tensor, nn.Parameter)
            and weight.dtype in ROW_REDUCTION_DTYPES and x.dtype == weight.dtype
            and weight.shape[1] >= ROW_REDUCTION_MIN_FEATURES)


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as a multiply and a sum over the input features, both in fp32 (the
    products exact, as in cuBLAS's fp32 accumulation; compiled, the casts fuse into the reduction's
    loads): x (..., K), weight (N, K) -> (..., N) in x's dtype."""
    y = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` whose product runs as ``row_product`` where ``reduces_as_row`` says so."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if reduces_as_row(x, self.weight):
            return row_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
