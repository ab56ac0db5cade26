"""Building the model of an assignment on this rank's devices: per backend and per pipeline stage, the
weights made layer by layer where a quantized build needs it, then converted as the precision's
record says (quantization, float8 training, low-rank adapters). A layout that does not compose is
refused before anything is built. Parallelism and the techniques that wrap the built model follow in
``fitbench.worker.parallelize``; nothing here applies them, but a native model's tensor-parallel cut,
which must happen on the meta device, before its weights get storage (``tensor_parallel_cut``).

- one process: ``fitbench.models.backends.load_model``, or either backend's model quantized layer by
  layer, from a checkpoint too (``fitbench.worker.quantize``), or offloaded (``build_offload``);
- pipeline stages: the native model's ranks each build their stage (``build_pipelined``), transformers'
  stages are one process over every GPU (``fitbench.worker.hf_pipeline``);
- tensor parallelism of the native model: each rank builds only its shards (``build_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fitbench.models.architecture import Architecture
from fitbench.models.backends import DECODE_TUNING, CausalLM, HuggingFaceLM, NativeLM, load_model
from fitbench.models.hf import has_weights
from fitbench.models.native import NativeCausalLM
from fitbench.models.offload import Offload, build_offloaded
from fitbench.models.registry import is_local_model
from fitbench.precisions import ADAPTER_ALPHA, ADAPTER_RANK, FLOAT8, TRAINING_MODES, PrecisionPolicy, entry
from fitbench.worker.adapters import add_adapters
from fitbench.worker.hf_pipeline import StagedHuggingFaceLM, build_staged, stage_devices
from fitbench.worker.loops import random_tokens
from fitbench.worker.parallelize import DRAWN_PER_RANK, local_shards, tensor_parallel_cut
from fitbench.worker.pipeline import PipelineLM
from fitbench.worker.quality import Quality
from fitbench.worker.quantize import Carried, build_quantized_native
from fitbench.worker.quantize.hf_layers import build_quantized_hf
from fitbench.worker.quantize.torchao import float8_training
from fitbench.worker.ranks import Rank
from fitbench.worker.stages import build_stage, prune
from fitbench.worker.tensor_parallel import device_mesh, small_all_reduces, tensor_mesh
from fitbench.spec import Assignment, Layout, RunSpec, Stage, microbatch_problem

PROBE_TOKENS = 64  # the sequence on which quantized weights are compared with bf16


class RefusedError(Exception):
    """This hardware cannot run the configuration; nothing was attempted."""


def checkpoint_of(model_path: str | None) -> Path | None:
    """The directory ``model_path`` when it holds a checkpoint, else None (random weights)."""
    return Path(model_path) if model_path is not None and has_weights(model_path) else None


def checkpoint_directory(spec: RunSpec) -> Path | None:
    """The directory the weights are loaded from, or None when they are random (a preset, a hub id,
    a directory with a config and no weights)."""
    checkpoint = checkpoint_of(spec.model if is_local_model(spec.model) else None)
    return checkpoint.resolve() if checkpoint is not None else None


@dataclass(frozen=True)
class Built:
    """A model ready to run; the quality of quantized weights against bf16; what a training step
    updates when it is not every weight; for offload, where the layers went."""

    lm: CausalLM
    quality: Quality | None = None
    training: dict | None = None
    adapter_params: int | None = None
    offload: Offload | None = None
    mesh: Any = None  # tensor parallelism's device mesh, and what it applied
    parallel: dict | None = None


def decoding_as_asked(lm, spec: RunSpec):
    """``lm`` compiling its decode step, and tuning it, as ``spec`` asks, where it is the native backend's
    (one model or a pipeline stage)."""
    if isinstance(lm, (NativeLM, PipelineLM)):
        lm.compile_decode = spec.compile_decode
        lm.decode_options = DECODE_TUNING if spec.decode_tuning else {}
    return lm


def build(assignment: Assignment, arch, policy, device: torch.device, scratch: Path,
          rank: Rank | None = None) -> Built:
    """The model of the assignment, or with pipeline stages this ``rank``'s stage of it. A layout that
    does not compose (an assignment not made by the sweep, which refuses it first) is refused before
    anything is built."""
    spec = assignment.spec
    problem = spec.layout.problem(arch, spec.mode, spec.precision, spec.backend, spec.offload)
    if problem:
        raise RefusedError(problem)
    model_path = spec.model if is_local_model(spec.model) else None
    if spec.layer_offload:
        return build_offload(assignment, arch, policy, device, scratch, model_path)
    if spec.layout.pp > 1:
        return build_stage_of_rank(spec, arch, policy, device, rank, model_path)
    if spec.layout.tp > 1 and spec.backend == "native":
        return build_shards(spec, arch, policy, rank, model_path)
    if not policy.quantized:
        lm = load_model(arch, spec.backend, device, policy.weight_dtype, model_path=model_path,
                        compute_dtype=policy.compute_dtype, cuda_graphs=spec.cuda_graphs)
        return Built(decoding_as_asked(lm, spec))
    return build_converted(spec, arch, policy, device, model_path)


def build_stage_of_rank(spec: RunSpec, arch, policy, device: torch.device, rank: Rank,
                        model_path: str | None) -> Built:
    """This rank's pipeline stage: transformers' stages all in this one process, over a GPU each
    (``fitbench.worker.hf_pipeline``), or the native model's stage of this rank (``build_pipelined``)."""
    problem = entry(spec.precision).hardware_problem(device.type, torch.cuda.get_device_capability(device)
                                                     if device.type == "cuda" else None)
    if problem:
        raise RefusedError(problem)
    probe = random_tokens(arch.vocab_size, 1, min(spec.seq_len, PROBE_TOKENS), device, spec.seed + 1)
    if spec.backend == "hf":
        devices = stage_devices(device, spec.layout.pp)
        checkpoint = checkpoint_of(model_path)
        if policy.quantized:
            module, _, quality = build_quantized_hf(arch, devices, spec.precision, probe, checkpoint=checkpoint)
            return Built(StagedHuggingFaceLM(module, True, devices, checkpoint is not None), quality)
        module, _ = build_staged(arch, devices, policy.weight_dtype, weights_dir=model_path)
        return Built(StagedHuggingFaceLM(module, policy.compute_dtype == policy.weight_dtype, devices,
                                         checkpoint is not None))
    lm, quality = build_pipelined(spec, arch, policy, rank, probe if policy.quantized else None)
    return Built(decoding_as_asked(lm, spec), quality)


