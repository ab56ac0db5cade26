"""Enumerate ways to run a model on some GPUs, keep those predicted to fit, rank, and explain.

A candidate is a precision, a layout over a GPU count (``fitbench.spec.Layout``: the object the run
is given, so a planned layout is the layout that runs; ``layouts_for`` enumerates them for any
count), activation checkpointing on or off and a batch size. A layout the run cannot launch is
rejected with ``Layout.problem``'s reason. Its predicted per-GPU peak is the memory model's tensor
terms plus the calibrated overheads (CUDA context, cuBLAS workspace, allocator page rounding, NCCL
buffers; none on a CPU, where the calibration is None). It fits when that peak is at most the GPU's
memory. An offloaded candidate (inference on one GPU) keeps only some decoder layers on the GPU;
``offload_split`` says how many fit. An FSDP candidate with CPU offload keeps its shards, gradients
and optimizer state in host memory.

Automatic choices (the precision, activation checkpointing, the layout, an automatic batch) treat a
candidate predicted within ``RETRY_MARGIN`` of a GPU's memory as not fitting where another choice is
clear of it (``Assessment.clear``): at the edge, the caching allocator's retries slow every step.

The precision ladder is an order of preference (quality first): the chosen plan uses the first
rung that has a fitting candidate, and among that rung's candidates the highest forecast
throughput over the GPUs each uses (``forecast_tokens_per_s``; fewer GPUs on a tie): one GPU,
replicas, DDP, FSDP, tensor parallelism, pipeline stages and their combinations alike. Every
rejected candidate keeps its reason.

A ``fitbench run`` configuration that no choice left open makes fit is refused before launch
(``refusal``): its reason names the predicted need and the ``alternatives`` predicted to fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fitbench.hardware.ceilings import load_ceilings
from fitbench.hardware.datasheet import gpu_spec
from fitbench.models.architecture import Architecture, default_backend
from fitbench.planning import compiled as inductor
from fitbench.planning.calibration import DEFAULT, NCCL_TENSOR_PARALLEL_GENERATION, PAGE, TENSORS_ONLY, Calibration
from fitbench.planning.collectives import bus_bandwidth
from fitbench.planning.forecast import (Ceilings, StepRun, ceilings, decode_kind, forecast_spec, forecast_step_time,
                                   step_run)
from fitbench.planning.activations import saved_per_layer
from fitbench.planning.memory import estimate_memory, stage_estimates
from fitbench.planning.sharding import Parallelism, rank_edge_params
from fitbench.planning.terms import MemoryEstimate, Term, Widths
from fitbench.planning.weights import offloaded_weights
from fitbench.precisions import TRAINING_MODES
from fitbench.planning.nodes import Nodes, inter_node_link, job_nodes, placement_problem
from fitbench.planning.search import largest
from fitbench.planning.speed import StepTime, estimate_step_time
from fitbench.precisions import ADAPTER_BASE, DEFAULT_LADDER, UNQUANTIZED_BASE, entry
from fitbench.spec import Layout, Stage, pipeline_stages, recompute_label
from fitbench.util.units import format_bytes

# The most GPUs a search for the fewest (``fewest_gpus``) looks at.
MOST_GPUS = 64

# Names people type for --gpu, to the exact device names of the peak table.
GPU_ALIASES = {
    "H100-80GB": "NVIDIA H100 80GB HBM3", "H100": "NVIDIA H100 80GB HBM3", "H100-SXM": "NVIDIA H100 80GB HBM3",
    "H100-PCIE": "NVIDIA H100 PCIe", "H100-NVL": "NVIDIA H100 NVL", "H200": "NVIDIA H200",
    "H200-NVL": "NVIDIA H200 NVL", "A100-80GB": "NVIDIA A100-SXM4-80GB", "A100-40GB": "NVIDIA A100-SXM4-40GB",
    "A100-80GB-PCIE": "NVIDIA A100 80GB PCIe", "A100-40GB-PCIE": "NVIDIA A100-PCIE-40GB", "L40S": "NVIDIA L40S",
    "L4": "NVIDIA L4", "RTX4090": "NVIDIA GeForce RTX 4090", "RTX3090": "NVIDIA GeForce RTX 3090",
}
DEFAULT_SPEED_GPU = "NVIDIA H100 80GB HBM3"

MAX_AUTO_BATCH = 1 << 16
# The share of a GPU's memory that automatic choices keep free beyond a predicted peak: within it the
# CUDA caching allocator's retries start (frees and cudaMalloc inside a step, ``fitbench.worker.retries``).
# Where the edge lies, measured (benchmarks/results/2026-11-27-h100x4-retry-edge and -fsdp-memory): 30B
# bf16-pure under FSDP x 4 at 4 x 512 on H100s giving a process 85.02 GB, with fewer and fewer layers
# recomputed:
#     every layer   predicted 74.40 GB, ran at 76.61 GB, no retries, 1.26 s a step
#     50 of 60      predicted 77.26 GB, ran at 80.34 GB, no retries, 1.22 s
#     30 of 60      predicted at the capacity, ran at 85.0 GB, retries in every measured step, 3.37 s
#     20 of 60      predicted at the capacity, ran at 85.0 GB, retries in every measured step, 3.42 s
# So a step that peaks at 80.34 GB, 94.5% of the memory, is known to run clear of the retries. A
# prediction P peaks at most at P / (1 - u), u = 3.89% the memory model's largest under-prediction
# over the committed rows of several GPUs (benchmarks/repredict.py --min-gpus 2: the 1B generation
# of 4 replicas, its calibration's CUDA context read short; one GPU's rows stay within it,
# docs/planning.md). P is then clear where P / (1 - u) <= 0.945 of the memory:
#     RETRY_MARGIN = 1 - (80.34 / 85.02) x (1 - 0.0389) = 9.2% of the GPU's memory.
# (The 12.5% before came from a 30B prediction 12.2% short, since corrected.)
# A CPU has no caching allocator: there (no calibration) the margin is 0.
RETRY_MARGIN = 1 - (80.34 / 85.02) * (1 - 0.0389)
# Offload is the last rung of the fallback ladder: an out-of-memory there ends the configuration,
# while one layer fewer on the GPU costs about 1/L of the speed. So on a GPU the split keeps 1% of
# the memory free beyond the predicted peak, three times the largest under-prediction measured for
# inference (-0.3%, benchmarks/results/2026-11-22-h100-memory/errors.md).
OFFLOAD_HEADROOM = 0.01


@dataclass(frozen=True)
class GpuTarget:
    """The GPUs a plan is for: detected, or described by the user."""

    name: str | None  # exact device name, if known
    count: int
    memory: float  # bytes per GPU
    described: bool
    memory_source: str | None = None  # where ``memory`` comes from
    # GPUs of one node: tensor parallelism stays inside one (its all-reduces need NVLink's bandwidth);
    # a job of more GPUs spans nodes (``fitbench.planning.nodes``)
    node_gpus: int = 8
    # bytes/s per GPU between nodes (``--inter-node-bandwidth``); None: calibrated, else the fabric's default
    inter_node_bandwidth: float | None = None

    @property
    def speed_name(self) -> str:
        """Whose datasheet figures the speed model uses."""
        return self.name if self.name and gpu_spec(self.name) else DEFAULT_SPEED_GPU

    def nodes(self, gpus: int, calibration: Calibration | None) -> Nodes | None:
        """The nodes a job of ``gpus`` of these GPUs spans and the link between them; None on one node."""
        return job_nodes(gpus, self.node_gpus, inter_node_link(self.speed_name, calibration,
                                                               self.inter_node_bandwidth))


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner weighs: a precision, the run's layout (``fitbench.spec.Layout``, the
    object the worker is given; its strategy and GPU count are the layout's), activation checkpointing
    and the batch per rank."""

    precision: str
    layout: Layout
    activation_checkpointing: bool
    batch_size: int
    resident_layers: int | None = None  # offload: decoder layers kept on the GPU, the rest in host memory
    compiled: bool = False  # torch.compile (``fitbench.planning.compiled``)
    cpu_offload: bool = False  # FSDP's: shards, gradients and optimizer state in host memory
    # With activation checkpointing: the first N decoder layers of each stage recompute, None every layer
    # (``fitbench.spec.RunSpec.checkpointed_layers``; ``fewest_checkpointed`` finds the fewest that fit)
    checkpointed_layers: int | None = None
    # A pipeline's training microbatches (``fitbench.spec.RunSpec.pipeline_microbatches``); None: its default
    microbatches: int | None = None

    @classmethod
    def of_strategy(cls, precision: str, strategy: str, gpus: int, activation_checkpointing: bool, batch_size: int,
                    *args, **options) -> Candidate:
        """The candidate of ``strategy`` over ``gpus`` (``Layout.of_strategy``)."""
        return cls(precision, Layout.of_strategy(strategy, gpus), activation_checkpointing, batch_size, *args,
                   **options)

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def gpus(self) -> int:
        return self.layout.world_size

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(layout=self.layout, offload=self.cpu_offload, microbatches=self.microbatches)

    def as_dict(self) -> dict:
        return {"precision": self.precision, "strategy": self.strategy, "gpus": self.gpus,
                **{k: v for k, v in self.__dict__.items() if k != "precision"}, "layout": self.layout.model_dump()}

    @property
    def label(self) -> str:
        layout = "1 GPU" if self.gpus == 1 else self.layout.label
        recompute = ("," + recompute_label(self.activation_checkpointing, self.checkpointed_layers, self.layout.pp)
                     if self.activation_checkpointing else "")
        offload = f", offload ({self.resident_layers} layers on the GPU)" if self.resident_layers is not None else ""
        offload += ", CPU offload" if self.cpu_offload else ""
        compiled = ", compiled" if self.compiled else ""
        return f"{self.precision}, {layout}{recompute}{offload}{compiled}, batch {self.batch_size}"


