"""What a precision is, as plain data every floor may read: the modes that train, the tensor cores
whose peak MFU divides by, and why a precision's decode step cannot be captured in a CUDA graph. (Dtypes, autocast and how each precision builds live in
``fitbench.run.precision`` and ``fitbench.run.quantize``.)"""

from __future__ import annotations

TRAINING_MODES = ("train", "forward-backward")


# The tensor-core kind (a column of ``fitbench.hardware``'s peak table) that does the bulk of the
# FLOPs, for inference (forward, infer) and for training (train, forward-backward):
#
# - int8 (bitsandbytes LLM.int8): int8 x int8 matmuls (cuBLASLt igemm) for every column but the few
#   outliers, which run in 16 bits (Dettmers et al. 2022, section 3.2);
# - int8-dynamic (torchao): activations quantized per token at run time, int8 x int8 matmuls (``_int_mm``);
# - fp8, fp8-block (torchao): float8 x float8 matmuls (``torch._scaled_mm``), row-wise or block-wise scales;
# - int4, nf4, fp4: weight-only; the weights are dequantized to bf16 (bitsandbytes before the matmul,
#   torchao's int4 inside its kernel) and the matmuls run in bf16;
# - fp8 training (torchao float8 training): the forward matmul and both backward matmuls in float8;
# - adapters on an int8, nf4 or fp4 base: the forward pass runs as in inference, but the backward's
#   input gradients (2 N per token, bitsandbytes multiplies by the dequantized weight) and attention
#   (12 L H Q T, all of it) run in bf16, more than the forward's 2 N: bf16.
#
# int8-dynamic, int4 and fp8-block have no training (``training_problem``).
_PEAK_KINDS: dict[str, tuple[str, str | None]] = {  # precision -> (inference, training)
    "fp32": ("fp32", "fp32"),
    "tf32": ("tf32", "tf32"),
    "bf16": ("bf16", "bf16"),
    "fp16": ("fp16", "fp16"),
    "bf16-pure": ("bf16", "bf16"),
    "int8": ("int8", "bf16"),
    "nf4": ("bf16", "bf16"),
    "fp4": ("bf16", "bf16"),
    "int8-dynamic": ("int8", None),
    "int4": ("bf16", None),
    "fp8": ("fp8", "fp8"),
    "fp8-block": ("fp8", None),
}


def peak_kind(precision: str, mode: str) -> str:
    """Which peak FLOP/s MFU divides ``mode`` in ``precision`` by: the tensor cores that do most of its
    FLOPs (the table above)."""
    inference, training = _PEAK_KINDS[precision]
    if mode not in TRAINING_MODES:
        return inference
    if training is None:
        raise ValueError(f"{precision} has no backward pass, so no training peak")
    return training


# Precisions whose decode step no CUDA graph can hold, and why: the worker decodes them eagerly from
# the start (a failed capture would leave its side stream's cuBLAS workspace and context behind) and
# the planner counts the eager overheads for them.
_GRAPH_PROBLEMS = {
    "int8": "LLM.int8 finds each input's outlier columns with a data-dependent shape (bitsandbytes' "
            "int8_vectorwise_quant calls torch.argwhere), which a CUDA graph cannot capture",
}


def graph_problem(precision: str) -> str | None:
    """Why ``precision`` decodes without a CUDA graph, or None when its step can be captured."""
    return _GRAPH_PROBLEMS.get(precision)
