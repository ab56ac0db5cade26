"""Two sweeps (or two trees of sweeps) compared configuration by configuration, with gates for CI.

Rows are joined on ``key``, the hash of the configuration (``fitbench.spec``), and, between two trees
of sweeps (``fitbench.results.directories.sweep_directories``), on the folder each was found in too.
``match_across`` names options whose value may differ between the pair (``precision``: A's bf16 row
against B's int8 row of the same configuration otherwise), as pytest-benchmark's ``--group-by``
groups runs: the key is then that of the configuration with those options set aside
(``match_key``). A key in one sweep only is listed, and a key whose row is not ``ok`` on either side
is listed with both statuses. For each configuration ok on both sides, B against A:

- **time**: the mean of the raw samples (a training-style row's step times, an ``infer`` row's
  per-token decode latencies: ``timing.samples``); the change is ``100 (mean_B / mean_A - 1)`` % and
  the ratio ``mean_B / mean_A``. Its 95% confidence interval is a **percentile bootstrap** (Efron and
  Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13): ``RESAMPLES`` times, draw n_A samples
  from A and n_B from B with replacement and take ``100 (mean(B*) / mean(A*) - 1)``; the interval is
  the 2.5% and 97.5% quantiles of those (linear interpolation, as ``fitbench.util.stats``). A bootstrap
  rather than Welch's t-interval: step times are skewed (a slow first step, an allocator retry),
  which the bootstrap does not assume away. The generator is seeded (``SEED``), so a comparison gives
  the same interval every time. The change is **slower** when the whole interval is above 0,
  **faster** when it is below, else **within noise**. With fewer than 2 samples on a side there is
  no interval: the change of the rows' means (``timing.step.mean``) is shown, marked ``no samples``.
- **tokens/s**: the rows' figures, and their change; at a fixed number of tokens per step, tokens/s
  is inversely proportional to the time, so its interval is the time's mapped through
  ``100 (1 / (1 + c/100) - 1)`` (bounds swapped), and its verdict is the time's.
- **peak memory**: the largest GPU's measured peak in GB (``fitbench.report.columns``); one figure per
  run, so no interval: **larger** or **smaller** when it moved by more than ``MEMORY_NOISE_PERCENT``,
  else **unchanged**.

Gates, ``--fail-on FIGURE:PERCENT``, any number of them, each checked and reported on its own line:
``mean:P%`` fails when a configuration's time is slower (its interval above 0) by more than P% (a
time without samples gates on its change); ``memory:P%`` when its peak memory grew by more than P%;
and every gate fails when a configuration ok in A is not ok in B (it crashed, ran out of memory, was
refused) or is missing from B. Whatever the gates, a comparison in which no configuration was
compared (nothing in common, or nothing ok on both sides) fails: it cannot vouch for anything.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
from pydantic import ValidationError

from fitbench.report.columns import largest_peak
from fitbench.results.directories import SweepRows, read_sweeps
from fitbench.results.report import PER_TOKEN_MODES, headline
from fitbench.results.row import Row
from fitbench.results.terminal import NO_STEPS, Steps
from fitbench.spec import Layout, RunSpec
from fitbench.util.errors import UserError, excerpt
from fitbench.util.units import format_seconds

RESAMPLES = 2000
SEED = 0
CONFIDENCE = 0.95
MEMORY_NOISE_PERCENT = 1.0
# Resamples drawn at once: a decode row holds thousands of samples, and all its resamples at once
# would be hundreds of MB.
CHUNK_VALUES = 2_000_000
GATES = {"mean": "the mean step time (per-token latency in infer)", "memory": "the peak memory of the largest GPU"}
BOOTSTRAP = (f"Time: mean of the raw samples (per step; per decoded token in infer), B/A with a {CONFIDENCE:.0%} "
             f"percentile bootstrap interval ({RESAMPLES} resamples); slower or faster only when the whole interval "
             f"is on one side of 1. Tokens/s: the rows' figures, the interval mapped from the time's. Peak: the "
             f"largest GPU's measured peak, GB.")
# The options a comparison may match across: RunSpec's fields, as the command line spells them.
MATCHABLE = tuple(name.replace("_", "-") for name in RunSpec.model_fields)


@dataclass(frozen=True)
class Gate:
    """``--fail-on``: which figure (``GATES``) and by how many percent it may get worse."""

    figure: str
    percent: float

    @property
    def text(self) -> str:
        return f"{self.figure}:{self.percent:g}%"


def parse_fail_on(text: str) -> Gate:
    """``mean:5%`` -> Gate("mean", 5.0); a UserError for anything else."""
    match = re.fullmatch(r"\s*(\w+)\s*:\s*(\d+(?:\.\d+)?)\s*%?\s*", text or "")
    if not match or match.group(1) not in GATES:
        raise UserError(f"fail-on: {excerpt(text)} is not a gate; write FIGURE:PERCENT with FIGURE one of "
                        f"{', '.join(f'{name} ({what})' for name, what in GATES.items())}, e.g. --fail-on mean:5%.")
    return Gate(match.group(1), float(match.group(2)))


def parse_gates(texts: str | Iterable[str] | None) -> list[Gate]:
    """Every ``--fail-on`` given, in order, each a ``Gate``; none for None."""
    given = [] if texts is None else [texts] if isinstance(texts, str) else list(texts)
    return [parse_fail_on(text) for text in given]


def parse_match_across(names: str | Iterable[str] | None) -> tuple[str, ...]:
    """The RunSpec fields of ``--match-across`` (``batch-size`` -> ``batch_size``); a UserError naming the
    options one may give for an unknown one."""
    given = [] if names is None else [names] if isinstance(names, str) else list(names)
    fields = tuple(dict.fromkeys(name.strip().replace("-", "_") for name in given))
    unknown = [name for name in fields if name not in RunSpec.model_fields]
    if unknown:
        raise UserError(f"match-across: {excerpt(', '.join(unknown))} is not an option of a configuration; name one "
                        f"or more of {', '.join(MATCHABLE)}, e.g. --match-across precision.")
    return fields


@dataclass(frozen=True)
class Change:
    """One figure of one configuration, A to B; percents are ``100 (B / A - 1)``. ``gate`` is the
    figure of the gates that judge it (``GATES``) and ``gated`` the percent they compare with theirs:
    the time's change only where it is slower beyond its noise (or has no samples), the peak's change."""

    figure: str
    before: float | None
    after: float | None
    percent: float | None
    low_percent: float | None = None
    high_percent: float | None = None
    verdict: str = "no samples"
    gate: str | None = None
    gated: float | None = None

    def crosses(self, gate: Gate) -> bool:
        """Whether this change is beyond ``gate``."""
        return gate.figure == self.gate and self.gated is not None and self.gated > gate.percent

    def ratio(self) -> str:
        """B/A to three decimals, with its interval where it has one: ``1.100 [1.082, 1.118]``."""
        if self.percent is None:
            return "-"
        interval = ("" if self.low_percent is None
                    else f" [{1 + self.low_percent / 100:.3f}, {1 + self.high_percent / 100:.3f}]")
        return f"{1 + self.percent / 100:.3f}{interval}"


@dataclass
class ConfigurationChange:
    key: str
    label: str
    changes: list[Change]

    def change(self, figure: str) -> Change | None:
        return next((change for change in self.changes if change.figure == figure), None)


@dataclass(frozen=True)
class GateResult:
    """One gate's verdict: the configurations that failed it, each with why."""

    gate: Gate
    failures: list[str]

    @property
    def line(self) -> str:
        return f"Gate {self.gate.text}: " + (f"failed by {'; '.join(self.failures)}" if self.failures else "passed")


