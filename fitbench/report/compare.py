"""Two sweeps compared configuration by configuration, with a gate for CI.

Rows are joined on ``key``, the hash of the configuration (``fitbench.spec``); a key in one sweep
only is listed, and a key whose row is not ``ok`` on either side is listed with both statuses. For
each configuration ok on both sides, B against A:

- **time**: the mean of the raw samples (a training-style row's step times, an ``infer`` row's
  per-token decode latencies: ``timing.samples``); the change is ``100 (mean_B / mean_A - 1)`` %.
  Its 95% confidence interval is a **percentile bootstrap** (Efron and Tibshirani, *An Introduction
  to the Bootstrap*, 1993, ch. 13): ``RESAMPLES`` times, draw n_A samples from A and n_B from B with
  replacement and take ``100 (mean(B*) / mean(A*) - 1)``; the interval is the 2.5% and 97.5%
  quantiles of those (linear interpolation, as ``fitbench.util.stats``). A bootstrap rather than Welch's
  t-interval: step times are skewed (a slow first step, an allocator retry), which the bootstrap
  does not assume away. The generator is seeded (``SEED``), so a comparison gives the same interval
  every time. The change is **slower** when the whole interval is above 0, **faster** when it is
  below, else **within noise**. With fewer than 2 samples on a side there is no interval: the
  change of the rows' means (``timing.step.mean``) is shown, marked ``no samples``.
- **tokens/s**: the rows' figures, and their change; at a fixed number of tokens per step, tokens/s
  is inversely proportional to the time, so its interval is the time's mapped through
  ``100 (1 / (1 + c/100) - 1)`` (bounds swapped), and its verdict is the time's.
- **peak memory**: the largest GPU's measured peak (``fitbench.report.columns``); one figure per
  run, so no interval: **larger** or **smaller** when it moved by more than ``MEMORY_NOISE_PERCENT``,
  else **unchanged**.

The gate ``--fail-on FIGURE:PERCENT`` (``mean:5%``, ``memory:10%``): the comparison fails when a
configuration's time is slower (its interval above 0) by more than PERCENT (``mean``), or its peak
memory grew by more than PERCENT (``memory``); and with either, when a configuration ok in A is not
ok in B (it crashed, ran out of memory, was refused). A time without samples gates on its change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fitbench.report.columns import largest_peak
from fitbench.results.directories import SweepRows, read_sweep
from fitbench.results.report import PER_TOKEN_MODES, headline
from fitbench.results.row import Row
from fitbench.results.terminal import NO_STEPS, Steps
from fitbench.util.errors import UserError, excerpt

RESAMPLES = 2000
SEED = 0
CONFIDENCE = 0.95
MEMORY_NOISE_PERCENT = 1.0
# Resamples drawn at once: a decode row holds thousands of samples, and all its resamples at once
# would be hundreds of MB.
CHUNK_VALUES = 2_000_000
GATES = {"mean": "the mean step time (per-token latency in infer)", "memory": "the peak memory of the largest GPU"}
BOOTSTRAP = (f"Time: mean of the raw samples, B against A, with a {CONFIDENCE:.0%} percentile bootstrap interval "
             f"({RESAMPLES} resamples); slower or faster only when the whole interval is on one side of 0. "
             f"Tokens/s: the rows' figures, the interval mapped from the time's. Memory: the largest GPU's peak.")


@dataclass(frozen=True)
class Gate:
    """``--fail-on``: which figure (``GATES``) and by how many percent it may get worse."""

    figure: str
    percent: float


def parse_fail_on(text: str) -> Gate:
    """``mean:5%`` -> Gate("mean", 5.0); a UserError for anything else."""
    match = re.fullmatch(r"\s*(\w+)\s*:\s*(\d+(?:\.\d+)?)\s*%?\s*", text or "")
    if not match or match.group(1) not in GATES:
        raise UserError(f"fail-on: {excerpt(text)} is not a gate; write FIGURE:PERCENT with FIGURE one of "
                        f"{', '.join(f'{name} ({what})' for name, what in GATES.items())}, e.g. --fail-on mean:5%.")
    return Gate(match.group(1), float(match.group(2)))


@dataclass(frozen=True)
class Change:
    """One figure of one configuration, A to B; percents are ``100 (B / A - 1)``."""

    figure: str
    before: float | None
    after: float | None
    percent: float | None
    low_percent: float | None = None
    high_percent: float | None = None
    verdict: str = "no samples"
    crosses: bool = False  # beyond the gate's threshold


@dataclass
class ConfigurationChange:
    key: str
    label: str
    changes: list[Change]


@dataclass
class Comparison:
    a: SweepRows
    b: SweepRows
    rows: list[ConfigurationChange]
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    not_comparable: list[str] = field(default_factory=list)  # "label: ok -> oom"
    regressed: list[str] = field(default_factory=list)  # ok in A, not in B
    gate: Gate | None = None
    method: str = BOOTSTRAP

    @property
    def failed(self) -> bool:
        """Whether the gate fails: a change beyond it, or (with a gate) a configuration no longer ok."""
        return self.gate is not None and (bool(self.regressed) or any(
            change.crosses for row in self.rows for change in row.changes))

    def lines(self) -> list[str]:
        """The comparison as text: one line per configuration and figure, then the lists, then the summary."""
        lines = []
        for row in self.rows:
            for change in row.changes:
                interval = ("" if change.low_percent is None
                            else f" [{change.low_percent:+.1f}%, {change.high_percent:+.1f}%]")
                shown = "-" if change.percent is None else f"{change.percent:+.1f}%"
                lines.append(f"{row.label}: {change.figure} {_figure(change.before)} -> {_figure(change.after)}, "
                             f"{shown}{interval} {change.verdict}" + ("  << beyond the gate" if change.crosses else ""))
        lines += [f"only in A: {label}" for label in self.only_a] + [f"only in B: {label}" for label in self.only_b]
        lines += [f"not ok on a side: {text}" for text in self.not_comparable]
        return lines + [self.summary()]

    def summary(self) -> str:
        times = [change for row in self.rows for change in row.changes if change.figure == "time (s)"]
        counts = {verdict: sum(change.verdict == verdict for change in times)
                  for verdict in ("slower", "faster", "within noise", "no samples")}
        text = (f"{len(self.rows)} configuration(s) in both: " + ", ".join(f"{count} {verdict}" for verdict, count
                                                                          in counts.items() if count))
        if self.only_a or self.only_b:
            text += f"; {len(self.only_a)} only in A, {len(self.only_b)} only in B"
        if self.not_comparable:
            text += f"; {len(self.not_comparable)} not ok on a side"
        if self.gate:
            crossing = [f"{row.label} ({change.figure} {change.percent:+.1f}%)" for row in self.rows
                        for change in row.changes if change.crosses] + [f"{label} (no longer ok)"
                                                                        for label in self.regressed]
            text += (f". Gate {self.gate.figure}:{self.gate.percent:g}%: " + (
                f"failed by {'; '.join(crossing)}" if crossing else "passed"))
        return text


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:,.4g}"


def time_samples(row: Row) -> list[float]:
    """The raw samples of the row's headline time: step times, or per-token latencies in infer."""
    samples = (row.timing or {}).get("samples") or {}
    values = samples.get("token_latency" if row.spec["mode"] in PER_TOKEN_MODES else "step") or []
    return [float(value) for value in values if isinstance(value, (int, float)) and not isinstance(value, bool)]


