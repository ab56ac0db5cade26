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

from fitbench.plan.memory import ADAPTER_BASES

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
