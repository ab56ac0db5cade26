"""A job: one configuration's life in a sweep, as data that ``fitbench.launch.local.run_sweep`` runs.

A job holds the configuration as the planner left it (``spec``: the choices it made filled in), the
planner's prediction for it or why it is refused before launch, the GPU it was planned for with its
calibration, its fallback policy and its timeout. Running it (``Job.run``) is the configuration's
whole life: the batch search if asked for, then the run with its fallback ladder
(``fitbench.launch.fallback``), each attempt given its assignment (``fitbench.launch.orders``) just
before a ``Launcher`` runs it, all within the job's timeout. Its row keeps the job's own key and
label, whatever finally ran (the row's ``spec`` says that); the prediction beside it is for what ran
(``Job.prediction_for``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from fitbench.launch.fallback import (RAN_TO_THE_END, FallbackPolicy, run_with_fallback,
                                     search_max_batch)
from fitbench.launch.launcher import Attempt, Event, Launcher
from fitbench.launch.orders import assign
from fitbench.models.registry import resolve
from fitbench.planning.calibration import Calibration, load_calibration
from fitbench.planning.planner import Candidate, GpuTarget, largest_fitting_batch, predict_spec
from fitbench.precisions import PRECISIONS
from fitbench.results.row import Row
from fitbench.spec import Assignment, RunSpec
from fitbench.util.host import host_memory
from fitbench.util.inject import injected_memory_limit


@dataclass(frozen=True)
class Job:
    """``spec``: the configuration as planned; ``timeout``: seconds for its whole life (batch probes and
    fallback attempts included); ``policy``: its fallback ladder; ``target`` and ``calibration``: what
    it was planned against (None: nothing is planned, as on a CPU without a mem-limit);
    ``prediction``: the planner's for ``spec``; ``refusal``: why it is not launched (None: it is);
    ``chosen_by_planner``: the choices the planner made for it, listed in a new prediction too."""

    spec: RunSpec
    timeout: float
    policy: FallbackPolicy = field(default_factory=lambda: FallbackPolicy((), enabled=False))
    target: GpuTarget | None = None
    calibration: Calibration | None = None
    prediction: dict[str, Any] | None = None
    refusal: str | None = None
    chosen_by_planner: tuple[str, ...] = ()

    def assignment(self, spec: RunSpec) -> Assignment:
        """What the worker of an attempt at ``spec`` is told (``fitbench.launch.orders.assign``)."""
        return assign(spec, self.target, self.calibration)

    def predicted_batch(self) -> int:
        """The planner's largest batch per rank for the job on its device (``predicted_max_batch``)."""
        return predicted_max_batch(self.spec, self.spec.device)

    def prediction_for(self, ran: RunSpec) -> dict[str, Any] | None:
        """The prediction for the configuration that finally ran: the planned one's, or, after a
        fallback or the batch search changed it, a new one for what ran."""
        if ran.key == self.spec.key:
            return self.prediction
        if self.target is None:
            return None
        _, prediction = predict_spec(resolve(ran.model), ran, self.target, self.calibration, choose_precision=False,
                                     choose_recompute=False, runnable=PRECISIONS)
        return {**prediction, "chosen_by_planner": list(self.chosen_by_planner)}

    def run(self, launcher: Launcher, logs: Path, on_event: Callable[[Event], None]) -> dict[str, Any]:
        """The job's row: its refusal, or the batch search if asked for (a probe whose steps made the
        caching allocator retry counts as not fitting: a smaller batch beats a step that thrashes), then
        the run with its fallbacks, each attempt run by ``launcher`` with its log in ``logs`` (and its
        artifacts beside them), all within ``timeout`` seconds: a timed-out probe or attempt, or none
        left for the next, ends it as ``timeout``."""
        spec = self.spec
        if self.refusal is not None:
            return Row(key=spec.key, label=spec.label, spec=spec.model_dump(), status="refused", error=self.refusal,
                       params=resolve(spec.model).total_params, started_at=_now(), finished_at=_now()).as_dict()
        attempt = iter(range(1, 1000))
        deadline = time.monotonic() + self.timeout
        limit = f"the configuration's {self.timeout:g} s --timeout (batch probes and fallback attempts included)"
        tried: list[dict[str, Any]] = []

        def run(candidate: RunSpec) -> dict[str, Any]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _OutOfTime(Row(key=candidate.key, label=candidate.label, spec=candidate.model_dump(),
                                     status="timeout", error=f"{limit} ran out before {candidate.label} could start",
                                     params=resolve(candidate.model).total_params, started_at=_now(),
                                     finished_at=_now()).as_dict())
            number = next(attempt)
            row = launcher.run(Attempt(self.assignment(candidate), logs / f"{spec.key}-{number}.log",
                                       logs.parent / "artifacts" / spec.key / str(number), remaining, limit),
                               on_event).as_dict()
            tried.append({"spec": candidate.model_dump(), "status": row["status"], "error": row.get("error")})
            if row["status"] == "timeout":
                raise _OutOfTime(row)
            return row

        search: dict[str, Any] = {}
        to_run = spec
        try:
            if spec.auto_batch:
                predicted = self.predicted_batch()
                found, probes = search_max_batch(spec, predicted, lambda probe: _ran_clear(run(probe)))
                search = {"predicted_batch": predicted, "max_batch": found, "batch_probes": probes}
                to_run = spec.model_copy(update={"batch_size": max(found, 1), "auto_batch": False})
            row = run_with_fallback(to_run, self.policy, run)
        except _OutOfTime as out_of_time:
            row = {**out_of_time.row, "attempts": tried}
        row.update(search, key=spec.key, label=spec.label)
        return row


