"""Plan before run: what ``fitbench run`` does between parsing its options and launching the first
worker. The device and its default models, the GPU target and its calibration, the planner's choices
and predictions for every configuration, and the configurations refused before launch (this hardware
cannot run them, or they are predicted not to fit), with the reason: one job per configuration
(``fitbench.launch.job``), which ``fitbench.launch.local.run_sweep`` runs.
"""

from __future__ import annotations

import math
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, NamedTuple

from fitbench.launch.fallback import FallbackPolicy
from fitbench.launch.job import Job
from fitbench.planning.calibration import Calibration
from fitbench.planning.planner import GpuTarget
from fitbench.precisions import DEFAULT_LADDER, PRECISIONS
from fitbench.spec import RunSpec
from fitbench.util.errors import UserError, excerpt


def resolve_device(requested: str) -> str:
    """'auto' -> the first GPU if torch sees one, else cpu; a GPU that is not there is a UserError.
    ``cpu``, and ``auto`` on a machine without a GPU's device file (``fitbench.hardware.devices.no_gpu_device``), ask
    nothing of torch (nor import it)."""
    from fitbench.hardware.devices import no_gpu_device

    if requested == "cpu" or (requested == "auto" and no_gpu_device()):
        return "cpu"
    import torch

    if requested == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cuda(:\d{1,6})?", requested):
        raise UserError(f"device: {excerpt(requested)} is not a device; give auto, cpu, cuda or cuda:N (--device).")
    if not torch.cuda.is_available():
        raise UserError(
            f"device: {requested!r} was asked for, but torch {torch.__version__} sees no CUDA GPU (no driver, or a "
            f"CPU-only build). Use --device cpu, or run where a GPU is visible."
        )
    index = int(requested.split(":")[1]) if ":" in requested else 0
    if index >= torch.cuda.device_count():
        raise UserError(f"device: {requested!r} does not exist; this machine has {torch.cuda.device_count()} GPU(s), "
                        f"cuda:0 to cuda:{torch.cuda.device_count() - 1}.")
    return f"cuda:{index}"


def check_ranks(device: str, ranks: int) -> None:
    """A job of ``ranks`` ranks on ``device``: on GPUs, rank r drives cuda:r (torchrun's LOCAL_RANK), so
    the job needs that many visible GPUs, from the first; on a CPU any number of processes runs.
    Raises UserError."""
    if ranks == 1 or device == "cpu":
        return
    import torch

    visible = torch.cuda.device_count()
    if device != "cuda:0":
        raise UserError(f"device: a job of {ranks} ranks uses cuda:0 to cuda:{ranks - 1}, one rank each; "
                        f"{device} was given. Leave --device out, or choose the GPUs with CUDA_VISIBLE_DEVICES.")
    if visible < ranks:
        raise UserError(f"gpus: --gpus {ranks} needs {ranks} GPUs; this machine shows {visible}. Give --gpus "
                        f"{visible} or fewer, or run on --device cpu ({ranks} CPU processes).")


def default_models(device: str, gpus: int = 1, strategy: str = "auto") -> list[str]:
    """The main job's models: ``tiny`` and ``small`` on a CPU; on GPUs, ``default_gpu_models`` for the
    device's memory, the job's ``gpus`` and its ``strategy``."""
    if device == "cpu":
        return ["tiny", "small"]
    import torch

    memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return default_gpu_models(memory, gpus, strategy)


def default_gpu_models(memory: int, gpus: int, strategy: str = "auto") -> list[str]:
    """The main job's models on ``gpus`` GPUs of ``memory`` bytes each. A ladder size fits a share of
    memory when its mixed-precision training state (16 bytes per parameter: fp32 weights and gradients,
    AdamW's two moments) takes at most 70% of it, leaving the rest for activations. On one GPU, the
    two largest sizes that fit it; on several, the largest that fits all of them together (sharded),
    alone: the job then runs in about the time one GPU's takes. A ``strategy`` that holds the whole
    model on each GPU (DDP, replicas) has one GPU's. ``tiny`` where none fits."""
    from fitbench.models.presets import SIZE_LADDER
    from fitbench.models.registry import resolve

    gpus = 1 if strategy in ("ddp", "replicas") else gpus
    fitting = [name for name in SIZE_LADDER if 16 * resolve(name).total_params <= 0.7 * memory * gpus]
    return fitting[-2 if gpus == 1 else -1:] or ["tiny"]


