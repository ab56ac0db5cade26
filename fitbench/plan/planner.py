"""Enumerate ways to run a model on some GPUs, keep those predicted to fit, rank, and explain.

A candidate is a precision, a strategy over a GPU count, activation checkpointing on or off and a
batch size. Its predicted per-GPU peak is the memory model's tensor terms plus the calibrated
overheads (CUDA context, cuBLAS workspace, allocator page rounding, NCCL buffers). It fits when
that peak is at most the GPU's memory. An offloaded candidate (inference on one GPU) keeps only
some decoder layers on the GPU; ``offload_split`` says how many fit.

The precision ladder is an order of preference (quality first): the chosen plan uses the first
rung that has a fitting candidate, and among that rung's candidates the highest predicted
throughput (fewer GPUs on a tie). Every rejected candidate keeps its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fitbench import hardware
from fitbench.models.architecture import Architecture
from fitbench.models.backends import default_backend
from fitbench.plan.calibration import DEFAULT, PAGE, Calibration
from fitbench.plan.memory import (QUANTIZED, TRAINING_MODES, MemoryEstimate, Parallelism, Term, Widths, estimate_memory,
                                  offloaded_weights, saved_per_layer)
from fitbench.plan.speed import StepTime, estimate_step_time
from fitbench.run.precision import training_problem

# Names people type for --gpu, to the exact device names of the peak table.
GPU_ALIASES = {
    "H100-80GB": "NVIDIA H100 80GB HBM3", "H100": "NVIDIA H100 80GB HBM3", "H100-SXM": "NVIDIA H100 80GB HBM3",
    "H100-PCIE": "NVIDIA H100 PCIe", "H100-NVL": "NVIDIA H100 NVL", "H200": "NVIDIA H200",
    "H200-NVL": "NVIDIA H200 NVL", "A100-80GB": "NVIDIA A100-SXM4-80GB", "A100-40GB": "NVIDIA A100-SXM4-40GB",
    "A100-80GB-PCIE": "NVIDIA A100 80GB PCIe", "A100-40GB-PCIE": "NVIDIA A100-PCIE-40GB", "L40S": "NVIDIA L40S",
    "L4": "NVIDIA L4", "RTX4090": "NVIDIA GeForce RTX 4090", "RTX3090": "NVIDIA GeForce RTX 3090",
}
DEFAULT_SPEED_GPU = "NVIDIA H100 80GB HBM3"

DEFAULT_LADDER = {
    "train": ["bf16", "bf16-pure"],
    "forward-backward": ["bf16", "bf16-pure"],
    "forward": ["bf16-pure", "int8", "nf4"],
    "infer": ["bf16-pure", "int8", "nf4"],
}
MAX_AUTO_BATCH = 1 << 16
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

    @property
    def speed_name(self) -> str:
        """Whose datasheet figures the speed model uses."""
        return self.name if self.name and hardware.gpu_spec(self.name) else DEFAULT_SPEED_GPU


@dataclass(frozen=True)
class Candidate:
    precision: str
    strategy: str
    gpus: int
    activation_checkpointing: bool
    batch_size: int
    resident_layers: int | None = None  # offload: decoder layers kept on the GPU, the rest in host memory

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(self.strategy, self.gpus)

    @property
    def label(self) -> str:
        layout = "1 GPU" if self.gpus == 1 else f"{self.strategy} x {self.gpus}"
        recompute = ", recompute" if self.activation_checkpointing else ""
        offload = f", offload ({self.resident_layers} layers on the GPU)" if self.resident_layers is not None else ""
        return f"{self.precision}, {layout}{recompute}{offload}, batch {self.batch_size}"


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

    def as_dict(self) -> dict:
        return {
            "candidate": self.candidate.__dict__,
            "peak_moment": self.peak_moment,
            "label": self.candidate.label,
            "predicted_peak_bytes": self.predicted_peak,
            "fits": self.fits,
            "reason": self.reason,
            "memory": self.memory.as_dict() if self.memory else None,
            "overheads": [{"name": t.name, "bytes": t.bytes, "formula": t.formula} for t in self.overheads],
            "speed": self.speed.as_dict() if self.speed else None,
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
        }


LATE_BACKWARD = ("recompute of the last layer", "backward of the first layer", "end of the backward pass")


# Decoding stays eager under autocast (its 16-bit weight copies live one generation) and with
# LLM.int8, whose outlier search synchronizes (``fitbench.models.backends``).
EAGER_DECODE_PRECISIONS = ("bf16", "fp16", "int8")


def decodes_through_graph(candidate: Candidate) -> bool:
    """Whether a generation of ``candidate`` replays its decode steps from a CUDA graph; offloaded
    layers stream in through hooks a graph cannot hold."""
    return candidate.precision not in EAGER_DECODE_PRECISIONS and candidate.resident_layers is None


def overhead_terms(arch: Architecture, mode: str, candidate: Candidate, memory: MemoryEstimate, moment: str,
                   seq_len: int, calibration: Calibration, backend: str | None = None) -> tuple[Term, ...]:
    """What the GPU gives the process beyond the step's tensors at ``moment`` (``fitbench.plan.calibration``)."""
    graph = decodes_through_graph(candidate)
    terms = [
        Term("CUDA context", calibration.context(mode, graph), calibration.source),
        Term("workspaces", calibration.workspace(mode, graph), "cuBLAS workspaces, allocated peak minus tensors"),
    ]
    if moment in LATE_BACKWARD:
        layer = saved_per_layer(arch, candidate.batch_size * seq_len, Widths.of(candidate.precision),
                                candidate.parallelism.tensor, backend=backend or default_backend(arch),
                                context=seq_len)
        terms.append(Term("allocator fragmentation", layer, "one layer's saved activations: gradients allocated "
                          "among freed activations late in the backward pass"))
    else:
        terms.append(Term("allocator page rounding", Calibration.page_rounding(memory.total_at(moment)),
                          "expandable segments: the peak rounded up to 2 MiB"))
    if candidate.gpus > 1:
        terms.append(Term("NCCL buffers", calibration.nccl_per_communicator, "one communicator"))
    return tuple(terms)


