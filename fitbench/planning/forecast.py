"""Forecast of one step's time: what a step is expected to last, beside the roofline bound.

The model, its terms and their sources: docs/planning.md, "The speed forecast, term by term".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fitbench.hardware.ceilings import Ceilings as MeasuredCeilings
from fitbench.hardware.datasheet import peak_bandwidth, peak_flops
from fitbench.hardware.environment import package_version
from fitbench.models.architecture import Architecture
from fitbench.models.hf_operators import layer_operators
from fitbench.models.loss import loss_chunk_rows
from fitbench.planning.collectives import PCIE_BANDWIDTH, BusBandwidth, bus_bandwidth
from fitbench.planning.kv_cache import kv_bytes_read_per_position
from fitbench.planning.sharding import Parallelism, kv_heads_split
from fitbench.planning.terms import Widths
from fitbench.planning.weights import adapter_params
from fitbench.planning.nodes import LayoutLinks, Nodes, layout_links
from fitbench.planning.speed import (HOST_LINK_BANDWIDTH, _data_parallel_step, bubble_fraction, recomputed_share,
                                 tensor_parallel_decode_s, tensor_parallel_pass_s)
from fitbench.precisions import ADAPTERS, FLOAT8, TRAINING_MODES, DecodeFormat, entry
from fitbench.spec import pipeline_stages

# ---- ceilings --------------------------------------------------------------------------------

# What ``fitbench env --measure`` (``fitbench.hardware.ceilings.measure_ceilings``) found: a bf16 8192^3
# matmul, FLOP/s, and a 1 GiB device-to-device copy, bytes read and written per second.
MEASURED_CEILINGS = {
    # benchmarks/results/2026-11-22-h100-core/README.md: 785.7 TFLOP/s; "the measured copy reached 3.0 TB/s"
    "NVIDIA H100 80GB HBM3": (785.7e12, 3.0e12, "measured on an H100 SXM (benchmarks/results/2026-11-22-h100-core)"),
    # Copy: 4.2 TB/s, benchmarks/results/2026-11-24-h200-compiled-decode/README.md. The matmul is the
    # H100's: the same GH100 processor at the same clocks (``fitbench.hardware.datasheet``: Hopper SXM compute).
    "NVIDIA H200": (785.7e12, 4.2e12, "copy measured on an H200 (benchmarks/results/2026-11-24-h200-compiled-"
                                      "decode), matmul the H100 SXM's (same processor and clocks)"),
}
# Elsewhere the datasheet, scaled as the H100 measured against its datasheet: 785.7 / 989.4 of the
# matmul peak, 3.0 / 3.35 of the bandwidth.
MATMUL_OF_DATASHEET = 785.7 / 989.4
COPY_OF_DATASHEET = 3.0 / 3.35


@dataclass(frozen=True)
class Ceilings:
    """What the GPU measurably reaches: ``matmul``, the bf16 tensor cores' FLOP/s on a large matmul;
    ``bandwidth``, a device-to-device copy's bytes (read and written) per second."""

    matmul: float
    bandwidth: float
    source: str

    def peak(self, gpu_name: str, kind: str) -> float:
        """FLOP/s of ``kind`` (a column of ``fitbench.hardware.datasheet``'s peak table): the measured bf16
        figure scaled by the datasheet's ratio of the two kinds (fp8 twice bf16, fp32 without TF32 about
        1/15)."""
        bf16 = peak_flops(gpu_name, "bf16")
        other = peak_flops(gpu_name, kind)
        return self.matmul * other / bf16 if bf16 and other else self.matmul


def ceilings(gpu_name: str, measured: MeasuredCeilings | None = None) -> Ceilings:
    """The ceilings of ``gpu_name``: ``measured`` (``fitbench.hardware.ceilings.load_ceilings``, what
    ``fitbench env --measure`` cached on this machine) where given, else ``MEASURED_CEILINGS``, else the
    datasheet scaled as on the H100."""
    if measured is not None and "bf16" in measured.matmul_flops:
        return Ceilings(measured.matmul_flops["bf16"], measured.bandwidth,
                        f"measured here at {measured.measured_at} ({measured.method})")
    if gpu_name in MEASURED_CEILINGS:
        matmul, bandwidth, source = MEASURED_CEILINGS[gpu_name]
        return Ceilings(matmul, bandwidth, source)
    matmul, bandwidth = peak_flops(gpu_name, "bf16"), peak_bandwidth(gpu_name)
    if not matmul or not bandwidth:
        raise ValueError(f"no datasheet figures for {gpu_name!r}")
    return Ceilings(matmul * MATMUL_OF_DATASHEET, bandwidth * COPY_OF_DATASHEET,
                    f"{gpu_name}'s datasheet x {MATMUL_OF_DATASHEET:.3f} (matmul), x {COPY_OF_DATASHEET:.3f} (copy), "
                    f"as an H100 SXM measures against its own")


# ---- counted in fitbench's own step -----------------------------------------------------------

# The backward of an elementwise operator reads what its forward read and the output's gradient and
# writes the inputs' gradients: about twice the forward's traffic, as the backward's matmuls are twice
# the forward's FLOPs; more where the residual stream is fp32, whose gradients are. Bytes of a layer's
# backward per byte of its forward (``layer_traffic``), by (residual, compute) widths, where autograd
# records each operator (transformers' layers, tensor-parallel and compiled native builds, native steps
# measured before them), counted in the native decoder's training step as it was
# (tests/test_forecast.py then): bf16 503 h per token against 168 h forward, bf16 autocast 531 against
# 156, fp32 743 against 229.
BACKWARD_TRAFFIC = {(2, 2): 2.0, (4, 2): 2.4, (4, 4): 2.24}
# The native decoder's eager training through its own autograd Functions (``fitbench.models.layer_ops``:
# RMSNorm in one fused kernel saving x and 1/rms, rotary and SwiGLU saving only what their backward
# reads, gradients written into their place with ``out=``): a training step's forward and backward
# together move about 2.4 forward passes' bytes. Bytes of the step beyond one forward pass's
# (``layer_traffic``), per byte of that forward, and of a recomputed forward (the Functions' forward,
# lighter than the plain operators), by the block's family, counted in the real step
# (tests/test_forecast.py). Llama: bf16 2.37 forward passes' worth, bf16 autocast 2.53, fp32 2.40, bf16
# checkpointed 3.22. Falcon (its rotary through the Function, its LayerNorms and GELU as plain operators
# under autograd), the grouped-heads block with two LayerNorms and the multi-query block with one alike:
# bf16 1.93, bf16 autocast 2.16 and 2.17, fp32 2.07 and 2.09, bf16 checkpointed 2.67 and 2.67. GPT-2
# (none of the Functions: LayerNorm, learned positions, GELU, every operator recorded): bf16 3.14, bf16
# autocast 2.98, fp32 3.14, bf16 checkpointed 4.01; its forward moves little beside attention's backward,
# which reads q, k, v, the output and its gradient and writes three gradients.
FUNCTIONS_BACKWARD_TRAFFIC = {"llama": {(2, 2): 1.37, (4, 2): 1.53, (4, 4): 1.40},
                              "falcon": {(2, 2): 0.93, (4, 2): 1.17, (4, 4): 1.08},
                              "gpt2": {(2, 2): 2.14, (4, 2): 1.98, (4, 4): 2.14}}