def hardware_refusals(specs: list, device: str) -> dict[str, str]:
    """Configurations this device cannot run (fp8 below compute capability 8.9, int4 without a GPU;
    on a CPU, one predicted to need more than the host memory available), by spec key, with the
    reason; they are recorded, not launched."""
    from fitbench.precisions import entry
    from fitbench.util.inject import injected_memory_limit

    device_type, capability = device.partition(":")[0], None
    if device_type == "cuda":
        import torch

        capability = torch.cuda.get_device_capability(torch.device(device))
    refusals = {}
    for spec in specs:
        problem = entry(spec.precision).hardware_problem(device_type, capability)
        if problem:
            refusals[spec.key] = f"refused before launch: {problem}"
    if device_type == "cpu" and injected_memory_limit() is None:  # a mem-limit is planned as a GPU (run_target)
        refusals = {**ram_refusals(specs), **refusals}
    return refusals


def ram_refusals(specs: list) -> dict[str, str]:
    """CPU configurations whose predicted peak (the planner's tensors: weights, gradients, optimizer
    state, activations, KV cache; offloaded layers go to disk) exceeds the host memory available
    (``fitbench.util.host``), by spec key, with the reason; a job of several ranks needs each rank's peak
    once per rank. FSDP's CPU offload moves nothing off a CPU: its state is counted where it is."""
    from fitbench.models.registry import resolve
    from fitbench.planning.memory import estimate_memory
    from fitbench.planning.sharding import Parallelism
    from fitbench.planning.planner import offload_split
    from fitbench.util.host import host_memory
    from fitbench.util.units import format_bytes

    memory = host_memory()
    refusals = {}
    for spec in specs:
        if spec.backend == "vllm":  # vLLM's engine takes its own share of the host (vllm_job's prediction)
            continue
        arch = resolve(spec.model)
        resident = offload_split(arch, spec.mode, spec.precision, spec.batch_size, spec.seq_len,
                                 new_tokens=spec.new_tokens, budget=memory.available, calibration=None,
                                 backend=spec.backend).resident_layers if spec.layer_offload else None
        ranks = spec.layout.world_size
        parallelism = Parallelism(layout=spec.layout, microbatches=spec.microbatches)
        peak = ranks * estimate_memory(arch, spec.mode, spec.precision, spec.batch_size, spec.seq_len,
                                       new_tokens=spec.new_tokens, activation_checkpointing=spec.activation_checkpointing,
                                       checkpointed_layers=spec.checkpointed_layers,
                                       resident_layers=resident, backend=spec.backend, compiled=spec.compile,
                                       parallelism=parallelism).peak_bytes
        if peak > memory.available:
            offload = " or, for infer and forward, --offload (layers that do not fit go to disk)" \
                if spec.mode in ("infer", "forward") and not spec.offload else ""
            ladder = DEFAULT_LADDER[spec.mode]
            lower = ladder[ladder.index(spec.precision) + 1:] if spec.precision in ladder else ladder
            precision = f", a lower precision ({', '.join(lower)})" if lower else ""
            refusals[spec.key] = (
                f"refused before launch: {spec.label} is predicted to need {format_bytes(peak)} of host memory; "
                f"{format_bytes(memory.available)} is available ({memory.source}). Run a smaller model, batch "
                f"or --seq-len{precision}{offload}, or on a machine with more memory.")
    return refusals


def run_target(device: str, measure: Callable[[], Any] | None = None, say: Callable[[str], None] = print,
               ranks: int = 1):
    """What ``fitbench run`` plans against: (GpuTarget, calibration). On a GPU, its name and memory
    (FITBENCH_INJECT's mem-limit replaces the memory) with the calibration stored for it and this
    torch version, measured now and stored when there is none (``measure``, default
    ``measure_calibration`` on the GPU: seconds, one line told to ``say``). On a CPU, a target only under a
    mem-limit, which makes the CPU a GPU of that size, tensors only (calibration None); else
    (None, None): nothing is planned. A job of ``ranks`` ranks plans for that many GPUs of this kind."""
    from fitbench.planning.planner import GpuTarget
    from fitbench.util.inject import injected_memory_limit

    limit = injected_memory_limit()
    if device == "cpu":
        source = "FITBENCH_INJECT mem-limit"
        return (GpuTarget(None, ranks, limit, described=False, memory_source=source) if limit else None), None

    import torch

    from fitbench.launch.calibrate import measure_calibration
    from fitbench.planning.calibration import ensure_calibration, load_calibration

    properties = torch.cuda.get_device_properties(torch.device(device))

    def measure_here():
        with tempfile.TemporaryDirectory(prefix="fitbench-calibrate-") as scratch:
            return measure_calibration(device, Path(scratch), gpus=ranks)

    try:
        calibration, stored_in = ensure_calibration(properties.name, measure or measure_here)
    except RuntimeError as error:  # a calibration run that failed, or no NVML: plan as before
        calibration, stored_in = load_calibration(properties.name), None
        say(f"calibrating {properties.name} failed ({error}); planning with {calibration.source}")
    if stored_in is not None:
        say(f"first run on {properties.name} with torch {torch.__version__}, calibrated: "
            f"{calibration_figures(calibration)}; stored in {stored_in}")
    memory, source = ((limit, "FITBENCH_INJECT mem-limit") if limit else
                      (float(properties.total_memory), "torch.cuda.get_device_properties().total_memory"))
    return GpuTarget(properties.name, ranks, memory, described=False, memory_source=source), calibration