def assess(arch: Architecture, mode: str, candidate: Candidate, target: GpuTarget, *, seq_len: int,
           new_tokens: int, calibration: Calibration = DEFAULT, backend: str | None = None) -> Assessment:
    """Predict ``candidate``'s peak and speed; ``backend`` (native or hf, by default the family's)
    is the model the run builds."""
    problem = _layout_problem(arch, candidate, target)
    if problem:
        return Assessment(candidate, None, (), 0.0, False, problem, None)

    if mode in TRAINING_MODES:
        problem = training_problem(candidate.precision)
        if problem:
            return Assessment(candidate, None, (), 0.0, False, f"{candidate.label}: {problem}", None)
    memory = estimate_memory(arch, mode, candidate.precision, candidate.batch_size, seq_len, new_tokens=new_tokens,
                             activation_checkpointing=candidate.activation_checkpointing,
                             parallelism=candidate.parallelism, resident_layers=candidate.resident_layers,
                             backend=backend)

    def total(moment: str) -> float:
        extra = overhead_terms(arch, mode, candidate, memory, moment, seq_len, calibration, backend)
        return memory.total_at(moment) + sum(t.bytes for t in extra)

    # The overheads depend on the moment (fragmentation comes late in the backward pass), so the
    # peak is taken over tensors and overheads together.
    moment = max(memory.moments, key=total)
    overheads = overhead_terms(arch, mode, candidate, memory, moment, seq_len, calibration, backend)
    peak = total(moment)
    fits = peak <= target.memory
    reason = None if fits else (f"{candidate.label} needs {peak / 1e9:.1f} GB per GPU; "
                                f"{target.memory / 1e9:.1f} GB available")
    speed = estimate_step_time(arch, mode, candidate.precision, candidate.batch_size, seq_len, new_tokens=new_tokens,
                               parallelism=candidate.parallelism, gpu_name=target.speed_name,
                               activation_checkpointing=candidate.activation_checkpointing,
                               offloaded_bytes=offloaded_weights(arch, candidate.precision, candidate.resident_layers)
                               if candidate.resident_layers is not None else 0.0)
    return Assessment(candidate, memory, overheads, peak, fits, reason, speed, moment)