FUNCTIONS_RECOMPUTED_TRAFFIC = {"llama": 0.85, "falcon": 0.74, "gpt2": 0.87}

# Operators launched per layer in a decode step, by the native decoder's block (``fitbench.models.native``):
# with its q/k/v (and Llama's gate/up) fused, or unfused as quantized, tensor-parallel and pipelined builds
# keep them; a forward or training pass launches the same but for the step's two cache writes, which the
# forecast counts in passes too (its constants solved from measured rows took them). Llama 43 and 46;
# Falcon 26 and 28, the grouped-heads and the multi-query block alike (two LayerNorms, which the one-norm
# block runs twice on the same input; q/k/v; rotary q and k, 12 operators in plain expressions;
# attention; output projection; GELU MLP; two residual adds, as x + attention + MLP adds in two steps);
# GPT-2 12 and 14 (no rotary; biases inside their matmuls' operator). transformers' layers as the
# installed version launches them (``fitbench.models.hf_operators``). Where autograd records each
# operator, autocast adds its casts (``autocast_casts``) and a training step launches BACKWARD_OPS
# operators per forward operator more (the native decoder before its Functions, bf16-pure: 103 per layer
# against 41 forward with grad mode's own; bf16 autocast 105 against 47). Through the Functions a layer's
# training launches FUNCTIONS_BACKWARD_OPS per forward operator more, with or without its fused
# projections, and each autocast cast twice (the cast and its gradient's; Llama's norm writes the matmuls'
# dtype, no casts): Llama bf16-pure 84 against 43, bf16 autocast 82, unfused 96 and 100 against 46;
# Falcon bf16-pure 35 (grouped heads) and 37 (multi-query: the shared norm's two weight gradients added)
# against 26, bf16 autocast 49 and 51, unfused 44 and 46 against 28, autocast 66 and 68 (Falcon's figure
# is their mean); GPT-2 bf16-pure 29 against 12, autocast 51, unfused 38 against 14, autocast 72. Its
# recomputation launches FUNCTIONS_RECOMPUTED_OPS per forward operator: Llama 29 against 43, Falcon 12
# against 26, GPT-2 8 against 12. Outside the layers: embedding (and GPT-2's position rows and their add),
# final norm (Llama's RMSNorm nine operators in plain expressions, LayerNorm one), output projection and
# the logits' reduction; in training also the optimizer's and the gradients' bookkeeping (EDGE_OPS:
# Llama's, transformers' models counted as Llama's); and each chunk of the loss (``fitbench.models.loss``):
# the fused loss's maximum, shifted exponential, sum, gradient written over the logits and its scaling in
# backward (LOSS_CHUNK_OPS); the out-of-place loss of DTensor logits and of steps measured before the
# fused loss: upcast, cross-entropy, sum and their backward (CHUNKED_LOSS_CHUNK_OPS, with
# CHUNKED_LOSS_EDGE_OPS at the edges). All counted by tests/test_forecast.py.
LAYER_OPS = {"llama": {"fused": 43, "unfused": 46}, "falcon": {"fused": 26, "unfused": 28},
             "gpt2": {"fused": 12, "unfused": 14}}
BACKWARD_OPS = 1.45
FUNCTIONS_BACKWARD_OPS = {"llama": {"fused": 1.03, "unfused": 1.03}, "falcon": {"fused": 0.38, "unfused": 0.61},
                          "gpt2": {"fused": 1.42, "unfused": 1.71}}
FUNCTIONS_RECOMPUTED_OPS = {"llama": 29 / 43, "falcon": 12 / 26, "gpt2": 8 / 12}
EDGE_OPS = {"llama": {"forward": 12, "training": 42}, "falcon": {"forward": 7, "training": 20},
            "gpt2": {"forward": 9, "training": 23}}
LOSS_CHUNK_OPS = 17
CHUNKED_LOSS_CHUNK_OPS = 7
CHUNKED_LOSS_EDGE_OPS = 43

# ---- constants, each from a measured row ------------------------------------------------------
#
# Each is the value at which its source row's forecast equals the row's measured step (the others held
# at their values; tests/test_forecast.py solves each again from its row). Rows are under
# benchmarks/results/; "the 7B", "13B", ... are fitbench's presets.

