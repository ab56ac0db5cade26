"""Roofline step time, to rank candidate plans and to show next to the measured time.

Each step is bounded below by its arithmetic and its memory traffic on one GPU, plus the
communication that cannot overlap, over the GPU-to-GPU link (Williams et al. 2009 for the
roofline; the collective volumes are the ring algorithms' ``2 (g - 1) / g`` for all-reduce and
``(g - 1) / g`` for all-gather and reduce-scatter):

    t = max(FLOPs per GPU / peak FLOP/s, bytes per GPU / bandwidth) + communication / link bandwidth

- training step: ``6 N + 12 L H Q T`` FLOPs per token (PaLM), ``8 N + 16 L H Q T`` with activation
  checkpointing, which runs the forward pass twice; memory traffic of reading the weights
  three times (forward, two backward matmuls) and the optimizer's read-modify-write of weights,
  gradients and both moments;
- forward: ``2 N + 4 L H Q T`` FLOPs per token; decode: per step, for the whole batch, one read of
  the weights the step touches (``_decode_weight_bytes``) and of the KV cache it attends over:
  every slot of the preallocated cache (``T + new_tokens``), as the native backend's CUDA graph
  reads it, or the positions so far (``T + new_tokens / 2`` on average) in eager decoding, as
  ``fitbench.run.metrics`` counts them; so batch 1 decoding sits on the bandwidth roof;
- data parallel: gradients all-reduced (DDP) or weights all-gathered twice and gradients
  reduce-scattered (FSDP); tensor parallel: two all-reduces of the activations per layer in the
  forward pass and two in the backward; pipeline: one micro-batch per step crosses the stages one
  after another, ``(M + S - 1) / M`` stage-times for M micro-batches and S stages;
- offload: the offloaded layers' weights cross the host link (PCIe) once per forward pass (each
  decode step, the prefill, a forward step), copied synchronously before each layer runs, so the
  time ``offloaded bytes / host-link bandwidth`` adds to the step like communication.

It is an optimistic bound, never a forecast of the achieved time: fitbench prints it beside the
measured time so its error is visible.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitbench import hardware
from fitbench.models.architecture import Architecture
from fitbench.plan.memory import (ADAPTER_BASES, QUANTIZED, Parallelism, Widths, adapter_params, layer_matmul_params,
                                  quantized_layer_bytes)
from fitbench.precisions import peak_kind

# GPU-to-GPU bandwidth per direction, bytes/s. NVLink 4 (H100/H200 SXM): 900 GB/s both directions
# (NVIDIA H100 datasheet); NVLink 3 (A100 SXM): 600 GB/s; PCIe Gen5 x16: 64 GB/s, Gen4: 32 GB/s.
LINK_BANDWIDTH = {
    "NVIDIA H100 80GB HBM3": 450e9,
    "NVIDIA H200": 450e9,
    "NVIDIA A100-SXM4-80GB": 300e9,
    "NVIDIA A100-SXM4-40GB": 300e9,
    "NVIDIA H100 NVL": 300e9,
    "NVIDIA H200 NVL": 450e9,
}
PCIE_BANDWIDTH = 32e9

# Host-to-GPU bandwidth per direction, bytes/s: PCIe Gen5 x16 on Hopper ("PCIe Gen5: 128 GB/s", both
# directions, NVIDIA H100 and H200 datasheets); other GPUs PCIe Gen4 x16 (A100 datasheet: 64 GB/s).
HOST_LINK_BANDWIDTH = {
    "NVIDIA H100 80GB HBM3": 64e9,
    "NVIDIA H100 PCIe": 64e9,
    "NVIDIA H100 NVL": 64e9,
    "NVIDIA H200": 64e9,
    "NVIDIA H200 NVL": 64e9,
}


@dataclass(frozen=True)
class StepTime:
    seconds: float
    compute_s: float
    memory_s: float
    communication_s: float
    bound: str  # "compute", "memory" or "communication"
    tokens_per_s: float  # all GPUs together; for infer, decode tokens/s

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _weight_bytes(arch: Architecture, precision: str) -> float:
    if precision in QUANTIZED:
        layers = quantized_layer_bytes(arch, QUANTIZED[precision]) * arch.num_layers
        return layers + 2 * (arch.total_params - layer_matmul_params(arch) * arch.num_layers)
    return Widths.of(precision).weights * arch.total_params


def estimate_step_time(arch: Architecture, mode: str, precision: str, batch: int, seq_len: int, *,
                       new_tokens: int, parallelism: Parallelism, gpu_name: str,
                       activation_checkpointing: bool = False, offloaded_bytes: float = 0.0,
                       whole_cache: bool = True) -> StepTime:
    """The roofline time of one step (one decode step in infer); ``offloaded_bytes`` of weights
    cross the host link each forward pass. ``whole_cache``: decoding attends over every slot of the
    preallocated KV cache, as a GPU run's CUDA graph does; offloaded layers decode eagerly, over the
    positions so far."""
    peak = hardware.peak_flops(gpu_name, peak_kind(precision, mode)) or hardware.peak_flops(gpu_name, "bf16")
    bandwidth = hardware.peak_bandwidth(gpu_name)
    if not peak or not bandwidth:
        raise ValueError(f"no datasheet figures for {gpu_name!r}")
    link = LINK_BANDWIDTH.get(gpu_name, PCIE_BANDWIDTH)
    g, tp, stages = parallelism.gpus, parallelism.tensor, parallelism.stages
    data_parallel = g if parallelism.strategy in ("ddp", "fsdp") else 1
    widths = Widths.of(precision)
    weight_bytes = _weight_bytes(arch, precision)
    n = batch * seq_len  # tokens per data-parallel rank

    if mode == "infer":
        positions = seq_len + new_tokens if whole_cache and not offloaded_bytes else seq_len + new_tokens / 2
        cache = arch.kv_cache_bytes_per_token(widths.compute) * batch * positions
        step_bytes = (_decode_weight_bytes(arch, precision, batch) + cache) / (tp * stages)
        memory_s = step_bytes * stages / bandwidth  # stages decode one after another
        compute_s = 2 * batch * arch.matmul_params / (peak * tp)
        per_layer = 2 * (tp - 1) / tp * batch * arch.hidden_size * widths.compute
        communication_s = 2 * arch.num_layers * per_layer / link if tp > 1 else 0.0
        communication_s += offloaded_bytes / HOST_LINK_BANDWIDTH.get(gpu_name, PCIE_BANDWIDTH)
        seconds = max(compute_s, memory_s) + communication_s
        tokens_per_s = batch / seconds
    else:
        # Recomputing activations repeats the forward pass: 4 forward-passes' worth instead of 3.
        passes = 1 if mode == "forward" else (4 if activation_checkpointing else 3)
        per_token = arch.forward_flops_per_token(seq_len) * passes
        adapters = mode != "forward" and precision in ADAPTER_BASES
        if adapters:  # no weight gradients for the frozen base: 2 N fewer per token
            per_token += arch.adapter_train_flops_per_token(seq_len, adapter_params(arch)) - \
                arch.train_flops_per_token(seq_len)
        compute_s = n * per_token / (peak * tp * stages)
        reads = 1 if mode == "forward" else 3
        optimizer_bytes = 4 * widths.weights * arch.total_params if mode == "train" and not adapters else 0
        # Every FSDP rank reads the whole gathered model; its optimizer touches only its shard.
        shards = g if parallelism.strategy == "fsdp" else 1
        memory_s = (reads * weight_bytes + optimizer_bytes / shards) / (bandwidth * tp * stages)
        communication_s = 0.0
        if parallelism.strategy == "ddp" and mode != "forward":
            communication_s = 2 * (g - 1) / g * widths.weights * arch.total_params / link
        elif parallelism.strategy == "fsdp":
            gathers = 1 if mode == "forward" else 2
            communication_s = (gathers + (0 if mode == "forward" else 1)) * (g - 1) / g * weight_bytes / link
        elif tp > 1:
            directions = 1 if mode == "forward" else 2
            per_layer = 2 * 2 * (tp - 1) / tp * n * arch.hidden_size * widths.compute
            communication_s = directions * arch.num_layers * per_layer / link
        communication_s += offloaded_bytes / HOST_LINK_BANDWIDTH.get(gpu_name, PCIE_BANDWIDTH)
        # One micro-batch per step: it crosses the stages one after another, (M + S - 1) / M = S slots.
        microbatches = 1
        seconds = max(compute_s, memory_s) * (microbatches + stages - 1) / microbatches + communication_s
        tokens_per_s = n * data_parallel / seconds
    bound = max((("compute", compute_s), ("memory", memory_s), ("communication", communication_s)),
                key=lambda item: item[1])[0]
    return StepTime(seconds, compute_s, memory_s, communication_s, bound, tokens_per_s)


def _decode_weight_bytes(arch: Architecture, precision: str, batch: int) -> float:
    """The weights one decode step of ``batch`` sequences reads (``fitbench.run.worker.decode_weight_bytes``
    measures the same on the built model): all of them, but of each lookup table that the output
    projection does not share one row per sequence (tokens) or one row (GPT-2's positions, shared by
    the batch); under autocast, each matmul's weights and biases (all parameters but the tables and
    norms) are re-cast every step, a 16-bit copy written and read beside the fp32 read."""
    widths = Widths.of(precision)
    table_width = 2 if precision in QUANTIZED else widths.weights  # quantization leaves the tables bf16
    token_table = 0 if arch.tie_embeddings else arch.vocab_size * arch.hidden_size
    position_table = arch.embedding_params - arch.vocab_size * arch.hidden_size
    rows = (0 if arch.tie_embeddings else batch) + (1 if position_table else 0)
    touched = _weight_bytes(arch, precision) - table_width * (token_table + position_table - rows * arch.hidden_size)
    if widths.autocast:
        norms = arch.num_layers * arch.norm_params_per_layer + arch.final_norm_params
        touched += 2 * widths.compute * (arch.matmul_params - norms)
    return touched
