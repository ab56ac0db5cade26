"""Statistics of a frozen sample of timings.

Computed once from an immutable tuple. Quantiles interpolate linearly between order statistics
(numpy's default "linear" method, Hyndman and Fan type 7): for sorted x_0..x_{n-1} the q-quantile
is x_j + (x_{j+1} - x_j) f where q (n - 1) = j + f. Outliers lie outside
[Q1 - 1.5 IQR, Q3 + 1.5 IQR] (Tukey's fences).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable

NOISY_CV_PERCENT = 5.0


def quantile(sorted_values: tuple[float, ...], q: float) -> float:
    position = q * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


@dataclass(frozen=True)
class SampleStats:
    count: int
    mean: float
    std: float  # sample standard deviation (n - 1); 0 for a single value
    cv_percent: float  # 100 std / mean
    median: float
    q1: float
    q3: float
    iqr: float
    min: float
    max: float
    p90: float
    p95: float
    p99: float
    outliers: int

    @classmethod
    def of(cls, values: Iterable[float]) -> SampleStats:
        sample = tuple(sorted(float(v) for v in values))
        if not sample:
            raise ValueError("statistics of an empty sample")
        n = len(sample)
        mean = math.fsum(sample) / n
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in sample) / (n - 1)) if n > 1 else 0.0
        q1, q3 = quantile(sample, 0.25), quantile(sample, 0.75)
        iqr = q3 - q1
        low_fence, high_fence = q1 - 1.5 * iqr, q3 + 1.5 * iqr
        return cls(
            count=n, mean=mean, std=std, cv_percent=100.0 * std / mean if mean else 0.0,
            median=quantile(sample, 0.5), q1=q1, q3=q3, iqr=iqr, min=sample[0], max=sample[-1],
            p90=quantile(sample, 0.90), p95=quantile(sample, 0.95), p99=quantile(sample, 0.99), outliers=sum(1 for v in sample if v < low_fence or v > high_fence),
        )

    @property
    def noisy(self) -> bool:
        return self.cv_percent > NOISY_CV_PERCENT

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