# The host and the device overlap imperfectly: within a step the pace-setter alternates (the forward's
# small operators wait on the host, the backward's matmuls on the device) and the launch queue between
# them evens out only part of it. A step lasts (device^p + host^p)^(1/p): the longer clock where one
# dominates, 2^(1/p) = 1.26 times either where they are equal. p = 3: solved from each training row of
# the validation matrices whose two clocks come within 10% of each other (2026-11-24-h200-validation:
# CS336 small 8 x 1024 and fp32 checkpointed, 1B 4 x 512, Llama-3.1-8B 1 x 1024 and 7B checkpointed,
# 7B nf4), p lies between 2.3 and 5.5, 3.3 their median.
OVERLAP_EXPONENT = 3.0
# The model's tensor-core matmuls against the 8192^3 product that measured the peak: 7B forward,
# bf16-pure, 2 x 1024, H200 (2026-11-24-h200-validation/matrix1-forward/3, 59.3 ms), a step of large
# matmuls (2048 x 4096 x 11008 and alike) with little else.
MATMUL_EFFICIENCY = 0.81
# Causal flash attention against the matmul peak: Llama-3.1-8B training, bf16-pure, checkpointed, H200
# (2026-11-23-h200-chunked-loss/long-sequences): 1 x 8192 took 77.4 ms more than 2 x 4096, the same
# tokens with twice the context (the extra time, not either row, is matched).
ATTENTION_EFFICIENCY = 0.65
# Device time per kernel beyond its traffic (the gap between two kernels a CUDA graph replays, a small
# kernel's ramp and tail): the 7B decoding at batch 1 through a graph of the eager step, H200
# (2026-11-24-h200-validation/matrix1-inference/3): 7.23 ms, 3.3 ms of it the weights and cache at
# 4.2 TB/s, the rest over 46 x 32 + 12 kernels.
KERNEL_S = 2.7e-6
# Host time per operator launched eagerly. Training, where autograd records each operator: CS336
# small, bf16, 8 x 1024, H200 (2026-11-24-h200-validation/matrix1-training/2, 35.5 ms, its device clock
# 27 ms). Inference (inference_mode): Llama-2-7B bf16 decoding without a graph, H100
# (2026-11-22-h100-quantized-decode/decode-eager, 21.2 ms over 1,484 operators, its device clock 8.5 ms).
HOST_OP_S = {"training": 17.1e-6, "inference": 14.0e-6}
# transformers' layers call more Python per operator: GPT-2 XL decoding, batch 8, H200
# (2026-11-24-h200-validation/matrix2-inference/2): 19.76 ms over 48 x 24 + 12 operators.
HF_HOST_OP_S = 17.0e-6
# Operators dispatched through DTensor (fitbench's tensor-parallel training, transformers' tensor
# parallelism) propagate their sharding on the host first. Host seconds per such operator, solved from
# each committed eager row of pure TP (each row's value at which its forecast is its measured step),
# differ by host: training 123 us on the 2 x H200 host (2026-11-24-h200x2-model-parallel/13b-train-tp),
# 158 to 194 us on the 4 x H100 host (2026-11-27-h100x4-model-parallel/7, 2026-11-27-h100x4-tp-steps/
# 13b-train-tp4, 2026-11-27-h100x4-vs-one-gpu-2/sharded/30B); inference 35 us and 48 us
# (2026-11-24-h200x2-model-parallel/13b-hf-tp-transformers-5.17, 2026-11-27-h100x4-model-parallel/10).
# A plan does not know its host's speed, so each constant is the geometric mean of the fastest and the
# slowest host's values, sqrt(min x max): the forecast errs by the same ratio on both.
DTENSOR_HOST_OP_S = {"training": 154e-6, "inference": 40.9e-6}
# transformers' models over pipeline stages (``fitbench.worker.hf_pipeline``) run in one process, each
# decoder layer behind accelerate's ``AlignDevicesHook``: before each layer's forward the hook walks its
# arguments and moves each tensor to the layer's device (a no-op ``.to`` call on all but the first
# layer of a stage), and that process launches every stage's operators, each on a device other than
# the current one but for the first stage's. Host seconds per decoder layer and forward pass beyond
# its operators: the median of the values at which each committed pipelined decode row of transformers
# that overlaps host and device (5.17) is forecast as measured, one value for all of them
# (tests/test_forecast.py solves them again): Falcon-40B over 2 H200s, batch 1 and 8
# (2026-11-24-h200x2-model-parallel/falcon40-hf-pp: 195 and 189 us), over 2 and 4 H100s
# (2026-11-27-h100x4-hf-versions/hf-5.17/1: 374 us; 2026-11-27-h100x4-model-parallel/9, batch 1 and 8:
# 470 and 416 us). The spread is the hosts' (the one-GPU Falcon-40B row on an H200,
# 2026-11-24-h200-validation/matrix2-inference/1, is forecast within 7% without the term). The same
# configuration under transformers 5.24 on the same machine (hf-5.24/1), its clocks one after the
# other (``HF_SERIAL_DECODE_SINCE``), solves to 351 us.
HF_STAGED_LAYER_HOST_S = 374e-6
# From this transformers version on, a decode step's host and device work run one after the other, not
# side by side: the same machine and configurations under 5.17 and 5.24
# (2026-11-27-h100x4-hf-versions, one command), where 5.24's decode steps last the sum of 5.17's two
# clocks (Qwen2.5-7B 41.7 ms against 22.3 ms device and 20.7 host; GPT-2 XL 24.3 against 4.6 and 19.8)
# while its forward passes, whose device clock dominates, keep 5.17's time. Versions between the two
# were not measured; the first measured to serialize is the bound.
HF_SERIAL_DECODE_SINCE = (5, 24)
# A checkpointed layer's host time beyond its operators (the recomputation's Python frames and
# saved-tensor hooks): CS336 small, bf16, 4 x 512, checkpointed, H200
# (2026-11-24-h200-validation/matrix1-training/1, 56.6 ms).
CHECKPOINT_HOST_S = 1.42e-3
# FSDP2's host time per sharded layer and training step, beyond the layer's operators: its pre- and
# post-forward and -backward hooks, the copies into and out of its all-gather and reduce-scatter
# buffers, and the optimizer's step over DTensor shards. The default job's two FSDP rows on 4 H100s,
# 4 x 512 tokens a rank, whose steps the host sets (2026-11-27-h100x4-replicas/default: 1B, 16 layers,
# 123.3 ms; 3B, 28 layers, 217.0 ms), each solved for the value at which its forecast is its measured
# step; their mean.
FSDP_HOST_S_PER_LAYER = 5.58e-3
# The same over a 2-D mesh (FSDP x TP: each layer's shards are DTensors sharded on both dimensions,
# gathered and reduced through DTensor), beyond DTensor's per-operator time: the median of the committed
# eager FSDP x TP training rows on 4 H100s, each solved for the value at which its forecast is its
# measured step (2026-11-27-h100x4-vs-one-gpu/13b-fsdp2-tp2, 2026-11-27-h100x4-vs-one-gpu-2/sharded/
# 13B-fsdp-tp2, 2026-11-27-h100x4-model-parallel/11, 2026-11-27-h100x4-auto-vs-best/13b-train/fsdp-4-tp2
# and 30b-train/fsdp-4-tp2-checkpointed). Eager steps only: under ``torch.compile`` each layer is a compiled
# region that runs on the DTensors' local shards, its kernels launched at a plain operator's rate
# (HOST_OP_S), and what stays eager per layer is FSDP2's own (FSDP_HOST_S_PER_LAYER): 13B FSDP 2 x TP 2
# compiled on 4 H100s (2026-11-27-h100x4-vs-one-gpu-2/sharded/13B-fsdp-tp2-compile) took 480 ms, where
# DTensor's eager host time would put it at 843 ms.
FSDP_TP_HOST_S_PER_LAYER = 10.0e-3
# A forward step runs one of a training step's three gathered passes (forward; backward's gather and
# reduce-scatter): its share of the per-layer host time, counted in proportion.
FSDP_FORWARD_SHARE = 1 / 3
# The share of the eager elementwise traffic a torch.compile'd training step still moves (inductor
# fuses norms, rotary, SwiGLU and the casts): 1B training, bf16, 8 x 2048, compiled, H200
# (2026-11-24-h200-validation/matrix2-training/3, 209.4 ms).
COMPILED_TRAFFIC = 0.25
# Kernels a compiled decode step replays per layer, in kernel-equivalents of KERNEL_S (norms fused with
# their casts, rotary with the cache write, SwiGLU in one; matmuls and attention as before): Llama-2-7B
# bf16, compiled decode step, batch 1, H200 (2026-11-24-h200-compiled-decode/after/compiled, 4.56 ms).
COMPILED_LAYER_KERNELS = 15
# Offloaded decoder layers stream in through accelerate's hooks, each copied from pageable host memory
# before its forward: 65B decoding with 31 of 80 layers in host memory, H100 (2026-11-22-h100-offload:
# 50.2 GB a token, 7.34 s).
OFFLOAD_STREAM_BANDWIDTH = 6.9e9

