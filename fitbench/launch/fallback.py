"""When reality disagrees with the plan: the fallback ladder, and the search for the largest batch.

**Fallback.** A configuration that runs out of memory is retried in a fresh process with, in this
order: for full training with GPUs at hand (``next_rung``), FSDP over all of them; the next
precision of the ladder (``--fallback``, e.g. bf16-pure, int8, nf4), then, for training,
activation checkpointing, then half the batch, and last, for inference, offload: the decoder
layers that do not fit stay in host memory and stream in for their forward
(``fitbench.models.offload``). Each attempt is recorded in the row's ``attempts`` (what was tried
and why it failed); the row's ``spec`` is the one that finally ran.

**Adaptive batch.** ``--batch-size auto`` starts from the planner's largest batch predicted to
fit and verifies it with short probe runs in fresh processes: a bisection between a batch known to
fit and one known not to, so at most about ``log2`` of the predicted batch probes, reported as
``max_batch`` with every probe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fitbench.planning.search import largest
from fitbench.precisions import QUANTIZED_PRECISIONS, TRAINING_MODES, UNQUANTIZED_BASE, entry
from fitbench.spec import Layout, RunSpec

# Statuses of a run whose memory held to its end: ``invalid`` (non-finite numbers, fitbench.worker.sanity)
# is a failed row, but no out-of-memory: no rung of the ladder would change it, and its batch fits.
RAN_TO_THE_END = ("ok", "invalid")


def probe_steps(mode: str) -> dict[str, int]:
    """The fewest steps whose peak is the run's: a generation peaks in its first, a training step in its
    second, the first with AdamW's state (created lazily by the first optimizer step) beside the
    activations (a one-step probe of 7B bf16-pure training passed at batch 18 where the run then ran
    out of memory)."""
    return {"warmup_steps": 1 if mode in TRAINING_MODES else 0, "measure_steps": 1}


@dataclass(frozen=True)
class FallbackPolicy:
    ladder: tuple[str, ...]  # precisions in order of preference; a repeated one counts once, where it first stands
    enabled: bool = True
    gpus_at_hand: int = 1  # GPUs (ranks) the sweep may spread a configuration over (--gpus)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ladder", tuple(dict.fromkeys(self.ladder)))


def next_attempt(spec: RunSpec, policy: FallbackPolicy) -> tuple[RunSpec, str] | None:
    """The configuration to try after ``spec`` ran out of memory, and what changed; None when the
    ladder, checkpointing, the batch and offload are exhausted. Checkpointing is one rung: on for every
    layer, or from some layers (``checkpointed_layers``) to every layer.

    Rungs are skipped where they would change the workload or cannot run: in training, those that do
    not train every weight (``Precision.trains_every_weight``); in an offloaded run, quantized ones. Offload
    comes last, at batch 1 of the last rung, for infer and forward, and uses the ladder's first
    floating-point rung (the registry's ``UNQUANTIZED_BASE`` when it has none). Offload lifts the
    GPU-memory limit on the weights, the one reason the ladder was walked down, so the attempt goes
    back to the most preferred precision that can stream; quantized rungs cannot: bitsandbytes and
    torchao weights carry quantization state (row scales, 4-bit block states, tensor subclasses) that
    accelerate's hooks do not move with the weight.
    """
    if not policy.enabled:
        return None
    if spec.mode in TRAINING_MODES:
        ladder = [p for p in policy.ladder if entry(p).trains_every_weight]
    else:
        ladder = [p for p in policy.ladder if not (spec.offload and p in QUANTIZED_PRECISIONS)]
    if spec.precision in ladder and ladder.index(spec.precision) + 1 < len(ladder):
        precision = ladder[ladder.index(spec.precision) + 1]
        return spec.model_copy(update={"precision": precision}), f"precision {spec.precision} -> {precision}"
    if spec.mode in TRAINING_MODES and not spec.activation_checkpointing:
        return spec.model_copy(update={"activation_checkpointing": True}), "activation checkpointing on"
    if spec.mode in TRAINING_MODES and spec.checkpointed_layers is not None:
        # the layers that kept their activations recompute them too: the most checkpointing saves
        return (spec.model_copy(update={"checkpointed_layers": None}),
                f"activation checkpointing of {spec.checkpointed_layers} layers -> every layer")
    if spec.batch_size > 1:
        half = spec.batch_size // 2
        return spec.model_copy(update={"batch_size": half}), f"batch {spec.batch_size} -> {half}"
    precision = next((p for p in policy.ladder if p not in QUANTIZED_PRECISIONS), UNQUANTIZED_BASE)
    if spec.offload or Layout().offload_problem(spec.mode, precision, spec.backend, spec.compile):
        return None
    change = "offload on" + (f", precision {spec.precision} -> {precision}" if precision != spec.precision else "")
    return spec.model_copy(update={"offload": True, "precision": precision}), change


# The layouts a data-parallel rung moves between (one GPU, DDP, FSDP); tensor-parallel and pipeline
# layouts keep theirs.
DATA_PARALLEL = ("single", "ddp", "fsdp")


@dataclass(frozen=True)
class Rung:
    """The next attempt: a configuration, the layout it runs with (``strategy`` over ``gpus``) and
    what changed, in words."""

    spec: RunSpec
    strategy: str
    gpus: int
    change: str


def next_rung(spec: RunSpec, policy: FallbackPolicy, *, strategy: str, gpus: int, gpus_at_hand: int) -> Rung | None:
    """The attempt after ``spec``, run with ``strategy`` over ``gpus`` GPUs, ran out of memory, with
    ``gpus_at_hand`` GPUs available to it; None when nothing is left to try.

    Full training (a training mode in a precision that trains every weight) shards before anything
    else: one GPU, DDP, or FSDP over fewer GPUs than are at hand becomes FSDP over all of them, with
    the same precision, checkpointing and batch per GPU. It changes neither the numbers nor the work
    per GPU, and divides the weights, gradients and optimizer state, which DDP replicates; quantizing
    or dropping fp32 master weights changes the model that is trained, so those rungs come after it.
    From there ``next_attempt``'s ladder goes on in the layout reached (precisions that train every
    weight, checkpointing, half the batch): adapters on a quantized base train another model, and are
    never a rung of full training. Other runs keep their layout; offload is a rung of one GPU only (a
    run under FSDP's CPU offload keeps it)."""
    if not policy.enabled:
        return None
    full_training = spec.mode in TRAINING_MODES and entry(spec.precision).trains_every_weight
    if full_training and strategy in DATA_PARALLEL and gpus_at_hand > 1 and (strategy != "fsdp" or gpus < gpus_at_hand):
        before = "1 GPU" if gpus == 1 else f"{strategy} x {gpus}"
        return Rung(spec, "fsdp", gpus_at_hand, f"{before} -> fsdp x {gpus_at_hand}")
    following = next_attempt(spec, policy)
    if following is None or (following[0].offload and not spec.offload and gpus > 1):
        return None
    return Rung(following[0], strategy, gpus, following[1])


def run_with_fallback(spec: RunSpec, policy: FallbackPolicy,
                      run: Callable[[RunSpec], dict[str, Any]]) -> dict[str, Any]:
    """Run ``spec``, walking the fallback ladder (``next_rung``: full training shards over the GPUs at
    hand first) on out-of-memory only (an ``invalid`` run's weights give the same non-finite numbers
    on every rung); the last attempt's row, with all attempts listed."""
    attempts = []
    current, change = spec, "as planned"
    while True:
        try:
            row = run(current)
        except KeyboardInterrupt as interruption:
            # the attempts so far, and the one stopped, for whoever writes the row of a stopped job
            interruption.attempts = [*attempts, {"spec": current.model_dump(), "change": change,
                                                 "status": "interrupted", "error": str(interruption)}]
            raise
        attempts.append({"spec": current.model_dump(), "change": change, "status": row["status"],
                         "error": row.get("error")})
        layout = current.layout
        rung = next_rung(current, policy, strategy=layout.strategy, gpus=layout.world_size,
                         gpus_at_hand=policy.gpus_at_hand) if row["status"] == "oom" else None
        if rung is None:
            break
        current = rung.spec.model_copy(update={"layout": Layout.of_strategy(rung.strategy, rung.gpus)})
        change = rung.change
    row["attempts"] = attempts
    return row


def search_max_batch(spec: RunSpec, predicted: int, fits: Callable[[RunSpec], bool]) -> tuple[int, list[dict]]:
    """The largest batch that runs, by bisection from the planner's ``predicted`` batch; returns it
    (0 if even batch 1 fails) and the probes made."""
    probes: list[dict] = []

    def probe(batch: int) -> bool:
        ok = fits(spec.model_copy(update={"batch_size": batch, **probe_steps(spec.mode)}))
        probes.append({"batch_size": batch, "fits": ok})
        return ok

    found = largest(probe, start=predicted)
    return found, probes
