"""One result from every rank of a job, by an explicit rule per figure (STYLE.md 8, DISTRIBUTED.md):

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
- **losses**: rank 0's (each data-parallel rank's loss is that of its own batch);
- **pipeline stages**: the loss, the quality of quantized weights and a generation's latencies
  exist on the last stage (``fitbench.run.pipeline``): under pipeline parallelism the row starts
  from the last stage's result instead of rank 0's, ``parallel.stages`` lists every rank's stage
  (its layers and parameters), and the weights' bytes are the stages' sum.

A single process's result passes through unchanged.
"""

from __future__ import annotations

from typing import Any

from fitbench.results.row import Measurement
from fitbench.spec import Layout


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
    steps = [p.get("timing", {}).get("step") for p in payloads]
    if all(steps):
        slowest = max(range(len(steps)), key=lambda rank: steps[rank]["median"])
        row["timing"] = {**payloads[slowest]["timing"], "slowest_rank": slowest,
                         "rank_step_medians": [step["median"] for step in steps]}
        row["throughput"] = _throughput([p["throughput"] for p in payloads], layout)
    elif row.get("throughput", {}).get("prefill_flops") is not None:
        row["throughput"] = {**row["throughput"], **{key: row["throughput"][key] / layout.world_size
                                                     for key in ("prefill_mfu", "prefill_mfu_measured_peak")
                                                     if row["throughput"].get(key) is not None}}
    return Measurement.model_validate({**row, "ranks": layout.world_size, "layout": layout.model_dump()}).as_dict()


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
