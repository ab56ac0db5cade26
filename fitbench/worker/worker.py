"""One configuration in one process: build (``fitbench.worker.build``) -> parallelize
(``fitbench.worker.parallelize``) -> the mode's measuring loop (``fitbench.worker.modes``) -> a
measurement, written as the result.

Run as ``python -m fitbench.worker.worker ASSIGNMENT.json RESULT.json``: the configuration
(``fitbench.spec.Assignment``) with the planner's figures it acts on, which the launcher computed;
the worker never plans. Progress goes to stdout as one
JSON object per line (the parent shows it as a live line); diagnostics go to stderr (the parent
keeps them in the run's log). The result file is written only at the end; a worker that dies
leaves none, and the parent records the death. Disk offload writes its layers into RESULT.json's
directory, which the parent makes for the run and removes after it, however the run ends.

The vllm backend measures vLLM's engine instead, started from this process
(``fitbench.worker.vllm_backend``).

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
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch

from fitbench.hardware.ceilings import load_ceilings
from fitbench.hardware.datasheet import peak_bandwidth, peak_flops
from fitbench.hardware.devices import cpu_device_name
from fitbench.hardware.environment import environment
from fitbench.models.offload import Offload, OffloadCapacityError
from fitbench.models.registry import resolve
from fitbench.precisions import TRAINING_MODES, entry
from fitbench.precisions import policy as precision_policy
from fitbench.results.row import Measurement
from fitbench.worker.aggregate import combine
from fitbench.worker.build import Built, RefusedError, build, checkpoint_directory
from fitbench.worker.host_speed import host_launch_seconds
from fitbench.worker.loops import random_tokens
from fitbench.worker.modes import measure_mode
from fitbench.worker.modes.peaks import Peaks
from fitbench.worker.parallel import data_seed
from fitbench.worker.parallelize import parallelize
from fitbench.worker.phases import PhaseLog, rank_result_path
from fitbench.worker.progress import REPORTS_PROGRESS, emit
from fitbench.worker.ranks import Rank, gather_json, process_group
from fitbench.worker.retries import RetryCounter, retries_warning
from fitbench.worker.sanity import non_finite_figures, warmup_warning
from fitbench.worker.snapshot import RECORDING_WARNING, recorded, recording
from fitbench.worker.tensor_parallel import data_parallel_rank
from fitbench.worker.timing import DeviceClock
from fitbench.worker.trackers import NvmlSampler, memory_report
from fitbench.worker.vllm_backend import measure_vllm
from fitbench.worker.weight_bytes import weight_storage_bytes
from fitbench.spec import Assignment, RunSpec
from fitbench.util.inject import injected, injected_memory_limit, injected_value
from fitbench.util.processes import end_own_tree, rank_token, tie_to_parent

EXIT_OK, EXIT_FAILED = 0, 3


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


def measure(assignment: Assignment, device: torch.device, scratch: Path, rank: Rank | None = None,
            phases: PhaseLog | None = None) -> dict:
    """Build, parallelize, run the mode and measure the assignment's configuration; every field of the
    result row but the memory. The status is ``ok``, or ``invalid`` with the reasons in ``error`` when
    a loss, logits or quality figure is not finite (``fitbench.worker.sanity``). ``rank``: this process's
    place in a torchrun job, whose layout's tensor and data parallelism are applied after the build;
    each data-parallel rank draws its own batch. Replicas build each a whole model of their own from
    the seed, the weights one process would draw, and time their own batch between two barriers
    (``replica_barrier``). ``phases``: where a rank of such a job says which phase it is in."""
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

    built, build_s, weights = build_timed(assignment, arch, policy, device, scratch, rank, phases, clock)
    misbehave_once_built(spec, rank, device)
    parallel = parallelize_as_asked(built, spec, policy, rank, phases)
    if spec.layout.tp > 1 and spec.layout.pp == 1:
        weights = (weight_storage_bytes(built.lm.module), "parameter storage of this rank's shards")

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_device_name()
    kind = entry(spec.precision).peak_kind(spec.mode)
    peaks = device_peaks(device, device_name, kind)
    host_launch_s = host_launch_seconds(device)
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
        timing, throughput, noisy, compile_s, verdict = measure_mode(spec.mode)(
            data, arch, built, policy, clock, device, peaks, weights[0], tokens, stages)
    generations = spec.mode == "infer"
    allocator = retries.report(timing["samples"]["end_to_end" if generations else "step"]) if retries else None
    if replicas:
        parallel = {"strategy": "replicas", "world_size": rank.world_size, "replica": rank.rank,
                    "initial_weights": "each replica's own, drawn from the seed", "data_seed": data.seed,
                    "batch_digest": batch_digest(tokens)}
    decoding = built.lm.decoding if generations else None

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
    if peaks.flops is None and device.type == "cuda":
        warnings.append(f"no datasheet peak for {device_name!r}: MFU left empty (fitbench env --measure "
                        f"gives a measured one)")
    offload = built.offload
    offloaded = {"offload": offload_row(offload, timing, spec.mode)} if offload else {}
    quality = built.quality.as_dict() if built.quality else None
    problems = verdict.problems + [f"quality figure not finite: {name}" for name in non_finite_figures(quality or {})]
    checkpoint = checkpoint_directory(spec)
    weight_bytes, weight_method = weights
    return Measurement(
        status="invalid" if problems else "ok", **({"error": "; ".join(problems)} if problems else {}),
        device_name=device_name, build_s=build_s, compile_s=compile_s, warnings=warnings,
        peak_flops=peaks.flops, measured_peak_flops=peaks.measured_flops, peak_kind=kind,
        peak_source="datasheet (dense)" if peaks.flops else None,
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


def build_timed(assignment: Assignment, arch, policy, device: torch.device, scratch: Path, rank: Rank,
                phases: PhaseLog, clock: DeviceClock) -> tuple[Built, float, tuple[float, str]]:
    """The build (``fitbench.worker.build``), its seconds, and the bytes of its weights with how they were
    counted: an offloaded model's parameters on the device and offloaded; on a GPU what the build
    left allocated; on a CPU the parameters' storage (``fitbench.worker.weight_bytes``)."""
    emit(phase="build")
    if assignment.spec.layout.pp > 1:  # the stages make a process group together, and pass a quantized build's probe on
        phases.enter("building its pipeline stage", collective=True)
    elif assignment.spec.layout.tp > 1:  # the ranks make the device mesh together
        phases.enter("building its tensor-parallel shards", collective=True)
    else:
        phases.enter("building its model", collective=False)
    started = time.perf_counter()
    allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    built = build(assignment, arch, policy, device, scratch, rank)
    clock.synchronize()
    if device.type == "cuda":
        # The build's free blocks (a quantized layer's bf16 weights, the quality probe's temporaries)
        # go back to the device: they are holes a served model does not keep, sized for the build and
        # not for the steps, and the planner's step moments count allocations, not the build's holes.
        torch.cuda.empty_cache()
    build_s = time.perf_counter() - started
    if built.offload:
        weights = (built.offload.resident_bytes + built.offload.offloaded_bytes,
                   "parameters, on the device and offloaded")
    elif device.type == "cuda":
        weights = (torch.cuda.memory_allocated(device) - allocated_before, "allocated by the build")
    else:
        weights = (weight_storage_bytes(built.lm.module), "parameter storage")
    return built, build_s, weights


