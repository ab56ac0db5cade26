"""Low-rank adapters on a frozen quantized base: how int8, nf4 and fp4 weights train (QLoRA).

Each quantized matmul of the decoder layers (q, k, v, o, gate, up, down) gets an adapter beside
it: ``y = base(x) + (alpha / r) * up(down(x))`` with ``down`` (r x in) and ``up`` (out x r)
trainable and the quantized ``base`` frozen (LoRA, Hu et al. 2021; on a 4-bit base, QLoRA,
Dettmers et al. 2023, which puts adapters on every linear layer). ``up`` starts at zero, so the
adapted model computes what the base does; ``down`` starts as LoRA's reference code does
(Kaiming-uniform with a = sqrt(5), nn.Linear's default).

Adapters keep fp32 weights, gradients and AdamW state, as QLoRA does, and compute in the
activations' dtype. Embeddings, norms and the output projection stay frozen in bf16, so a step's
gradients and optimizer state are the adapters' alone; gradients still flow through every frozen
matmul to reach the adapters below it, which is why activations are saved as in full training.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fitbench.precisions import ADAPTER_ALPHA, ADAPTER_RANK


class LowRankAdapted(nn.Module):
    """A frozen matmul with a trainable low-rank update beside it."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, rank: int, alpha: float,
                 device: torch.device):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.down = nn.Parameter(torch.empty(rank, in_features, device=device))
        self.up = nn.Parameter(torch.zeros(out_features, rank, device=device))
        nn.init.kaiming_uniform_(self.down, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(x, self.down.to(x.dtype)), self.up.to(x.dtype))  # (..., out)
        return self.base(x) + self.scale * update


def _quantized_matmul(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a bitsandbytes layer, or None for anything else."""
    import bitsandbytes as bnb

    if isinstance(module, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)):
        return module.in_features, module.out_features
    return None


def add_adapters(model: nn.Module, device: torch.device, rank: int = ADAPTER_RANK,
                 alpha: float = ADAPTER_ALPHA) -> int:
    """Freeze every parameter of ``model``, put an adapter beside each quantized matmul, and return the
    number of trainable parameters (r x (in + out) per matmul)."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    trainable = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            features = _quantized_matmul(child)
            if features is None:
                continue
            in_features, out_features = features
            setattr(parent, name, LowRankAdapted(child, in_features, out_features, rank, alpha, device))
            trainable += rank * (in_features + out_features)
    if trainable == 0:
        raise ValueError("no quantized matmul found to put adapters on")
    return trainable
