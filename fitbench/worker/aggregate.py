"""One result from every rank of a job, by an explicit rule per figure (docs/style.md, rule 7):

- **status**: ``ok`` only when every rank's is; else the first rank's (by rank) that is not, its error
  prefixed with the rank;
- **step time**: the slowest rank's (the job advances at its pace), with every rank's median kept;
- **throughput**: tokens per step and tokens/s sum over the data-parallel ranks, which see different
  batches (tensor- and pipeline-parallel ranks work on the same tokens); ``tokens_per_s_per_gpu`` is
  the sum over the world size; achieved FLOP/s scale with tokens/s, and MFU divides them by the peak
  of every GPU of the job;
- **generation** (every rank takes part in each prefill and decode step): the latencies and rates are
  the job's, timed on rank 0; the prefill's MFU divides its FLOP/s by the peak of every GPU of the job;
- **memory**: listed per GPU, each with its rank; the host's peak RSS is the largest rank's;
- **placement**: each rank's node (SLURM's name for it where SLURM started the job, else the
  hostname), device and memory, in rank order, so a job of several nodes says where every rank ran;
- **allocator retries** (``fitbench.worker.retries``): summed over the ranks, each rank's kept; a step of
  the job retried where any of its ranks did, and took the slowest rank's time (``_allocator_retries``);
- **losses**: rank 0's (each data-parallel rank's loss is that of its own batch);
- **pipeline stages**: the loss, the quality of quantized weights and a generation's latencies
  exist on the last stage (``fitbench.worker.pipeline``): under pipeline parallelism the row starts
  from the last stage's result instead of rank 0's, ``parallel.stages`` lists every rank's stage
  (its layers and parameters), and the weights' bytes are the stages' sum;
- **replicas** (independent copies, each its own batch, measured side by side between two
  barriers): a training-style step's figures as for data parallelism above; a generation's latency
  samples concatenate over the replicas, and its rates sum over them (``_replica_generation``);
  ``parallel.replicas`` lists each replica's own tokens/s, peak memory, data seed and batch digest.

A single process's result passes through unchanged.
"""

from __future__ import annotations

from typing import Any

from fitbench.results.row import Measurement
from fitbench.worker.retries import WARNING_START, retries_warning
from fitbench.spec import Layout
from fitbench.util.stats import SampleStats


def combine(payloads: list[dict[str, Any]], layout: Layout) -> dict[str, Any]:
    """The job's result (``fitbench.results.row.Measurement``) from ``payloads``, every rank's in rank order."""
    if len(payloads) == 1:
        return payloads[0]
    row = dict(payloads[-1] if layout.pp > 1 else payloads[0])
    if layout.pp > 1 and "parallel" in row:
        row["parallel"] = {**{key: value for key, value in row["parallel"].items() if key != "stage"},
                           "stages": [p.get("parallel", {}).get("stage") for p in payloads]}
    if layout.pp > 1 and all(p.get("weights") for p in payloads):
        row["weights"] = _pipeline_weights(payloads, layout)
    failed = next(((rank, p) for rank, p in enumerate(payloads) if p.get("status") != "ok"), None)
    if failed is not None:
        rank, payload = failed
        row.update(status=payload.get("status"), error=f"rank {rank}: {payload.get('error')}")
    row["memory"] = _memory(payloads)
    row["placement"] = [_placement(rank, payload) for rank, payload in enumerate(payloads)]
    steps = [p.get("timing", {}).get("step") for p in payloads]
    if all(steps):
        slowest = max(range(len(steps)), key=lambda rank: steps[rank]["median"])
        row["timing"] = {**payloads[slowest]["timing"], "slowest_rank": slowest,
                         "rank_step_medians": [step["median"] for step in steps]}
        row["throughput"] = _throughput([p["throughput"] for p in payloads], layout)
    elif layout.replicas > 1 and all(p.get("throughput") for p in payloads):
        row["timing"], row["throughput"] = _replica_generation(payloads)
    elif row.get("throughput", {}).get("prefill_flops") is not None:
        row["throughput"] = {**row["throughput"], **{key: row["throughput"][key] / layout.world_size
                                                     for key in ("prefill_mfu", "prefill_mfu_measured_peak")
                                                     if row["throughput"].get(key) is not None}}
    if any(p.get("allocator_retries") for p in payloads):
        generations = "timing" in row and "step" not in row["timing"]
        row["allocator_retries"] = _allocator_retries(payloads, "end_to_end" if generations else "step")
        warning = retries_warning(row["allocator_retries"], "measured generations" if generations
                                  else "measured steps of the job")
        row["warnings"] = [w for w in row.get("warnings") or [] if not w.startswith(WARNING_START)] + (
            [warning] if warning else [])
    if layout.replicas > 1 and all(p.get("parallel") for p in payloads):
        row["parallel"] = {**{key: value for key, value in row["parallel"].items()
                              if key not in ("replica", "data_seed", "batch_digest")},
                           "replicas": _replicas(payloads)}
    return Measurement.model_validate({**row, "ranks": layout.world_size, "layout": layout.model_dump()}).as_dict()