class _OutOfTime(Exception):
    """The configuration's ``--timeout`` ran out: ``row`` is its last attempt's, or one that says no
    time was left to start the next."""

    def __init__(self, row: dict[str, Any]):
        super().__init__(row["error"])
        self.row = row


def _ran_clear(row: dict[str, Any]) -> bool:
    """A batch probe ran to the end without the caching allocator retrying (``fitbench.worker.retries``)."""
    return row["status"] in RAN_TO_THE_END and not (row.get("allocator_retries") or {}).get("num_alloc_retries")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def predicted_max_batch(spec: RunSpec, device: str) -> int:
    """The planner's largest batch per rank for ``spec`` on its device (``largest_fitting_batch``): on a
    GPU the largest whose peak with the calibrated overheads stays clear of ``RETRY_MARGIN`` of its
    memory (the allocator retries within it), else the largest that fits; on a CPU the largest within
    the budget of FITBENCH_INJECT's mem-limit (else the available RAM, shared by the job's ranks); with
    offload, beside no resident decoder layer. A job of several ranks is planned per rank under its
    layout's strategy (DDP's replicas, FSDP's shards)."""
    arch = resolve(spec.model)
    ranks = spec.layout.world_size
    if device == "cpu":
        target = GpuTarget(None, ranks, injected_memory_limit() or host_memory().available / ranks, described=False)
        calibration = None  # a CPU: no caching allocator's overheads or retries
    else:
        import torch

        properties = torch.cuda.get_device_properties(torch.device(device))
        target = GpuTarget(properties.name, ranks, injected_memory_limit() or float(properties.total_memory),
                           described=False)
        calibration = load_calibration(properties.name)
    candidate = Candidate(spec.precision, spec.layout, spec.activation_checkpointing, 1,
                                    resident_layers=0 if spec.layer_offload else None, compiled=spec.compile,
                                    cpu_offload=spec.fsdp_offload, checkpointed_layers=spec.checkpointed_layers,
                                    microbatches=spec.microbatches)
    return largest_fitting_batch(arch, spec.mode, candidate, target, seq_len=spec.seq_len,
                                 new_tokens=spec.new_tokens, calibration=calibration, backend=spec.backend, clear=True)