def _layout_problem(arch: Architecture, candidate: Candidate, target: GpuTarget) -> str | None:
    if candidate.gpus > target.count:
        return f"{candidate.label} needs {candidate.gpus} GPUs; {target.count} available"
    if candidate.resident_layers is not None and candidate.gpus > 1:
        return f"{candidate.label}: offload keeps the layers that do not fit on one GPU in host memory"
    if candidate.strategy == "tp" and (arch.num_heads % candidate.gpus or arch.num_kv_heads % candidate.gpus):
        return (f"{candidate.label}: tensor parallel {candidate.gpus} does not divide {arch.num_heads} heads / "
                f"{arch.num_kv_heads} kv heads")
    if candidate.strategy == "pipeline" and arch.num_layers % candidate.gpus:
        return f"{candidate.label}: {arch.num_layers} layers do not split into {candidate.gpus} equal stages"
    return None


def gpu_counts(available: int) -> list[int]:
    """1, 2, 4, 8 ... up to the GPUs available, and that count itself."""
    counts, g = [], 1
    while g <= available:
        counts.append(g)
        g *= 2
    if available not in counts:
        counts.append(available)
    return counts


def strategies_for(mode: str, gpus: int) -> list[str]:
    if gpus == 1:
        return ["single"]
    if mode in TRAINING_MODES:
        return ["ddp", "fsdp", "tp", "pipeline"]
    return ["tp", "pipeline"]