# Training: operators each matmul adds to its layer's forward (the backward adds BACKWARD_OPS per
# operator): LoRA's adapters beside a frozen quantized base, two casts, two matmuls, a scale and an add
# (``fitbench.worker.adapters``), with the base format's own (LLM.int8's as in decoding); and torchao's
# float8 training eagerly, its dynamic scaling of inputs, weights and gradients: 7B fp8, 4 x 512, H100
# (2026-11-22-h100-quantized-training/7b-train, 683 ms against bf16-pure's 227 ms). Compiled, inductor
# fuses the scaling into the matmuls' neighbours.
ADAPTER_OPS = 6
FP8_TRAINING_OPS = 61
# Bytes of each cast of a bf16 element to float8 with a dynamic scale: read for the maximum, read and
# written as one byte for the cast.
FLOAT8_CAST_BYTES = 2 + 2 + 1


@dataclass(frozen=True)
class StepRun:
    """How the step runs, as far as its speed goes: the ``backend`` (native or hf); ``compiled``, the
    model ``torch.compile``d (``--compile``); for generation ``decode``: "graph" (the eager step
    replayed from a CUDA graph), "compiled" (the compiled step in a graph) or "eager" (no graph); and
    ``fused``, False for steps measured before the native decoder fused its projections, and
    ``tp_fused`` before a tensor-parallel generation or forward pass stacked its local shards;
    ``functions``, False for training steps measured before its autograd Functions, and ``fused_loss``
    before the fused cross-entropy (``benchmarks/speed_error.py`` tells them by their start);
    ``one_shot``: a tensor-parallel decode step's per-layer all-reduces summed through symmetric memory
    (``fitbench.spec.RunSpec.symmetric_memory``); ``transformers``: the version the hf backend runs
    (``hf_serial_decode``), None for the one installed here."""

    backend: str = "native"
    compiled: bool = False
    decode: str = "graph"
    fused: bool = True  # the native decoder's fused projections, where its build has them (``fused_build``)
    tp_fused: bool = True
    functions: bool = True
    fused_loss: bool = True
    one_shot: bool = False
    transformers: str | None = None  # the hf backend's transformers version; None: the installed one


@dataclass(frozen=True)
class Forecast:
    seconds: float
    device_s: float
    host_s: float
    communication_s: float
    bound: str  # "device", "host" or "communication"
    terms: dict[str, float]  # seconds of the device's parts (matmuls, attention, memory, optimizer, kernels)
    launches: float  # kernels (operators) the step launches


def decode_format(precision: str, decode: str, tokens: int) -> DecodeFormat:
    """The weight format's decode terms for a step of ``tokens`` tokens that runs as ``decode`` says."""
    return entry(precision).decode.at(decode, tokens)


def native_block(arch: Architecture, backend: str) -> str:
    """Whose counts a layer takes: the native decoder's block of ``arch``'s family (llama, falcon, gpt2);
    transformers' layers (``backend`` hf) take the Llama block's elementwise traffic and edges, as they
    always have (their operators are their own: ``layer_operators``)."""
    return arch.family if backend == "native" else "llama"


def layer_traffic(arch: Architecture, widths: Widths, backend: str = "native") -> float:
    """Bytes the elementwise operators of one eager layer read and write per token in a forward pass
    (``fitbench.models.native``; h hidden, f MLP width, k key/value width, c compute and r residual
    widths; tests/test_forecast.py counts them in the real step of each block):

    - the residual stream, ``residual_stream_traffic``: the two norms and the two residual adds;
    - rotary embedding of q and k (Llama, Falcon; GPT-2's positions enter with the embeddings): products
      with cos and sin, the negated half, the concatenation and the sum, 10 c per element: 10 c (h + k);
    - attention's q, k, v and output, 2 c (h + k) (grouped heads expanded for fp32: k = h, and the
      expansion's copies, 8 (h + k)); GPT-2's q, k and v views of the one projection's output alike;
    - the MLP's activation: SwiGLU's silu of the gate and its product with up, 5 c f; GELU (Falcon's
      exact, GPT-2's tanh, one ``F.gelu``) reads its input and writes its output, 2 c f.

    Biases (GPT-2's, Falcon's where its config has them) are added inside their matmul's operator
    (``addmm``), no elementwise operator of their own. ``backend`` hf: the Llama block's bytes
    (``native_block``). Autocast's casts are counted as the fused projections run them: one per norm."""
    block = native_block(arch, backend)
    h, f, c = arch.hidden_size, arch.ffn_size, widths.compute
    k = arch.num_kv_heads * arch.head_dim
    expanded = c == 4 and k != h
    attention = 2 * c * (h + (h if expanded else k)) + (8 * (h + k) if expanded else 0)
    rotary = 0 if block == "gpt2" else 10 * c * (h + k)
    mlp = 5 * c * f if block == "llama" else 2 * c * f
    return residual_stream_traffic(arch, widths, backend) + rotary + attention + mlp


