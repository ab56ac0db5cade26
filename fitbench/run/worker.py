"""One configuration in one process: build the model, warm up, measure, write the result.

Run as ``python -m fitbench.run.worker ASSIGNMENT.json RESULT.json``: the configuration
(``fitbench.spec.Assignment``) with the planner's figures it acts on, which the launcher computed;
the worker never plans. Progress goes to stdout as one
JSON object per line (the parent shows it as a live line); diagnostics go to stderr (the parent
keeps them in the run's log). The result file is written only at the end; a worker that dies
leaves none, and the parent records the death. Disk offload writes its layers into RESULT.json's
directory, which the parent makes for the run and removes after it, however the run ends.

Fault injection for tests: ``fitbench.util.inject``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from fitbench.hardware.ceilings import load_ceilings
from fitbench.hardware.datasheet import peak_bandwidth, peak_flops
from fitbench.hardware.devices import cpu_device_name
from fitbench.hardware.environment import environment
from fitbench.models.backends import DECODE_TUNING, CausalLM, NativeLM, load_model
from fitbench.models.hf import has_weights
from fitbench.models.offload import Offload, OffloadCapacityError, build_offloaded
from fitbench.models.registry import is_local_model, resolve
from fitbench.precisions import ADAPTER_ALPHA, ADAPTER_RANK, FLOAT8, TRAINING_MODES, entry
from fitbench.precisions import policy as precision_policy
from fitbench.results.row import Measurement
from fitbench.run.adapters import add_adapters
from fitbench.run.aggregate import combine
from fitbench.run.hf_pipeline import StagedHuggingFaceLM, build_staged, stage_devices
from fitbench.run.hf_tensor_parallel import parallelize_hf_layout
from fitbench.run.host_speed import host_launch_seconds
from fitbench.run.loops import generate, make_step, random_tokens, read_generation
from fitbench.run.metrics import inference_metrics, step_metrics
from fitbench.run.parallel import data_seed, parallelize
from fitbench.run.phases import PhaseLog, rank_result_path
from fitbench.run.pipeline import PipelineLM, build_pipelined
from fitbench.run.quality import Quality
from fitbench.run.quantize import build_quantized_native, quantize_built
from fitbench.run.quantize.torchao import float8_training
from fitbench.run.ranks import Rank, gather_json, process_group
from fitbench.run.retries import RetryCounter, retries_warning
from fitbench.run.sanity import Verdict, non_finite_figures, non_finite_steps, read, warmup_warning
from fitbench.run.snapshot import RECORDING_WARNING, recorded, recording
from fitbench.run.tensor_parallel import (build_layout, data_parallel_rank, parallelize_layout, small_all_reduces,
                                          tensor_mesh)
from fitbench.run.timing import DeviceClock, first_call_seconds, run_stages, time_steps
from fitbench.run.trackers import NvmlSampler, memory_report
from fitbench.spec import Assignment, RunSpec
from fitbench.util.inject import injected, injected_memory_limit, injected_value
from fitbench.util.processes import end_own_tree, rank_token, tie_to_parent
from fitbench.util.stats import SampleStats

EXIT_OK, EXIT_FAILED = 0, 3
PROBE_TOKENS = 64  # the sequence on which quantized weights are compared with bf16


# Only rank 0 of a torchrun job reports progress: one progress line per job.
_REPORTS_PROGRESS = {"on": True}


def emit(**event) -> None:
    if _REPORTS_PROGRESS["on"]:
        print(json.dumps(event), flush=True)


def inject_misbehaviour(spec: RunSpec) -> None:
    """FITBENCH_INJECT's ``orphan``, ``garbage`` and ``hang`` (module docstring)."""
    if injected("orphan", spec.model):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True,
                                 stdin=subprocess.DEVNULL)
        print(f"FITBENCH_INJECT: started process {child.pid} in its own session", file=sys.stderr, flush=True)
    if injected("garbage", spec.model):
        sys.stdout.buffer.write(b'[1, 2, 3]\n42\n\xff\xfe not UTF-8\n' + b"x" * (5 << 20) + b"\n")
        sys.stdout.flush()
    if injected("hang", spec.model):
        print(f"FITBENCH_INJECT: the worker of {spec.model} hangs", file=sys.stderr, flush=True)
        while True:
            time.sleep(60)


