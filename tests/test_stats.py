import math
import random
import statistics

import pytest

from fitbench.util.stats import NOISY_CV_PERCENT, SampleStats, quantile


def test_small_sample_with_one_outlier():
    stats = SampleStats.of([3, 100, 1, 4, 2])  # order must not matter
    # mean (1 + 2 + 3 + 4 + 100) / 5 = 22; squared deviations 441 + 400 + 361 + 324 + 6084 = 7610
    assert stats.count == 5
    assert stats.mean == pytest.approx(22.0)
    assert stats.std == pytest.approx(math.sqrt(7610 / 4))
    assert stats.cv_percent == pytest.approx(100 * math.sqrt(7610 / 4) / 22)
    assert stats.min == 1 and stats.max == 100
    # sorted 1 2 3 4 100: the q-quantile sits at position q * 4
    assert stats.median == pytest.approx(3.0)
    assert stats.q1 == pytest.approx(2.0)  # position 1
    assert stats.q3 == pytest.approx(4.0)  # position 3
    assert stats.iqr == pytest.approx(2.0)
    assert stats.p95 == pytest.approx(4 + 0.8 * (100 - 4))  # position 3.8
    # fences [2 - 3, 4 + 3] = [-1, 7]: only 100 lies outside
    assert stats.outliers == 1
    assert stats.noisy


def test_interpolation_between_order_statistics():
    stats = SampleStats.of([1.0, 2.0, 3.0, 4.0])
    assert stats.median == pytest.approx(2.5)  # position 1.5
    assert stats.q1 == pytest.approx(1.75)  # position 0.75
    assert stats.q3 == pytest.approx(3.25)  # position 2.25
    assert stats.p95 == pytest.approx(3.85)  # position 2.85
    assert stats.outliers == 0
    assert stats.std == pytest.approx(math.sqrt((2.25 + 0.25 + 0.25 + 2.25) / 3))


def test_outliers_on_both_sides():
    stats = SampleStats.of([-50, 10, 11, 12, 13, 14, 80])
    # positions 1.5 and 4.5: q1 = 10.5, q3 = 13.5, iqr 3, fences [6, 18]
    assert stats.q1 == pytest.approx(10.5)
    assert stats.q3 == pytest.approx(13.5)
    assert stats.outliers == 2


def test_single_value():
    stats = SampleStats.of([0.25])
    assert stats.count == 1
    assert stats.mean == stats.median == stats.q1 == stats.q3 == stats.p95 == 0.25
    assert stats.min == stats.max == 0.25
    assert stats.std == 0.0 and stats.iqr == 0.0 and stats.cv_percent == 0.0
    assert stats.outliers == 0
    assert not stats.noisy


def test_accepts_a_generator():
    stats = SampleStats.of(x / 10 for x in range(1, 6))
    assert stats.count == 5
    assert stats.mean == pytest.approx(0.3)


def test_empty_sample_raises():
    with pytest.raises(ValueError):
        SampleStats.of([])
    with pytest.raises(ValueError):
        SampleStats.of(iter(()))


def test_zero_mean_has_zero_cv():
    stats = SampleStats.of([-1.0, 1.0])
    assert stats.mean == 0.0
    assert stats.cv_percent == 0.0


def test_noisy_threshold_is_five_percent():
    assert NOISY_CV_PERCENT == 5.0
    # two values a - d, a + d: std = d * sqrt(2), cv = 100 d sqrt(2) / a
    quiet = SampleStats.of([100 - 3.4, 100 + 3.4])  # cv 4.81%
    loud = SampleStats.of([100 - 3.7, 100 + 3.7])  # cv 5.23%
    assert quiet.cv_percent == pytest.approx(100 * 3.4 * math.sqrt(2) / 100)
    assert loud.cv_percent == pytest.approx(100 * 3.7 * math.sqrt(2) / 100)
    assert not quiet.noisy
    assert loud.noisy

    fields = quiet.as_dict()
    at_threshold = SampleStats(**{**fields, "cv_percent": 5.0})
    just_above = SampleStats(**{**fields, "cv_percent": 5.0001})
    assert not at_threshold.noisy
    assert just_above.noisy


def test_as_dict_holds_every_field():
    stats = SampleStats.of([1.0, 2.0, 4.0])
    d = stats.as_dict()
    assert set(d) == {"count", "mean", "std", "cv_percent", "median", "q1", "q3", "iqr", "min", "max", "p90", "p95",
                      "p99", "outliers"}
    assert d["mean"] == pytest.approx(7 / 3)
    assert SampleStats(**d) == stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantiles_match_the_standard_library(seed):
    rng = random.Random(seed)
    values = [rng.lognormvariate(0, 0.5) for _ in range(rng.randint(7, 60))]
    stats = SampleStats.of(values)
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    twentieths = statistics.quantiles(values, n=20, method="inclusive")
    assert stats.q1 == pytest.approx(quartiles[0], rel=1e-12)
    assert stats.median == pytest.approx(quartiles[1], rel=1e-12)
    assert stats.median == pytest.approx(statistics.median(values), rel=1e-12)
    assert stats.q3 == pytest.approx(quartiles[2], rel=1e-12)
    assert stats.p95 == pytest.approx(twentieths[18], rel=1e-12)
    assert stats.mean == pytest.approx(statistics.fmean(values), rel=1e-12)
    assert stats.std == pytest.approx(statistics.stdev(values), rel=1e-12)
    assert stats.iqr == pytest.approx(quartiles[2] - quartiles[0], rel=1e-9)
    low, high = quartiles[0] - 1.5 * (quartiles[2] - quartiles[0]), quartiles[2] + 1.5 * (quartiles[2] - quartiles[0])
    assert stats.outliers == sum(1 for v in values if v < low or v > high)


def test_quantile_function_at_the_ends():
    ordered = (1.0, 5.0, 9.0)
    assert quantile(ordered, 0.0) == 1.0
    assert quantile(ordered, 1.0) == 9.0
    assert quantile(ordered, 0.5) == 5.0
    assert quantile(ordered, 0.75) == pytest.approx(7.0)