def choose_recompute(config) -> bool:
    """Whether the planner decides activation checkpointing: neither ``--activation-checkpointing`` nor
    ``--checkpointed-layers`` was given (either one decides it)."""
    return config.activation_checkpointing is None and config.checkpointed_layers is None


def plan_jobs(specs: list[RunSpec], config, target: GpuTarget | None, calibration: Calibration | None) -> list[Job]:
    """A job per configuration, planned before it runs with the model of its backend on the GPU of
    ``target`` (``run_target``; None: nothing is planned): the planner picks the precision, activation
    checkpointing and layout the user left open, and predicts the per-GPU peak stored with the result.
    A configuration that no choice left open makes fit is refused: it is not launched, and its reason
    names the predicted need and the alternatives predicted to fit
    (``fitbench.planning.planner.alternatives``, also in the prediction). Each job walks the fallback
    ladder of ``config`` for its mode and lives at most ``config.timeout`` seconds."""
    from fitbench.config import fallback_ladder
    from fitbench.models.registry import resolve
    from fitbench.planning.planner import alternatives, planner_choices, predict_spec, refusal

    jobs = []
    for spec in specs:
        if spec.backend == "vllm":
            jobs.append(vllm_job(spec, config, target))
            continue
        ladder = fallback_ladder(config, spec.mode)
        policy = FallbackPolicy(tuple(ladder), enabled=not config.no_fallback, gpus_at_hand=config.gpus)
        if target is None:
            jobs.append(Job(spec, config.timeout, policy))
            continue
        arch = resolve(spec.model)
        spec, prediction = predict_spec(arch, spec, target, calibration, choose_precision=config.precision is None,
                                        choose_recompute=choose_recompute(config),
                                        runnable=PRECISIONS, choose_strategy=config.strategy == "auto",
                                        gpus=None if spec.offload else config.gpus, ladder=ladder)
        reason = None
        if not prediction["fits"]:
            found = alternatives(arch, spec, target, calibration)
            prediction["alternatives"] = [alternative.as_dict() for alternative in found]
            reason = refusal(arch, spec, prediction, target, found)
        chosen = planner_choices(spec.mode, config.precision is None, choose_recompute(config))
        jobs.append(Job(spec, config.timeout, policy, target, calibration, prediction, reason, tuple(chosen)))
    return jobs


def vllm_job(spec: RunSpec, config, target: GpuTarget | None) -> Job:
    """A ``--backend vllm`` configuration's job, planned with vLLM's memory model
    (``fitbench.planning.vllm_memory``) on each GPU of ``target``, or on a CPU (no target) on the host's
    memory, which vLLM's CPU build takes its share of; refused when its batch is predicted not to fit
    the KV cache. It runs once, as asked: vLLM has no fallback ladder's precisions and layouts to walk
    (the precisions it has are ``fitbench.models.vllm_options``'), and its own answer to "how many fit"
    is the row's ``vllm.max_concurrency``."""
    import psutil

    from fitbench.models.registry import resolve
    from fitbench.planning.vllm_memory import vllm_prediction, vllm_refusal

    if target is not None:
        total, source = target.memory, target.memory_source
    else:  # vLLM's CPU worker: its share of the memory node's total (vllm/v1/worker/cpu_worker.py)
        total, source = float(psutil.virtual_memory().total), "psutil.virtual_memory().total, the host's"
    prediction = vllm_prediction(resolve(spec.model), spec, total, source)
    reason = None if prediction["fits"] else vllm_refusal(spec, prediction)
    return Job(spec, config.timeout, target=target, prediction=prediction, refusal=reason)