def largest_fitting_batch(arch, mode, candidate: Candidate, target, *, seq_len, new_tokens, calibration,
                          backend: str | None = None) -> int:
    """The largest batch predicted to fit (bisection on the monotone memory model); 0 if none."""
    def fits(batch: int) -> bool:
        return assess(arch, mode, replace(candidate, batch_size=batch), target, seq_len=seq_len,
                      new_tokens=new_tokens, calibration=calibration, backend=backend).fits

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_AUTO_BATCH and fits(high):
        low, high = high, high * 2
    high = min(high, MAX_AUTO_BATCH + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


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
    """``batch_sizes`` None means auto: each layout gets the largest batch predicted to fit; ``backend``
    as in ``assess``."""
    ladder = precisions or DEFAULT_LADDER[mode]
    recompute_options = checkpointing if checkpointing is not None else (
        [False, True] if mode in TRAINING_MODES else [False])
    assessments: list[Assessment] = []
    for precision in ladder:
        for gpus in gpu_counts(target.count):
            for strategy in strategies_for(mode, gpus):
                if strategies and strategy not in strategies and not (gpus == 1 and "single" in strategies):
                    continue
                for recompute in recompute_options:
                    base = Candidate(precision, strategy, gpus, recompute, 1)
                    if batch_sizes is None:
                        batch = largest_fitting_batch(arch, mode, base, target, seq_len=seq_len,
                                                      new_tokens=new_tokens, calibration=calibration,
                                                      backend=backend)
                        sizes = [batch or 1]
                    else:
                        sizes = batch_sizes
                    for batch in sizes:
                        assessments.append(assess(arch, mode, replace(base, batch_size=batch), target,
                                                  seq_len=seq_len, new_tokens=new_tokens, calibration=calibration,
                                                  backend=backend))
    feasible = [a for a in assessments if a.fits]
    rejected = [a for a in assessments if not a.fits]
    chosen = None
    for precision in ladder:
        rung = [a for a in feasible if a.candidate.precision == precision]
        if rung:
            chosen = max(rung, key=lambda a: (a.speed.tokens_per_s, -a.candidate.gpus))
            break
    ranked = sorted(feasible, key=lambda a: (ladder.index(a.candidate.precision), -a.speed.tokens_per_s))
    notes = []
    if target.speed_name != target.name:
        notes.append(f"speed estimates use {target.speed_name} figures; name the GPU with --gpu for others")
    return Plan(arch.name, mode, target, chosen, tuple(ranked), tuple(rejected), calibration.source, tuple(notes))


def minimum_gpus(arch: Architecture, mode: str, precision: str, gpu_memory: float, *, seq_len: int,
                 new_tokens: int, batch_size: int = 1, max_gpus: int = 64,
                 calibration: Calibration = DEFAULT, backend: str | None = None) -> tuple[int, str] | None:
    """The fewest GPUs of ``gpu_memory`` bytes that run this at ``batch_size``, and how; None if
    more than ``max_gpus`` would be needed."""
    target = GpuTarget(None, max_gpus, gpu_memory, described=True)
    for gpus in gpu_counts(max_gpus):
        for strategy in strategies_for(mode, gpus):
            if strategy == "ddp":
                continue
            for recompute in ([False, True] if mode in TRAINING_MODES else [False]):
                candidate = Candidate(precision, strategy, gpus, recompute, batch_size)
                if assess(arch, mode, candidate, target, seq_len=seq_len, new_tokens=new_tokens,
                          calibration=calibration, backend=backend).fits:
                    return gpus, candidate.label
    return None


def planner_choices(mode: str, choose_precision: bool, choose_recompute: bool) -> list[str]:
    """What the planner decides for a ``fitbench run`` configuration of ``mode``."""
    return [name for name, chose in (("precision", choose_precision),
                                     ("activation_checkpointing", choose_recompute and mode in TRAINING_MODES)) if chose]


def predict_spec(arch: Architecture, spec, target: GpuTarget, calibration: Calibration, *,
                 choose_precision: bool, choose_recompute: bool, runnable: tuple[str, ...]):
    """Plan one ``fitbench run`` configuration on one GPU: choose the precision and activation
    checkpointing the user left open (first rung of the ladder that fits, fastest within it),
    and predict its peak; an offloaded one keeps the layers ``offload_split`` finds room for.
    Returns the spec to run and the prediction stored with its result."""
    ladder = [p for p in DEFAULT_LADDER[spec.mode] if p in runnable] if choose_precision else [spec.precision]
    if spec.offload:
        ladder = [p for p in ladder if p not in QUANTIZED]
    recompute = [False, True] if choose_recompute and spec.mode in TRAINING_MODES else [spec.activation_checkpointing]

    def resident(precision: str) -> int | None:
        if not spec.offload:
            return None
        return offload_split(arch, spec.mode, precision, spec.batch_size, spec.seq_len, new_tokens=spec.new_tokens,
                             budget=target.memory, calibration=calibration, backend=spec.backend).resident_layers

    options = [assess(arch, spec.mode, Candidate(precision, "single", 1, ac, spec.batch_size, resident(precision)),
                      target, seq_len=spec.seq_len, new_tokens=spec.new_tokens, calibration=calibration,
                      backend=spec.backend)
               for precision in ladder for ac in recompute]
    fitting = [a for a in options if a.fits]
    chosen = fitting[0] if fitting else options[0]
    candidate = chosen.candidate
    planned = spec.model_copy(update={"precision": candidate.precision,
                                      "activation_checkpointing": candidate.activation_checkpointing})
    return planned, {
        "predicted_peak_bytes": chosen.predicted_peak,
        "tensor_peak_bytes": chosen.memory.peak_bytes,
        "peak_moment": chosen.peak_moment,
        "fits": chosen.fits,
        "gpu_memory_bytes": target.memory,
        "resident_layers": candidate.resident_layers,
        "chosen_by_planner": planner_choices(spec.mode, choose_precision, choose_recompute),
        "rejected": [a.reason for a in options if not a.fits],
        "terms": [{"name": t.name, "bytes": t.bytes, "at_peak": t.moments is None or chosen.peak_moment in t.moments}
                  for t in chosen.memory.terms]
                 + [{"name": t.name, "bytes": t.bytes, "at_peak": True} for t in chosen.overheads],
        "step_time_estimate_s": chosen.speed.seconds if chosen.speed else None,
        "calibration": calibration.source,
    }