@dataclass(frozen=True)
class Assessment:
    candidate: Candidate
    memory: MemoryEstimate | None
    overheads: tuple[Term, ...]
    predicted_peak: float  # bytes per GPU, tensors and overheads
    fits: bool
    reason: str | None
    speed: StepTime | None
    peak_moment: str | None = None  # with the overheads, which can move it
    # What the choice ranked it by, where it was ranked (``forecast_tokens_per_s``)
    forecast_tokens_per_s: float | None = None
    # It fits with ``RETRY_MARGIN`` of the GPU's memory to spare (on a CPU, it fits): what automatic
    # choices take where they can
    clear: bool = False

    def as_dict(self) -> dict:
        return {
            "candidate": self.candidate.as_dict(),
            "peak_moment": self.peak_moment,
            "label": self.candidate.label,
            "predicted_peak_bytes": self.predicted_peak,
            "fits": self.fits,
            "reason": self.reason,
            "memory": self.memory.as_dict() if self.memory else None,
            "overheads": [{"name": t.name, "bytes": t.bytes, "formula": t.formula} for t in self.overheads],
            "speed": self.speed.as_dict() if self.speed else None,
            "forecast_tokens_per_s": self.forecast_tokens_per_s,
            "clear_of_retry_margin": self.clear,
        }


@dataclass(frozen=True)
class Plan:
    model: str
    mode: str
    target: GpuTarget
    chosen: Assessment | None
    feasible: tuple[Assessment, ...]
    rejected: tuple[Assessment, ...]
    calibration: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    inter_node_link: str | None = None  # where the plan spans nodes: the link between them, and its source
    backend: str = "native"  # whose build the plan predicts: native or hf

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "mode": self.mode,
            "hardware": self.target.__dict__,
            "calibration": self.calibration,
            "chosen": self.chosen.as_dict() if self.chosen else None,
            "feasible": [a.as_dict() for a in self.feasible],
            "rejected": [a.as_dict() for a in self.rejected],
            "notes": list(self.notes),
            "inter_node_link": self.inter_node_link,
            "backend": self.backend,
        }


LATE_BACKWARD = ("recompute of the last layer", "backward of the first layer", "end of the backward pass",
                 "backward of the second microbatch")


# Decoding stays eager with LLM.int8, whose outlier search synchronizes (``fitbench.models.backends``).


def decodes_through_graph(candidate: Candidate) -> bool:
    """Whether a generation of ``candidate`` replays its decode steps from a CUDA graph; offloaded
    layers stream in through hooks a graph cannot hold."""
    return entry(candidate.precision).graph_problem is None and candidate.resident_layers is None


