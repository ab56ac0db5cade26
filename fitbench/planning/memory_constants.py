"""The memory model's measured constants, each with the row or trace it was read from: what the
formulas of ``fitbench.planning.memory``'s term families cannot count from shapes alone.
"""

from __future__ import annotations


# LLM.int8 keeps, for the backward pass, each matmul's input columns holding an outlier (|x| > 6)
# in fp16 (bitsandbytes' MatMul8bitLt, ``subA``): a data-dependent amount. With fitbench's random
# weights the residual stream grows layer after layer and about a third of the columns qualify
# (fraction measured on the 7B preset training adapters at 4 x 512 on one H100,
# benchmarks/results/2026-11-22-h100-quantized-training); trained weights have far fewer.
INT8_OUTLIER_COLUMNS = 0.32


# Tensors of width h alive at the MLP's widest point of a forward pass without autograd in
# transformers' models, beside the MLP's own intermediates and the KV cache: (residual-width r,
# compute-width c) counts, forward pass and generation's prefill alike, as the fake-tensor trace of
# ``LlamaDecoderLayer``, ``FalconDecoderLayer`` and ``GPT2Block`` through fitbench's loops finds them
# with transformers 5.17 and 5.24 (the layer's input and residual, the norms' outputs, and in Falcon's
# parallel layer the attention output waiting to be added).
HF_WIDE_AT_MLP = {"llama": (4, 0), "falcon": (5, 0), "gpt2": (4, 1)}


# Bytes per element of a matmul's input while torchao quantizes it: three fp32 copies (the input
# upcast, its scaled and its clamped values) and the 8-bit result. Traced on an H200 at 3B fp8
# 4 x 1024 (``benchmarks/results/2026-11-23-h200-packed-build/anatomy``): three 134.2 MB fp32 blocks
# (``_quantize_affine_float8``) and a 33.6 MB float8 one, for the 4,096 x 8,192 input of down_proj.
ACTIVATION_QUANTIZATION_BYTES = 13


# LLM.int8 at the MLP, per element of n x f beyond the three 16-bit intermediates the MLP temporaries
# count: the up projection's int32 product (4 B) and one more 16-bit copy (2 B). Traced on an H200 at
# 1B int8 8 x 256 (``benchmarks/results/2026-11-23-h200-packed-build/anatomy/1B-int8-8x256.json``):
# a 67.1 MB int32 block (bitsandbytes' ops.py:80) and four 33.6 MB 16-bit ones at 2,048 x 8,192.
INT8_PRODUCT_BYTES = 6