def residual_stream_traffic(arch: Architecture, widths: Widths, backend: str = "native") -> float:
    """The part of ``layer_traffic`` on the residual stream, whole hidden vectors: two norms and two
    residual adds, (2 r + c) h each. Tensor parallelism splits heads and the MLP's width, not these: every
    rank runs them on the whole activation (``fitbench.worker.tensor_parallel``: "the norms replicated"),
    unless sequence parallelism gives each rank 1 / tp of the sequence (``sequence_parallel``).

    - each RMSNorm (Llama): two fp32 upcasts of a 16-bit input (r + 4 each), the square (8), the mean
      (4), the product with 1/rms (8), the cast back (4 + r), the weight's product (2 r), autocast's cast
      of the result for the matmul (6): 28 h + 2 r h in fp32, 34 h under autocast, 42 h in bf16;
    - each LayerNorm (Falcon, GPT-2): one operator reading the residual and writing its output in the
      residual's dtype (mean and 1/std per token besides, negligible), 2 r h, and under autocast, which
      runs it in fp32, its output's cast for the matmul (4 + c): 8 h + 6 h under autocast, 4 h in bf16,
      8 h in fp32. Falcon-7B's block with one LayerNorm runs it twice on the same input, once for
      attention and once for the MLP (``DecoderLayer.mlp_norm``): two norms' bytes too;
    - Falcon's parallel block adds attention's and the MLP's outputs to its input in two adds
      (x + attention + MLP), as the sequential blocks do: two adds all the same."""
    h, c, r = arch.hidden_size, widths.compute, widths.residual
    cast = (4 + c) * h if widths.autocast else 0
    if native_block(arch, backend) == "llama":
        norm = (0 if r == 4 else 2 * (r + 4) + 4 + r) * h + 20 * h + 2 * r * h + cast
    else:
        norm = 2 * r * h + cast
    return 2 * norm + 2 * (2 * r + c) * h


def sequence_parallel(backend: str, training: bool, seq_len: int, tp: int, learned_positions: bool = False) -> bool:
    """Whether a tensor-parallel step splits the residual stream along the sequence: the native decoder's
    training where the sequence divides by the degree and positions are rotary
    (``fitbench.worker.build.build_layout``); its forward passes and generation, a model with learned
    positions, and transformers' tensor parallelism, keep it whole on every rank."""
    return tp > 1 and backend == "native" and training and seq_len % tp == 0 and not learned_positions


def loss_traffic(vocab: int, compute: int, training: bool, fused: bool = True) -> float:
    """Bytes per token the output's logits cost beyond its matmul: a forward pass writes them and sums
    them (2 c V). A training step writes them (c); the fused loss (``fitbench.worker.cross_entropy``,
    ``fused``) reads each chunk for its maximum (c), reads it again for the shifted fp32 copy (c + 4),
    takes its exponential in place (8), sums it (4) and writes the gradient over the logits (4 + c),
    which backward scales in place (2 c): (6 c + 20) V. The out-of-place loss (DTensor logits, steps
    measured before the fused loss) upcasts each chunk (c + 4), takes its log-softmax (8) and the
    target's entry, and backward forms the log-softmax's gradient (4 + 12) and casts it back for the
    matmul (4 + c): (32 + 3 c) V."""
    if not training:
        return 2 * compute * vocab
    return (6 * compute + 20) * vocab if fused else (32 + 3 * compute) * vocab


def layer_ops(arch: Architecture, backend: str, fused: bool = True, transformers: str | None = None) -> int:
    """Operators one layer launches in a decode step, which the forecast counts for a forward pass too: the
    native decoder's block's (``LAYER_OPS``, by ``arch``'s family; ``fused``: its fused projections), or
    transformers' layer as ``transformers`` (a version; None: the installed one) runs it
    (``layer_operators``)."""
    if backend == "native":
        return LAYER_OPS[arch.family]["fused" if fused else "unfused"]
    return layer_operators(arch, transformers)


def layer_matmuls(arch: Architecture, backend: str, fused: bool = True) -> int:
    """Matmuls one layer runs: transformers' layer one per matrix (``Architecture.layer_matrices``); the
    native decoder's q, k and v as one (``fused``) or three, the output projection, and its MLP's: Llama's
    gate and up as one or two and down, a GELU MLP's up and down."""
    if backend != "native":
        return len(arch.layer_matrices)
    mlp = (2 if fused else 3) if arch.family == "llama" else 2
    return (1 if fused else 3) + 1 + mlp


def autocast_casts(arch: Architecture, backend: str, fused: bool = True, functions: bool = False) -> int:
    """Casts autocast adds to a layer's forward. The native Llama block and transformers' layers: one per
    matmul's input, as the forecast has counted them for the measured rows (a native Llama forward pass
    counts 6 for its fused layer's 4 matmuls: each weight's cast and each norm output's), and none through
    the native Llama's Functions (``functions``), whose norm writes the matmuls' dtype. The native Falcon
    and GPT-2 blocks, whose LayerNorms autocast runs in fp32, with or without the Functions: each matmul's
    weight, each bias, and each matmul input a LayerNorm wrote (q/k/v's, as one or three, and the MLP's
    up projection), counted in the real step (tests/test_forecast.py)."""
    matmuls = layer_matmuls(arch, backend, fused)
    if backend != "native" or arch.family == "llama":
        return 0 if functions else matmuls
    qkv_biased = arch.layer_matrices[0].bias  # q, k and v each carry their part of it when unfused
    biases = sum(m.bias for m in arch.layer_matrices) + (2 if qkv_biased and not fused else 0)
    return matmuls + biases + (1 if fused else 3) + 1


def fused_build(precision: str, parallelism: Parallelism, run: StepRun, mode: str) -> bool:
    """Whether the native decoder runs with fused projections: not quantized, on one rank's layers whole
    (``fitbench.models.native``), or a tensor-parallel generation or forward pass without FSDP, which
    stacks its local shards (``fitbench.worker.tensor_parallel.fuse_local_projections``); not over stages."""
    if not run.fused or entry(precision).quantized or parallelism.stages > 1:
        return False
    if parallelism.tensor == 1:
        return True
    return run.tp_fused and mode not in TRAINING_MODES and parallelism.layout.dp_shard == 1