def build_shards(spec: RunSpec, arch, policy, rank: Rank, model_path: str | None) -> Built:
    """This rank's tensor-parallel shards of the native model (``build_layout``), with its device mesh
    and what the cut applied, which ``fitbench.worker.parallelize`` records."""
    if model_path is not None and has_weights(model_path):
        raise ValueError(f"tensor-parallel ranks draw random weights shard by shard; {model_path} holds a "
                         f"checkpoint, which they do not load: run it without --strategy tp")
    lm, mesh, applied = build_layout(arch, spec.layout, policy, spec.mode, spec.seq_len, rank,
                                     cuda_graphs=spec.cuda_graphs)
    applied |= small_all_reduces(spec, tensor_mesh(mesh).get_group(), rank.device)
    # generation compiles its step as on one GPU: the all-reduces trace into the layer's graph; the
    # prefill, whose host launches outlast a quarter of its GPU work, replays a graph too
    lm.graph_prefill = True
    return Built(decoding_as_asked(lm, spec), mesh=mesh, parallel=applied)


def build_converted(spec: RunSpec, arch, policy, device: torch.device, model_path: str | None) -> Built:
    """One process's model in a precision its build converts, as the precision's record says: float8
    training's matmuls (``fitbench.worker.quantize.torchao.float8_training``); quantized weights, made
    and quantized layer by layer, random or read from a checkpoint directory as each layer is made
    (the native model: ``fitbench.worker.quantize``; transformers': its ``hf_layers``), with their
    quality against bf16; then, to train a quantized base, low-rank adapters
    (``fitbench.worker.adapters``). Refused where the device or the mode cannot run it."""
    precision = entry(spec.precision)
    problem = precision.hardware_problem(device.type,
                                         torch.cuda.get_device_capability(device) if device.type == "cuda" else None)
    training = spec.mode in TRAINING_MODES
    problem = problem or (precision.training_problem if training else None)
    if problem:
        raise RefusedError(problem)
    if training and precision.training == FLOAT8:
        lm = load_model(arch, spec.backend, device, policy.weight_dtype, model_path=model_path, fused=False)
        converted = float8_training(lm.module)
        return Built(lm, training={"method": f"every weight, bf16 with AdamW in bf16; {converted} matmuls in float8 "
                                             f"(torchao float8 training, row-wise scales)",
                                   "trainable_params": sum(p.numel() for p in lm.module.parameters())})
    probe = random_tokens(arch.vocab_size, 1, min(spec.seq_len, PROBE_TOKENS), device, spec.seed + 1)
    checkpoint = checkpoint_of(model_path)
    if spec.backend == "native":
        module, quality = build_quantized_native(arch, device, spec.precision, probe, checkpoint=checkpoint)
        lm = NativeLM(module, cache_dtype=policy.compute_dtype, cuda_graphs=spec.cuda_graphs,
                      graph_problem=precision.graph_problem)
    else:
        module, _, quality = build_quantized_hf(arch, [str(device)], spec.precision, probe, checkpoint=checkpoint)
        lm = HuggingFaceLM(module, static_cache=True)
    decoding_as_asked(lm, spec)  # quantized too: inductor fuses the dequantization into the matmul's loads
    if not training:
        return Built(lm, quality)
    adapters = add_adapters(lm.module, device)
    return Built(lm, quality, adapter_params=adapters,
                 training={"method": f"low-rank adapters only (rank {ADAPTER_RANK}, alpha {ADAPTER_ALPHA}, fp32, on "
                                     f"every matmul of every layer); the {spec.precision} base, embeddings and "
                                     f"output projection are frozen",
                           "trainable_params": adapters})