def _allocator_retries(payloads: list[dict[str, Any]], samples: str) -> dict[str, Any]:
    """The job's ``allocator_retries`` from each rank's (``RetryCounter.report``): the retries summed; step i
    of the job retried where any rank's step i did, and lasted its slowest rank's measured time (each
    rank's ``samples``, a step's or a generation's); ``per_rank``: each rank's own report (None where a
    rank has none)."""
    reports = [p.get("allocator_retries") for p in payloads]
    steps = max(len(report["per_step"]) for report in reports if report)
    retried = [i for i in range(steps) if any(report and report["per_step"][i] > 0 for report in reports)]
    timed = [p["timing"]["samples"][samples] for p in payloads
             if samples in ((p.get("timing") or {}).get("samples") or {})]
    seconds = [max(ranks[i] for ranks in timed) for i in retried] if timed else []
    return {"num_alloc_retries": sum(report["num_alloc_retries"] for report in reports if report),
            "per_step": [sum(report["per_step"][i] for report in reports if report) for i in range(steps)],
            "steps_with_retries": len(retried), "seconds_in_steps_with_retries": sum(seconds),
            "per_rank": reports}


def _pipeline_weights(payloads: list[dict[str, Any]], layout: Layout) -> dict[str, Any]:
    """The model's weights are its stages': the bytes of one pipeline are every stage's (a tied table
    held by the first and last stages counts twice, as it is stored), each rank's listed."""
    per_rank = [p["weights"]["bytes"] for p in payloads]
    pipelines = layout.world_size // layout.pp
    weights = payloads[-1]["weights"]
    total = sum(per_rank) / pipelines
    return {**weights, "bytes": total, "relative_to_bf16": total / weights["bf16_bytes"], "bytes_per_rank": per_rank}


