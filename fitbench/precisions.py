"""What a precision is, in one registry every floor may read.

- ``fp32``: fp32 weights and math, TF32 tensor cores off.
- ``tf32``: fp32 weights, matmuls on TF32 tensor cores (a GPU setting; the CPU ignores it).
- ``bf16`` / ``fp16``: mixed precision: fp32 weights, gradients and optimizer state; matmuls under
  autocast in 16 bits. fp16 training scales the loss (``torch.amp.GradScaler``).
- ``bf16-pure``: weights, gradients and AdamW state all bf16; no autocast.
- quantized (``fitbench.run.quantize`` builds them): bf16 weights and activations, whose
  decoder-layer matmuls are then quantized; MFU divides by the peak of the tensor cores that do most
  of the FLOPs (``peak_kind``).

Training with quantized weights (``training_problem`` says which can):

- ``int8``, ``nf4``, ``fp4``: the quantized base is frozen and only low-rank adapters train
  (QLoRA, ``fitbench.run.adapters``): a different workload from full training, and rows say so;
- ``fp8``: full training, bf16 weights and AdamW state, the decoder layers' matmuls in float8
  (torchao's float8 training, row-wise scales, fresh casts of weights and activations every step);
- ``int8-dynamic``, ``int8-weight-only``, ``int4``, ``fp8-weight-only``, ``fp8-block``: torchao's
  inference tensors have no backward pass, so these are refused for training.

Beside the names: the dtypes and autocast of each (``policy``), the tensor cores whose peak MFU
divides by (``peak_kind``), what the hardware must offer (``hardware_problem``) and why a decode
step cannot be captured in a CUDA graph (``graph_problem``), and why it cannot run with
``--offload`` (``offload_problem``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

TRAINING_MODES = ("train", "forward-backward")

FLOAT_PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "bf16-pure")
QUANTIZED_PRECISIONS: tuple[str, ...] = ("int8", "nf4", "fp4", "int8-dynamic", "int8-weight-only", "int4", "fp8",
                                         "fp8-weight-only", "fp8-block")
PRECISIONS: tuple[str, ...] = FLOAT_PRECISIONS + QUANTIZED_PRECISIONS


# The precisions whose quantized base trains through low-rank adapters (``fitbench.run.adapters``):
# rank 16 on every matmul of every layer (seven in Llama, four in Falcon and GPT-2), alpha 32, between
# PEFT's default rank 8 and QLoRA's 64 (Dettmers et al. 2023, every linear layer adapted).
ADAPTER_BASES = ("int8", "nf4", "fp4")
ADAPTER_RANK, ADAPTER_ALPHA = 16, 32


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
    """How a precision runs inside a worker. Its dtypes are named, not torch objects, so that the
    registry (and the parent process, which plans and launches) never imports torch: a sweep's
    parent and ``fitbench plan`` start in a fraction of a second instead of torch's seconds."""

    name: str
    weight_dtype_name: str  # an attribute of torch: "float32", "bfloat16"
    autocast_dtype_name: str | None
    allow_tf32: bool
    scale_loss: bool
    quantized: bool = False

    @property
    def weight_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.weight_dtype_name)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        import torch

        return None if self.autocast_dtype_name is None else getattr(torch, self.autocast_dtype_name)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations (and the KV cache) have."""
        return self.autocast_dtype or self.weight_dtype

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        import torch

        with torch.autocast(device_type=device_type, dtype=self.autocast_dtype):
            yield

    def apply_backend_flags(self) -> None:
        """Process-wide matmul precision. Each run is its own process, so this never leaks."""
        import torch

        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        torch.backends.cudnn.allow_tf32 = self.allow_tf32


_POLICIES = {
    "fp32": PrecisionPolicy("fp32", "float32", None, False, False),
    "tf32": PrecisionPolicy("tf32", "float32", None, True, False),
    "bf16": PrecisionPolicy("bf16", "float32", "bfloat16", False, False),
    "fp16": PrecisionPolicy("fp16", "float32", "float16", False, True),
    "bf16-pure": PrecisionPolicy("bf16-pure", "bfloat16", None, False, False),
    **{name: PrecisionPolicy(name, "bfloat16", None, False, False, quantized=True)
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
# - int4, nf4, fp4, int8-weight-only, fp8-weight-only: weight-only; the weights are dequantized to bf16
#   (bitsandbytes and torchao's int8 and float8 before the matmul, torchao's int4 inside its kernel) and
#   the matmuls run in bf16;
# - fp8 training (torchao float8 training): the forward matmul and both backward matmuls in float8;
# - adapters on an int8, nf4 or fp4 base: the forward pass runs as in inference, but the backward's
#   input gradients (2 N per token, bitsandbytes multiplies by the dequantized weight) and attention
#   (12 L H Q T, all of it) run in bf16, more than the forward's 2 N: bf16.
#
# int8-dynamic, int8-weight-only, int4, fp8-weight-only and fp8-block have no training (``training_problem``).
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
    "int8-weight-only": ("bf16", None),
    "int4": ("bf16", None),
    "fp8": ("fp8", "fp8"),
    "fp8-weight-only": ("bf16", None),
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


def quantization_library(precision: str) -> str | None:
    """The library whose tensors hold ``precision``'s quantized weights (``fitbench.run.quantize``):
    bitsandbytes for LLM.int8, nf4 and fp4, torchao for the others; None for a floating-point one."""
    if precision not in QUANTIZED_PRECISIONS:
        return None
    return "bitsandbytes" if precision in ADAPTER_BASES else "torchao"


def weight_only(precision: str) -> bool:
    """Whether ``precision`` quantizes the weights alone: stored small, dequantized for matmuls that run
    in bf16 (the table above), so what it buys is the bytes a decode step reads, which its kernels must
    beat bf16's at the batch asked to gain anything."""
    return precision in QUANTIZED_PRECISIONS and _PEAK_KINDS[precision][0] == "bf16"


