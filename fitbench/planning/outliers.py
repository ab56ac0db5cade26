"""How many input columns LLM.int8 takes out of its int8 product on fitbench's random weights.

LLM.int8 (Dettmers et al. 2022, section 3.2; bitsandbytes' ``MatMul8bitLt`` with threshold 6) runs
every column of a matmul's input (n rows x k columns) that holds an element with |x| >= 6 in 16 bits,
against the same columns of the weight dequantized; how many there are sets the size of those
temporaries (``fitbench.planning.memory``).

On random weights (N(0, 0.02^2) matrices and unit norms: ``fitbench.models.native.init_random_weights``,
and transformers' ``initializer_range`` of 0.02) the input of every matmul but the MLP's output
projection is a normalized residual (|x| >= 6 has probability 2e-9 per element) or an average of
values: no outliers. The MLP's output projection reads ``act(g) * u`` (gated, Llama) or ``act(g)``
(GELU: Falcon, GPT-2), where ``g`` and ``u`` are a unit-RMS input times an N(0, 0.02^2) column of h
rows: ``g, u ~ N(0, s^2)``, ``s = 0.02 sqrt(h)``. One element is an outlier with probability

    p = P(|silu(g) u| >= 6) = E_g[ erfc(6 / (|silu(g)| s sqrt 2)) ]    (gated, by quadrature over g)
    p = P(gelu(g) >= 6) = P(g >= 6) = erfc(6 / (s sqrt 2)) / 2        (GELU, which is g itself there)

and a column of n rows holds one with probability ``1 - (1 - p)^n``.

Checked on one H200 (llama 7B preset, h 4096, 4 x 512 prompt tokens): 10,981 of the 11,008 columns
(99.75%) held an outlier; this gives 99.90%. Trained checkpoints have far fewer outlier columns (a
handful of feature dimensions, Dettmers et al. 2022, section 4), so for them the count is an upper
bound.
"""

from __future__ import annotations

import math
from functools import lru_cache

from fitbench.models.architecture import Architecture

THRESHOLD = 6.0  # bitsandbytes' Linear8bitLt threshold, as fitbench.worker.quantize.bitsandbytes builds it
INIT_STD = 0.02  # fitbench.models.native.init_random_weights; transformers' initializer_range
QUADRATURE_POINTS = 2000  # midpoints over g in [-10 s, 10 s]: the sum is stable to 1e-6 at 1000


@lru_cache(maxsize=64)
def outlier_probability(hidden_size: int, gated: bool) -> float:
    """p: the probability that one element of the MLP output projection's input is at least the
    threshold in magnitude, on random weights (the module docstring's formulas)."""
    s = INIT_STD * math.sqrt(hidden_size)
    if not gated:
        return math.erfc(THRESHOLD / (s * math.sqrt(2))) / 2
    low, width = -10 * s, 20 * s / QUADRATURE_POINTS
    total = 0.0
    for i in range(QUADRATURE_POINTS):
        g = low + (i + 0.5) * width
        silu = abs(g / (1 + math.exp(-g)))
        if silu > 0:
            density = math.exp(-0.5 * (g / s) ** 2) / (s * math.sqrt(2 * math.pi))
            total += density * math.erfc(THRESHOLD / (silu * s * math.sqrt(2))) * width
    return total


def outlier_columns(arch: Architecture, tokens: int) -> float:
    """Expected columns of the MLP output projection's input (of ``arch.ffn_size``) that hold
    an outlier among ``tokens`` rows: ``f (1 - (1 - p)^n)``."""
    p = outlier_probability(arch.hidden_size, arch.family == "llama")
    return arch.ffn_size * -math.expm1(tokens * math.log1p(-p))
