"""The torchao converter: a plain ``nn.Linear``'s weight converted in place to one of torchao 0.18's
tensor subclasses (``quantize_`` with the entry's config), for the entries whose library is torchao; and
fp8 training's float8 linears (``float8_training``).

- ``int8-dynamic``: int8 per row, activations int8 per token; int8 matmuls;
- ``int8-weight-only``: int8 per row, activations left bf16; the weight cast to bf16 for the matmul;
- ``int4``: int4 weight-only, groups of 128, tinygemm's packing; bf16 inside the kernel (GPU only);
- ``fp8``: float8 e4m3, per-row scales, dynamic activations; fp8 matmuls (compute capability >= 8.9);
- ``fp8-weight-only``: float8 e4m3, per-row scales, activations left bf16; the weight cast to fp32,
  scaled and cast to bf16 for the matmul;
- ``fp8-block``: float8 e4m3, 128 x 128 weight blocks, 1 x 128 activation blocks; fp8 matmuls (>= 8.9);
- ``int8-dynamic-int4``: int4 weights held in int8, groups of 32, activations int8 per token, quantized
  and dequantized; bf16 matmuls on the dequantized weight (any device).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fitbench.worker.quantize.linears import quantizable


# Each entry's torchao 0.18 config, from ``torchao.quantization`` (``q``) and its ``granularity`` (``g``),
# which are imported only when a model is converted.
CONFIGS: dict[str, Callable] = {
    "int8-dynamic": lambda q, g: q.Int8DynamicActivationInt8WeightConfig(),
    # symmetric, one scale per output row (torchao's default, PerRow)
    "int8-weight-only": lambda q, g: q.Int8WeightOnlyConfig(),
    "int4": lambda q, g: q.Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"),
    "fp8": lambda q, g: q.Float8DynamicActivationFloat8WeightConfig(granularity=g.PerRow()),
    # e4m3, one fp32 scale per output row
    "fp8-weight-only": lambda q, g: q.Float8WeightOnlyConfig(granularity=g.PerRow()),
    "fp8-block": lambda q, g: q.Float8DynamicActivationFloat8WeightConfig(
        granularity=[g.PerBlock([1, 128]), g.PerBlock([128, 128])]),
    # int4 weights, one scale and zero point per group of 32 (torchao's default group), activations int8
    # per token, asymmetric (the config's defaults)
    "int8-dynamic-int4": lambda q, g: q.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                                               weight_granularity=g.PerGroup(32)),
}


def converter(precision: str, device: torch.device) -> Callable[[nn.Linear], nn.Module]:
    """What converts one plain matmul's weight, in place on its device, to ``precision``'s torchao tensor."""
    from torchao import quantization
    from torchao.quantization import granularity, quantize_

    config = CONFIGS[precision](quantization, granularity)

    def convert(linear: nn.Linear) -> nn.Module:
        quantize_(linear, config)
        return linear
    return convert


def float8_training(module: nn.Module) -> int:
    """Convert the decoder layers' matmuls to torchao's float8 training linears (row-wise scales: each
    step casts weights, activations and gradients to float8 e4m3 with one scale per row, and the
    backward pass casts again along the other axis); returns how many were converted. The output
    projection stays bf16, and a matmul whose sides are not multiples of 16 (the float8 kernel's
    tile) too."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = []

    def convertible(linear: nn.Module, fqn: str) -> bool:
        ok = (quantizable(linear, fqn) and linear.in_features % 16 == 0 and linear.out_features % 16 == 0)
        if ok:
            converted.append(fqn)
        return ok

    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=convertible)
    return len(converted)