def build_offload(assignment: Assignment, arch, policy, device: torch.device, scratch: Path,
                  model_path: str | None) -> Built:
    """The native model with the decoder layers the device has no room for offloaded
    (``fitbench.models.offload``). The room is the assignment's ``offload_layer_memory``, the
    planner's split of the device's memory (``fitbench.launch.orders``). Decoding stays eager: the
    offloaded layers stream in through accelerate's hooks, host-to-device copies a CUDA graph cannot
    replay."""
    import psutil

    if assignment.offload_layer_memory is None:
        raise ValueError("an offloaded run needs the room for its layers (Assignment.offload_layer_memory), "
                         "which the launcher computes")
    if model_path is not None and has_weights(model_path):
        raise RefusedError(f"offload builds random weights layer by layer; {model_path} holds a checkpoint, "
                           f"which it does not stream: run it without --offload")
    host = float(psutil.virtual_memory().available)
    module, offload = build_offloaded(arch, device, policy.weight_dtype, assignment.offload_layer_memory, host,
                                      scratch / "offload")
    lm = NativeLM(module, cache_dtype=policy.compute_dtype)
    lm.decode_eagerly("offloaded layers stream in through accelerate's hooks: host-to-device copies a CUDA graph "
                      "cannot replay")
    return Built(lm, offload=offload)


def build_tensor_parallel(arch, stage: Stage, mesh, device: torch.device | str, dtype: torch.dtype, *,
                          sequence_parallel: bool = False,
                          inference: bool = False) -> tuple[NativeCausalLM, dict[str, Any]]:
    """This rank's shards of ``stage``'s modules (the whole model when ``stage`` is the only one),
    sharded over ``mesh`` (the "tp" ranks) with the weights of the single-process build of the same
    seed, and what was applied (``fitbench.worker.tensor_parallel``: no rank holds more than its shards
    and one whole weight of scratch). ``inference``: local shards with explicit collectives, for a
    model that computes no gradients (``fitbench.worker.tensor_parallel.parallelize_tensor``)."""
    applied: dict[str, Any] = {}
    cut = tensor_parallel_cut(mesh, device, applied, sequence_parallel=sequence_parallel, inference=inference)
    model = build_stage(arch, stage, device, dtype, shard=cut)
    if inference:
        local_shards(model, applied)
    return model, {**applied, "initial_weights": DRAWN_PER_RANK}