@dataclass
class Comparison:
    a: list[SweepRows]
    b: list[SweepRows]
    rows: list[ConfigurationChange]
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    not_comparable: list[str] = field(default_factory=list)  # "label: ok -> oom"
    regressed: list[str] = field(default_factory=list)  # ok in A, not ok in B
    missing: list[str] = field(default_factory=list)  # ok in A, not in B
    gates: list[Gate] = field(default_factory=list)
    match_across: tuple[str, ...] = ()
    differing: list[str] = field(default_factory=list)  # options whose values A and B share none of
    method: str = BOOTSTRAP

    def gate_results(self) -> list[GateResult]:
        """Each gate, checked on every configuration: its changes beyond it, then those no longer ok."""
        lost = [f"{label} (no longer ok)" for label in self.regressed] + [f"{label} (missing from B)"
                                                                           for label in self.missing]
        return [GateResult(gate, [f"{row.label} ({change.figure} {change.percent:+.1f}%)" for row in self.rows
                                  for change in row.changes if change.crosses(gate)] + lost) for gate in self.gates]

    @property
    def nothing_compared(self) -> bool:
        return not self.rows

    @property
    def failed(self) -> bool:
        """Whether the comparison fails: nothing was compared, or a gate failed."""
        return self.nothing_compared or any(result.failures for result in self.gate_results())

    def table(self) -> tuple[list[str], list[list[str]]]:
        """One row per configuration compared: its times, tokens/s and peaks in A and B, each with B/A."""
        header = ["configuration", "mean time A", "mean time B", "time B/A [95% CI]", "verdict", "tokens/s A", "tokens/s B",
                  "tokens/s B/A", "peak A (GB)", "peak B (GB)", "peak B/A", "gates"]
        lines = []
        for row in self.rows:
            time, rate, peak = (row.change(figure) for figure in ("time", "tokens/s", "peak memory"))
            crossed = [gate.text for gate in self.gates if any(change.crosses(gate) for change in row.changes)]
            lines.append([row.label, format_seconds(time.before), format_seconds(time.after), time.ratio(),
                          time.verdict, _rate(rate.before), _rate(rate.after), rate.ratio(),
                          _gigabytes(peak and peak.before), _gigabytes(peak and peak.after),
                          peak.ratio() if peak else "-", ", ".join(f"beyond {text}" for text in crossed) or
                          ("passed" if self.gates else "-")])
        return header, lines

    def lines(self) -> list[str]:
        """The comparison as text: the table (one line per configuration), the configurations not
        compared, then the verdict."""
        header, values = self.table()
        lines = _aligned(header, values) if values else []
        lines += [f"only in A: {label}" for label in self.only_a] + [f"only in B: {label}" for label in self.only_b]
        lines += [f"not ok on a side: {text}" for text in self.not_comparable]
        return lines + self.verdict()

    def verdict(self) -> list[str]:
        """What was compared, in one line; then one line per gate; then why nothing was compared, if so."""
        times = [row.change("time") for row in self.rows]
        counts = {verdict: sum(change.verdict == verdict for change in times)
                  for verdict in ("slower", "faster", "within noise", "no samples")}
        text = f"{len(self.rows)} configuration(s) compared" + "".join(
            f", {count} {verdict}" for verdict, count in counts.items() if count)
        if self.match_across:
            text += f" (matched across {', '.join(name.replace('_', '-') for name in self.match_across)})"
        if self.only_a or self.only_b:
            text += f"; {len(self.only_a)} only in A, {len(self.only_b)} only in B"
        if self.not_comparable:
            text += f"; {len(self.not_comparable)} not ok on a side"
        lines = [text] + [result.line for result in self.gate_results()]
        if self.nothing_compared:
            lines.append("FAILED: nothing was compared: no configuration is ok in both A and B, so this comparison "
                         "cannot vouch for B" + self._why_nothing())
        return lines

    def summary(self) -> str:
        return " ".join(self.verdict())

    def _why_nothing(self) -> str:
        places_a = {sweep.place for sweep in self.a}
        places_b = {sweep.place for sweep in self.b}
        if not places_a & places_b:
            return (f". A's folders ({', '.join(sorted(places_a))}) and B's ({', '.join(sorted(places_b))}) share "
                    f"none; compare two sweeps, or two trees of the same folders.")
        if self.differing:
            options = " ".join(self.differing)
            return (f". Their rows differ in {', '.join(self.differing)}; --match-across {options} pairs the rows "
                    f"that differ only there.")
        return "."