def bootstrap_interval(a: list[float], b: list[float], resamples: int = RESAMPLES,
                       seed: int = SEED) -> tuple[float, float]:
    """The percentile bootstrap interval of ``100 (mean(B) / mean(A) - 1)`` (the module's docstring)."""
    generator = np.random.default_rng(seed)
    a_values, b_values = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    changes = []
    per_chunk = max(1, CHUNK_VALUES // (len(a) + len(b)))
    for start in range(0, resamples, per_chunk):
        count = min(per_chunk, resamples - start)
        a_means = a_values[generator.integers(0, len(a), size=(count, len(a)))].mean(axis=1)
        b_means = b_values[generator.integers(0, len(b), size=(count, len(b)))].mean(axis=1)
        changes.append(100 * (b_means / a_means - 1))
    values = np.concatenate(changes)
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def _percent(before: float | None, after: float | None) -> float | None:
    return 100 * (after / before - 1) if before and after is not None else None


def _time_change(row_a: Row, row_b: Row, gate: Gate | None) -> Change:
    a, b = time_samples(row_a), time_samples(row_b)
    threshold = gate.percent if gate and gate.figure == "mean" else None
    if len(a) >= 2 and len(b) >= 2:
        before, after = sum(a) / len(a), sum(b) / len(b)
        percent = _percent(before, after)
        low, high = bootstrap_interval(a, b)
        verdict = "slower" if low > 0 else "faster" if high < 0 else "within noise"
        crosses = threshold is not None and verdict == "slower" and percent > threshold
        return Change("time (s)", before, after, percent, low, high, verdict, crosses)
    name = "token_latency" if row_a.spec["mode"] in PER_TOKEN_MODES else "step"
    before, after = (((row.timing or {}).get(name) or {}).get("mean") for row in (row_a, row_b))
    percent = _percent(before, after)
    crosses = threshold is not None and percent is not None and percent > threshold
    return Change("time (s)", before, after, percent, crosses=crosses)


def _inverse(percent: float | None) -> float | None:
    """The change of a rate whose time changed by ``percent``: 100 (1 / (1 + percent/100) - 1)."""
    return None if percent is None or percent <= -100 else 100 * (1 / (1 + percent / 100) - 1)


def _rate_change(row_a: Row, row_b: Row, time: Change) -> Change:
    before, after = headline(row_a)["tokens_per_s"], headline(row_b)["tokens_per_s"]
    return Change("tokens/s", before, after, _percent(before, after), _inverse(time.high_percent),
                  _inverse(time.low_percent), time.verdict)


def _memory_change(row_a: Row, row_b: Row, gate: Gate | None) -> Change | None:
    before, after = largest_peak(row_a), largest_peak(row_b)
    percent = _percent(before, after)
    if percent is None:
        return None
    verdict = ("larger" if percent > MEMORY_NOISE_PERCENT else "smaller" if percent < -MEMORY_NOISE_PERCENT
               else "unchanged")
    crosses = gate is not None and gate.figure == "memory" and percent > gate.percent
    return Change("peak memory (GB)", before, after, percent, verdict=verdict, crosses=crosses)


def compare_sweeps(a: str | Path, b: str | Path, fail_on: str | None = None, steps: Steps = NO_STEPS) -> Comparison:
    """Sweep B against sweep A (their directories), gated by ``fail_on`` (``mean:5%``) when given;
    each configuration in both is a step of ``steps``."""
    gate = parse_fail_on(fail_on) if fail_on is not None else None
    first, second = (read_sweep(directory, side).require_rows(side)
                     for directory, side in ((a, "compare A"), (b, "compare B")))
    rows_a = {row.key: row for row in first.rows}
    rows_b = {row.key: row for row in second.rows}
    comparison = Comparison(first, second, [], gate=gate,
                            only_a=[rows_a[key].label for key in rows_a if key not in rows_b],
                            only_b=[rows_b[key].label for key in rows_b if key not in rows_a])
    steps.begin("configurations compared", sum(key in rows_b for key in rows_a))
    for key, row_a in rows_a.items():
        if key in rows_b:
            _compare_one(comparison, key, row_a, rows_b[key])
            steps.advance()
    return comparison


def _compare_one(comparison: Comparison, key: str, row_a: Row, row_b: Row) -> None:
    """The changes of one configuration in both sweeps, or why it cannot be compared, added to ``comparison``."""
    if row_a.status != "ok" or row_b.status != "ok":
        comparison.not_comparable.append(f"{row_a.label}: {row_a.status} -> {row_b.status}")
        if row_a.status == "ok":
            comparison.regressed.append(row_a.label)
        return
    time = _time_change(row_a, row_b, comparison.gate)
    changes = [time, _rate_change(row_a, row_b, time)]
    memory = _memory_change(row_a, row_b, comparison.gate)
    comparison.rows.append(ConfigurationChange(key, row_a.label, changes + ([memory] if memory else [])))
