"""Numeric precision of a run: the dtype weights live in, autocast, TF32, loss scaling.

- ``fp32``: fp32 weights and math, TF32 tensor cores off.
- ``tf32``: fp32 weights, matmuls on TF32 tensor cores (a GPU setting; the CPU ignores it).
- ``bf16`` / ``fp16``: mixed precision: fp32 weights, gradients and optimizer state; matmuls under
  autocast in 16 bits. fp16 training scales the loss (``torch.amp.GradScaler``).
- ``bf16-pure``: weights, gradients and AdamW state all bf16; no autocast.

- quantized (``fitbench.run.quantize``): bf16 weights and activations, whose decoder-layer matmuls
  are then quantized; MFU divides by the peak of the tensor cores that do most of the FLOPs
  (``peak_kind``).

Training with quantized weights (``training_problem`` says which can):

- ``int8``, ``nf4``, ``fp4``: the quantized base is frozen and only low-rank adapters train
  (QLoRA, ``fitbench.run.adapters``): a different workload from full training, and rows say so;
- ``fp8``: full training, bf16 weights and AdamW state, the decoder layers' matmuls in float8
  (torchao's float8 training, row-wise scales, fresh casts of weights and activations every step);
- ``int8-dynamic``, ``int4``, ``fp8-block``: torchao's inference tensors have no backward pass, so
  these are refused for training.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from fitbench.plan.memory import ADAPTER_BASES, TRAINING_MODES

FLOAT_PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "bf16-pure")
QUANTIZED_PRECISIONS: tuple[str, ...] = ("int8", "nf4", "fp4", "int8-dynamic", "int4", "fp8", "fp8-block")
PRECISIONS: tuple[str, ...] = FLOAT_PRECISIONS + QUANTIZED_PRECISIONS


def training_problem(precision: str) -> str | None:
    """Why a training-style mode cannot run ``precision``, or None."""
    if precision in QUANTIZED_PRECISIONS and precision not in ADAPTER_BASES + ("fp8",):
        return (f"{precision} weights are torchao inference tensors with no backward pass; train with fp8 (float8 "
                f"training), with adapters on an int8, nf4 or fp4 base, or in bf16 / bf16-pure")
    return None


def trains_every_weight(precision: str) -> bool:
    """Whether training in ``precision`` updates the whole model; adapters on a frozen base do not, so a
    fallback from full training never lands there (it would measure another workload)."""
    return training_problem(precision) is None and precision not in ADAPTER_BASES


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    weight_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    allow_tf32: bool
    scale_loss: bool
    quantized: bool = False

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations (and the KV cache) have."""
        return self.autocast_dtype or self.weight_dtype

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=device_type, dtype=self.autocast_dtype):
            yield

    def apply_backend_flags(self) -> None:
        """Process-wide matmul precision. Each run is its own process, so this never leaks."""
        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        torch.backends.cudnn.allow_tf32 = self.allow_tf32


_POLICIES = {
    "fp32": PrecisionPolicy("fp32", torch.float32, None, False, False),
    "tf32": PrecisionPolicy("tf32", torch.float32, None, True, False),
    "bf16": PrecisionPolicy("bf16", torch.float32, torch.bfloat16, False, False),
    "fp16": PrecisionPolicy("fp16", torch.float32, torch.float16, False, True),
    "bf16-pure": PrecisionPolicy("bf16-pure", torch.bfloat16, None, False, False),
    **{name: PrecisionPolicy(name, torch.bfloat16, None, False, False, quantized=True)
       for name in QUANTIZED_PRECISIONS},
}


def policy(name: str) -> PrecisionPolicy:
    return _POLICIES[name]


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
        raise ValueError(training_problem(precision))
    return training