def _rate(value: float | None) -> str:
    return "-" if not value else f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def _gigabytes(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _aligned(header: list[str], rows: list[list[str]]) -> list[str]:
    """A plain-text table: the first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(line[c]) for line in [header] + rows) for c in range(len(header))]

    def joined(line: list[str]) -> str:
        return "  ".join(cell.ljust(widths[c]) if c == 0 else cell.rjust(widths[c])
                         for c, cell in enumerate(line)).rstrip()

    return [joined(header), joined(["-" * width for width in widths])] + [joined(line) for line in rows]


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


def _time_change(row_a: Row, row_b: Row) -> Change:
    a, b = time_samples(row_a), time_samples(row_b)
    if len(a) >= 2 and len(b) >= 2:
        before, after = sum(a) / len(a), sum(b) / len(b)
        percent = _percent(before, after)
        low, high = bootstrap_interval(a, b)
        verdict = "slower" if low > 0 else "faster" if high < 0 else "within noise"
        return Change("time", before, after, percent, low, high, verdict, "mean",
                      percent if verdict == "slower" else None)
    name = "token_latency" if row_a.spec["mode"] in PER_TOKEN_MODES else "step"
    before, after = (((row.timing or {}).get(name) or {}).get("mean") for row in (row_a, row_b))
    percent = _percent(before, after)
    return Change("time", before, after, percent, gate="mean", gated=percent)


def _inverse(percent: float | None) -> float | None:
    """The change of a rate whose time changed by ``percent``: 100 (1 / (1 + percent/100) - 1)."""
    return None if percent is None or percent <= -100 else 100 * (1 / (1 + percent / 100) - 1)


def _rate_change(row_a: Row, row_b: Row, time: Change) -> Change:
    before, after = headline(row_a)["tokens_per_s"], headline(row_b)["tokens_per_s"]
    return Change("tokens/s", before, after, _percent(before, after), _inverse(time.high_percent),
                  _inverse(time.low_percent), time.verdict)


def _memory_change(row_a: Row, row_b: Row) -> Change | None:
    before, after = largest_peak(row_a), largest_peak(row_b)
    percent = _percent(before, after)
    if percent is None:
        return None
    verdict = ("larger" if percent > MEMORY_NOISE_PERCENT else "smaller" if percent < -MEMORY_NOISE_PERCENT
               else "unchanged")
    return Change("peak memory", before, after, percent, verdict=verdict, gate="memory", gated=percent)


def match_key(row: Row, across: tuple[str, ...]) -> str:
    """The key rows are joined on: the configuration's ``key``, or, matching ``across`` options, the key
    of the configuration with each of them set to one placeholder (the layout to one device), so that
    rows differing only there share it. A spec this fitbench cannot read (a row of an older one) is
    keyed on its fields less those options."""
    if not across:
        return row.key
    try:
        spec = RunSpec.model_validate(row.spec)
    except ValidationError:
        return json.dumps({name: value for name, value in row.spec.items() if name not in across}, sort_keys=True,
                          default=str)
    # A placeholder of each field's own type (0, "", False, the one-device layout), which its key serializes as such.
    return spec.model_copy(update={name: type(value)() if value is not None else None
                                   for name in across for value in [getattr(spec, name)]}).key


def _across_label(row_a: Row, row_b: Row, across: tuple[str, ...]) -> str:
    """A's label, and the values of the options matched across where B's differ: ``... (precision bf16 -> int8)``."""
    moved = [f"{name.replace('_', '-')} {_value(row_a.spec.get(name))} -> {_value(row_b.spec.get(name))}"
             for name in across if row_a.spec.get(name) != row_b.spec.get(name)]
    return row_a.label + (f" ({'; '.join(moved)})" if moved else "")


def _value(value: object) -> str:
    if isinstance(value, dict):  # a layout
        return Layout.model_validate(value).label or "one device"
    return str(value)


def _keyed(sweeps: list[SweepRows], across: tuple[str, ...], side: str) -> dict[tuple[str, str], Row]:
    """Each row of a side by its folder in the tree and its ``match_key``; a UserError where two rows of
    one folder share a key when matching across options (which of them would B's be compared to?)."""
    keyed: dict[tuple[str, str], Row] = {}
    for sweep in sweeps:
        for row in sweep.rows:
            place = (sweep.place, match_key(row, across))
            if across and place in keyed:
                raise UserError(f"match-across: {side} holds two rows that differ only in "
                                f"{', '.join(name.replace('_', '-') for name in across)} ({excerpt(keyed[place].label)} "
                                f"and {excerpt(row.label)}), so B's row has no one match; match across fewer options, "
                                f"or compare folders that hold one of them.")
            keyed[place] = row
    return keyed


def _differing(a: Iterable[Row], b: Iterable[Row]) -> list[str]:
    """The options whose values in A's rows and in B's share none (B ran int8 where A ran bf16), as
    the command line spells them."""
    values_a, values_b = defaultdict(set), defaultdict(set)
    for rows, values in ((a, values_a), (b, values_b)):
        for row in rows:
            for name, value in row.spec.items():
                values[name].add(json.dumps(value, sort_keys=True, default=str))
    return [name.replace("_", "-") for name in values_a
            if name in values_b and not values_a[name] & values_b[name] and name != "device"]


def compare_sweeps(a: str | Path, b: str | Path, fail_on: str | Iterable[str] | None = None,
                   steps: Steps = NO_STEPS, match_across: str | Iterable[str] | None = None) -> Comparison:
    """Sweep B against sweep A (their directories, or two trees of sweeps paired folder by folder),
    gated by each of ``fail_on`` (``mean:5%``, several allowed); rows paired across the options
    ``match_across`` names. Each configuration in both is a step of ``steps``."""
    gates = parse_gates(fail_on)
    across = parse_match_across(match_across)
    first, second = (read_sweeps(directory, side).sweeps for directory, side in ((a, "compare A"), (b, "compare B")))
    for side, sweeps in (("compare A", first), ("compare B", second)):
        if not any(sweep.rows for sweep in sweeps):
            sweeps[0].require_rows(side)
    rows_a, rows_b = _keyed(first, across, "A"), _keyed(second, across, "B")

    def label(place: tuple[str, str], row: Row) -> str:
        return row.label if place[0] == "." else f"{place[0]}: {row.label}"

    comparison = Comparison(first, second, [], gates=gates, match_across=across,
                            only_a=[label(place, row) for place, row in rows_a.items() if place not in rows_b],
                            only_b=[label(place, row) for place, row in rows_b.items() if place not in rows_a],
                            differing=_differing(rows_a.values(), rows_b.values()))
    comparison.missing = [label(place, row) for place, row in rows_a.items()
                          if place not in rows_b and row.status == "ok"]
    steps.begin("configurations compared", sum(place in rows_b for place in rows_a))
    for place, row_a in rows_a.items():
        if place in rows_b:
            row_b = rows_b[place]
            _compare_one(comparison, row_a.key, label(place, row_a) if not across
                         else label(place, row_a).replace(row_a.label, _across_label(row_a, row_b, across)),
                         row_a, row_b)
            steps.advance()
    return comparison


def _compare_one(comparison: Comparison, key: str, label: str, row_a: Row, row_b: Row) -> None:
    """The changes of one configuration in both sweeps, or why it cannot be compared, added to ``comparison``."""
    if row_a.status != "ok" or row_b.status != "ok":
        comparison.not_comparable.append(f"{label}: {row_a.status} -> {row_b.status}")
        if row_a.status == "ok":
            comparison.regressed.append(label)
        return
    time = _time_change(row_a, row_b)
    changes = [time, _rate_change(row_a, row_b, time)]
    memory = _memory_change(row_a, row_b)
    comparison.rows.append(ConfigurationChange(key, label, changes + ([memory] if memory else [])))