def _memory(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    gpus = [{**gpu, "rank": rank} for rank, p in enumerate(payloads) for gpu in p.get("memory", {}).get("gpus", [])]
    rss = [p.get("memory", {}).get("host_peak_rss") for p in payloads]
    return {**payloads[0].get("memory", {}), "gpus": gpus,
            "host_peak_rss": max((value for value in rss if value is not None), default=None),
            "host_peak_rss_per_rank": rss}


def _placement(rank: int, payload: dict[str, Any]) -> dict[str, Any]:
    environment, memory = payload.get("environment") or {}, payload.get("memory") or {}
    return {"rank": rank, "node": environment.get("slurm_node") or environment.get("hostname"),
            "hostname": environment.get("hostname"), "device": payload.get("device_name"),
            "host_peak_rss": memory.get("host_peak_rss"),
            "gpu_peak_reserved": [gpu.get("peak_reserved") for gpu in memory.get("gpus", [])]}


# A generation's rates, which sum over replicas; the other throughput figures are each replica's own GPU's.
GENERATION_RATES = ("decode_tokens_per_s", "prefill_tokens_per_s", "prefill_tflops", "decode_roofline_tokens_per_s")
GENERATION_SAMPLES = ("time_to_first_token", "token_latency", "end_to_end")


def _replica_generation(payloads: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The timing and throughput of replicas' generations. Each replica r decodes its own batch of B
    sequences at its own rate, B / (its median token latency), and the job's is their sum:

        decode tokens/s = sum over r of B / median token latency_r

    (likewise the prefill's tokens/s and TFLOP/s, and the decode roofline's tokens/s); each rate is
    kept per rank (``<rate>_per_rank``) and per GPU (``decode_tokens_per_s_per_gpu``, the sum over
    the replicas). The prefill's MFU is the replicas' mean, their summed FLOP/s over every GPU's peak.
    The latency samples of every replica make one sample (docs/style.md, rule 7), their statistics
    computed again; the other figures (bytes per step, bandwidth, roofline percent) are rank 0's GPU's."""
    per_rank = [p["throughput"] for p in payloads]
    throughput = dict(per_rank[0])
    for key in GENERATION_RATES:
        if all(rank.get(key) is not None for rank in per_rank):
            throughput[key] = sum(rank[key] for rank in per_rank)
            throughput[f"{key}_per_rank"] = [rank[key] for rank in per_rank]
    throughput["decode_tokens_per_s_per_gpu"] = throughput["decode_tokens_per_s"] / len(per_rank)
    for key in ("prefill_mfu", "prefill_mfu_measured_peak"):
        if all(rank.get(key) is not None for rank in per_rank):
            throughput[key] = sum(rank[key] for rank in per_rank) / len(per_rank)
    timing = dict(payloads[0]["timing"])
    samples = {name: [value for p in payloads for value in p["timing"]["samples"][name]] for name in GENERATION_SAMPLES}
    timing.update({name: SampleStats.of(values).as_dict() for name, values in samples.items()})
    timing["samples"] = samples
    timing["rank_token_latency_medians"] = [p["timing"]["token_latency"]["median"] for p in payloads]
    return timing, throughput


def _replicas(payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each replica's own figures: its tokens/s (a generation's decode rate, else a step's), its peak
    memory (its GPU's reserved peak; on a CPU, its process's peak resident memory), the seed of its
    batch and its batch's digest."""
    replicas = []
    for rank, payload in enumerate(payloads):
        throughput, memory = payload.get("throughput") or {}, payload.get("memory") or {}
        gpus = memory.get("gpus") or []
        replicas.append({
            "rank": rank,
            "tokens_per_s": throughput.get("decode_tokens_per_s", throughput.get("tokens_per_s")),
            "peak_memory_bytes": gpus[0].get("peak_reserved") if gpus else memory.get("host_peak_rss"),
            "peak_memory": "GPU reserved peak" if gpus else "host peak RSS",
            "data_seed": payload["parallel"].get("data_seed"),
            "batch_digest": payload["parallel"].get("batch_digest"),
        })
    return replicas


def _throughput(per_rank: list[dict[str, Any]], layout: Layout) -> dict[str, Any]:
    """Sums over the data-parallel ranks: the ranks of one data-parallel group (its tensor- and pipeline-
    parallel ranks) report the same tokens, so each group counts once."""
    group = layout.world_size // layout.data_parallel
    counted = per_rank[::group]
    tokens_per_s = sum(rank["tokens_per_s"] for rank in counted)
    first = per_rank[0]
    scale = tokens_per_s / first["tokens_per_s"]
    row = {**first, "tokens_per_step": sum(rank["tokens_per_step"] for rank in counted),
           "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / layout.world_size,
           "tokens_per_s_per_rank": [rank["tokens_per_s"] for rank in per_rank],
           "achieved_tflops": first["achieved_tflops"] * scale}
    for key in ("mfu", "mfu_measured_peak"):
        if first.get(key) is not None:  # achieved / (peak x GPUs): rank 0's MFU x the throughput ratio / GPUs
            row[key] = first[key] * scale / layout.world_size
    return row