def build_layout(arch, layout: Layout, policy: PrecisionPolicy, mode: str, seq_len: int, rank: Rank, *,
                 cuda_graphs: bool = False) -> tuple[NativeLM, Any, dict[str, Any]]:
    """This rank's tensor-parallel model of ``layout`` (TP alone or under FSDP), its mesh and what was
    applied. Sequence parallelism is on in training (train, forward-backward) where ``seq_len``
    divides by the degree and positions are rotary: it is there that the norms' and residuals'
    activations are kept for a backward pass (learned positions are added to the whole sequence). Inference and ``forward`` without FSDP run on local shards
    (``fitbench.worker.tensor_parallel``)."""
    problem = layout.problem(arch, mode, policy.name, "native")
    if problem:
        raise ValueError(problem)
    mesh = device_mesh(layout, rank.device.type)
    training = mode in TRAINING_MODES
    sequence_parallel = training and seq_len % layout.tp == 0 and arch.position_embeddings == "rotary"
    module, applied = build_tensor_parallel(arch, Stage.of(arch.num_layers, 0, 1), tensor_mesh(mesh), rank.device,
                                            policy.weight_dtype, sequence_parallel=sequence_parallel,
                                            inference=not training and layout.dp_shard == 1)
    return NativeLM(module, cache_dtype=policy.compute_dtype, cuda_graphs=cuda_graphs), mesh, applied


def build_pipelined(spec: RunSpec, arch: Architecture, policy: PrecisionPolicy, rank: Rank,
                    probe: torch.Tensor | None = None) -> tuple[PipelineLM, Quality | None]:
    """This rank's stage of ``spec``'s model, ready to run. Quantized weights are built, quantized and
    packed layer by layer on the stage's device (``fitbench.worker.quantize.build_quantized_native`` over
    the stage's layers), random or read from the model's checkpoint directory, the ``probe``'s hidden
    states passing from stage to stage, and their quality against bf16 comes back on the last stage
    (None on the others, and for float weights). Floating-point stages draw random weights: a
    checkpoint is refused there."""
    problem = spec.layout.problem(arch, spec.mode, spec.precision, spec.backend)
    if spec.mode in TRAINING_MODES:
        problem = problem or microbatch_problem(spec.batch_size, spec.pipeline_microbatches)
    checkpoint = checkpoint_directory(spec)
    if checkpoint is not None and not (policy.quantized and spec.layout.tp == 1):
        problem = problem or (f"pipeline stages in floating point, or with --tp, draw random weights stage by "
                              f"stage; {spec.model} holds a checkpoint, which they do not load: run it without "
                              f"--strategy pipeline, or its stages in a quantized precision without --tp")
    if problem:
        raise ValueError(problem)
    tp = spec.layout.tp
    stages = spec.layout.pp
    graphs = {"cuda_graphs": spec.cuda_graphs, "graph_problem": entry(spec.precision).graph_problem}
    stage = Stage.of(arch.num_layers, rank.rank // tp, stages)
    if tp > 1:
        mesh = device_mesh(spec.layout, rank.device.type)
        module, applied = build_tensor_parallel(arch, stage, tensor_mesh(mesh), rank.device, policy.weight_dtype,
                                                inference=True)
        applied |= small_all_reduces(spec, tensor_mesh(mesh).get_group(), rank.device)
        return PipelineLM(module, stage, rank, cache_dtype=policy.compute_dtype, hidden_dtype=policy.weight_dtype,
                          tp=tp, stage_group=mesh["pp"].get_group(), tensor_parallel=applied, **graphs), None
    if not policy.quantized:
        module = build_stage(arch, stage, rank.device, policy.weight_dtype)
        return PipelineLM(module, stage, rank, cache_dtype=policy.compute_dtype, hidden_dtype=policy.weight_dtype,
                          **graphs), None
    shape = (probe.shape[0], probe.shape[1], arch.hidden_size)

    def receive() -> Carried:
        reference, quantized = (torch.empty(shape, dtype=policy.compute_dtype, device=rank.device)
                                for _ in range(2))
        dist.recv(reference, src=rank.rank - 1)
        dist.recv(quantized, src=rank.rank - 1)
        errors: list = [None]
        dist.recv_object_list(errors, src=rank.rank - 1)
        return reference, quantized, errors[0]

    def send(carried: Carried) -> None:
        reference, quantized, errors = carried
        dist.send(reference.to(policy.compute_dtype).contiguous(), dst=rank.rank + 1)
        dist.send(quantized.to(policy.compute_dtype).contiguous(), dst=rank.rank + 1)
        dist.send_object_list([errors], dst=rank.rank + 1)

    module, quality = build_quantized_native(arch, rank.device, spec.precision, probe, stage.layers, receive, send,
                                             checkpoint=checkpoint)
    prune(module, stage)
    return PipelineLM(module, stage, rank, cache_dtype=policy.compute_dtype, hidden_dtype=policy.weight_dtype,
                      from_checkpoint=checkpoint is not None, **graphs), quality
