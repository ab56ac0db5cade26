"""Training-style steps (``train``, ``forward``, ``forward-backward``), timed: the step of one process
(``fitbench.worker.loops.make_step``) or of a pipeline stage (``PipelineLM.make_step``), compiled on its
first call where asked, then warm-up and measured steps (``fitbench.worker.timing.time_steps``)."""

from __future__ import annotations

from typing import Any

import torch

from fitbench.worker.build import Built
from fitbench.worker.loops import make_step
from fitbench.worker.metrics import step_metrics
from fitbench.worker.modes.peaks import Peaks
from fitbench.worker.pipeline import PipelineLM
from fitbench.worker.progress import emit, step_done
from fitbench.worker.sanity import Verdict, non_finite_steps, read
from fitbench.worker.timing import first_call_seconds, time_steps
from fitbench.util.stats import SampleStats


def measure_steps(spec, arch, built: Built, policy, clock, device, peaks: Peaks, weight_bytes: int,
                   tokens: torch.Tensor, stages: dict[str, Any]):
    """Time ``spec``'s training-style steps over ``tokens``; ``stages``: ``run_stages``' barrier and counter."""
    if isinstance(built.lm, PipelineLM):
        step = built.lm.make_step(spec.mode, policy, tokens, spec.pipeline_microbatches)
    else:
        step = make_step(spec.mode, built.lm, policy, tokens, device)
    compile_s = None
    if spec.compile:
        emit(phase="compile")
        compile_s = first_call_seconds(step, clock)
    samples, returned = time_steps(step, clock, warmup=spec.warmup_steps, repeats=spec.measure_steps,
                                   on_step=step_done, **stages)
    stats = SampleStats.of(samples)
    timing = {"step": stats.as_dict(), "samples": {"step": samples}}
    throughput = step_metrics(arch, spec.mode, spec.batch_size, spec.seq_len, stats, peaks.flops,
                              peaks.measured_flops, adapter_params=built.adapter_params)
    if returned and returned[0] is None:  # a pipeline stage before the last, where no logits or loss exist
        verdict = Verdict()
    elif spec.mode == "forward":
        verdict = Verdict(non_finite_steps("logits", read(returned)))
    else:
        loss = read(returned)
        verdict = Verdict(non_finite_steps("loss", loss), loss)
    return timing, throughput, ["step time"] if stats.noisy else [], compile_s, verdict
