"""The bitsandbytes converter: a plain ``nn.Linear`` replaced by bitsandbytes' quantized layer, for the
entries whose library is bitsandbytes.

- ``int8``: LLM.int8 (Dettmers et al. 2022), ``Linear8bitLt``: int8 weights with one absmax per row; int8
  matmuls, the input's outlier columns (|x| >= 6) in 16 bits;
- ``nf4``, ``fp4``: ``Linear4bit`` of that quant type, an absmax per block of 64 (double-quantized),
  matmuls in bf16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def _int8(linear: nn.Linear, device: torch.device) -> nn.Module:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                has_fp16_weights=False, threshold=6.0, device="meta")
    weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False, has_fp16_weights=False)
    layer.weight = weight._quantize(device)
    return layer


def _four_bit(quant_type: str) -> Callable[[nn.Linear, torch.device], nn.Module]:
    def convert(linear: nn.Linear, device: torch.device) -> nn.Module:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=torch.bfloat16, quant_type=quant_type, device="meta")
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type=quant_type).to(device)
        return layer
    return convert


LAYERS: dict[str, Callable[[nn.Linear, torch.device], nn.Module]] = {
    "int8": _int8, "nf4": _four_bit("nf4"), "fp4": _four_bit("fp4"),
}


def converter(precision: str, device: torch.device) -> Callable[[nn.Linear], nn.Module]:
    """What turns one plain matmul into ``precision``'s bitsandbytes layer on ``device``; the bias, if
    any, kept frozen."""
    layer_of = LAYERS[precision]

    def convert(linear: nn.Linear) -> nn.Module:
        layer = layer_of(linear, device)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        return layer
    return convert