def forecast_step_time(arch: Architecture, mode: str, precision: str, batch: int, seq_len: int, *,
                       new_tokens: int, parallelism: Parallelism, gpu_name: str, ceiling: Ceilings,
                       run: StepRun = StepRun(), activation_checkpointing: bool = False,
                       checkpointed_layers: int | None = None, offloaded_bytes: float = 0.0,
                       links: BusBandwidth | None = None, nodes: Nodes | None = None) -> Forecast:
    """The forecast time of one step (one decode step in infer) of the configuration, run as ``run``
    says, on ``gpu_name`` with ``ceiling``; with ``activation_checkpointing``, the first
    ``checkpointed_layers`` layers of each stage recompute (every layer when None); ``offloaded_bytes``
    of weights cross the host link each
    forward pass (decoding then runs eagerly); ``links``: the collectives' constants inside a node,
    ``nodes``: the job's nodes where it spans several (``fitbench.planning.nodes``)."""
    links = layout_links(parallelism.layout, links or bus_bandwidth(gpu_name), nodes)
    if mode == "infer":
        return _decode_time(arch, precision, batch, seq_len, new_tokens, parallelism, gpu_name, ceiling, run,
                            offloaded_bytes, links)
    recomputed = recomputed_share(arch.num_layers, parallelism.stages, checkpointed_layers) \
        if activation_checkpointing else 0.0
    return _pass_time(arch, mode, precision, batch, seq_len, parallelism, gpu_name, ceiling, run,
                      recomputed, offloaded_bytes, links)


# A token id as the last stage sends it back to the first: one int64 per sequence.
TOKEN_BYTES = 8


def _decode_time(arch: Architecture, precision: str, batch: int, seq_len: int, new_tokens: int,
                 parallelism: Parallelism, gpu_name: str, ceiling: Ceilings, run: StepRun,
                 offloaded_bytes: float, links: LayoutLinks) -> Forecast:
    tp, stages = parallelism.tensor, parallelism.stages
    widths = Widths.of(precision)
    decode = "eager" if run.backend == "hf" or offloaded_bytes else run.decode
    fmt = decode_format(precision, decode, batch)
    fused = run.backend == "native" and fused_build(precision, parallelism, run, "infer")
    layer_weights = arch.layer_matmul_weights * arch.num_layers
    if entry(precision).quantized:
        stored = sum(entry(precision).storage.matrix_bytes(m.rows, m.columns) for m in arch.layer_matrices)
        quantized = stored * arch.num_layers
    else:
        quantized = widths.weights * layer_weights
    # Everything else the step reads: the other parameters at their width, less the lookup tables'
    # rows no token uses (a tied output projection reads its whole table); under autocast each matmul
    # weight's 16-bit copy, written and read.
    plain_width = 2 if entry(precision).quantized else widths.weights
    h = arch.hidden_size
    unread = (0 if arch.tie_embeddings else (arch.vocab_size - batch) * h)
    unread += arch.position_params - h if arch.position_params else 0
    plain = plain_width * (arch.total_params - layer_weights - unread)
    if widths.autocast:
        plain += 2 * widths.compute * (arch.matmul_params - arch.num_layers * arch.norm_params_per_layer)
    weights_s = ((quantized + fmt.dequantized * layer_weights) / fmt.read_rate(ceiling.bandwidth, ceiling.matmul)
                 + plain / ceiling.bandwidth)
    positions = seq_len + new_tokens if decode != "eager" else seq_len + new_tokens / 2
    cache = kv_bytes_read_per_position(arch, widths, run.backend) * batch * positions / kv_heads_split(arch, tp)
    memory_s = weights_s / tp + cache / ceiling.bandwidth
    matmul_s = 2 * batch * arch.matmul_params / (tp * ceiling.peak(gpu_name, entry(precision).peak_kind("infer"))
                                                 * MATMUL_EFFICIENCY)
    per_layer = COMPILED_LAYER_KERNELS if decode == "compiled" else \
        layer_ops(arch, run.backend, fused, run.transformers)
    per_layer += layer_matmuls(arch, run.backend, fused) * fmt.extra_kernels
    kernels = per_layer * arch.num_layers + EDGE_OPS[native_block(arch, run.backend)]["forward"]
    kernels_s = kernels * KERNEL_S
    device_s = max(matmul_s, memory_s) + kernels_s
    # Stages decode in turn, the whole model at one rank's pace; each native stage's process launches
    # its own layers, transformers' stages are one process.
    host_s = 0.0 if decode != "eager" else kernels / (stages if run.backend == "native" else 1) * \
        _host_op_s(run.backend, tp, "inference")
    if run.backend == "hf" and stages > 1:  # accelerate's hooks, one process over every stage's device
        host_s += arch.num_layers * HF_STAGED_LAYER_HOST_S
    communication_s = tensor_parallel_decode_s(arch, batch, widths.compute, tp, links.tensor, one_shot=run.one_shot)
    communication_s += links.sends_s(batch * arch.hidden_size * widths.compute, stages, 1)
    if stages > 1:  # the chosen token's way back from the last stage to the first, across nodes where they are
        way_back = links.inter if links.boundaries_across else links.intra
        communication_s += way_back.send_recv_s(batch * TOKEN_BYTES, messages=1)
    communication_s += offloaded_bytes / OFFLOAD_STREAM_BANDWIDTH
    serial = run.backend == "hf" and hf_serial_decode(run.transformers)
    seconds = (device_s + host_s if serial else side_by_side(device_s, host_s)) + communication_s
    terms = {"matmuls": matmul_s, "memory": memory_s, "kernels": kernels_s}
    return Forecast(seconds, device_s, host_s, communication_s, _bound(device_s, host_s, communication_s), terms,
                    kernels)


