"""The figures of one point of a serving benchmark (one request rate or one concurrency), from its
requests' outcomes (``fitbench.serving.client.Outcome``). The definitions are those of vLLM's
``vllm bench serve`` (vllm/benchmarks/serve.py), so that figures compare across the two:

- **duration** D: from the first send to the end of the last request, succeeded or failed;
- **request throughput**: completed requests / D; **output token throughput**: the completed requests'
  output tokens / D; **total token throughput**: their prompt plus output tokens / D;
- per completed request: **TTFT** (send to first output), **E2E** (send to end of stream), **TPOT**
  (time per output token after the first, (E2E - TTFT) / (output tokens - 1), for a request of more than
  one output token); **ITL** (the gaps between output events), pooled over the completed requests;
- each latency's mean and percentiles p50, p90, p99 (linear interpolation between order statistics,
  ``fitbench.util.stats.quantile``), with ``fitbench.util.stats.SampleStats``' figures;
- **goodput** against ``--slo`` targets (``ttft``, ``tpot``, ``e2e``, in seconds): the completed requests
  that met every target given, per second of D (DistServe, Zhong et al., OSDI 2024, section 2.2);
- **failed**: every request that did not complete, counted by the kind of its error
  (``fitbench.serving.client.ERROR_KINDS``). A failed request is in the raw records with its error,
  and in no latency.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable

from fitbench.serving.client import Outcome
from fitbench.util.errors import UserError, excerpt
from fitbench.util.stats import SampleStats, quantile

PERCENTILES = (50, 90, 99)
SLO_FIGURES = ("ttft", "tpot", "e2e")


def parse_slo(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:200ms", "e2e:2s"]`` -> ``{"ttft": 0.2, "e2e": 2.0}``; a UserError naming ``--slo`` otherwise."""
    targets: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        number = value.strip().lower()
        scale = 1e-3 if number.endswith("ms") else 1.0
        number = number.removesuffix("ms").removesuffix("s")
        try:
            seconds = float(number) * scale
        except ValueError:
            seconds = math.nan
        if name not in SLO_FIGURES or not math.isfinite(seconds) or seconds <= 0:
            raise UserError(f"slo: {excerpt(item)} is not a target; give FIGURE:TIME with FIGURE one of "
                            f"{', '.join(SLO_FIGURES)} and a time above 0 in s or ms (--slo ttft:200ms tpot:50ms).")
        targets[name] = seconds
    return targets


def tpot(outcome: Outcome) -> float | None:
    """(E2E - TTFT) / (output tokens - 1); None for a request of one output token or a failed one."""
    if not outcome.ok or outcome.output_tokens < 2:
        return None
    return (outcome.e2e - outcome.ttft) / (outcome.output_tokens - 1)


def latency(values: list[float]) -> dict[str, float] | None:
    """``SampleStats`` of ``values`` and their p50, p90 and p99; None for no values."""
    if not values:
        return None
    stats = SampleStats.of(values).as_dict()
    ordered = tuple(sorted(values))
    return {**stats, **{f"p{p}": quantile(ordered, p / 100) for p in PERCENTILES}}


def met(outcome: Outcome, slo: dict[str, float]) -> bool:
    """Whether a completed request met every target of ``slo`` (a request without a TPOT meets its target)."""
    figures = {"ttft": outcome.ttft, "tpot": tpot(outcome), "e2e": outcome.e2e}
    return outcome.ok and all(figures[name] is None or figures[name] <= target for name, target in slo.items())


def summary(outcomes: list[Outcome], slo: dict[str, float]) -> dict[str, Any]:
    """The point's figures (the module's docstring defines each): ``duration_s``, the counts, the
    throughputs, ``latency`` (``ttft``, ``tpot``, ``itl``, ``e2e``) and, with ``slo``, ``good`` and
    ``goodput_requests_per_s``."""
    start = min(outcome.sent for outcome in outcomes)
    duration = max(outcome.ended for outcome in outcomes) - start
    done = [outcome for outcome in outcomes if outcome.ok]
    failed = Counter(outcome.error.split(":", 1)[0] for outcome in outcomes if not outcome.ok)
    output = sum(outcome.output_tokens for outcome in done)
    prompt = sum(outcome.prompt_tokens for outcome in done)
    tpots = [value for value in map(tpot, done) if value is not None]
    figures: dict[str, Any] = {
        "duration_s": duration,
        "requests": len(outcomes),
        "completed": len(done),
        "failed": sum(failed.values()),
        "failures": dict(sorted(failed.items())),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "requests_per_s": len(done) / duration,
        "output_tokens_per_s": output / duration,
        "total_tokens_per_s": (prompt + output) / duration,
        "latency": {"ttft": latency([outcome.ttft for outcome in done]), "tpot": latency(tpots),
                    "itl": latency([gap for outcome in done for gap in outcome.itl]),
                    "e2e": latency([outcome.e2e for outcome in done])},
    }
    if slo:
        good = sum(met(outcome, slo) for outcome in done)
        figures.update(slo=slo, good=good, goodput_requests_per_s=good / duration)
    return figures
