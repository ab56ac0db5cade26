"""Roofline step time, to rank candidate plans and to show next to the measured time.

The model, its terms and their sources: docs/planning.md, "The roofline bound".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fitbench.hardware.datasheet import peak_bandwidth, peak_flops
from fitbench.models.architecture import Architecture
from fitbench.planning.collectives import ONE_SHOT_LATENCY_S, PCIE_BANDWIDTH, BusBandwidth, bus_bandwidth
from fitbench.planning.sharding import Parallelism
from fitbench.planning.terms import Widths
from fitbench.planning.weights import adapter_params, layer_matmul_params, quantized_layer_bytes
from fitbench.planning.nodes import AcrossNodes, Nodes, layout_links
from fitbench.precisions import ADAPTERS, entry
from fitbench.spec import ONE_SHOT_BYTES, checkpointed_count, pipeline_stages

# Host-to-GPU bandwidth per direction, bytes/s: PCIe Gen5 x16 on Hopper ("PCIe Gen5: 128 GB/s", both
# directions, NVIDIA H100 and H200 datasheets); other GPUs PCIe Gen4 x16 (A100 datasheet: 64 GB/s).
HOST_LINK_BANDWIDTH = {
    "NVIDIA H100 80GB HBM3": 64e9,
    "NVIDIA H100 PCIe": 64e9,
    "NVIDIA H100 NVL": 64e9,
    "NVIDIA H200": 64e9,
    "NVIDIA H200 NVL": 64e9,
}


# DDP's default bucket size, bytes: bucket_cap_mb = 25 (torch ``DistributedDataParallel``).
DDP_BUCKET_BYTES = 25 * 1024**2


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
    if entry(precision).quantized:
        layers = quantized_layer_bytes(arch, entry(precision).storage) * arch.num_layers
        return layers + 2 * (arch.total_params - layer_matmul_params(arch) * arch.num_layers)
    return Widths.of(precision).weights * arch.total_params


def recomputed_share(n_layers: int, stages: int, checkpointed_layers: int | None) -> float:
    """The share of the busiest pipeline stage's layers (the whole model's without stages) that
    recompute their forward under activation checkpointing of ``checkpointed_layers`` per stage
    (``fitbench.spec.checkpointed_count``; every layer when None): C / layers, 1 for every layer. The
    recomputation costs that share of one forward pass of the layers."""
    busiest = max(len(layers) for layers in pipeline_stages(n_layers, stages))
    return checkpointed_count(busiest, checkpointed_layers) / busiest


def estimate_step_time(arch: Architecture, mode: str, precision: str, batch: int, seq_len: int, *,
                       new_tokens: int, parallelism: Parallelism, gpu_name: str,
                       activation_checkpointing: bool = False, checkpointed_layers: int | None = None,
                       offloaded_bytes: float = 0.0, whole_cache: bool = True, links: BusBandwidth | None = None,
                       nodes: Nodes | None = None) -> StepTime:
    """The roofline time of one step (one decode step in infer); ``offloaded_bytes`` of weights
    cross the host link each forward pass; with ``activation_checkpointing``, ``checkpointed_layers``
    of each stage recompute (every layer when None: ``recomputed_share``). ``whole_cache``: decoding
    attends over every slot of the preallocated KV cache, as a GPU run's CUDA graph does; offloaded
    layers decode eagerly, over the positions so far. ``links``: the collectives' bandwidths and latencies inside a node
    (``bus_bandwidth``; by default the interconnect's); ``nodes``: the job's nodes and the link between
    them, where it spans several (``fitbench.planning.nodes``)."""
    peak = peak_flops(gpu_name, entry(precision).peak_kind(mode)) or peak_flops(gpu_name, "bf16")
    bandwidth = peak_bandwidth(gpu_name)
    if not peak or not bandwidth:
        raise ValueError(f"no datasheet figures for {gpu_name!r}")
    paths = layout_links(parallelism.layout, links or bus_bandwidth(gpu_name), nodes)
    tp, stages = parallelism.tensor, parallelism.stages
    data_parallel = parallelism.layout.data_parallel
    g = data_parallel  # the ranks the data-parallel collectives span
    widths = Widths.of(precision)
    weight_bytes = _weight_bytes(arch, precision)
    n = batch * seq_len  # tokens per data-parallel rank
    # The largest stage's share of the layers sets a pipeline's pace.
    share = max(len(layers) for layers in pipeline_stages(arch.num_layers, stages)) / arch.num_layers

    if mode == "infer":
        positions = seq_len + new_tokens if whole_cache and not offloaded_bytes else seq_len + new_tokens / 2
        cache = arch.kv_cache_bytes_per_token(widths.compute) * batch * positions
        memory_s = (_decode_weight_bytes(arch, precision, batch) + cache) / (tp * bandwidth)  # stages in turn
        compute_s = 2 * batch * arch.matmul_params / (peak * tp)
        communication_s = tensor_parallel_decode_s(arch, batch, widths.compute, tp, paths.tensor)
        communication_s += paths.sends_s(batch * arch.hidden_size * widths.compute, stages, 1)
        communication_s += offloaded_bytes / HOST_LINK_BANDWIDTH.get(gpu_name, PCIE_BANDWIDTH)
        seconds = max(compute_s, memory_s) + communication_s
        tokens_per_s = batch * data_parallel / seconds
    else:
        # Recomputing activations repeats the forward pass: 4 forward-passes' worth instead of 3 where every
        # layer recomputes, 3 + C / layers where the first C of each stage do.
        recomputed = recomputed_share(arch.num_layers, stages, checkpointed_layers) if activation_checkpointing \
            else 0.0
        passes = 1 if mode == "forward" else 3 + recomputed
        per_token = arch.forward_flops_per_token(seq_len) * passes
        adapters = mode != "forward" and entry(precision).training == ADAPTERS
        if adapters:  # no weight gradients for the frozen base: 2 N fewer per token
            per_token += arch.adapter_train_flops_per_token(seq_len, adapter_params(arch)) - \
                arch.train_flops_per_token(seq_len)
        compute_s = n * per_token * share / (peak * tp)
        reads = 1 if mode == "forward" else 3
        optimizer_bytes = 4 * widths.weights * arch.total_params if mode == "train" and not adapters else 0
        # Every FSDP rank reads the whole gathered model (16-bit under its mixed precision); its
        # optimizer touches only its shard.
        fsdp = parallelism.shards > 1
        gathered = weight_bytes if entry(precision).quantized or not fsdp else widths.compute * arch.total_params
        shards = parallelism.shards
        memory_s = (reads * gathered + optimizer_bytes / shards) * share / (bandwidth * tp)
        directions = 1 if mode == "forward" else 2
        activation = n * arch.hidden_size * widths.compute
        layers = round(share * arch.num_layers)
        communication_s = tensor_parallel_pass_s(activation, layers, directions, tp, paths.tensor)
        training = mode != "forward"
        microbatches = parallelism.microbatches_of(batch) if training else 1
        communication_s += paths.sends_s(activation / microbatches, stages, directions)
        if parallelism.offload:
            offloaded_bytes += (1 if mode == "forward" else 3) * widths.weights * arch.total_params / g
        communication_s += offloaded_bytes / HOST_LINK_BANDWIDTH.get(gpu_name, PCIE_BANDWIDTH)
        step_s = max(compute_s, memory_s) / (1 - (bubble_fraction(stages, microbatches) if training else 0.0))
        exposed_s = communication_s  # tensor parallel's, the stages' and the host link's: nothing to hide behind
        if g > 1:
            gradient_bytes = 4 * adapter_params(arch) if adapters else widths.weights * arch.total_params
            # under FSDP x TP each rank gathers, and reduces, its tensor-parallel share
            collectives_s, step_s = _data_parallel_step(arch, mode, parallelism, paths.data, step_s, passes,
                                                        gathered / tp, gradient_bytes / tp, widths, adapters)
            communication_s += collectives_s
        seconds = step_s + exposed_s
        tokens_per_s = n * data_parallel / seconds
    bound = max((("compute", compute_s), ("memory", memory_s), ("communication", communication_s)),
                key=lambda item: item[1])[0]
    return StepTime(seconds, compute_s, memory_s, communication_s, bound, tokens_per_s)


def tensor_parallel_decode_s(arch: Architecture, batch: int, compute_width: int, tp: int,
                             links: BusBandwidth, one_shot: bool = False) -> float:
    """One decode step's tensor-parallel collectives over ``tp`` ranks (``fitbench.worker.tensor_parallel``):
    2 L + 1 all-reduces of the batch's activations, B x h x c bytes each (two per layer, after the
    row-wise attention output and MLP down projections, and the embedding's, each rank holding a slice of
    the vocabulary's rows), and the all-gather of the logits, B x V x c bytes, each rank computing its
    columns of them. At batch 1 each message is a few kB: their latency, not their bytes, sets the
    time (``fitbench.planning.collectives``). ``one_shot``: the layers' 2 L, where each is at most
    ``ONE_SHOT_BYTES``, go through symmetric memory, each ``ONE_SHOT_LATENCY_S`` plus its peers' g - 1
    partial sums read over the link; the embedding's stays NCCL's."""
    if tp <= 1:
        return 0.0
    all_reduces = 2 * arch.num_layers + 1
    activation = batch * arch.hidden_size * compute_width
    gather_s = links.all_gather_s(batch * arch.vocab_size * compute_width, tp)
    if one_shot and activation <= ONE_SHOT_BYTES:
        layers = 2 * arch.num_layers
        return layers * (ONE_SHOT_LATENCY_S + (tp - 1) * activation / links.all_reduce) + \
            links.all_reduce_s(activation, tp) + gather_s
    return links.all_reduce_s(all_reduces * activation, tp, messages=all_reduces) + gather_s


def tensor_parallel_pass_s(activation: float, layers: int, directions: int, tp: int, links: BusBandwidth) -> float:
    """A training or forward step's tensor-parallel all-reduces over ``tp`` ranks: two per layer and
    direction (forward; backward, the gradients of the column-wise inputs), ``activation`` bytes each
    (B x T x h x c); nothing on one rank."""
    messages = directions * 2 * layers
    return links.all_reduce_s(messages * activation, tp, messages=messages)


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of a pipeline's training step that a stage idles, ``(p - 1) / (m + p - 1)`` for p
    stages and m microbatches under GPipe or 1F1B: the fill and the drain."""
    return (stages - 1) / (microbatches + stages - 1)


def _data_parallel_step(arch: Architecture, mode: str, parallelism: Parallelism, links: BusBandwidth | AcrossNodes,
                        busy: float, passes: int, gathered: float, gradient_bytes: float, widths: Widths,
                        adapters: bool) -> tuple[float, float]:
    """The collectives' time and the step's under DDP or FSDP (the module docstring): ``busy`` the
    step's compute-or-memory time, a ``1 / passes`` share of it the forward pass; ``gathered`` the
    bytes of the whole model as the ranks compute with it, ``gradient_bytes`` of its gradients."""
    g, V, h, L = parallelism.layout.data_parallel, arch.vocab_size, arch.hidden_size, arch.num_layers
    forward_s = busy / passes
    backward_s = busy - forward_s
    training = mode != "forward"
    if parallelism.shards == 1:
        if not training:
            return 0.0, busy
        buckets = max(1, math.ceil(gradient_bytes / DDP_BUCKET_BYTES))
        total = links.all_reduce_s(gradient_bytes, g, messages=buckets)
        last_bucket = min(gradient_bytes, max(0 if adapters else widths.weights * V * h, DDP_BUCKET_BYTES))
        exposed = links.all_reduce_s(last_bucket, g)
        return total, forward_s + max(backward_s, total - exposed) + exposed
    # one message per unit and pass: the root's and each layer's
    share = gathered / arch.total_params  # bytes per parameter, as gathered
    root = arch.total_params - arch.params_per_layer * L
    gather_forward = links.all_gather_s(gathered, g, messages=L + 1)
    first_units = links.all_gather_s(share * (root + arch.params_per_layer), g, messages=2)
    seconds = max(forward_s, gather_forward - first_units) + first_units
    total = gather_forward
    if training:
        gather_backward = links.all_gather_s(gathered - share * root, g, messages=L)
        reduce = links.reduce_scatter_s(gradient_bytes, g, messages=L + 1)
        root_reduce = links.reduce_scatter_s(0 if adapters else widths.weights * root, g)
        seconds += max(backward_s, gather_backward + reduce - root_reduce) + root_reduce
        total += gather_backward + reduce
    return total, seconds


def _decode_weight_bytes(arch: Architecture, precision: str, batch: int) -> float:
    """The weights one decode step of ``batch`` sequences reads (``fitbench.worker.weight_bytes.decode_weight_bytes``
    measures the same on the built model): all of them, but of each lookup table that the output
    projection does not share one row per sequence (tokens) or one row (GPT-2's positions, shared by
    the batch); under autocast, each matmul's weights and biases (all parameters but the tables and
    norms) are re-cast every step, a 16-bit copy written and read beside the fp32 read. Quantized
    matrices are read once as stored: the least a step moves, what a compiled step (the default) reads,
    inductor fusing the dequantization into the matmul; an eager step's dequantized copies are the
    speed forecast's (``fitbench.precisions.DecodeFormat.dequantized``)."""
    widths = Widths.of(precision)
    table_width = 2 if entry(precision).quantized else widths.weights  # quantization leaves the tables bf16
    token_table = 0 if arch.tie_embeddings else arch.vocab_size * arch.hidden_size
    position_table = arch.embedding_params - arch.vocab_size * arch.hidden_size
    rows = (0 if arch.tie_embeddings else batch) + (1 if position_table else 0)
    touched = _weight_bytes(arch, precision) - table_width * (token_table + position_table - rows * arch.hidden_size)
    if widths.autocast:
        norms = arch.num_layers * arch.norm_params_per_layer + arch.final_norm_params
        touched += 2 * widths.compute * (arch.matmul_params - norms)
    return touched