def _pass_time(arch: Architecture, mode: str, precision: str, batch: int, seq_len: int, parallelism: Parallelism,
               gpu_name: str, ceiling: Ceilings, run: StepRun, recomputed: float, offloaded_bytes: float,
               links: LayoutLinks) -> Forecast:
    """``recomputed``: the share of the layers whose forward a training step repeats (``recomputed_share``)."""
    training = mode != "forward"
    recomputed = recomputed if training else 0.0
    tp, stages = parallelism.tensor, parallelism.stages
    widths = Widths.of(precision, parallelism)
    n = batch * seq_len
    L, h, V = arch.num_layers, arch.hidden_size, arch.vocab_size
    share = max(len(layers) for layers in pipeline_stages(L, stages)) / L
    adapters = training and entry(precision).training == ADAPTERS
    float8 = training and entry(precision).training == FLOAT8
    matmul_params = arch.matmul_params
    # forward 2 N per token; the backward's two matmuls 4 N, the frozen base's weight gradient (2 N) not
    # formed under adapters, which train fully (6 A); checkpointing repeats the layers' forward, R of it
    passes = (3 if training else 1) - (1 if adapters else 0) + recomputed
    matmul_flops = 2 * n * matmul_params * passes + (6 * n * adapter_params(arch) if adapters else 0)
    kind = entry(precision).peak_kind("train" if training else "forward")
    cuda_cores = kind == "fp32"
    peak = ceiling.peak(gpu_name, kind) * (1.0 if cuda_cores else MATMUL_EFFICIENCY)
    matmul_s = matmul_flops * share / (peak * tp)
    attention_passes = (1 + 2.5 + recomputed) if training else 1
    attention_flops = 2 * L * arch.num_heads * arch.head_dim * seq_len * n * attention_passes
    attention_s = attention_flops * share / (ceiling.peak(gpu_name, "bf16") * ATTENTION_EFFICIENCY * tp)

    # autograd records the native decoder's Functions where eager training on one rank's whole tensors
    # runs them (``layer_ops.eager_training``), each operator elsewhere; the fused loss takes plain logits
    functions = training and run.functions and run.backend == "native" and tp == 1 and not run.compiled
    fused_loss = training and run.fused_loss and tp == 1
    widths_key = (widths.residual, widths.compute)
    block = native_block(arch, run.backend)
    if functions:
        backward = FUNCTIONS_BACKWARD_TRAFFIC[block].get(widths_key, 1.0)
        recomputed_traffic = FUNCTIONS_RECOMPUTED_TRAFFIC[block]
    else:
        backward, recomputed_traffic = BACKWARD_TRAFFIC.get(widths_key, 2.0), 1.0
    traffic_passes = (1 + backward + recomputed_traffic * recomputed) if training else 1
    # a stage's layers alone; each tensor-parallel rank runs 1 / tp of the heads and the MLP, and the
    # residual stream whole unless sequence parallelism splits it
    residual = residual_stream_traffic(arch, widths, run.backend)
    split = tp if sequence_parallel(run.backend, training, seq_len, tp, arch.position_embeddings == "learned") else 1
    per_rank = (layer_traffic(arch, widths, run.backend) - residual) / tp + residual / split
    layers = n * share * L * per_rank * traffic_passes
    if run.compiled:
        layers *= COMPILED_TRAFFIC
    # the logits are gathered whole on every tensor-parallel rank, which runs the loss (or the forward's
    # sum) over all of them
    loss = n * loss_traffic(V, widths.compute, training, fused_loss)
    trainable = 4 * adapter_params(arch) if adapters else widths.weights * arch.total_params
    optimizer = 7 * trainable / (parallelism.shards * tp) if mode == "train" else 0.0
    weights = 0.0
    if widths.autocast:  # 16-bit copies of the matmul weights, per forward; the gradients' fp32 accumulation
        weights += 6 * matmul_params * (recomputed + 1) + (6 * matmul_params if training else 0)
    if entry(precision).quantized:  # the frozen matmuls read, and where the format does, dequantized to a copy
        stored = sum(entry(precision).storage.matrix_bytes(m.rows, m.columns) for m in arch.layer_matrices) * L
        copies = decode_format(precision, "eager", n).dequantized * arch.layer_matmul_weights * L
        weights += (stored + copies) * (passes if training else 1)
    if float8:  # dynamic scaling: each cast to float8 reads its input twice (maximum, cast) and writes a byte
        weights += FLOAT8_CAST_BYTES * 2 * arch.layer_matmul_weights * L  # the weight and its transpose
        inputs = sum(m.rows + m.columns for m in arch.layer_matrices) * L  # each matmul's input, its gradient
        layers += FLOAT8_CAST_BYTES * 2 * n * inputs / tp  # forward and backward
    memory_s = (layers + loss + share * weights / tp) / ceiling.bandwidth
    optimizer_s = share * optimizer / ceiling.bandwidth

    fused = run.backend == "native" and fused_build(precision, parallelism, run, mode)
    matmuls = layer_matmuls(arch, run.backend, fused)
    # the casts autocast adds, which a compiled region fuses into its kernels
    casts = autocast_casts(arch, run.backend, fused, functions) if widths.autocast and not run.compiled else 0
    forward_ops = COMPILED_LAYER_KERNELS if run.compiled else layer_ops(arch, run.backend, fused, run.transformers)
    if adapters:
        forward_ops += matmuls * (ADAPTER_OPS + decode_format(precision, "eager", n).extra_kernels)
    if float8 and not run.compiled:
        forward_ops += matmuls * FP8_TRAINING_OPS
    if functions:  # each cast and its gradient's, and the cast again where the layer recomputes
        backward_ops = FUNCTIONS_BACKWARD_OPS[block]["fused" if fused else "unfused"]
        per_layer = forward_ops * (1 + backward_ops + FUNCTIONS_RECOMPUTED_OPS[block] * recomputed) \
            + casts * (2 + recomputed)
    else:
        per_layer = (forward_ops + casts) * ((1 + BACKWARD_OPS + recomputed) if training else 1)
    chunks = math.ceil(n / loss_chunk_rows(V)) if training else 0
    edge = EDGE_OPS[block]
    edges = edge["forward"] if not training else edge["training"] if fused_loss else CHUNKED_LOSS_EDGE_OPS
    ops = share * L * per_layer + edges + chunks * (LOSS_CHUNK_OPS if fused_loss else CHUNKED_LOSS_CHUNK_OPS)
    kernels_s = ops * KERNEL_S
    device_s = matmul_s + attention_s + memory_s + optimizer_s + kernels_s
    # a compiled region runs on the DTensors' local shards: its kernels launch at a plain operator's rate
    host_s = ops * _host_op_s(run.backend, 1 if run.compiled else tp, "training" if training else "inference") \
        + optimizer_s
    host_s += share * L * recomputed * CHECKPOINT_HOST_S if not run.compiled else 0.0
    if parallelism.shards > 1:  # FSDP2's hooks, copies into and out of its buffers, DTensor's optimizer step
        per_layer = FSDP_TP_HOST_S_PER_LAYER if tp > 1 and not run.compiled else FSDP_HOST_S_PER_LAYER
        host_s += round(share * L) * per_layer * (1 if training else FSDP_FORWARD_SHARE)
    busy = side_by_side(device_s, host_s)

    directions = 2 if training else 1
    activation = n * h * widths.compute
    communication_s = tensor_parallel_pass_s(activation, round(share * L), directions, tp, links.tensor)
    communication_s += links.tensor.all_gather_s(n * V * widths.compute, tp)  # the logits, gathered whole
    microbatches = parallelism.microbatches_of(batch) if training else 1
    communication_s += links.sends_s(activation / microbatches, stages, directions)
    communication_s += offloaded_bytes / OFFLOAD_STREAM_BANDWIDTH
    if parallelism.offload:  # FSDP's shards cross the host link before each gather, its gradients after
        shards = (1 if not training else 3) * widths.weights * arch.total_params / parallelism.layout.data_parallel
        communication_s += shards / HOST_LINK_BANDWIDTH.get(gpu_name, PCIE_BANDWIDTH)
    step_s = busy / (1 - (bubble_fraction(stages, microbatches) if training else 0.0))
    exposed_s = communication_s
    if parallelism.layout.data_parallel > 1:
        fsdp = parallelism.shards > 1
        gathered = (widths.compute if fsdp and not entry(precision).quantized else widths.weights) * arch.total_params
        gradient_bytes = 4 * adapter_params(arch) if adapters else widths.weights * arch.total_params
        collectives_s, step_s = _data_parallel_step(arch, mode, parallelism, links.data, step_s, 3 if training else 1,
                                                    gathered / tp, gradient_bytes / tp, widths, adapters)
        communication_s += collectives_s
    seconds = step_s + exposed_s
    terms = {"matmuls": matmul_s, "attention": attention_s, "memory": memory_s, "optimizer": optimizer_s,
             "kernels": kernels_s}
    return Forecast(seconds, device_s, host_s, communication_s, _bound(device_s, host_s, communication_s), terms,
                    ops)


