"""The modes' measuring loops: what the worker runs on a built, parallelized model. ``train``,
``forward`` and ``forward-backward`` time steps (``fitbench.worker.modes.steps``), ``infer`` times
generations (``fitbench.worker.modes.generation``). Each takes the spec (with this rank's data seed),
the architecture, the ``Built`` model, the precision's policy, the clock and device, the ``Peaks``
for MFU, the weight bytes, the tokens, and ``run_stages``' barrier and counter; each returns the
timing, the throughput, the names of the noisy figures, the compile seconds and the ``Verdict``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peaks:
    """The device's peaks for this run's MFU and bandwidth use: the datasheet's dense FLOP/s for the
    precision's tensor-core kind, the measured one (``fitbench env --measure``), the datasheet's
    memory bandwidth (B/s); None where not known."""

    flops: float | None
    measured_flops: float | None
    bandwidth: float | None


def measure_mode(mode: str):
    """The measuring loop of ``mode``."""
    if mode == "infer":
        from fitbench.worker.modes.generation import measure_generation

        return measure_generation
    from fitbench.worker.modes.steps import measure_steps

    return measure_steps