def overhead_terms(arch: Architecture, mode: str, candidate: Candidate, memory: MemoryEstimate, moment: str,
                   seq_len: int, calibration: Calibration | None, backend: str | None = None) -> tuple[Term, ...]:
    """What the GPU gives the process beyond the step's tensors at ``moment`` (``fitbench.planning.calibration``);
    nothing on a CPU (``calibration`` None). The transformers backend decodes eagerly."""
    if calibration is None:
        return ()
    graph = decodes_through_graph(candidate) and (backend or default_backend(arch)) == "native"
    terms = [
        Term("CUDA context", calibration.context(mode, graph), calibration.source),
        Term("workspaces", calibration.workspace(mode, graph), "cuBLAS workspaces, allocated peak minus tensors"),
    ]
    if moment in LATE_BACKWARD:
        backend = backend or default_backend(arch)
        parallelism = candidate.parallelism  # a pipeline's backward pass holds one microbatch's gradients
        microbatches = parallelism.microbatches_of(candidate.batch_size) if parallelism.stages > 1 else 1
        tokens, tp = -(-candidate.batch_size // microbatches) * seq_len, parallelism.tensor
        widths = Widths.of(candidate.precision, candidate.parallelism)
        layer = (inductor.saved_per_layer(arch, tokens, widths.compute, widths.residual, tp)
                 if candidate.compiled and backend == "native"
                 else saved_per_layer(arch, tokens, widths, tp, backend=backend, context=seq_len))
        fragmentation = Term("allocator fragmentation", layer, "one layer's saved activations: gradients "
                             "allocated among freed activations late in the backward pass")
        if parallelism.shards > 1 and not parallelism.offload:
            # Measured on 2 x H200 (llama-3.1-8b, FSDP, bf16): the compute stream mapped 3.74 GiB beyond
            # the most it held, against rd E = 3.91 GiB (benchmarks/results/2026-11-24-h200x2-data-parallel).
            root_input = widths.weights * rank_edge_params(arch, tp, Stage(0, 1, range(arch.num_layers)))
            fragmentation = max(fragmentation, Term(
                "allocator fragmentation", root_input, "rd E: FSDP's root reduce-scatter input, one block larger "
                "than the holes the freed activations leave, maps pages of its own late in the backward pass, and "
                "the holes stay mapped"), key=lambda term: term.bytes)
        terms.append(fragmentation)
    else:
        terms.append(Term("allocator page rounding", Calibration.page_rounding(memory.total_at(moment)),
                          "expandable segments: the peak rounded up to 2 MiB"))
    layout = candidate.layout
    # the hf backend's pipeline stages are one process driving a GPU each: no communicator between them
    stages = layout.pp if (backend or default_backend(arch)) == "native" else 1
    degrees = {"data": layout.dp_replicate, "shard": layout.dp_shard, "tensor": layout.tp, "stage": stages}
    communicators = [name for name, degree in degrees.items() if degree > 1]
    if communicators:
        held = [NCCL_TENSOR_PARALLEL_GENERATION if name == "tensor" and mode == "infer"
                else calibration.nccl_per_communicator for name in communicators]
        terms.append(Term("NCCL buffers", sum(held),
                          f"{len(communicators)} communicator(s): one per parallel dimension of {layout.label} "
                          f"(a tensor-parallel generation's holds less: NCCL_TENSOR_PARALLEL_GENERATION)"))
    widths = Widths.of(candidate.precision)
    if mode == "infer" and graph and widths.autocast:
        terms.append(autocast_graph_pool(arch, candidate.batch_size, widths))
    return tuple(terms)


def autocast_graph_pool(arch: Architecture, batch: int, widths: Widths) -> Term:
    """The private memory pool of a decode step captured under autocast. Inside ``inference_mode``
    autocast caches no weight cast, so the captured step casts every fp32 matrix to 16 bits as it
    reaches it; the pool keeps room for the most the step holds at once, at the output projection:
    its 16-bit copy and the logits, c (V h + B V) (the largest MLP matrix instead, c h f, where that
    is larger). The pool stays reserved from the capture, in the first warm-up generation, to the
    end, so every measured prefill has it beside its own peak."""
    c, h, V = widths.compute, arch.hidden_size, arch.vocab_size
    largest = max(V * h, h * arch.ffn_size)
    return Term("decode graph pool", c * (largest + batch * V),
                f"{c} B x ({largest:,} + {batch} x {V:,}): the largest matrix cast to 16 bits beside the logits, "
                f"kept by the graph captured under autocast")


def assess(arch: Architecture, mode: str, candidate: Candidate, target: GpuTarget, *, seq_len: int,
           new_tokens: int, calibration: Calibration | None = DEFAULT, backend: str | None = None) -> Assessment:
    """Predict ``candidate``'s peak and speed; ``backend`` (native or hf, by default the family's)
    is the model the run builds."""
    problem = _layout_problem(arch, mode, candidate, target, backend or default_backend(arch))
    if problem:
        return Assessment(candidate, None, (), 0.0, False, problem, None)

    if mode in TRAINING_MODES:
        problem = entry(candidate.precision).training_problem
        if problem:
            return Assessment(candidate, None, (), 0.0, False, f"{candidate.label}: {problem}", None)
    memory = estimate_memory(arch, mode, candidate.precision, candidate.batch_size, seq_len, new_tokens=new_tokens,
                             activation_checkpointing=candidate.activation_checkpointing,
                             checkpointed_layers=candidate.checkpointed_layers,
                             parallelism=candidate.parallelism, resident_layers=candidate.resident_layers,
                             backend=backend, compiled=candidate.compiled)

    def total(moment: str, cached: bool = True) -> float:
        extra = overhead_terms(arch, mode, candidate, memory, moment, seq_len, calibration, backend)
        return memory.total_at(moment, cached) + sum(t.bytes for t in extra)

    # The overheads depend on the moment (fragmentation comes late in the backward pass), so the
    # peak is taken over tensors and overheads together. Streams' cached pools (``Term.cached``)
    # count in the peak but not in what must fit: where they would not fit the allocator releases
    # them and retries, so the GPU fills to its capacity, no further.
    moment = max(memory.moments, key=total)
    overheads = overhead_terms(arch, mode, candidate, memory, moment, seq_len, calibration, backend)
    needed = max(total(m, cached=False) for m in memory.moments)
    fits = needed <= target.memory
    peak = min(total(moment), max(needed, target.memory))
    reason = None if fits else (f"{candidate.label} needs {needed / 1e9:.1f} GB per GPU; "
                                f"{target.memory / 1e9:.1f} GB available{_data_parallel_why(candidate, memory)}")
    speed = estimate_step_time(arch, mode, candidate.precision, candidate.batch_size, seq_len, new_tokens=new_tokens,
                               parallelism=candidate.parallelism, gpu_name=target.speed_name,
                               activation_checkpointing=candidate.activation_checkpointing,
                               checkpointed_layers=candidate.checkpointed_layers,
                               offloaded_bytes=offloaded_weights(arch, candidate.precision, candidate.resident_layers)
                               if candidate.resident_layers is not None else 0.0,
                               links=bus_bandwidth(target.speed_name, calibration),
                               nodes=target.nodes(candidate.gpus, calibration))
    clear = fits and peak <= (1 - retry_margin(calibration)) * target.memory
    return Assessment(candidate, memory, overheads, peak, fits, reason, speed, moment, clear=clear)


def retry_margin(calibration: Calibration | None) -> float:
    """The share of the memory automatic choices keep free: ``RETRY_MARGIN`` on a GPU, none on a CPU
    (``calibration`` None), which has no caching allocator to retry."""
    return RETRY_MARGIN if calibration is not None else 0.0


# The terms that hold the model's state: what DDP replicates and FSDP shards.
STATE_TERMS = ("weights", "gradients", "gradient buckets", "optimizer state")


def _data_parallel_why(candidate: Candidate, memory: MemoryEstimate) -> str:
    """For a data-parallel layout that does not fit, what its layout does to the per-GPU need: DDP
    replicates the state, FSDP shards it and gathers units in flight."""
    if candidate.strategy not in ("ddp", "fsdp"):
        return ""
    state = sum(t.bytes for t in memory.terms if t.name in STATE_TERMS)
    if candidate.strategy == "ddp":
        return f" (weights, gradients and optimizer state replicated on each GPU: {state / 1e9:.1f} GB)"
    gathered = sum(t.bytes for t in memory.terms if t.name.startswith("FSDP") and memory.at_peak(t))
    where = ("in host memory" if candidate.cpu_offload else
             f"sharded {candidate.gpus} ways: {state / 1e9:.1f} GB")
    return f" (weights, gradients and optimizer state {where}; units gathered in flight {gathered / 1e9:.1f} GB)"


def _layout_problem(arch: Architecture, mode: str, candidate: Candidate, target: GpuTarget,
                    backend: str) -> str | None:
    """Why ``candidate`` cannot run on ``target`` whatever its memory: more GPUs than there are,
    offloaded layers over several, tensor parallelism wider than a node or across nodes, ranks that do
    not spread evenly over nodes (``fitbench.planning.nodes.placement_problem``), or what its layout does
    not compose with (``Layout.problem``)."""
    if candidate.gpus > target.count:
        return f"{candidate.label} needs {candidate.gpus} GPUs; {target.count} available"
    if candidate.resident_layers is not None and candidate.gpus > 1:
        return f"{candidate.label}: offload keeps the layers that do not fit on one GPU in host memory"
    placement = placement_problem(candidate.layout, target.node_gpus)
    if placement:
        return f"{candidate.label}: {placement}"
    problem = candidate.layout.problem(arch, mode, candidate.precision, backend, candidate.cpu_offload)
    return f"{candidate.label}: the run cannot launch {problem}" if problem else None


def layouts_for(arch: Architecture, mode: str, gpus: int, node_gpus: int = 8) -> list[Layout]:
    """The layouts of ``gpus`` GPUs the planner weighs: every tensor-parallel degree that divides the
    GPU count and fits in one node (``node_gpus``; those that do not divide the heads are listed too,
    to be rejected with their reason), every pipeline degree that divides what is left, up to the
    layer count (stages of unequal size where the layers require: ``fitbench.spec.pipeline_stages``),
    and in training data parallelism for the rest, replicated (DDP) or sharded (FSDP); and ``gpus``
    replicas. Of those, the ones whose degrees compose in ``mode`` (``Layout.composes``): replicas
    for inference and forward, whose independent copies, each with its own batch, add their
    throughputs; data parallelism for training, beside no pipeline stages."""
    found = []
    for tp in (d for d in range(1, min(gpus, node_gpus) + 1) if gpus % d == 0):
        for pp in (d for d in range(1, min(gpus // tp, arch.num_layers) + 1) if (gpus // tp) % d == 0):
            dp = gpus // (tp * pp)
            if dp == 1:
                found.append(Layout(tp=tp, pp=pp))
            elif mode in TRAINING_MODES:  # generation under DDP or FSDP runs on one GPU (fitbench.config)
                found += [Layout(dp_replicate=dp, tp=tp, pp=pp), Layout(dp_shard=dp, tp=tp, pp=pp)]
    if gpus > 1:
        found.append(Layout(replicas=gpus))
    return [layout for layout in found if layout.composes(mode)]


def forecast_tokens_per_s(arch: Architecture, mode: str, candidate: Candidate, target: GpuTarget, *, seq_len: int,
                          new_tokens: int, calibration: Calibration | None, backend: str | None = None,
                          ceiling: Ceilings | None = None, cuda_graphs: bool = True,
                          compile_decode: bool = True, symmetric_memory: bool = True) -> float:
    """The throughput the forecast (``fitbench.planning.forecast``) expects of ``candidate`` on ``target``'s
    GPUs, over every GPU its layout uses, what automatic choices rank layouts by:

        tokens/s = tokens per step x data-parallel ranks / forecast step time

    with a step's tokens B x T (one decode step's B in infer) and the data-parallel ranks those that
    take their own batch (DDP, FSDP, replicas; tensor-parallel and pipeline ranks share one), so N
    replicas forecast N times one GPU, and one GPU counts as itself beside N. A generation decodes as
    the run would (``decode_kind``: ``cuda_graphs`` and ``compile_decode`` as the run asks; a compiled
    tensor-parallel step sums its layers' all-reduces through symmetric memory unless
    ``symmetric_memory`` is off: ``fitbench.spec.RunSpec.one_shot_applies``); the
    collectives at ``calibration``'s bus bandwidth (else the datasheet's); ``ceiling`` by default
    the GPU's (``ceilings``)."""
    backend = backend or default_backend(arch)
    name = target.speed_name
    offloaded = candidate.resident_layers is not None
    decode = decode_kind(backend, candidate.precision, offloaded=offloaded, compiled=candidate.compiled,
                         cuda_graphs=cuda_graphs, compile_decode=compile_decode)
    one_shot = symmetric_memory and decode == "compiled" and backend == "native" and candidate.layout.tp > 1
    run = StepRun(backend, candidate.compiled, decode, one_shot=one_shot)
    forecast = forecast_step_time(
        arch, mode, candidate.precision, candidate.batch_size, seq_len, new_tokens=new_tokens,
        parallelism=candidate.parallelism, gpu_name=name,
        ceiling=ceiling or ceilings(name, load_ceilings(name)),
        run=run, activation_checkpointing=candidate.activation_checkpointing,
        checkpointed_layers=candidate.checkpointed_layers,
        offloaded_bytes=offloaded_weights(arch, candidate.precision, candidate.resident_layers) if offloaded else 0.0,
        links=bus_bandwidth(name, calibration), nodes=target.nodes(candidate.gpus, calibration))
    tokens = candidate.batch_size * (1 if mode == "infer" else seq_len) * candidate.layout.data_parallel
    return tokens / forecast.seconds


def fastest_first(arch: Architecture, mode: str, assessed: list[Assessment], target: GpuTarget, *, seq_len: int,
           new_tokens: int, calibration: Calibration | None, backend: str | None = None,
           **run: bool) -> list[Assessment]:
    """``assessed`` with their ``forecast_tokens_per_s``, fastest first, fewer GPUs first on a tie."""
    if not assessed:
        return []
    name = target.speed_name
    ceiling = ceilings(name, load_ceilings(name))
    forecast = [replace(a, forecast_tokens_per_s=forecast_tokens_per_s(
        arch, mode, a.candidate, target, seq_len=seq_len, new_tokens=new_tokens, calibration=calibration,
        backend=backend, ceiling=ceiling, **run)) for a in assessed]
    return sorted(forecast, key=lambda a: (-a.forecast_tokens_per_s, a.candidate.gpus))


def gpu_counts(available: int) -> list[int]:
    """1, 2, 4, 8 ... up to the GPUs available, and that count itself: the counts ``plan`` weighs
    (``minimum_gpus`` tries every count)."""
    counts, g = [], 1
    while g <= available:
        counts.append(g)
        g *= 2
    if available not in counts:
        counts.append(available)
    return counts


def largest_fitting_batch(arch, mode, candidate: Candidate, target, *, seq_len, new_tokens, calibration,
                          backend: str | None = None, clear: bool = False) -> int:
    """The largest batch predicted to fit (bisection on the monotone memory model); 0 if none. ``clear``:
    the largest clear of ``RETRY_MARGIN`` (``Assessment.clear``), else the largest that fits."""
    def assessed(batch: int) -> Assessment:
        return assess(arch, mode, replace(candidate, batch_size=batch), target, seq_len=seq_len,
                      new_tokens=new_tokens, calibration=calibration, backend=backend)

    found = largest(lambda batch: assessed(batch).clear, limit=MAX_AUTO_BATCH) if clear else 0
    return found or largest(lambda batch: assessed(batch).fits, limit=MAX_AUTO_BATCH)


def fewest_checkpointed(arch: Architecture, mode: str, every: Assessment, target: GpuTarget, *, seq_len: int,
                        new_tokens: int, calibration: Calibration | None, backend: str | None = None,
                        without: Assessment | None = None) -> Assessment:
    """``every``, a training candidate with every decoder layer checkpointed, assessed, with as few
    checkpointed layers per stage (``Candidate.checkpointed_layers``, the first C of each) as keep it
    clear of ``RETRY_MARGIN``. ``every`` itself where it is not clear (fewer layers recomputed would
    only stand nearer the edge, where the caching allocator's retries cost more than the recomputation
    saves: ``benchmarks/results/2026-11-27-h100x4-calibration-context``), where no fewer layers are
    clear, or where ``without`` (the same candidate without checkpointing) is already clear, so that
    checkpointing buys nothing.

    C runs from 1 to the busiest stage's layers (``fitbench.spec.pipeline_stages``; that many is every
    layer), and the predicted tensor peak falls as C grows (each layer more recomputed trades its saved
    activations for its input: ``fitbench.planning.training_memory.training_estimate``), so the fewest is found by
    bisection, about log2(layers) assessments. Near every layer the overheads can break the order (the
    fragmentation counted late in the backward pass stands beside every layer's recompute, not beside
    the start of it), so the count found is one whose own assessment is good, the fewest up to that.
    Fewer recomputed layers cost less time (``fitbench.planning.forecast``: the recomputation scales with
    C / layers): the fewest is the fastest."""
    candidate = every.candidate
    if mode not in TRAINING_MODES or not candidate.activation_checkpointing or not every.clear:
        return every
    if without is not None and without.clear:
        return every
    layers = max(len(stage) for stage in pipeline_stages(arch.num_layers, candidate.layout.pp))
    assessed: dict[int, Assessment] = {}

    def enough(count: int) -> bool:
        assessed[count] = assess(arch, mode, replace(candidate, checkpointed_layers=count), target, seq_len=seq_len,
                                 new_tokens=new_tokens, calibration=calibration, backend=backend)
        return assessed[count].clear

    low, high = 1, layers  # every layer (high) is clear
    while low < high:
        middle = (low + high) // 2
        if enough(middle):
            high = middle
        else:
            low = middle + 1
    return assessed[low] if low < layers else every


@dataclass(frozen=True)
class OffloadSplit:
    """How an offloaded run spreads its decoder layers: ``layer_memory`` bytes of the GPU for them
    (accelerate's ``max_memory``), ``layer_bytes`` each, ``resident_layers`` of them on the GPU."""

    layer_memory: float
    layer_bytes: float
    resident_layers: int


def offload_split(arch: Architecture, mode: str, precision: str, batch: int, seq_len: int, *, new_tokens: int,
                  budget: float, calibration: Calibration | None = None, backend: str | None = None) -> OffloadSplit:
    """The decoder layers an offloaded run keeps on a GPU of ``budget`` bytes.

    With S = w x parameters per layer and P0 what the run needs with every layer offloaded (its
    predicted peak: the edges, one layer in flight, the KV cache, temporaries; with ``calibration``,
    that is on a GPU, also the CUDA context, workspaces, one 2 MiB page of allocator rounding and
    ``OFFLOAD_HEADROOM`` of the budget kept free), k resident layers need P0 + k S while any layer
    is offloaded, and all L need P0 - S + L S (nothing in flight). The layers may therefore take

        X = budget - P0 + S

    bytes: the ``max_memory`` that accelerate's ``infer_auto_device_map`` gets. It keeps S of it free
    for the layer in flight while layers remain to place, so it puts all L layers on the GPU when
    L S <= X, and otherwise the largest k with (k + 1) S <= X: the largest k whose need is within the
    budget, so the split accelerate makes is the one predicted here. With X < S not even the layer
    in flight fits: every layer is offloaded, and the run is predicted not to fit.
    """
    width = Widths.of(precision).weights
    layer_bytes = width * arch.params_per_layer
    everything_offloaded = estimate_memory(arch, mode, precision, batch, seq_len, new_tokens=new_tokens,
                                           resident_layers=0, backend=backend).peak_bytes
    if calibration is not None:
        everything_offloaded += (calibration.context(mode, decode_graph=False)
                                 + calibration.workspace(mode, decode_graph=False) + PAGE
                                 + OFFLOAD_HEADROOM * budget)
    layer_memory = budget - everything_offloaded + layer_bytes
    L = arch.num_layers
    resident = L if L * layer_bytes <= layer_memory else max(0, int(layer_memory // layer_bytes) - 1)
    return OffloadSplit(layer_memory, layer_bytes, resident)


def plan(arch: Architecture, mode: str, target: GpuTarget, *, seq_len: int, new_tokens: int,
         batch_sizes: list[int] | None, precisions: list[str] | None = None,
         strategies: list[str] | None = None, checkpointing: list[bool] | None = None,
         calibration: Calibration = DEFAULT, backend: str | None = None) -> Plan:
    """``batch_sizes`` None means auto: each layout gets the largest batch predicted to fit (with
    checkpointing, of every layer: the batch is what it grows); ``backend``
    as in ``assess``, clear of ``RETRY_MARGIN`` where one is. The layouts are ``layouts_for`` each count
    of ``gpu_counts``, those that use only ``strategies`` where given (a combined layout, e.g. tp x
    pipeline, needs both named). The chosen one is, on the first rung of the ladder with any fit, the
    fastest forecast among those that fit (``fastest_first``), those clear of ``RETRY_MARGIN`` first
    where any is; layouts the run cannot launch are rejected with the reason. At a given batch, a
    checkpointed candidate keeps the fewest checkpointed layers that leave it as clear of the margin
    (``fewest_checkpointed``) where it is not so without checkpointing."""
    ladder = precisions or DEFAULT_LADDER[mode]
    recompute_options = checkpointing if checkpointing is not None else (
        [False, True] if mode in TRAINING_MODES else [False])
    assessments: list[Assessment] = []
    for precision in ladder:
        for gpus in gpu_counts(target.count):
            for layout in layouts_for(arch, mode, gpus, target.node_gpus):
                if strategies and not set(layout.strategy.split("+")) <= set(strategies):
                    continue
                without: dict[int, Assessment] = {}  # by batch: this layout without checkpointing
                for recompute in recompute_options:
                    base = Candidate(precision, layout, recompute, 1)
                    if batch_sizes is None:
                        batch = largest_fitting_batch(arch, mode, base, target, seq_len=seq_len,
                                                      new_tokens=new_tokens, calibration=calibration,
                                                      backend=backend, clear=True)
                        sizes = [batch or 1]
                    else:
                        sizes = batch_sizes
                    for batch in sizes:
                        assessed = assess(arch, mode, replace(base, batch_size=batch), target, seq_len=seq_len,
                                          new_tokens=new_tokens, calibration=calibration, backend=backend)
                        if recompute and batch_sizes is not None:
                            assessed = fewest_checkpointed(arch, mode, assessed, target, seq_len=seq_len,
                                                           new_tokens=new_tokens, calibration=calibration,
                                                           backend=backend, without=without.get(batch))
                        else:
                            without[batch] = assessed
                        assessments.append(assessed)
    fitting = fastest_first(arch, mode, [a for a in assessments if a.fits], target, seq_len=seq_len,
                            new_tokens=new_tokens, calibration=calibration, backend=backend)
    # stable sorts: fastest first within a rung, the rungs in order, those clear of the margin first
    fitting.sort(key=lambda a: ladder.index(a.candidate.precision))
    fitting.sort(key=lambda a: not a.clear)
    chosen = fitting[0] if fitting else None
    # First the layouts of the chosen precision that do not fit: why it is not run more simply.
    rejected = sorted((a for a in assessments if not a.fits),
                      key=lambda a: chosen is None or a.candidate.precision != chosen.candidate.precision)
    notes = []
    if chosen and not chosen.clear:
        notes.append(f"{chosen.candidate.label} is predicted within {RETRY_MARGIN:.1%} of the GPU's memory, where "
                     f"the caching allocator's retries slow every step, and nothing else fits clear of it")
    if target.speed_name != target.name:
        notes.append(f"speed estimates use {target.speed_name} figures; name the GPU with --gpu for others")
    nodes = target.nodes(target.count, calibration)
    return Plan(arch.name, mode, target, chosen, tuple(fitting), tuple(rejected), calibration.source, tuple(notes),
                nodes.link.source if nodes else None, backend or default_backend(arch))


def node_counts(node_gpus: int, max_gpus: int) -> list[int]:
    """The GPU counts that fill whole nodes of ``node_gpus`` alike, fewest nodes first, then fewest
    GPUs: 1 to ``node_gpus`` on one node, then on n nodes each n x k with k GPUs on every node
    (k > (n - 1) / n x ``node_gpus``, or fewer nodes would hold them), up to ``max_gpus``."""
    counts = []
    for nodes in range(1, max_gpus // node_gpus + 2):
        counts += [nodes * k for k in range(1, node_gpus + 1)
                   if (nodes - 1) * node_gpus < nodes * k <= max_gpus]
    return counts


def fewest_gpus(arch: Architecture, mode: str, precision: str, gpu_memory: float, *, seq_len: int,
                new_tokens: int, batch_size: int = 1, max_gpus: int = MOST_GPUS, calibration: Calibration = DEFAULT,
                backend: str | None = None, gpu_name: str | None = None, node_gpus: int = 8,
                inter_node_bandwidth: float | None = None, clear_only: bool = False) -> Assessment | None:
    """The fewest nodes of ``node_gpus`` GPUs of ``gpu_memory`` bytes, and on them the fewest GPUs (the
    same count on every node: ``node_counts``), that run this at ``batch_size``, and the layout that
    does it: of the layouts of that count (``layouts_for``) that the run can launch (``Layout.problem``,
    tensor parallelism inside a node) and that fit, the fastest forecast (``fastest_first``) of those
    clear of ``RETRY_MARGIN`` where any is; in training with activation checkpointing only where
    nothing fits without it, and then of the fewest layers that do (``fewest_checkpointed``). None if
    more than ``max_gpus`` would be needed. ``gpu_name``: whose speed figures rank the layouts (by default
    ``DEFAULT_SPEED_GPU``'s). ``clear_only``: the fewest on which a layout fits clear of the margin, the
    count on which ``plan`` keeps this precision rather than taking the ladder's next."""
    target = GpuTarget(gpu_name, max_gpus, gpu_memory, described=True, node_gpus=node_gpus,
                       inter_node_bandwidth=inter_node_bandwidth)
    for gpus in node_counts(node_gpus, max_gpus):
        layouts = layouts_for(arch, mode, gpus, node_gpus)
        for recompute in ([False, True] if mode in TRAINING_MODES else [False]):
            fitting = [fewest_checkpointed(arch, mode, assessed, target, seq_len=seq_len, new_tokens=new_tokens,
                                           calibration=calibration, backend=backend)
                       for assessed in (
                assess(arch, mode, Candidate(precision, layout, recompute, batch_size), target,
                       seq_len=seq_len, new_tokens=new_tokens, calibration=calibration, backend=backend)
                for layout in layouts) if assessed.fits]
            if clear_only:
                fitting = [assessed for assessed in fitting if assessed.clear]
            if fitting:
                return fastest_first(arch, mode, [a for a in fitting if a.clear] or fitting, target,
                                     seq_len=seq_len, new_tokens=new_tokens, calibration=calibration,
                                     backend=backend)[0]
    return None


def unsplittable(arch: Architecture, mode: str, precision: str, gpus: int, node_gpus: int = 8,
                 backend: str | None = None) -> str | None:
    """Why no layout of ``gpus`` GPUs splits this model at all, whatever its memory: every layout that
    would divide its weights (tensor parallelism, pipeline stages, FSDP) refused (``Layout.problem``);
    the pipeline's reason, else the first. None where one of them can launch."""
    backend = backend or default_backend(arch)
    splits = [layout for layout in layouts_for(arch, mode, gpus, node_gpus)
              if layout.tp > 1 or layout.pp > 1 or layout.dp_shard > 1]
    problems = [(layout, layout.problem(arch, mode, precision, backend)) for layout in splits]
    if not problems or any(problem is None for _, problem in problems):
        return None
    return next((problem for layout, problem in problems if layout.pp > 1 and layout.tp == 1), problems[0][1])


def minimum_gpus(arch: Architecture, mode: str, precision: str, gpu_memory: float, *, seq_len: int,
                 new_tokens: int, batch_size: int = 1, max_gpus: int = MOST_GPUS,
                 calibration: Calibration = DEFAULT, backend: str | None = None) -> tuple[int, str] | None:
    """The fewest GPUs of ``gpu_memory`` bytes that run this at ``batch_size``, and how (the label of
    ``fewest_gpus``'s choice); None if more than ``max_gpus`` would be needed."""
    found = fewest_gpus(arch, mode, precision, gpu_memory, seq_len=seq_len, new_tokens=new_tokens,
                        batch_size=batch_size, max_gpus=max_gpus, calibration=calibration, backend=backend)
    return (found.candidate.gpus, found.candidate.label) if found else None


def planner_choices(mode: str, choose_precision: bool, choose_recompute: bool, choose_strategy: bool = False) -> list[str]:
    """What the planner decides for a ``fitbench run`` configuration of ``mode``."""
    return [name for name, chose in (("precision", choose_precision),
                                     ("activation_checkpointing", choose_recompute and mode in TRAINING_MODES),
                                     ("layout", choose_strategy)) if chose]


def predict_spec(arch: Architecture, spec, target: GpuTarget, calibration: Calibration | None, *,
                 choose_precision: bool, choose_recompute: bool, runnable: tuple[str, ...],
                 choose_strategy: bool = False, gpus: int | None = None, ladder: list[str] | None = None):
    """Plan one ``fitbench run`` configuration on its GPUs (one, or its layout's world size): choose
    the precision and activation checkpointing the user left open (first rung of the ladder that
    fits: ``ladder``, the run's, else ``DEFAULT_LADDER``, its rungs among ``runnable``) and, with
    ``choose_strategy``, the layout of ``gpus`` ranks (by default the layout's world size): one GPU
    or any of ``layouts_for`` those ranks that the run can launch, the fastest forecast among those
    that fit (``fastest_first``: N replicas count N GPUs' tokens, one GPU its own), as ``plan``
    chooses. Those choices take a candidate clear of ``RETRY_MARGIN`` where the ladder has one
    (checkpointing or another layout before a step at the edge), else the first that fits; the
    prediction says ``within_retry_margin`` when what it chose is not clear of it. And predict the
    peak per GPU (compiled when ``spec.compile``); an offloaded one keeps the layers ``offload_split``
    finds room for. When nothing fits, the option that comes closest (the
    smallest peak) stands for the configuration: what its refusal names.
    Returns the spec to run and the prediction stored with its result. ``calibration`` None: a CPU,
    tensors only."""
    ladder = ([p for p in ladder or DEFAULT_LADDER[spec.mode] if p in runnable] if choose_precision
              else [spec.precision])
    if spec.offload:
        ladder = [p for p in ladder if not entry(p).quantized]
    recompute = [False, True] if choose_recompute and spec.mode in TRAINING_MODES else [spec.activation_checkpointing]

    def resident(precision: str) -> int | None:
        if not spec.layer_offload:
            return None
        return offload_split(arch, spec.mode, precision, spec.batch_size, spec.seq_len, new_tokens=spec.new_tokens,
                             budget=target.memory, calibration=calibration, backend=spec.backend).resident_layers

    ranks = gpus if choose_strategy and gpus else spec.layout.world_size
    layouts = ([Layout(), *layouts_for(arch, spec.mode, ranks, target.node_gpus)] if choose_strategy and ranks > 1
               else [spec.layout])
    def options_of(precision: str, layout: Layout) -> list[Assessment]:
        """The layout with checkpointing and without, as chosen or given; a chosen one of the fewest layers
        that leave it as clear of the margin (``fewest_checkpointed``)."""
        found: list[Assessment] = []
        for ac in recompute:
            candidate = Candidate(precision, layout, ac, spec.batch_size, resident_layers=resident(precision),
                                            compiled=spec.compile, cpu_offload=spec.offload and layout.world_size > 1,
                                            checkpointed_layers=spec.checkpointed_layers if ac else None)
            assessed = assess(arch, spec.mode, candidate, target, seq_len=spec.seq_len, new_tokens=spec.new_tokens,
                              calibration=calibration, backend=spec.backend)
            if ac and choose_recompute:
                assessed = fewest_checkpointed(arch, spec.mode, assessed, target, seq_len=spec.seq_len,
                                               new_tokens=spec.new_tokens, calibration=calibration,
                                               backend=spec.backend, without=found[0] if found else None)
            found.append(assessed)
        return found

    groups = [[option for layout in layouts for option in options_of(precision, layout)] for precision in ladder]
    options = [option for group in groups for option in group]
    first = (next((clear for group in groups if (clear := [a for a in group if a.clear])), None)
             or next((fitting for group in groups if (fitting := [a for a in group if a.fits])), None))
    estimated = [a for a in options if a.memory is not None] or options
    run = dict(cuda_graphs=spec.cuda_graphs, compile_decode=spec.compile_decode,
               symmetric_memory=spec.symmetric_memory)

    def ranked(assessed: list[Assessment]) -> list[Assessment]:
        return fastest_first(arch, spec.mode, assessed, target, seq_len=spec.seq_len, new_tokens=spec.new_tokens,
                             calibration=calibration, backend=spec.backend, **run)

    chosen = ranked(first)[0] if first else min(estimated, key=lambda a: a.predicted_peak)
    # the ladder's later precisions, each at its fastest layout clear of the margin: what the warning weighs
    at = next((i for i, group in enumerate(groups) if chosen.candidate in [a.candidate for a in group]),
              len(groups))
    later = [a for group in groups[at + 1:] for a in group if a.clear] \
        if first and choose_precision and calibration is not None else []
    candidate = chosen.candidate
    planned = spec.model_copy(update={"precision": candidate.precision, "layout": candidate.layout,
                                      "activation_checkpointing": candidate.activation_checkpointing,
                                      "checkpointed_layers": candidate.checkpointed_layers
                                      if candidate.activation_checkpointing else None})
    forecast = (_forecast(arch, planned, target, calibration, chosen)
                if chosen.speed and calibration is not None else None)
    return planned, {
        "predicted_peak_bytes": chosen.predicted_peak,
        "tensor_peak_bytes": chosen.memory.peak_bytes,
        "peak_moment": chosen.peak_moment,
        "fits": chosen.fits,
        "within_retry_margin": chosen.fits and not chosen.clear,
        "gpu_memory_bytes": target.memory,
        "resident_layers": candidate.resident_layers,
        "chosen_by_planner": planner_choices(spec.mode, choose_precision, choose_recompute,
                                             choose_strategy and ranks > 1),
        "rejected": [a.reason for a in options if not a.fits],
        "terms": [{"name": t.name, "bytes": t.bytes, "at_peak": t.moments is None or chosen.peak_moment in t.moments}
                  for t in chosen.memory.terms]
                 + [{"name": t.name, "bytes": t.bytes, "at_peak": True} for t in chosen.overheads],
        "step_time_estimate_s": chosen.speed.seconds if chosen.speed else None,
        # a CPU's run (no calibration) is not forecast: the speed model is a GPU's
        "step_time_forecast_s": forecast,
        "warnings": slower_than_bf16(arch, planned, target, calibration, chosen, forecast)
                    + (faster_precision(chosen, ranked(later)[:1]) if later else []),
        "calibration": calibration.source if calibration else TENSORS_ONLY,
        **_stage_predictions(arch, spec.mode, chosen, spec.seq_len, spec.new_tokens, spec.backend),
    }


# How much faster, by the forecast, a later precision of the ladder must run than the one chosen before the
# row says so: twice, beyond the forecast's worst error over the rows of several GPUs (25%, issue target).
FASTER_PRECISION_RATIO = 2.0


def faster_precision(chosen: Assessment, later: list[Assessment]) -> list[str]:
    """A warning for the row when the ladder's first precision that fits (``chosen``) is forecast at most half
    as fast as a later one's fastest layout (``later``: that one, ranked, or nothing): the ladder orders
    precisions by the user's preference, so the planner keeps the first, and the row names the faster one
    (both forecasts in tokens/s, ``forecast_tokens_per_s``)."""
    if not later or not chosen.forecast_tokens_per_s or not later[0].forecast_tokens_per_s:
        return []
    faster, base = later[0], chosen.forecast_tokens_per_s
    if faster.forecast_tokens_per_s < FASTER_PRECISION_RATIO * base:
        return []
    return [f"{faster.candidate.label} is forecast {faster.forecast_tokens_per_s / base:.1f}x as fast as the chosen "
            f"{chosen.candidate.label} ({faster.forecast_tokens_per_s:,.0f} against {base:,.0f} tokens/s); "
            f"{chosen.candidate.precision} comes first in the precision ladder, so it runs: give --precision "
            f"{faster.candidate.precision} to run the faster one"]


def slower_than_bf16(arch: Architecture, spec, target: GpuTarget, calibration: Calibration | None,
                     chosen: Assessment, forecast: float | None) -> list[str]:
    """A warning for the row when ``spec`` decodes in a weight-only format (the entry's ``weight_only``) that the
    forecast puts slower than bf16 weights at the same batch and layout: its kernels read fewer bytes
    but, past batch 1, some run far below the bandwidth that bf16's matmuls reach (the forecast's
    its entry's ``decode``); nothing where there is no forecast."""
    if spec.mode != "infer" or not entry(spec.precision).weight_only or forecast is None:
        return []
    base = _forecast(arch, spec.model_copy(update={"precision": UNQUANTIZED_BASE}), target, calibration, chosen)
    if forecast <= base:
        return []
    return [f"{spec.precision} is forecast slower than {UNQUANTIZED_BASE} at batch {spec.batch_size}: "
            f"{forecast * 1e3:.2f} against {base * 1e3:.2f} ms per decode step; its kernels pay off at batch 1, so "
            f"decode this batch with --precision {UNQUANTIZED_BASE}, or this precision at a smaller batch"]


def _forecast(arch: Architecture, spec, target: GpuTarget, calibration: Calibration | None,
              chosen: Assessment) -> float:
    """The forecast step time of the configuration that runs (``fitbench.planning.forecast``), at the
    ceilings ``fitbench env --measure`` cached for the GPU where there are some."""
    name = target.speed_name
    resident = chosen.candidate.resident_layers
    offloaded = offloaded_weights(arch, spec.precision, resident) if resident is not None else 0.0
    return forecast_spec(arch, spec, name, ceilings(name, load_ceilings(name)), run=step_run(spec),
                         offloaded_bytes=offloaded, links=bus_bandwidth(name, calibration),
                         nodes=target.nodes(spec.layout.world_size, calibration)).seconds


def _stage_predictions(arch: Architecture, mode: str, chosen: Assessment, seq_len: int, new_tokens: int,
                       backend: str | None) -> dict:
    """Under pipeline parallelism, the stage whose peak the prediction is, and each stage's predicted
    peak in rank order of the stages (the chosen moment's overheads beside each stage's tensors), to
    hold against each GPU's measured peak; nothing for one stage."""
    candidate = chosen.candidate
    if chosen.memory is None or chosen.memory.stage is None:
        return {}
    overheads = sum(t.bytes for t in chosen.overheads)
    stages = stage_estimates(arch, mode, candidate.precision, candidate.batch_size, seq_len, new_tokens=new_tokens,
                             activation_checkpointing=candidate.activation_checkpointing,
                             checkpointed_layers=candidate.checkpointed_layers,
                             parallelism=candidate.parallelism, backend=backend, compiled=candidate.compiled)
    return {"peak_stage": chosen.memory.stage.label,
            "stage_predicted_peak_bytes": [estimate.peak_bytes + overheads for estimate in stages]}


STRATEGY_NAMES = {"fsdp": "FSDP", "tp": "tensor parallel", "pipeline": "pipeline stages"}


@dataclass(frozen=True)
class Alternative:
    """A change that makes a configuration predicted not to fit fit: ``change`` in words, and the
    assessment of the changed configuration (its per-GPU peak)."""

    change: str
    assessment: Assessment

    @property
    def summary(self) -> str:
        gpus = self.assessment.candidate.gpus
        each = " each" if gpus > 1 else ""
        return f"{self.change} at {format_bytes(self.assessment.predicted_peak)}{each}"

    def as_dict(self) -> dict:
        return {"change": self.change, "candidate": self.assessment.candidate.as_dict(),
                "predicted_peak_bytes": self.assessment.predicted_peak, "label": self.assessment.candidate.label}


def alternatives(arch: Architecture, spec, target: GpuTarget, calibration: Calibration | None, *,
                 max_gpus: int = MOST_GPUS) -> list[Alternative]:
    """What would make ``spec`` (one ``fitbench run`` configuration, predicted not to fit on its GPUs of
    ``target``: one, or its layout's) fit, each change alone, where it applies, in this order:

    - activation checkpointing, in training that has it off (of the fewest layers that fit:
      ``fewest_checkpointed``), or of every layer where it checkpoints some;
    - another precision of the mode's ladder (``DEFAULT_LADDER``; in training, those that train every
      weight), with checkpointing where only that fits;
    - the largest smaller batch that fits (not for ``--batch-size auto``, which tried batch 1);
    - training: low-rank adapters on an nf4 base (QLoRA) on these GPUs;
    - inference on one GPU: ``--offload`` with the layers ``offload_split`` finds room for, in a
      floating-point precision (the spec's, else ``UNQUANTIZED_BASE``);
    - the fewest GPUs of this kind (on the fewest nodes, the same count on each: ``node_counts``, up to
      ``max_gpus``) on which a layout that divides the
      memory (``layouts_for``: FSDP, tensor parallel, pipeline stages and their combinations; not DDP
      or replicas, which replicate it) fits, the fastest forecast among those (``fastest_first``).

    Each keeps everything else of the spec, its layout included. Returns only the changes predicted
    to fit."""

    mode, batch, seq_len, new_tokens = spec.mode, spec.batch_size, spec.seq_len, spec.new_tokens
    training = mode in TRAINING_MODES
    recompute = [spec.activation_checkpointing, True] if training and not spec.activation_checkpointing \
        else [spec.activation_checkpointing]
    layout = spec.layout
    one = replace(target, count=layout.world_size)
    here = "on this GPU" if layout.world_size == 1 else "on these GPUs"

    def first_fitting(candidates) -> Assessment | None:
        for candidate in candidates:
            assessed = assess(arch, mode, candidate, one, seq_len=seq_len, new_tokens=new_tokens,
                              calibration=calibration, backend=spec.backend)
            if assessed.fits:
                return assessed
        return None

    def single(precision: str, ac: bool, batch_size: int = batch) -> Candidate:
        """The spec with these changes, on its own layout (checkpointing the spec's layers where it has
        checkpointing, every layer where it is turned on here)."""
        return Candidate(precision, layout, ac, batch_size, compiled=spec.compile,
                                   cpu_offload=spec.fsdp_offload,
                                   checkpointed_layers=spec.checkpointed_layers if ac and spec.activation_checkpointing
                                   else None)

    def with_recompute(candidate: Candidate) -> str:
        return " with activation checkpointing" if candidate.activation_checkpointing and \
            not spec.activation_checkpointing else ""

    found: list[Alternative] = []
    if training and not spec.activation_checkpointing:
        fits = first_fitting([single(spec.precision, True)])
        if fits:  # of the fewest layers that fit
            fits = fewest_checkpointed(arch, mode, fits, one, seq_len=seq_len, new_tokens=new_tokens,
                                       calibration=calibration, backend=spec.backend)
            layers = fits.candidate.checkpointed_layers
            found.append(Alternative("with activation checkpointing" + (f" of {layers} layers" if layers else ""),
                                     fits))
    if training and spec.checkpointed_layers is not None:
        fits = first_fitting([replace(single(spec.precision, True), checkpointed_layers=None)])
        if fits:
            found.append(Alternative("with activation checkpointing of every layer", fits))
    for precision in DEFAULT_LADDER[mode]:
        if precision == spec.precision or (training and not entry(precision).trains_every_weight):
            continue
        fits = first_fitting([single(precision, ac) for ac in recompute])
        if fits:
            found.append(Alternative(f"in {precision}{with_recompute(fits.candidate)}", fits))
    if batch > 1 and not spec.auto_batch:
        for ac in recompute:
            smaller = largest_fitting_batch(arch, mode, single(spec.precision, ac, 1), one, seq_len=seq_len,
                                            new_tokens=new_tokens, calibration=calibration, backend=spec.backend)
            if 0 < smaller < batch:
                fits = first_fitting([single(spec.precision, ac, smaller)])
                found.append(Alternative(f"at batch {smaller}{with_recompute(fits.candidate)}", fits))
                break
    if training and not entry(spec.precision).quantized:
        fits = first_fitting([single(ADAPTER_BASE, ac) for ac in recompute])
        if fits:
            found.append(Alternative(f"as {ADAPTER_BASE} adapters (QLoRA) {here}{with_recompute(fits.candidate)}",
                                     fits))
    precision = spec.precision if not entry(spec.precision).quantized else UNQUANTIZED_BASE
    if layout.world_size == 1 and not spec.offload and layout.offload_problem(mode, precision, spec.backend,
                                                                              spec.compile) is None:
        split = offload_split(arch, mode, precision, batch, seq_len, new_tokens=new_tokens, budget=target.memory,
                              calibration=calibration, backend=spec.backend)
        fits = first_fitting([Candidate.of_strategy(precision, "single", 1, False, batch, split.resident_layers)])
        if fits:
            found.append(Alternative(f"with --offload in {precision} ({split.resident_layers} of {arch.num_layers} "
                                     f"layers on the GPU)", fits))
    many = replace(target, count=max_gpus)
    for gpus in node_counts(target.node_gpus, max_gpus)[1:]:
        layouts = [Candidate(spec.precision, other, ac, batch, compiled=spec.compile)
                   for other in layouts_for(arch, mode, gpus, target.node_gpus)
                   if other.dp_replicate == 1 and other.replicas == 1 for ac in recompute]
        fitting = [a for a in (assess(arch, mode, c, many, seq_len=seq_len, new_tokens=new_tokens,
                                      calibration=calibration, backend=spec.backend) for c in layouts) if a.fits]
        if fitting:
            best = fastest_first(arch, mode, fitting, many, seq_len=seq_len, new_tokens=new_tokens,
                                 calibration=calibration, backend=spec.backend)[0]
            found.append(Alternative(f"on {gpus} GPUs with {layout_words(best.candidate.layout)}"
                                     f"{with_recompute(best.candidate)}", best))
            break
    return found


def layout_words(layout: Layout) -> str:
    """``FSDP``, ``tensor parallel``, ``pipeline stages``; a combined layout by its degrees (``tp 8 x
    pipeline 2``)."""
    return STRATEGY_NAMES.get(layout.strategy, layout.label)


def refusal(arch: Architecture, spec, prediction: dict, target: GpuTarget,
            found: list[Alternative]) -> str:
    """One paragraph: why ``spec`` is not launched (the need ``predict_spec`` predicted for it against
    the GPU's memory, per GPU under its layout) and the ``found`` alternatives that would fit, e.g.
    "30B train in bf16-pure with activation checkpointing needs 261.3 GB on one GPU of 150.1 GB; it
    fits on 2 GPUs with FSDP at 131.0 GB each, or as nf4 adapters (QLoRA) on this GPU at 41.0 GB", or
    "65B train in bf16 at batch 4 x 512 tokens under the layout tp x 4 is predicted to need 97.0 GB
    per GPU, on 4 GPUs of 85.0 GB each"."""
    recompute = (" with activation checkpointing" + (f" of {spec.checkpointed_layers} layers"
                                                     if spec.checkpointed_layers else "")
                 if spec.activation_checkpointing else "")
    offload = " with --offload" if spec.offload else ""
    what = f"{spec.model} {spec.mode} in {spec.precision}{recompute}{offload} at batch {spec.batch_size}"
    need = format_bytes(prediction["predicted_peak_bytes"])
    gpus = spec.layout.world_size
    need = (f"refused before launch: {what} x {spec.seq_len} tokens is predicted to need {need} on one GPU of "
            f"{format_bytes(target.memory)}" if gpus == 1 else
            f"refused before launch: {what} x {spec.seq_len} tokens under the layout {spec.layout.label} is "
            f"predicted to need {need} per GPU, on {gpus} GPUs of {format_bytes(target.memory)} each")
    if not found:
        return f"{need}, and no change of precision, checkpointing, batch, layout or GPU count makes it fit."
    options = [alternative.summary for alternative in found]
    listed = options[0] if len(options) == 1 else ", ".join(options[:-1]) + ", or " + options[-1]
    return f"{need}; it fits {listed}."