# Precisions whose decode step no CUDA graph can hold, and why: the worker decodes them eagerly from
# the start (a failed capture would leave its side stream's cuBLAS workspace and context behind) and
# the planner counts the eager overheads for them.
#
# The torchao ones are captured: read in torchao 0.18, none of their matmuls syncs with the host or
# changes shape with the data. int4 (``Int4TilePackedTo4dTensor``) is one ``aten._weight_int4pack_mm``
# call; fp8 (``Float8Tensor``, row-wise) quantizes the activation on the device (amax, scale, cast, or
# Triton's ``quantize_fp8_row``) and calls ``torch._scaled_mm``; fp8-block calls its Triton blockwise
# kernels; int8-weight-only and int8-dynamic (``Int8Tensor``) are a cast of the weight, ``torch.mm``
# (``_int_mm`` for int8-dynamic) and a multiply by the row scales; fp8-weight-only (``Float8Tensor``
# without activation quantization) casts the weight to fp32, multiplies it by the row scales, casts it to
# bf16 and calls ``torch.matmul``. bitsandbytes' 4-bit decode kernels are launches on fixed shapes too.
_GRAPH_PROBLEMS = {
    "int8": "LLM.int8 finds each input's outlier columns with a data-dependent shape (bitsandbytes' "
            "int8_vectorwise_quant calls torch.argwhere), which a CUDA graph cannot capture",
}


def graph_problem(precision: str) -> str | None:
    """Why ``precision`` decodes without a CUDA graph, or None when its step can be captured."""
    return _GRAPH_PROBLEMS.get(precision)


FP8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards


def hardware_problem(precision: str, device_type: str, capability: tuple[int, int] | None) -> str | None:
    """Why a device of ``device_type`` (``cpu``, ``cuda``) and compute ``capability`` cannot run
    ``precision``, or None. fp8-weight-only needs no float8 tensor cores: torchao 0.18's
    ``Float8WeightOnlyConfig`` checks no hardware (fp8's config calls ``_check_hardware_support``, this one
    does not) and its matmul is a bf16 one on the weight cast back, elementwise casts that run anywhere,
    the CPU included."""
    if precision in ("fp8", "fp8-block"):
        if device_type != "cuda":
            return f"{precision} needs a GPU with float8 tensor cores (compute capability 8.9 or newer); this run is on a CPU"
        if capability is not None and capability < FP8_CAPABILITY:
            return (f"{precision} needs compute capability 8.9 or newer (Ada, Hopper); this GPU has "
                    f"{capability[0]}.{capability[1]}")
    if precision == "int4" and device_type != "cuda":
        return "int4 uses torchao's tinygemm kernel, which runs on CUDA GPUs only"
    return None