def raise_injected_out_of_memory(assignment: Assignment) -> None:
    spec, peak = assignment.spec, assignment.predicted_peak_bytes
    if injected("oom", spec.precision) and not spec.offload:
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected by FITBENCH_INJECT for {spec.precision})")
    limit = injected_memory_limit()
    if limit is not None and peak is not None:
        if peak > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected: predicted {peak:,.0f} B exceeds the "
                                              f"FITBENCH_INJECT limit of {limit:,.0f} B)")


def weight_storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter's data, counting what quantized weights keep beside it: the inner
    tensors of torchao's tensor subclasses, bitsandbytes' row scales and 4-bit block states; of a
    DTensor, this rank's shard. Each tensor counts its elements x their size once per address:
    tensors sharing one allocation (a layer packed by ``fitbench.run.packing``, bitsandbytes' ``CB``
    beside its weight) count apart."""
    seen: set[int] = set()

    def storage(tensor) -> int:
        if tensor is None:
            return 0
        if hasattr(tensor, "to_local"):  # a DTensor (tensor parallelism): this rank's shard
            return storage(tensor.to_local())
        if hasattr(type(tensor), "__tensor_flatten__"):
            names, _ = tensor.__tensor_flatten__()
            return sum(storage(getattr(tensor, name)) for name in names)
        if tensor.data_ptr() in seen:
            return 0
        seen.add(tensor.data_ptr())
        return tensor.numel() * tensor.element_size()

    total = 0
    for part in module.modules():
        # bitsandbytes' int8 layers move their row scales from the weight to the layer's state on
        # the first forward.
        total += storage(getattr(getattr(part, "state", None), "SCB", None))
    for parameter in module.parameters():
        total += storage(parameter) + storage(getattr(parameter, "SCB", None))
        state = getattr(parameter, "quant_state", None)
        if state is not None:
            total += storage(state.absmax) + storage(getattr(state, "code", None))
            nested = getattr(state, "state2", None)
            if nested is not None:
                total += storage(nested.absmax) + storage(nested.code)
    return total


def measure(assignment: Assignment, device: torch.device, scratch: Path, rank: Rank | None = None,
            phases: PhaseLog | None = None) -> dict:
    """Build, warm up and measure the assignment's configuration; every field of the result row but
    the memory. The status is ``ok``, or ``invalid`` with the reasons in ``error`` when a loss, logits
    or quality figure is not finite (``fitbench.run.sanity``). ``rank``: this process's place in a
    torchrun job, whose layout's tensor and data parallelism are applied after the build; each data-parallel
    rank draws its own batch. Replicas build each a whole model of their own from the seed, the weights
    one process would draw, and time their own batch between two barriers (``replica_barrier``).
    ``phases``: where a rank of such a job says which phase it is in."""
    spec = assignment.spec
    rank = rank or Rank.from_environment(device)
    phases = phases or PhaseLog()
    arch = resolve(spec.model)
    policy = precision_policy(spec.precision)
    policy.apply_backend_flags()
    torch.manual_seed(spec.seed)
    clock = DeviceClock(device)

    inject_misbehaviour(spec)
    raise_injected_out_of_memory(assignment)
    emit(phase="build")
    if spec.layout.pp > 1:  # the stages make a process group together, and pass a quantized build's probe on
        phases.enter("building its pipeline stage", collective=True)
    elif spec.layout.tp > 1:  # the ranks make the device mesh together
        phases.enter("building its tensor-parallel shards", collective=True)
    else:
        phases.enter("building its model", collective=False)
    started = time.perf_counter()
    allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    built = build(assignment, arch, policy, device, scratch, rank)
    lm, offload = built.lm, built.offload
    clock.synchronize()
    if device.type == "cuda":
        # The build's free blocks (a quantized layer's bf16 weights, the quality probe's temporaries)
        # go back to the device: they are holes a served model does not keep, sized for the build and
        # not for the steps, and the planner's step moments count allocations, not the build's holes.
        torch.cuda.empty_cache()
    build_s = time.perf_counter() - started
    if offload:
        weight_bytes = offload.resident_bytes + offload.offloaded_bytes
        weight_method = "parameters, on the device and offloaded"
    elif device.type == "cuda":
        weight_bytes, weight_method = torch.cuda.memory_allocated(device) - allocated_before, "allocated by the build"
    else:
        weight_bytes, weight_method = weight_storage_bytes(lm.module), "parameter storage"
    if injected("crash", spec.model):
        print(f"FITBENCH_INJECT: aborting the worker of {spec.model}", file=sys.stderr, flush=True)
        os.abort()
    if injected("sigkill", spec.model):
        print(f"FITBENCH_INJECT: killing the worker of {spec.model}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if injected("alloc", spec.model):
        torch.empty(1 << 62, dtype=torch.uint8, device=device)
    if injected("rank-error", str(rank.rank)):
        raise RuntimeError(f"FITBENCH_INJECT: rank {rank.rank} fails once its model is built")
    while injected("rank-hang", str(rank.rank)):
        time.sleep(60)
    parallel = None
    if spec.layout.pp > 1:
        parallel = built.lm.applied(spec.pipeline_microbatches if spec.mode in TRAINING_MODES else None)
    if spec.layout.tp > 1 and spec.layout.pp == 1:
        if spec.backend == "hf":
            phases.enter(f"applying {spec.layout.strategy}, which broadcasts rank 0's weights", collective=True)
            parallel = parallelize_hf_layout(lm, spec.layout, rank,
                                             activation_checkpointing=spec.activation_checkpointing,
                                             compile=spec.compile)
        else:
            phases.enter(f"applying {spec.layout.strategy}", collective=True)
            parallel = parallelize_layout(lm, spec.layout, policy, rank, built.mesh, built.parallel,
                                          activation_checkpointing=spec.activation_checkpointing,
                                          checkpointed_layers=spec.checkpointed_layers,
                                          compile=spec.compile, offload=spec.fsdp_offload)
        weight_bytes, weight_method = weight_storage_bytes(lm.module), "parameter storage of this rank's shards"
    elif spec.layout.dp_replicate > 1 or spec.layout.dp_shard > 1:
        phases.enter(f"applying {spec.layout.strategy}, which broadcasts rank 0's weights", collective=True)
        parallel = parallelize(lm, spec.layout.strategy, policy, rank,
                               activation_checkpointing=spec.activation_checkpointing,
                               checkpointed_layers=spec.checkpointed_layers, compile=spec.compile,
                               offload=spec.fsdp_offload)
    else:
        if spec.activation_checkpointing:
            lm.enable_activation_checkpointing(spec.checkpointed_layers)
        if spec.compile:
            lm.compile()
    if parallel is not None and device.type == "cuda":
        # Sharding frees what each rank held of the whole model (FSDP shards a model built whole): holes
        # of the build's sizes that the steps would otherwise keep mapped beside their own pools.
        torch.cuda.empty_cache()

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_device_name()
    kind = entry(spec.precision).peak_kind(spec.mode)
    peak = peak_flops(device_name, kind) if device.type == "cuda" else None
    ceilings = load_ceilings(device_name)
    measured_peak = ceilings.matmul_flops.get(kind) if ceilings else None
    peaks = Peaks(flops=peak, measured_flops=measured_peak,
                  bandwidth=peak_bandwidth(device_name) if device.type == "cuda" else None)

    host_launch_s = host_launch_seconds(device)
    measure_mode = _measure_generation if spec.mode == "infer" else _measure_steps
    replicas = spec.layout.replicas > 1
    phases.enter("running its steps" + (", each with collectives every rank joins" if parallel else ""),
                 collective=parallel is not None)
    data = (spec.model_copy(update={"seed": data_seed(spec.seed, data_parallel_rank(spec.layout, rank.rank))})
            if parallel or replicas else spec)
    # a training-style step reads one token more per row: the target of its last position
    length = spec.seq_len if spec.mode == "infer" else spec.seq_len + 1
    tokens = random_tokens(arch.vocab_size, spec.batch_size, length, device, data.seed)
    retries = RetryCounter.of(device)
    stages = {"barrier": replica_barrier(phases) if replicas else None, "counter": retries}
    with recorded(device, spec.key, rank.rank):
        timing, throughput, noisy, compile_s, verdict = measure_mode(data, arch, built, policy, clock, device, peaks,
                                                                     weight_bytes, tokens, stages)
    generations = spec.mode == "infer"
    allocator = retries.report(timing["samples"]["end_to_end" if generations else "step"]) if retries else None
    if replicas:
        parallel = {"strategy": "replicas", "world_size": rank.world_size, "replica": rank.rank,
                    "initial_weights": "each replica's own, drawn from the seed", "data_seed": data.seed,
                    "batch_digest": batch_digest(tokens)}
    decoding = lm.decoding if spec.mode == "infer" else None

    warnings = [f"{name} varies: CV above 5%; more --warmup-steps or --measure-steps may steady it"
                for name in noisy]
    warnings += [warning for warning in (warmup_warning(spec.warmup_steps),
                                         retries_warning(allocator, "measured generations" if generations
                                                         else "measured steps")) if warning]
    if decoding and not decoding["cuda_graphs"] and device.type == "cuda" and spec.backend == "native" \
            and spec.cuda_graphs:
        warnings.append(f"decoded without CUDA graphs, so kernel launches are in the decode time: "
                        f"{decoding['reason']}")
    if recording(device):
        warnings.append(RECORDING_WARNING)
    if peak is None and device.type == "cuda":
        warnings.append(f"no datasheet peak for {device_name!r}: MFU left empty (fitbench env --measure "
                        f"gives a measured one)")
    offloaded = {"offload": offload_row(offload, timing, spec.mode)} if offload else {}
    quality = built.quality.as_dict() if built.quality else None
    problems = verdict.problems + [f"quality figure not finite: {name}" for name in non_finite_figures(quality or {})]
    checkpoint = checkpoint_directory(spec)
    return Measurement(
        status="invalid" if problems else "ok", **({"error": "; ".join(problems)} if problems else {}),
        device_name=device_name, build_s=build_s, compile_s=compile_s, warnings=warnings,
        peak_flops=peak, measured_peak_flops=measured_peak, peak_kind=kind,
        peak_source="datasheet (dense)" if peak else None,
        timing=timing, throughput=throughput, decode=decoding,
        environment={**environment(), "host_launch_s": host_launch_s},
        quality=quality, training=built.training,
        **({"loss": verdict.loss} if verdict.loss is not None else {}),
        weights={"bytes": weight_bytes, "bf16_bytes": 2 * arch.total_params,
                 "relative_to_bf16": weight_bytes / (2 * arch.total_params), "method": weight_method,
                 "source": f"checkpoint {checkpoint}" if checkpoint else "random"},
        **offloaded,
        **({"parallel": parallel} if parallel else {}),
        **({"allocator_retries": allocator} if allocator else {}),
    ).as_dict()


def checkpoint_directory(spec: RunSpec) -> Path | None:
    """The directory the weights are loaded from, or None when they are random (a preset, a hub id,
    a directory with a config and no weights)."""
    if is_local_model(spec.model) and has_weights(spec.model):
        return Path(spec.model).resolve()
    return None


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


def offload_row(offload: Offload, timing: dict, mode: str) -> dict:
    """Where the layers went, and ``stream_gbs``: the offloaded bytes, which every forward pass
    streams in once, over the median decode step (infer) or step (forward), the rate at which they
    arrived if the step did nothing else."""
    step = timing["token_latency" if mode == "infer" else "step"]["median"]
    return {**offload.as_dict(), "stream_gbs": offload.offloaded_bytes / step / 1e9 if offload.offloaded_layers else None}


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
    if spec.layout.pp > 1 and spec.backend == "hf":
        devices = stage_devices(device, spec.layout.pp)
        module, _ = build_staged(arch, devices, policy.weight_dtype, weights_dir=model_path)
        return Built(StagedHuggingFaceLM(module, policy.compute_dtype == policy.weight_dtype, devices))
    if spec.layout.pp > 1:
        problem = entry(spec.precision).hardware_problem(device.type, torch.cuda.get_device_capability(device)
                                                         if device.type == "cuda" else None)
        if problem:
            raise RefusedError(problem)
        probe = random_tokens(arch.vocab_size, 1, min(spec.seq_len, PROBE_TOKENS), device, spec.seed + 1)
        lm, quality = build_pipelined(spec, arch, policy, rank, probe if policy.quantized else None)
        return Built(decoding_as_asked(lm, spec), quality)
    if spec.layout.tp > 1 and spec.backend == "native":
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
    if not policy.quantized:
        lm = load_model(arch, spec.backend, device, policy.weight_dtype, model_path=model_path,
                        compute_dtype=policy.compute_dtype, cuda_graphs=spec.cuda_graphs)
        return Built(decoding_as_asked(lm, spec))
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
    if spec.backend == "native" and model_path is None:
        module, quality = build_quantized_native(arch, device, spec.precision, probe)
        lm = NativeLM(module, cache_dtype=policy.compute_dtype, cuda_graphs=spec.cuda_graphs,
                      graph_problem=precision.graph_problem)
    else:
        lm = load_model(arch, spec.backend, device, policy.weight_dtype, model_path=model_path,
                        cuda_graphs=spec.cuda_graphs, graph_problem=precision.graph_problem, fused=False)
        quality = quantize_built(lm, arch, spec.precision, device, probe, checkpoint=checkpoint_directory(spec))
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


class RefusedError(Exception):
    """This hardware cannot run the configuration; nothing was attempted."""


def replica_barrier(phases: PhaseLog) -> Callable[[], None]:
    """The barrier replicas meet at before their measured stage and after it (``run_stages``), so that
    the stages run side by side and their throughputs add up to what N GPUs do at once; the only
    collective of their steps. While a replica waits there its phase says so: one that hung in its own
    steps is the one outside it."""
    import torch.distributed as dist

    def barrier() -> None:
        phases.enter("waiting at the barrier every replica meets around its measured steps", collective=True)
        dist.barrier()
        phases.enter("running its steps", collective=False)

    return barrier


def batch_digest(tokens: torch.Tensor) -> str:
    """The first 12 hex digits of the SHA-1 of a batch's token ids (int64, row-major): batches alike
    have equal digests, so a row shows which ranks ran batches of their own."""
    return hashlib.sha1(tokens.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()[:12]


@dataclass(frozen=True)
class Peaks:
    flops: float | None
    measured_flops: float | None
    bandwidth: float | None


def _progress(phase: str, i: int, n: int) -> None:
    emit(phase=phase, step=i, of=n)


def _measure_steps(spec, arch, built: Built, policy, clock, device, peaks: Peaks, weight_bytes: int,
                   tokens: torch.Tensor, stages: dict[str, Any]):
    """Time ``spec``'s training-style steps over ``tokens``; ``stages``: ``run_stages``' barrier and counter."""
    if isinstance(built.lm, PipelineLM):
        step = built.lm.make_step(spec.mode, policy, tokens, spec.pipeline_microbatches)
    else:
        step = make_step(spec.mode, built.lm, policy, tokens, device)
    compile_s = None
    if spec.compile:
        emit(phase="compile")
        compile_s = first_call_seconds(step, clock)
    samples, returned = time_steps(step, clock, warmup=spec.warmup_steps, repeats=spec.measure_steps,
                                   on_step=_progress, **stages)
    stats = SampleStats.of(samples)
    timing = {"step": stats.as_dict(), "samples": {"step": samples}}
    throughput = step_metrics(arch, spec.mode, spec.batch_size, spec.seq_len, stats, peaks.flops,
                              peaks.measured_flops, adapter_params=built.adapter_params)
    if returned and returned[0] is None:  # a pipeline stage before the last, where no logits or loss exist
        verdict = Verdict()
    elif spec.mode == "forward":
        verdict = Verdict(non_finite_steps("logits", read(returned)))
    else:
        loss = read(returned)
        verdict = Verdict(non_finite_steps("loss", loss), loss)
    return timing, throughput, ["step time"] if stats.noisy else [], compile_s, verdict


def _measure_generation(spec, arch, built: Built, policy, clock, device, peaks: Peaks, weight_bytes: int,
                        prompt: torch.Tensor, stages: dict[str, Any]):
    """Time ``spec``'s generations from ``prompt``; ``stages``: ``run_stages``' barrier and counter."""
    lm = built.lm
    if isinstance(lm, PipelineLM):
        run = lm.generator(prompt, spec.new_tokens, policy, clock, device)
    else:
        run = generate(lm, prompt, spec.new_tokens, policy, clock, device)
    compile_s = None
    if spec.compile:
        emit(phase="compile")
        compile_s = first_call_seconds(run, clock)
    if lm.capture_pending and spec.warmup_steps == 0:
        # The first generation's first decode captures the CUDA graph; that must be a warm-up, so
        # without warm-up steps one untimed generation runs first.
        emit(phase="capture")
        run()
        clock.synchronize()
    runs = run_stages(run, clock, warmup=spec.warmup_steps, repeats=spec.measure_steps, on_step=_progress,
                      **stages)
    generations = [read_generation(marks, clock) for marks, _ in runs]
    sums = [read(logits_sums) for _, logits_sums in runs]
    verdict = Verdict(non_finite_steps("prefill logits", [first for first, _ in sums])
                      + non_finite_steps("last decode step's logits", [last for _, last in sums]))
    ttft = SampleStats.of(g.time_to_first_token for g in generations)
    latencies = [t for g in generations for t in g.token_latencies]
    token_latency = SampleStats.of(latencies)
    e2e = SampleStats.of(g.end_to_end for g in generations)
    timing = {
        "time_to_first_token": ttft.as_dict(),
        "token_latency": token_latency.as_dict(),
        "end_to_end": e2e.as_dict(),
        "samples": {
            "time_to_first_token": [g.time_to_first_token for g in generations],
            "end_to_end": [g.end_to_end for g in generations],
            "token_latency": latencies,
        },
    }
    offload = built.offload
    stored = offload.resident_bytes + offload.offloaded_bytes if offload else weight_storage_bytes(lm.module)
    decode_weights = decode_weight_bytes(lm.module, stored, spec.batch_size, arch.vocab_size, policy.autocast_dtype)
    # the decode steps write positions T .. T + new_tokens - 2, into the last generation's cache
    positions = range(spec.seq_len, spec.seq_len + spec.new_tokens - 1)
    decode_kv = sum(lm.kv_bytes_read(position) for position in positions) / len(positions)
    if isinstance(lm, PipelineLM):  # a token passes every stage in turn: the job's bytes per token are all of theirs
        weight_bytes, decode_weights, decode_kv = lm.summed_over_stages(weight_bytes, decode_weights, decode_kv)
    throughput = inference_metrics(arch, spec.batch_size, spec.seq_len, weight_bytes, ttft, token_latency,
                                   decode_weights, decode_kv, peaks.flops, peaks.measured_flops, peaks.bandwidth)
    noisy = [name for name, stats in (("time to first token", ttft), ("token latency", token_latency),
                                      ("end-to-end", e2e)) if stats.noisy]
    return timing, throughput, noisy, compile_s, verdict


def decode_weight_bytes(module: torch.nn.Module, stored_bytes: float, batch: int, vocab_size: int,
                        autocast_dtype: torch.dtype | None) -> float:
    """Bytes of weights one decode step of ``batch`` sequences reads, from the built module:

        stored - lookup tables + rows looked up + autocast copies + rotary rows

    - ``stored_bytes``: every parameter's storage (``weight_storage_bytes``, quantized layouts
      included; for offload, the resident and offloaded layers), each read once;
    - a lookup table (``nn.Embedding``) that no matmul shares is read a row at a time, not whole: the
      token table one row per sequence (B x dim x element bytes), a position table (GPT-2's) one
      row, the position every sequence is at. A table tied to the output projection is read whole
      by that matmul and stays in ``stored``;
    - under autocast (bf16 / fp16 over fp32 weights), every matmul (``nn.Linear``, transformers'
      ``Conv1D``) casts its fp32 weight and bias to 16 bits on every step, since autocast caches no
      casts inside ``inference_mode`` (profiled: one cast of the weight per call there, one in all
      under ``no_grad``); each element is read (4 B), written as a copy (2 B) and the copy read by
      the matmul (2 B): 8 B;
    - rotary positions: the native model's fp32 cos and sin tables (max_len x head_dim) are read one
      row each; transformers computes cos and sin from its inverse frequencies (head_dim / 2 fp32),
      read whole.
    """
    # A Conv1D exists only where transformers built the model, which imported it: a native model's
    # worker never imports transformers (seconds of CPU) to ask.
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    matmuls = (torch.nn.Linear, *((pytorch_utils.Conv1D,) if pytorch_utils else ()))
    matmul_weights = {id(p): p for part in module.modules() if isinstance(part, matmuls)
                      for p in part.parameters(recurse=False)}
    touched = float(stored_bytes)
    for part in module.modules():
        if isinstance(part, torch.nn.Embedding) and id(part.weight) not in matmul_weights:
            rows = batch if part.num_embeddings == vocab_size else 1
            table = _local(part.weight)  # under tensor parallelism, this rank's rows of the vocabulary
            touched += (rows - table.shape[0]) * part.embedding_dim * table.element_size()
    if autocast_dtype is not None:
        width = torch.finfo(autocast_dtype).bits // 8
        touched += sum(2 * width * _local(p).numel() for p in matmul_weights.values() if p.dtype == torch.float32)
    for name, buffer in module.named_buffers():
        leaf = name.rpartition(".")[2]
        if leaf in ("rope_cos", "rope_sin"):
            touched += buffer.shape[-1] * buffer.element_size()
        elif leaf == "inv_freq":
            touched += buffer.numel() * buffer.element_size()
    return touched


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (tensor parallelism, FSDP), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# How allocators say they ran out: CUDA's caching allocator, the CPU's (DefaultCPUAllocator) and libc's.
OUT_OF_MEMORY_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory")


def classify(error: BaseException) -> str:
    """``refused``, ``oom`` (on a GPU or a CPU: the fallback ladder starts from it) or ``error``."""
    if isinstance(error, (RefusedError, OffloadCapacityError)):
        return "refused"
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return "oom"
    if isinstance(error, RuntimeError) and any(text in str(error).lower() for text in OUT_OF_MEMORY_MESSAGES):
        return "oom"
    return "error"


def describe(error: BaseException) -> str:
    """The exception's own message, then where it was raised."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f"\n  at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return ("".join(traceback.format_exception_only(error)).strip() + where)[-2000:]


# A collective that waits longer than this fails instead of blocking (a rank hung or gone), which ends
# the job, with a result saying so (status timeout); the sweep's --timeout still bounds the
# configuration's whole life.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def _write(path: Path, payload: dict) -> None:
    """``payload``, checked against the result's schema (``fitbench.results.row``), in one rename."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(Measurement.model_validate(payload).as_dict()))
    os.replace(tmp, path)


def _memory(device: torch.device, sampler: NvmlSampler | None, payload: dict,
            indices: list[int] | None = None) -> None:
    """Also after a failure: the peak an out-of-memory reached is what the planner needs to know."""
    payload["memory"] = memory_report(device, sampler, indices)
    for gpu in payload["memory"]["gpus"]:
        if "expandable_segments:true" not in gpu["allocator"]["settings"].lower():
            payload.setdefault("warnings", []).append(
                f"the CUDA allocator ran without expandable segments ({gpu['allocator']['settings'] or 'defaults'}), "
                f"which the planner assumes: reserved memory may exceed the prediction")


def main(argv: list[str]) -> int:
    """Measure the assignment in ``argv[0]`` and write the result to ``argv[1]``. Under torchrun every
    rank measures and rank 0 writes the job's one result from all of theirs (``fitbench.run.aggregate``);
    only rank 0 reports progress."""
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    assignment = Assignment.model_validate_json(spec_path.read_text())
    rank = Rank.from_environment(assignment.spec.device)
    _REPORTS_PROGRESS["on"] = rank.main
    device = rank.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # one process of the hf backend's pipeline stages drives a GPU per stage
    indices = (list(range(assignment.spec.layout.pp)) if assignment.spec.backend == "hf" and
               assignment.spec.layout.pp > 1 and device.type == "cuda" else None)
    sampler = NvmlSampler(indices or [torch.cuda.current_device()]) if device.type == "cuda" else None
    phases = PhaseLog.of_rank(result_path, rank)
    phases.enter("joining the process group", collective=True)
    injected_timeout = injected_value("collective-timeout")
    timeout = timedelta(seconds=injected_timeout) if injected_timeout else COLLECTIVE_TIMEOUT
    with process_group(rank, timeout, host_only=assignment.spec.layout.replicas > 1):
        try:
            payload = measure(assignment, device, result_path.parent, rank, phases)
        except Exception as error:  # every failure becomes a result row; the sweep goes on
            traceback.print_exc()
            payload = Measurement(status=classify(error), error=describe(error)).as_dict()
            waited = phases.waited_out(timeout)
            if waited is not None:
                payload.update(status="timeout", error=f"waited in a collective ({waited.name}) past the process "
                                                       f"group's {timeout.total_seconds():g} s timeout for a rank that "
                                                       f"never joined it: {payload['error']}")
            if rank.world_size > 1:
                _memory(device, sampler, payload, indices)
                _write(rank_result_path(result_path, rank.rank), payload)
                print(f"rank {rank.rank} of {rank.world_size} failed: {payload['error'].splitlines()[0]}",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_FAILED)  # torchrun ends the ranks waiting for this one
        _memory(device, sampler, payload, indices)
        phases.enter("gathering every rank's result", collective=True)
        payloads = gather_json(rank, payload)
        if not rank.main:
            return EXIT_OK
        # on disk before the process group's teardown, which waits on every rank's communicators
        result = combine(payloads, assignment.spec.layout)
        _write(result_path, result)
    return EXIT_OK if result["status"] == "ok" else EXIT_FAILED


if __name__ == "__main__":
    rank_token()
    tie_to_parent(Path(sys.argv[2]).parent)
    try:
        exit_code = main(sys.argv[1:])
    finally:
        end_own_tree()
    sys.exit(exit_code)
