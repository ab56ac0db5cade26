"""The row fitbench writes to ``results.jsonl`` for each configuration, typed, and its schema version.

A row is built in two steps, by two processes:

- ``Measurement``: what a worker writes to its result file: its status, what it measured, or how it
  failed (``fitbench.worker.worker``); under torchrun, rank 0's combines every rank's
  (``fitbench.worker.aggregate``). The parent reads the file back through it: a result file that does
  not match is a protocol error, never a row with fields of the wrong kind;
- ``Row``: the measurement with what only the launcher knows (the spec, the outcome of the process,
  its times and log, the GPUs it sampled) and the sweep (the command, the prediction, the fallback
  attempts and batch probes) (``fitbench.launch.local``).

Both forbid fields they do not declare, so a field a writer misspells fails where it is built, in a
test, rather than in a reader. The nested objects (timing, throughput, memory, ...) are the
writers' own; what readers rely on in them is checked where rows are read
(``fitbench.results.schema``).

Versions: every row written since ``schema_version`` existed carries it; version 1 is the layout
below. Rows written before carry none and are version 0 (``version``): version 1's fields, fewer of
them the older the row, and readers take them as they are (a field left out shows blank). A row of a
version newer than ``SCHEMA_VERSION`` comes from a newer fitbench: it is read for the fields this
one knows, and the store says so (``fitbench.results.store``).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError

from fitbench.util.errors import excerpt

SCHEMA_VERSION = 1

# timeout, from a worker: a rank of its job waited in a collective past the process group's timeout.
WorkerStatus = Literal["ok", "invalid", "oom", "error", "refused", "timeout"]
# What a worker's result may say, then what only the launcher can: the process died without one
# (crashed), outlived its --timeout, or the sweep was stopped while it ran (interrupted); then what
# only a cluster's scheduler can say of a job that ended without a row of its own: a person or an
# administrator cancelled it (cancelled), a job of higher priority took its nodes (preempted), or a
# node of it failed (node_failed). SLURM's TIMEOUT and OUT_OF_MEMORY are timeout and oom, as on one
# machine (fitbench.launch.slurm.states).
Status = Literal["ok", "invalid", "oom", "error", "refused", "timeout", "crashed", "interrupted", "cancelled",
                 "preempted", "node_failed"]
WORKER_STATUSES: tuple[str, ...] = get_args(WorkerStatus)
# The statuses of a configuration that the sweep, not the configuration, stopped: ``--resume`` runs it
# again, and its new row replaces the old (fitbench.results.store).
RERUN_STATUSES = frozenset({"interrupted", "cancelled", "preempted", "node_failed"})
Fields = dict[str, Any]


class _Written(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def as_dict(self) -> dict[str, Any]:
        """The fields that were given: a field nobody set stays out of the row, as before the row was
        typed, rather than appearing as null. Values stay as given (a NaN loss stays NaN)."""
        return self.model_dump(exclude_unset=True)


class Measurement(_Written):
    """What one worker (or, under torchrun, rank 0 for every rank) writes to its result file."""

    status: WorkerStatus
    error: str | None = None
    device_name: str | None = None
    build_s: float | None = None
    compile_s: float | None = None
    warnings: list[str] | None = None
    peak_flops: float | None = None
    measured_peak_flops: float | None = None
    peak_kind: str | None = None
    peak_source: str | None = None
    timing: Fields | None = None
    throughput: Fields | None = None
    decode: Fields | None = None
    environment: Fields | None = None
    quality: Fields | None = None
    training: Fields | None = None
    loss: list[float] | None = None
    weights: Fields | None = None
    offload: Fields | None = None  # the decoder layers offloaded on one device (fitbench.models.offload)
    parallel: Fields | None = None  # what fitbench.worker.parallelize applied
    memory: Fields | None = None
    # the CUDA caching allocator's retries over the measured steps (fitbench.worker.retries); absent on a CPU
    allocator_retries: Fields | None = None
    # a torchrun job's (fitbench.worker.aggregate)
    ranks: int | None = None
    layout: Fields | None = None
    # where each rank of a torchrun job ran: its node, device and memory (fitbench.worker.aggregate)
    placement: list[Fields] | None = None
    # the vllm backend's engine: its KV blocks and tokens, the sequences they hold (fitbench.worker.vllm_backend)
    vllm: Fields | None = None


class Row(Measurement):
    """One line of ``results.jsonl``: a configuration's identity, its outcome and its measurement."""

    schema_version: int = SCHEMA_VERSION
    key: str
    label: str
    spec: Fields
    status: Status
    # the launch (fitbench.launch.local.run_one)
    params: int | None = None
    non_embedding_params: int | None = None
    exit_code: int | None = None
    started_at: str | None = None
    finished_at: str | None = None
    wall_s: float | None = None
    log: str | None = None
    protocol_errors: list[str] | None = None
    # a torchrun job that ended without its result: each rank's last phase, and its own result's status
    rank_phases: list[Fields] | None = None
    gpu_monitor: Fields | None = None
    # the sweep (fitbench.launch.local.run_sweep)
    attempts: list[Fields] | None = None
    predicted_batch: int | None = None
    max_batch: int | None = None
    batch_probes: list[Fields] | None = None
    command: str | None = None
    calibration: str | None = None
    prediction: Fields | None = None
    # a SLURM job's: its id, its state and SLURM's reason (fitbench.launch.slurm.states)
    slurm: Fields | None = None
    # a serving benchmark's point: counts, failures, goodput, each request (fitbench.serving.bench)
    serving: Fields | None = None

    def model_post_init(self, context: Any) -> None:
        self.model_fields_set.add("schema_version")  # written in every row, given or not