def offload_problem(mode: str, precision: str, backend: str, compile: bool, strategy: str = "single") -> str | None:
    """Why a configuration cannot run with ``--offload``, or None when it can. What offload is depends
    on the layout (``strategy``): on one device, decoder layers kept in host memory and streamed in
    for their forward (infer and forward); under FSDP, FSDP's CPU offload of the shards, their
    gradients and the optimizer state, in every mode FSDP runs (``data_parallel_problem`` says
    which); DDP has none."""
    if strategy == "ddp":
        return DDP_OFFLOAD
    if strategy == "fsdp":
        return None
    if strategy != "single":
        return f"{strategy} has no offload in fitbench: use --strategy fsdp --offload, or drop --offload"
    if mode not in ("infer", "forward"):
        return (f"layers stream in for inference only (--mode infer or forward); {mode} needs every weight "
                f"with its gradient and optimizer state at each step, which FSDP can keep in host memory "
                f"across several GPUs: --gpus 2 or more with --strategy fsdp (or auto)")
    if precision in QUANTIZED_PRECISIONS:
        return (f"layers stream in as floating-point weights; {precision} layers keep quantization state that "
                f"accelerate's hooks do not move: use bf16-pure")
    if backend != "native":
        return "fitbench builds its own decoder layer by layer to offload it: use --backend native (Llama-style models)"
    if compile:
        return ("torch.compile stops at accelerate's hooks around every offloaded layer, breaking the graph at "
                "each: drop --compile")
    return None


DATA_PARALLEL_STRATEGIES: tuple[str, ...] = ("ddp", "fsdp")
DDP_OFFLOAD = ("--offload and --strategy ddp do not combine: DDP keeps a whole replica of the weights, gradients and "
               "optimizer state on every GPU and has no CPU offload; keeping them in host memory is FSDP's: use "
               "--strategy fsdp --offload, or drop --offload")
# torchao's inference tensors: subclasses that implement the quantized matmul and little else
# (measured on torch 2.13 / torchao 0.18: DDP's start-up broadcast stops at aten.view, FSDP's
# sharding at aten.split). fp8 is one of them outside training, where it is float8 training instead.
_TORCHAO_INFERENCE = ("int8-dynamic", "int8-weight-only", "int4", "fp8", "fp8-weight-only", "fp8-block")


def pipeline_problem(precision: str, mode: str, backend: str = "native") -> str | None:
    """Why pipeline stages cannot run this configuration, in one sentence with the way out; None
    when they can. The native decoder's stages are ranks of a torchrun job (``fitbench.run.pipeline``)
    and train too; the hf backend's are one process's devices under accelerate's device map
    (``fitbench.run.hf_pipeline``), for inference and forward in the floating-point precisions."""
    if backend != "native":
        if mode in TRAINING_MODES:
            return (f"the {backend} backend's pipeline stages run one after another in one process, for inference: "
                    f"train Llama-style models as stages with --backend native, or run {mode} on one GPU")
        if precision in QUANTIZED_PRECISIONS:
            return (f"the {backend} backend's pipeline stages hold floating-point weights; {precision} layers are "
                    f"quantized on one device: use bf16-pure over stages, or --backend native for quantized stages")
        return None
    if mode not in TRAINING_MODES:
        return None
    if precision == "fp16":
        return ("fp16 training scales its loss with one GradScaler over every gradient, which pipeline stages "
                "split between ranks: use --precision bf16 or bf16-pure")
    if not trains_every_weight(precision) or precision == "fp8":
        return (f"pipeline stages train every weight in a floating-point precision, not {precision}'s adapters or "
                f"float8 linears: train with bf16 or bf16-pure, or run {precision} in infer or forward")
    return None


def data_parallel_problem(strategy: str, precision: str, mode: str, backend: str = "native",
                          offload: bool = False) -> str | None:
    """Why ``strategy`` (``ddp`` or ``fsdp``) cannot run ``precision`` in ``mode`` with ``backend`` (and
    FSDP's CPU offload when ``offload``), in one sentence with the way out; None when it can.

    What composes: fp32, tf32, bf16, fp16 and bf16-pure under both, in train, forward-backward and
    forward; fp8 training under both (torchao's float8 linears keep plain bf16 weights, and with
    row-wise scales FSDP gathers them in bf16 and each rank casts its own); adapters on an int8,
    nf4 or fp4 base under DDP (a frozen replica per rank, the fp32 adapters' gradients averaged)."""
    if strategy not in DATA_PARALLEL_STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not data parallel; expected one of {DATA_PARALLEL_STRATEGIES}")
    name = strategy.upper()
    if backend != "native":
        return (f"{name} is applied to fitbench's native decoder, layer by layer, and the {backend} backend's "
                f"models are not: use --backend native (Llama-style models) or run on one GPU")
    if mode == "infer" and strategy == "ddp":
        return ("generation has no gradients for DDP to average, so N GPUs would run N independent copies that "
                "one GPU's figures already describe: run infer on one GPU")
    if mode == "infer":
        return ("FSDP gathers a layer's weights around its forward call, and decoding runs the KV-cache step and "
                "CUDA graphs outside those calls: run infer on one GPU, with --offload for a model that does not fit")
    if offload and strategy == "ddp":
        return DDP_OFFLOAD
    training = mode in TRAINING_MODES
    if precision in _TORCHAO_INFERENCE and not (precision == "fp8" and training):
        return (f"{precision} weights are torchao tensor subclasses that implement the quantized matmul and little "
                f"else, so {name} can neither {'broadcast' if strategy == 'ddp' else 'shard'} them: run {precision} "
                f"on one GPU, or use bf16 across GPUs")
    if precision in ADAPTER_BASES and strategy == "fsdp":
        return (f"bitsandbytes keeps each {precision} weight's scales beside its data, and the flat shards FSDP "
                f"cuts from a weight carry none: use --strategy ddp, or bf16 or fp8 under FSDP")
    return None