def refuse_unrunnable(jobs: list[Job], device: str) -> list[Job]:
    """``jobs`` with those this device cannot run refused before launch (``hardware_refusals``)."""
    refusals = hardware_refusals([job.spec for job in jobs], device)
    return [replace(job, refusal=refusals[job.spec.key]) if job.spec.key in refusals else job for job in jobs]


def check_output_directory(out: str, option: str) -> None:
    """A UserError unless ``out`` is, or can be made, a directory this process can write in; checked
    before anything runs, by writing there."""
    path = Path(out)
    try:
        if path.exists() and not path.is_dir():
            raise UserError(f"out: {excerpt(out, 200)} ({option}) is an existing file, not a directory. Give a "
                            f"directory, or a path that does not exist yet.")
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise UserError(f"out: cannot write in {excerpt(out, 200)} ({option}): {error.strerror}. Give a directory "
                        f"you can write to.") from None


class PlannedSweep(NamedTuple):
    """A sweep ready to launch: the device it runs on, its jobs, and the source of the calibration its
    predictions used."""

    device: str
    jobs: list[Job]
    calibration: str


def plan_sweep(config, out: str, out_option: str = "--out", say: Callable[[str], None] = print) -> PlannedSweep:
    """Everything ``fitbench run`` does before its first launch, in order: the device (``resolve_device``)
    and its ranks, the configurations (``fitbench.config.expand``), the results directory ``out``
    (``check_output_directory``; ``out_option`` names it in an error), the target and its calibration
    (``run_target``, telling ``say`` if it calibrates), and the planned jobs, those this device cannot
    run refused. Under the slurm launcher the devices are the cluster's nodes', not this machine's:
    the jobs are planned here for the GPU they will get (``fitbench.launch.slurm.planned``), and each
    runs on its node as planned (``fitbench.cli.allocation``)."""
    from fitbench.config import expand
    from fitbench.planning.calibration import TENSORS_ONLY

    if config.launcher == "slurm":
        device = cluster_device(config)
        if device != "cpu" and not config.models:
            raise UserError("models: the default models depend on the GPU's memory, and the slurm launcher does not "
                            "see the nodes' GPUs from here; name them with --models.")
        specs = expand(config, device=device, default_models=default_models("cpu"))
        check_output_directory(out, out_option)
        from fitbench.launch.slurm.planned import login_target

        target, calibration = login_target(device, config.gpus, config.gpu, config.partition)
        if target is not None:
            target = cluster_target(target, config)
        return PlannedSweep(device, plan_jobs(specs, config, target, calibration),
                            calibration.source if calibration else TENSORS_ONLY)
    device = resolve_device(config.device)
    check_ranks(device, config.gpus // (config.nodes or 1))
    specs = expand(config, device=device, default_models=default_models(device, config.gpus, config.strategy))
    check_output_directory(out, out_option)
    target, calibration = run_target(device, say=say, ranks=config.gpus)
    if target is not None:
        target = cluster_target(target, config)
    jobs = refuse_unrunnable(plan_jobs(specs, config, target, calibration), device)
    return PlannedSweep(device, jobs, calibration.source if calibration else TENSORS_ONLY)


def cluster_target(target: GpuTarget, config) -> GpuTarget:
    """``target`` as the sweep's jobs take it: ``--gpus`` spread over ``--nodes`` where there are several
    (the target's node size otherwise, which alternatives of more GPUs keep) and, between nodes,
    ``--inter-node-bandwidth`` where given."""
    from dataclasses import replace

    from fitbench.planning.nodes import parse_inter_node_bandwidth

    bandwidth = config.inter_node_bandwidth
    return replace(target, node_gpus=config.gpus // config.nodes if (config.nodes or 1) > 1 else target.node_gpus,
                   inter_node_bandwidth=parse_inter_node_bandwidth(bandwidth) if bandwidth else None)


def cluster_device(config) -> str:
    """The device of a sweep's SLURM jobs: the one named, else a GPU where GPUs are asked of each node
    (``--gpus-per-node``) or named (``--gpu``), else cpu. Nothing is asked of this machine's devices."""
    if config.device != "auto":
        return "cuda:0" if config.device == "cuda" else config.device
    return "cuda:0" if config.gpus_per_node or config.gpu else "cpu"


def sized_config(config):
    """``config`` with its SLURM jobs sized (``fitbench.launch.slurm.sizing.size_job``: ranks, nodes and
    GPUs per node made to agree, those left out derived, CPUs and memory per node defaulted), and the
    warnings of what was not; ``config`` itself under the local launcher. Raises UserError."""
    from fitbench.launch.slurm.jobs import partition_node
    from fitbench.launch.slurm.options import time_problem, time_seconds
    from fitbench.launch.slurm.sizing import size_job

    if config.launcher != "slurm":
        return config, []
    on_gpus = cluster_device(config) != "cpu"
    size = size_job(on_gpus=on_gpus, gpus=config.gpus if "gpus" in config.model_fields_set else None,
                    nodes=config.nodes, gpus_per_node=config.gpus_per_node, cpus_per_task=config.cpus_per_task,
                    mem=config.mem, node=lambda: partition_node(config.partition))
    warnings = list(size.warnings)
    if config.time is not None:
        time_problem(config.time)
        if time_seconds(config.time) < config.timeout:
            warnings.append(f"--time {config.time} ends a job before --timeout {config.timeout:g} s ends its "
                            f"configuration: SLURM may stop it first, and its row then reads timeout. Give --time at "
                            f"least --timeout (and a margin for the job's start), or a shorter --timeout.")
    if not on_gpus and size.gpus > 1 and config.device == "auto":
        warnings.append(f"each job runs {size.gpus} CPU processes: no GPU was asked (--gpus-per-node or --gpu); "
                        f"give one of them for a job of GPUs, or --device cpu to say so.")
    return config.model_copy(update={"gpus": size.gpus, "nodes": size.nodes, "gpus_per_node": size.gpus_per_node,
                                     "cpus_per_task": size.cpus_per_task, "mem": size.mem}), warnings


SLURM_FIELDS = ("partition", "account", "time", "nodes", "gpus_per_node", "gpu", "cpus_per_task", "mem", "sbatch_args",
                "setup", "max_concurrent")


def slurm_options(config):
    """The sweep's SLURM options (``fitbench.launch.slurm.options.SlurmOptions``, checked), None under the
    local launcher; a UserError for one given without ``--launcher slurm`` (the job's size is
    ``sized_config``'s)."""
    from fitbench.launch.slurm.options import SlurmOptions

    if config.launcher != "slurm":
        given = [field for field in SLURM_FIELDS if getattr(config, field) is not None]
        if given:
            option = "--" + given[0].replace("_", "-").removesuffix("s" if given[0] == "sbatch_args" else "")
            raise UserError(f"{given[0]}: {option} asks SLURM for a job's resources, and the sweep runs on this "
                            f"machine (--launcher local, the default). Add --launcher slurm to run it as SLURM "
                            f"jobs, or leave {option} out.")
        return None
    return SlurmOptions(partition=config.partition, account=config.account, time=config.time, nodes=config.nodes or 1,
                        gpus_per_node=config.gpus_per_node, cpus_per_task=config.cpus_per_task, mem=config.mem,
                        sbatch_args=tuple(config.sbatch_args or ()), setup=tuple(config.setup or ()))


# Bounds of what a plan can describe: beyond them a number is a typo, and sizes stop being finite floats.
GPU_MEMORY_MAX = 1e14
GPU_MEMORY_MIN = 1e9
GPUS_MAX = 65536


def gpu_target(*, gpu: str | None = None, gpu_memory: str | None = None, gpus: int | None = None) -> GpuTarget:
    """The GPUs to plan for: described (``gpu``: a known GPU's name; ``gpu_memory``: a size such as 80GB;
    ``gpus``: how many), else those detected here. Bad values are a UserError naming the option."""
    from fitbench.hardware import devices
    from fitbench.hardware.datasheet import gpu_spec
    from fitbench.planning.planner import GPU_ALIASES
    from fitbench.util.units import parse_bytes

    for option, value in (("--gpu", gpu), ("--gpu-memory", gpu_memory)):
        if value is not None and not value.strip():
            raise UserError(f"{option[2:]}: {option} was given an empty value; give it like "
                            f"{'H100-80GB' if option == '--gpu' else '80GB'}, or leave it out.")
    if gpus is not None and not 0 < gpus <= GPUS_MAX:
        raise UserError(f"gpus: must be a number of GPUs from 1 to {GPUS_MAX:,}, got {excerpt(gpus)} (--gpus).")
    if gpu and gpu_memory:
        raise UserError(f"--gpu and --gpu-memory contradict: --gpu {excerpt(gpu)} sets the memory per GPU "
                        f"from its datasheet; give --gpu for a known GPU, or --gpu-memory to describe another.")
    name = None
    if gpu:
        name = GPU_ALIASES.get(gpu.upper(), gpu)
        if gpu_spec(name) is None:
            raise UserError(f"gpu: {excerpt(gpu)} is not a known GPU. Known: {', '.join(GPU_ALIASES)} (or an exact "
                            f"device name such as 'NVIDIA H100 80GB HBM3'); or describe it with --gpu-memory.")
    memory, source = None, None
    if gpu_memory:
        try:
            memory, source = parse_bytes(gpu_memory), "--gpu-memory"
        except ValueError:
            raise UserError(f"gpu-memory: {excerpt(gpu_memory)} is not a size; write it like 80GB or "
                            f"79.2GiB.") from None
        if not math.isfinite(memory) or not GPU_MEMORY_MIN <= memory <= GPU_MEMORY_MAX:
            raise UserError(f"gpu-memory: {excerpt(gpu_memory)} is not a GPU's memory; give a size from "
                            f"{GPU_MEMORY_MIN / 1e9:.0f} GB to {GPU_MEMORY_MAX / 1e12:.0f} TB with its unit, like 80GB "
                            f"or 79.2GiB (a bare number is bytes).")
    if name is None and memory is None:
        detected = devices.detect_gpus()  # only then: detecting imports torch, seconds a described GPU never needs
        if not detected and gpus is None:
            raise UserError("gpus: no GPU is visible here; describe the hardware to plan for, e.g. "
                            "--gpus 4 --gpu-memory 80GB, or --gpu H100-80GB.")
        if not detected:
            raise UserError("gpu-memory: no GPU is visible here, so with --gpus say how much memory each GPU has "
                            "(--gpu-memory 80GB) or which GPU it is (--gpu H100-80GB).")
        count = len(detected) if gpus is None else gpus
        if count > len(detected):
            raise UserError(f"gpus: {count} GPUs asked, {len(detected)} visible here ({detected[0].name}); ask for "
                            f"at most {len(detected)}, or plan for other hardware with --gpu or --gpu-memory.")
        return GpuTarget(detected[0].name, count, float(detected[0].total_memory), described=False,
                         memory_source="torch.cuda.get_device_properties().total_memory")
    if memory is None:
        spec = gpu_spec(name)
        memory, source = spec.total_memory, spec.total_memory_source
    return GpuTarget(name, 1 if gpus is None else gpus, memory, described=True, memory_source=source)


def calibration_figures(c) -> str:
    """A calibration's figures in one line."""
    return (f"CUDA context {c.cuda_context_training / 1e6:.0f} MB training, {c.cuda_context_inference / 1e6:.0f} MB "
            f"generating, {c.cuda_context_eager / 1e6:.0f} MB forward; workspaces {c.workspace_training / 1e6:.0f} "
            f"MB training, {c.workspace_inference / 1e6:.0f} MB generating, {c.workspace_eager / 1e6:.0f} MB forward"
            + _collectives_figures(c))


def bus_figures(bus) -> str:
    """Measured bus bandwidths and latencies in one line (a latency of 0: not measured)."""
    def per_message(latency: float) -> str:
        return f" + {latency * 1e6:.3g} us a message" if latency else ""

    return (f"bus bandwidth: all-reduce {bus.all_reduce / 1e9:.3g} GB/s{per_message(bus.all_reduce_latency)}, "
            f"all-gather {bus.all_gather / 1e9:.3g} GB/s{per_message(bus.all_gather_latency)} ({bus.source})")


def _collectives_figures(c) -> str:
    from fitbench.planning.collectives import BusBandwidth

    figures = ""
    if c.all_reduce_bus_bandwidth is not None:
        figures += "; " + bus_figures(BusBandwidth(c.all_reduce_bus_bandwidth, c.all_gather_bus_bandwidth,
                                                   c.collectives_source, c.all_reduce_latency_s or 0.0,
                                                   c.all_gather_latency_s or 0.0))
    if c.inter_node_all_reduce_bus_bandwidth is not None:
        figures += "; between nodes, " + bus_figures(BusBandwidth(
            c.inter_node_all_reduce_bus_bandwidth, c.inter_node_all_gather_bus_bandwidth, c.inter_node_source,
            c.inter_node_all_reduce_latency_s or 0.0, c.inter_node_all_gather_latency_s or 0.0))
    return figures