def version(row: dict[str, Any]) -> int:
    """The schema version ``row`` was written in: 0 for a row from before versions (it has none)."""
    value = row.get("schema_version")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def typed_row(fields: dict[str, Any]) -> tuple[Row, list[str]]:
    """The ``Row`` of a row read from a file, whose identity has been checked
    (``fitbench.results.schema.check_row``: ``key``, ``status`` and ``spec``), and what of it was left
    out, each as "`field` is value, why". Nothing makes it fail:

    - a field of the wrong kind is left out (the whole top-level field, named by the part at fault);
      null is blank without a word, as in ``check_row`` (a null item of a list is left out of it);
    - a field this fitbench does not declare is left out, named only in a row of this version or
      older (the store already says a newer row is read for the fields this version knows);
    - a status this fitbench does not know is kept as written, and named;
    - a missing ``label`` is the ``key``; a missing ``schema_version`` stays 0 (``version``).
    """
    given = dict(fields)
    given.setdefault("label", given["key"])
    given["schema_version"] = version(given)
    status = given["status"]
    if status not in get_args(Status):
        given["status"] = "error"  # validated as a known one, put back as written below
    problems = [] if status in get_args(Status) else [f"`status` is {excerpt(status, 24)}, which this fitbench "
                                                      f"does not know"]
    while True:
        try:
            row = Row.model_validate(given)
            break
        except ValidationError as error:
            faulty = {problem["loc"][0] for problem in error.errors()} & (given.keys() - {"key", "spec"})
            if not faulty:
                raise  # no identity: check_row's to refuse first
            for problem in error.errors():
                field = problem["loc"][0]
                if field not in faulty:
                    continue
                faulty.discard(field)  # one note per field; the next pass sees what is left
                if problem["input"] is None and len(problem["loc"]) == 2:
                    given[field] = [item for item in given[field] if item is not None]
                    continue
                if problem["type"] == "extra_forbidden":
                    if version(given) <= SCHEMA_VERSION:
                        problems.append(f"`{field}` is a field this fitbench does not know")
                elif problem["input"] is not None:
                    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in problem["loc"])
                    problems.append(f"`{where.lstrip('.')}` is {excerpt(problem['input'], 24)}, "
                                    f"{problem['msg'][0].lower()}{problem['msg'][1:]}")
                del given[field]
            given.setdefault("label", given["key"])
    if row.status != status:
        row = row.model_copy(update={"status": status})
    return row, problems