# The families whose transformers models carry a tensor-parallel plan (a ``base_model_tp_plan`` in
# their config, transformers 5.x): Llama, Mistral and Qwen2, fitbench's "llama" family. Falcon and
# GPT-2 have none.
HF_TENSOR_PARALLEL_FAMILIES = ("llama",)


def tensor_parallel_problem(precision: str, mode: str, backend: str = "native",
                            family: str | None = None) -> str | None:
    """Why tensor parallelism cannot run ``precision`` in ``mode`` with ``backend`` on a model of
    ``family``, in one sentence with the way out; None when it can: the floating-point precisions, in
    every mode, on the native decoder (``fitbench.run.tensor_parallel``) and on transformers' models
    of the families with a tensor-parallel plan (``fitbench.run.hf_tensor_parallel``).

    Quantized weights are refused: DTensor shards a weight by viewing and splitting it, which
    torchao's inference tensors (int8-dynamic, int8-weight-only, int4, fp8, fp8-weight-only, fp8-block)
    do not implement (the same stops DDP's broadcast and FSDP's sharding of them), and a bitsandbytes
    weight (int8, nf4, fp4) carries its scales and block state beside its data, which a shard of it
    would not. fp8 training
    would need torchao's own float8 tensor-parallel styles. Pipeline stages split a model by layers
    and leave each layer's weights whole. The hf backend's answer depends on the model's ``family``;
    without one it is refused."""
    if backend != "native" and family not in HF_TENSOR_PARALLEL_FAMILIES:
        whose = f"{family} models" if family else "a model of unnamed family"
        return (f"transformers has no tensor-parallel plan for {whose}: split the model over GPUs by layers with "
                f"--strategy pipeline (--mode infer or forward)")
    way_out = "split the model over GPUs by layers with --strategy pipeline, or use bf16 under --strategy tp"
    if precision == "fp8" and mode in TRAINING_MODES:
        return (f"fp8 training's float8 matmuls take tensor-parallel shards only through torchao's own float8 "
                f"styles, which fitbench does not apply: {way_out}")
    if precision in QUANTIZED_PRECISIONS:
        return (f"{precision} weights cannot be sharded by tensor parallelism: DTensor cuts a weight into shards "
                f"by views and splits, which {quantization_library(precision)}'s {precision} tensors do not "
                f"implement: {way_out}")
    return None


def tensor_parallel_heads_problem(heads: int, kv_heads: int, degree: int, backend: str = "native") -> str | None:
    """Why tensor parallelism of ``degree`` cannot split a model of ``heads`` query and ``kv_heads`` kv
    heads, in one sentence with the way out; None when it can. A head's dot products stay on one rank,
    so the query heads must divide by the degree. The native decoder replicates kv heads that do not
    divide; transformers' plans cut the k and v projections column-wise, which splits whole kv heads
    only when they divide too."""
    if heads % degree:
        return (f"tensor parallelism splits whole attention heads, and {degree} ranks do not divide the model's "
                f"{heads} heads: use a tensor-parallel degree that divides {heads} (--gpus under --strategy tp, --tp "
                f"beside --strategy fsdp or pipeline), or --strategy pipeline alone")
    if backend != "native" and kv_heads % degree:
        return (f"transformers' tensor-parallel plan splits the k and v projections by whole kv heads, and "
                f"{degree} ranks do not divide the model's {kv_heads}: use --gpus that divides {kv_heads}, "
                f"--backend native (which replicates the kv heads), or --strategy pipeline")
    return None
