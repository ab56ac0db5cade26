"""The device's peaks a mode's MFU and bandwidth use are taken against."""

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