def side_by_side(device_s: float, host_s: float) -> float:
    """The step's time when the device's and the host's clocks run side by side: the longer of the two
    where one dominates, more where they are close (``OVERLAP_EXPONENT``)."""
    p = OVERLAP_EXPONENT
    return (device_s ** p + host_s ** p) ** (1 / p)


def hf_serial_decode(version: str | None) -> bool:
    """Whether transformers at ``version`` (None: the installed one; none installed: False) runs a decode
    step's host and device work one after the other (``HF_SERIAL_DECODE_SINCE``)."""
    version = version or package_version("transformers")
    if version is None:
        return False
    release = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        release.append(int(digits))
    return tuple(release) >= HF_SERIAL_DECODE_SINCE


def _host_op_s(backend: str, tp: int, kind: str) -> float:
    """Host seconds per operator: DTensor's under tensor parallelism (native training, transformers
    always), transformers' or the native decoder's otherwise."""
    if tp > 1 and (backend == "hf" or kind == "training"):
        return DTENSOR_HOST_OP_S[kind]
    return HF_HOST_OP_S if backend == "hf" and kind == "inference" else HOST_OP_S[kind]


def _bound(device_s: float, host_s: float, communication_s: float) -> str:
    return max((("device", device_s), ("host", host_s), ("communication", communication_s)),
               key=lambda item: item[1])[0]


def step_run(spec, decoding: dict | None = None) -> StepRun:
    """How ``spec`` (a ``fitbench.spec.RunSpec``) runs its steps: a measured row's ``decoding`` (the
    worker's ``decode`` field) says how its generation decoded; without one, as the worker would on a
    GPU (``decode_kind``)."""
    if spec.mode != "infer":
        return StepRun(spec.backend, spec.compile)
    if decoding is not None:
        decode = "eager" if not decoding.get("cuda_graphs") else "compiled" if decoding.get("compiled") else "graph"
    else:
        decode = decode_kind(spec.backend, spec.precision, offloaded=spec.offload,
                             compiled=spec.compile, cuda_graphs=spec.cuda_graphs, compile_decode=spec.compile_decode)
    one_shot = spec.symmetric_memory and spec.one_shot_applies and decode == "compiled"
    return StepRun(spec.backend, spec.compile, decode, one_shot=one_shot)


def decode_kind(backend: str, precision: str, *, offloaded: bool = False, compiled: bool = False,
                cuda_graphs: bool = True, compile_decode: bool = True) -> str:
    """How a generation's decode steps run on a GPU: transformers' models eagerly, and the native
    decoder eagerly when offloaded, under ``--compile``, without CUDA graphs or where the precision's
    kernels cannot be captured (``graph_problem``); else the compiled step in a graph (under tensor
    parallelism too, its collectives inside the graph; over pipeline stages each stage's step, the
    sends between stages outside: ``fitbench.worker.stage_graph``) unless ``compile_decode`` is off."""
    if backend == "hf" or offloaded or compiled or not cuda_graphs or entry(precision).graph_problem:
        return "eager"
    return "compiled" if compile_decode else "graph"


def forecast_spec(arch: Architecture, spec, gpu_name: str, ceiling: Ceilings, *, run: StepRun,
                  offloaded_bytes: float = 0.0, links: BusBandwidth | None = None,
                  nodes: Nodes | None = None) -> Forecast:
    """``forecast_step_time`` of a ``fitbench.spec.RunSpec`` on its layout."""
    parallelism = Parallelism(layout=spec.layout, offload=spec.fsdp_offload, microbatches=spec.microbatches)
    return forecast_step_time(arch, spec.mode, spec.precision, spec.batch_size, spec.seq_len,
                              new_tokens=spec.new_tokens, parallelism=parallelism, gpu_name=gpu_name,
                              ceiling=ceiling, run=run, activation_checkpointing=spec.activation_checkpointing,
                              checkpointed_layers=spec.checkpointed_layers,
                              offloaded_bytes=offloaded_bytes, links=links, nodes=nodes)
