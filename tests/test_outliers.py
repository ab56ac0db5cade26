"""LLM.int8's outlier columns on random weights (``fitbench.planning.outliers``) against sampling."""

import math

import pytest
import torch
import torch.nn.functional as F

from fitbench.models.registry import resolve
from fitbench.planning.outliers import INIT_STD, THRESHOLD, outlier_columns, outlier_probability

SAMPLES = 4_000_000


@pytest.mark.parametrize("hidden_size", [3072, 4096, 5120])
def test_the_gated_probability_matches_sampled_products(hidden_size):
    s = INIT_STD * math.sqrt(hidden_size)
    generator = torch.Generator().manual_seed(hidden_size)
    g, u = (torch.randn(SAMPLES, generator=generator, dtype=torch.float64) * s for _ in range(2))
    sampled = ((F.silu(g) * u).abs() >= THRESHOLD).double().mean().item()
    expected = outlier_probability(hidden_size, gated=True)
    # binomial standard error of the sampled fraction, and four of them as the tolerance
    error = math.sqrt(expected * (1 - expected) / SAMPLES)
    assert abs(sampled - expected) < 4 * error + 1e-7


@pytest.mark.parametrize("hidden_size", [1600, 8192])
def test_the_gelu_probability_is_the_normal_tail_beyond_the_threshold(hidden_size):
    s = INIT_STD * math.sqrt(hidden_size)
    # P(g >= 6) for g ~ N(0, s^2), by the normal distribution's own survival function
    tail = 1 - torch.distributions.Normal(0.0, s).cdf(torch.tensor(THRESHOLD, dtype=torch.float64)).item()
    assert outlier_probability(hidden_size, gated=False) == pytest.approx(tail, rel=1e-6, abs=1e-15)


@pytest.mark.parametrize("model, tokens", [("7B", 1), ("7B", 2048), ("falcon-40b", 512), ("gpt2-xl", 4096)])
def test_outlier_columns_are_the_columns_with_at_least_one_outlier_row(model, tokens):
    arch = resolve(model)
    p = outlier_probability(arch.hidden_size, arch.family == "llama")
    # (1 - p)^n loses digits for tiny p, hence the absolute tolerance
    assert outlier_columns(arch, tokens) == pytest.approx(arch.ffn_size * (1 - (1 - p) ** tokens), rel=1e-9, abs=1e-6)


def test_the_7b_preset_at_2048_tokens_has_nearly_every_column_as_measured():
    # one H200 trace (benchmarks/peak_anatomy.py): 10,981 of 11,008 columns held an outlier
    assert outlier_columns(resolve("7B"), 2048) == pytest.approx(10_981, rel=0.005)
