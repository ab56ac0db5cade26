"""Whether a run that finished gave numbers worth keeping.

A broken model runs at full speed: weights full of NaN (a bad checkpoint, a failed conversion) give
NaN logits and a NaN loss, and nothing raises. Such a run's row has status ``invalid`` with the
reasons, beside everything it measured: not ``ok``, and not an out-of-memory, so no fallback follows.

Checked, each value read once after the measured stage's single synchronize, so checking adds no
synchronization between timed steps (``fitbench.worker.loops`` says what each step returns):

- training-style modes: the loss of every measured step, which the row keeps as ``loss``;
- ``forward``: the fp32 sum of every measured step's logits, and ``infer``: of each measured
  generation's prefill and last decode step. A sum is finite when every logit is and their total
  stays within fp32's range (3.4e38, a bound no working model's logits approach);
- quantized weights: every figure of the quality against bf16 (``fitbench.worker.quality``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class Verdict:
    """What the measured steps say about the run: why its numbers cannot be kept (empty when they
    can), and the loss of each measured step in training-style modes."""

    problems: list[str] = field(default_factory=list)
    loss: list[float] | None = None


def read(values: Sequence[torch.Tensor]) -> list[float]:
    """Device scalars to floats, in one transfer."""
    return torch.stack(list(values)).float().cpu().tolist() if values else []


def non_finite_steps(what: str, values: Sequence[float]) -> list[str]:
    """Which measured steps (from 1) gave a NaN or infinite ``what``, as one problem; none when every
    one is finite."""
    bad = [i + 1 for i, value in enumerate(values) if not math.isfinite(value)]
    if not bad:
        return []
    shown = ", ".join(f"{i} ({values[i - 1]})" for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
    return [f"{what} not finite in {len(bad)} of {len(values)} measured steps: {shown}"]


def non_finite_figures(figures: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted names of the NaN or infinite numbers in a nested dict of figures."""
    found = []
    for name, value in figures.items():
        if isinstance(value, dict):
            found += non_finite_figures(value, f"{prefix}{name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            found.append(f"{prefix}{name} = {value}")
    return found


def warmup_warning(warmup_steps: int) -> str | None:
    """Without a warm-up the first measured step pays what only a first step pays."""
    if warmup_steps > 0:
        return None
    return ("--warmup-steps 0: the first measured step includes one-time costs (first allocations, kernel "
            "selection and loading, lazily created state such as AdamW's moments)")