def misbehave_once_built(spec: RunSpec, rank: Rank, device: torch.device) -> None:
    """FITBENCH_INJECT's ``crash``, ``sigkill``, ``alloc``, ``rank-error`` and ``rank-hang``, once the
    model is built (``fitbench.util.inject``)."""
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


def parallelize_as_asked(built: Built, spec: RunSpec, policy, rank: Rank, phases: PhaseLog) -> dict | None:
    """``fitbench.worker.parallelize`` with the spec's techniques, saying first which collective phase a
    rank is in; what was applied, for the row."""
    layout = spec.layout
    if layout.pp == 1 and (layout.tp > 1 or layout.dp_replicate > 1 or layout.dp_shard > 1):
        broadcasts = layout.tp == 1 or spec.backend == "hf"  # a native model's shards are drawn on every rank
        phases.enter(f"applying {layout.strategy}" + (", which broadcasts rank 0's weights" if broadcasts else ""),
                     collective=True)
    parallel = parallelize(built.lm, layout, policy, rank, tensor_parallel=built.parallel, mesh=built.mesh,
                           activation_checkpointing=spec.activation_checkpointing,
                           checkpointed_layers=spec.checkpointed_layers, compile=spec.compile,
                           offload=spec.fsdp_offload,
                           microbatches=spec.pipeline_microbatches if spec.mode in TRAINING_MODES else None)
    if parallel is not None and rank.device.type == "cuda":
        # Sharding frees what each rank held of the whole model (FSDP shards a model built whole): holes
        # of the build's sizes that the steps would otherwise keep mapped beside their own pools.
        torch.cuda.empty_cache()
    return parallel


def device_peaks(device: torch.device, device_name: str, kind: str) -> Peaks:
    """The datasheet's peaks of a GPU (none on a CPU) and the measured matmul peak, if any
    (``fitbench.hardware``)."""
    ceilings = load_ceilings(device_name)
    return Peaks(flops=peak_flops(device_name, kind) if device.type == "cuda" else None,
                 measured_flops=ceilings.matmul_flops.get(kind) if ceilings else None,
                 bandwidth=peak_bandwidth(device_name) if device.type == "cuda" else None)


def offload_row(offload: Offload, timing: dict, mode: str) -> dict:
    """Where the layers went, and ``stream_gbs``: the offloaded bytes, which every forward pass
    streams in once, over the median decode step (infer) or step (forward), the rate at which they
    arrived if the step did nothing else."""
    step = timing["token_latency" if mode == "infer" else "step"]["median"]
    return {**offload.as_dict(), "stream_gbs": offload.offloaded_bytes / step / 1e9 if offload.offloaded_layers else None}


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


def measure_on_vllm(assignment: Assignment, result_path: Path) -> int:
    """The vllm backend's run (``fitbench.worker.vllm_backend``), its failure a result row as every
    backend's."""
    try:
        payload = measure_vllm(assignment, result_path.parent)
    except Exception as error:
        traceback.print_exc()
        payload = Measurement(status=classify(error), error=describe(error)).as_dict()
    _write(result_path, payload)
    return EXIT_OK if payload["status"] == "ok" else EXIT_FAILED


def main(argv: list[str]) -> int:
    """Measure the assignment in ``argv[0]`` and write the result to ``argv[1]``. Under torchrun every
    rank measures and rank 0 writes the job's one result from all of theirs (``fitbench.worker.aggregate``);
    only rank 0 reports progress."""
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    assignment = Assignment.model_validate_json(spec_path.read_text())
    if assignment.spec.backend == "vllm":  # vLLM's engines hold the GPUs: this process touches none
        return measure_on_vllm(assignment, result_path)
    rank = Rank.from_environment(assignment.spec.device)
    REPORTS_PROGRESS["on"] = rank.main
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
