"""Generation (``infer``), timed: a prefill and its decode steps (``fitbench.worker.loops.generate``, or a
pipeline's ``PipelineLM.generator``), compiled on its first call where asked, a CUDA graph captured in
a warm-up, then measured generations (``fitbench.worker.timing.run_stages``): time to first token, token
latency, end to end, and the bytes a decode step reads for the bandwidth roofline."""

from __future__ import annotations

from typing import Any

import torch

from fitbench.worker.build import Built
from fitbench.worker.loops import generate, read_generation
from fitbench.worker.metrics import inference_metrics
from fitbench.worker.modes.peaks import Peaks
from fitbench.worker.pipeline import PipelineLM
from fitbench.worker.progress import emit, step_done
from fitbench.worker.sanity import Verdict, non_finite_steps, read
from fitbench.worker.timing import first_call_seconds, run_stages
from fitbench.worker.weight_bytes import decode_weight_bytes, weight_storage_bytes
from fitbench.util.stats import SampleStats


def measure_generation(spec, arch, built: Built, policy, clock, device, peaks: Peaks, weight_bytes: int,
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
    runs = run_stages(run, clock, warmup=spec.warmup_steps, repeats=spec.measure_steps, on_step=step_done,
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
