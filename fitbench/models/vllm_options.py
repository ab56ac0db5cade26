"""fitbench's precisions and layouts as vLLM's engine options, or why vLLM has none for one.

Precisions (vLLM 0.32's ``ModelConfig.dtype`` and ``quantization``, ``vllm/config/model.py`` and
``vllm/model_executor/layers/quantization/__init__.py``). vLLM runs inference only, so a precision
that keeps float32 weights under autocast serves as its autocast dtype's weights:

- ``bf16``, ``bf16-pure``: ``dtype="bfloat16"``; ``fp16``: ``"float16"``; ``fp32``: ``"float32"``;
- ``fp8``: bfloat16 with ``quantization="fp8"``, vLLM's own dynamic FP8 of the weights at load and of
  the activations per step (FP8 tensor cores: compute capability 8.9 or newer; older GPUs run the
  weights in FP8 only);
- ``nf4``: bfloat16 with ``quantization="bitsandbytes"``, vLLM's in-flight 4-bit NF4 of the weights;
- none for the others: ``tf32`` (vLLM sets no TF32 matmul mode), bitsandbytes' ``int8`` and ``fp4``
  (vLLM quantizes in flight to NF4 only), and torchao's formats (vLLM loads torchao only from a
  checkpoint that was quantized with it, and fitbench's weights are random).

Layouts (``vllm/config/parallel.py``): ``tp`` is ``tensor_parallel_size``, ``pp``
``pipeline_parallel_size``, ``replicas`` ``data_parallel_size`` (independent engines, one per
replica); DDP and FSDP shard training state, which serving has none of.

Scheduling (``vllm/config/scheduler.py``): fitbench gives the engine its limits rather than leaving
vLLM's defaults, which differ by platform and by GPU, so that the planner predicts the profile run of
the same limits (``engine_limits``).

The Python that runs vLLM is ``FITBENCH_VLLM_PYTHON`` where set (vLLM's own environment: its CPU build
pins a torch and a transformers of its own), else this one (``vllm_python``).
"""

from __future__ import annotations

import os
import sys

PYTHON_VARIABLE = "FITBENCH_VLLM_PYTHON"
# vLLM's defaults for its offline engine (the LLM class's usage context, ``vllm/engine/arg_utils.py``,
# ``get_batch_defaults``) on GPUs below 70 GiB and the A100: at most 8192
# tokens per scheduler step, 256 sequences at once (an H100 or H200 gets 16384 and 1024 by default).
MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 256

PRECISION_OPTIONS: dict[str, dict[str, str]] = {
    "bf16": {"dtype": "bfloat16"},
    "bf16-pure": {"dtype": "bfloat16"},
    "fp16": {"dtype": "float16"},
    "fp32": {"dtype": "float32"},
    "fp8": {"dtype": "bfloat16", "quantization": "fp8"},
    "nf4": {"dtype": "bfloat16", "quantization": "bitsandbytes"},
}
_NO_PRECISION = {
    "tf32": "vLLM sets no TF32 matmul mode; fp32 is its float32",
    "int8": "vLLM quantizes with bitsandbytes in flight to NF4 only; nf4 is that",
    "fp4": "vLLM quantizes with bitsandbytes in flight to NF4 only; nf4 is that",
}


def precision_options(precision: str) -> dict[str, str] | str:
    """vLLM's ``dtype`` (and ``quantization``) for ``precision``, or why vLLM has none."""
    if precision in PRECISION_OPTIONS:
        return dict(PRECISION_OPTIONS[precision])
    reason = _NO_PRECISION.get(precision, "vLLM loads torchao's formats only from a checkpoint quantized with "
                                          "torchao, and fitbench's weights are random")
    return (f"vLLM has no {precision}: {reason}. Its precisions here: {', '.join(PRECISION_OPTIONS)}.")


def layout_options(tp: int = 1, pp: int = 1, replicas: int = 1, dp_replicate: int = 1,
                   dp_shard: int = 1) -> dict[str, int] | str:
    """vLLM's parallel sizes for a layout's degrees, or why vLLM has none (DDP, FSDP)."""
    if dp_replicate > 1 or dp_shard > 1:
        return ("vLLM serves with tensor parallelism, pipeline parallelism and replicas; DDP and FSDP shard "
                "training state, which serving has none of: use --strategy tp, pipeline or replicas.")
    return {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "data_parallel_size": replicas}


def vllm_python() -> str:
    """The Python that runs vLLM: ``FITBENCH_VLLM_PYTHON``, else this process's."""
    return os.environ.get(PYTHON_VARIABLE) or sys.executable


def engine_limits(batch: int, length: int) -> dict[str, int]:
    """The scheduler's limits for a batch of ``batch`` sequences of ``length`` tokens: ``max_num_seqs``
    at least the batch, so that it runs as one; ``max_num_batched_tokens`` at least one whole sequence."""
    return {"max_num_seqs": max(MAX_NUM_SEQS, batch), "max_num_batched_tokens": max(MAX_NUM_BATCHED_TOKENS, length)}
