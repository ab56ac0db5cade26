"""What the installed transformers keeps in a generation's KV cache, read from running it.

The hf backend's KV cache is transformers', and its shape changes between versions: which class
holds it (a ``StaticCache`` of prompt + new tokens when weights and activations share a dtype, a
``DynamicCache`` under autocast), the width of the keys and of the values (under autocast a rotary
family's keys leave the rotary embedding in fp32 while its values are 16-bit; transformers 5.17's
cache promoted the values to the keys' dtype, 5.24's keeps each in its own), how many heads a
layer caches (Falcon cached every query head's keys and values up to 5.24, its kv heads' from 5.25 on)
and how a ``DynamicCache``
grows (by concatenation: each step writes a new tensor holding every earlier position again).

None of that is a constant of one version, so ``cache_layout`` reads it from the installed one: it
builds a one-layer model of the family with small sizes on the CPU, prefills 3 tokens under the
precision's dtypes (autocast where they differ), decodes one, and looks at the cache. The answer is
kept per transformers and torch version in fitbench's cache directory (``fitbench.util.cache.remembered``),
so a planner pays for it once (transformers takes seconds to import). ``fitbench.models.hf_operators``
reads the operators a layer launches the same way, from the same small model (``probe_model``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache

from fitbench.models.architecture import Architecture
from fitbench.util.cache import installed_versions, remembered

PROMPT, HEADS = 3, 4

# The caches of the transformers versions that committed rows ran under (benchmarks/results/), each read
# by ``measure_layout`` with that version installed: "model type|probe kv heads|weights|activations" ->
# (key bytes, value bytes, query heads, static, copies on growth). A row is re-predicted with the cache
# its own run kept (``kept_under``, benchmarks/repredict.py), as its speed is forecast with the
# operators its version launched (``fitbench.models.hf_operators.COUNTED_UNDER``).
KEPT_UNDER: dict[str, dict[str, tuple[int, int, bool, bool, bool]]] = {
    "5.17.0": {
        "llama|1|float32|float32": (4, 4, False, True, False),
        "llama|1|bfloat16|bfloat16": (2, 2, False, True, False),
        "llama|1|float32|bfloat16": (4, 4, False, False, True),
        "llama|2|float32|float32": (4, 4, False, True, False),
        "llama|2|bfloat16|bfloat16": (2, 2, False, True, False),
        "llama|2|float32|bfloat16": (4, 4, False, False, True),
        "llama|4|float32|float32": (4, 4, False, True, False),
        "llama|4|bfloat16|bfloat16": (2, 2, False, True, False),
        "llama|4|float32|bfloat16": (4, 4, False, False, True),
        "mistral|1|float32|float32": (4, 4, False, True, False),
        "mistral|1|bfloat16|bfloat16": (2, 2, False, True, False),
        "mistral|1|float32|bfloat16": (4, 4, False, False, True),
        "mistral|2|float32|float32": (4, 4, False, True, False),
        "mistral|2|bfloat16|bfloat16": (2, 2, False, True, False),
        "mistral|2|float32|bfloat16": (4, 4, False, False, True),
        "mistral|4|float32|float32": (4, 4, False, True, False),
        "mistral|4|bfloat16|bfloat16": (2, 2, False, True, False),
        "mistral|4|float32|bfloat16": (4, 4, False, False, True),
        "qwen2|1|float32|float32": (4, 4, False, True, False),
        "qwen2|1|bfloat16|bfloat16": (2, 2, False, True, False),
        "qwen2|1|float32|bfloat16": (4, 4, False, False, True),
        "qwen2|2|float32|float32": (4, 4, False, True, False),
        "qwen2|2|bfloat16|bfloat16": (2, 2, False, True, False),
        "qwen2|2|float32|bfloat16": (4, 4, False, False, True),
        "qwen2|4|float32|float32": (4, 4, False, True, False),
        "qwen2|4|bfloat16|bfloat16": (2, 2, False, True, False),
        "qwen2|4|float32|bfloat16": (4, 4, False, False, True),
        "falcon|1|float32|float32": (4, 4, True, True, False),
        "falcon|1|bfloat16|bfloat16": (2, 2, True, True, False),
        "falcon|1|float32|bfloat16": (4, 4, True, False, True),
        "falcon|2|float32|float32": (4, 4, True, True, False),
        "falcon|2|bfloat16|bfloat16": (2, 2, True, True, False),
        "falcon|2|float32|bfloat16": (4, 4, True, False, True),
        "falcon|4|float32|float32": (4, 4, False, True, False),
        "falcon|4|bfloat16|bfloat16": (2, 2, False, True, False),
        "falcon|4|float32|bfloat16": (4, 4, False, False, True),
        "gpt2|4|float32|float32": (4, 4, False, True, False),
        "gpt2|4|bfloat16|bfloat16": (2, 2, False, True, False),
        "gpt2|4|float32|bfloat16": (2, 2, False, False, True),
    },
    "5.24.0": {
        "llama|1|float32|float32": (4, 4, False, True, False),
        "llama|1|bfloat16|bfloat16": (2, 2, False, True, False),
        "llama|1|float32|bfloat16": (4, 2, False, False, True),
        "llama|2|float32|float32": (4, 4, False, True, False),
        "llama|2|bfloat16|bfloat16": (2, 2, False, True, False),
        "llama|2|float32|bfloat16": (4, 2, False, False, True),
        "llama|4|float32|float32": (4, 4, False, True, False),
        "llama|4|bfloat16|bfloat16": (2, 2, False, True, False),
        "llama|4|float32|bfloat16": (4, 2, False, False, True),
        "mistral|1|float32|float32": (4, 4, False, True, False),
        "mistral|1|bfloat16|bfloat16": (2, 2, False, True, False),
        "mistral|1|float32|bfloat16": (4, 2, False, False, True),
        "mistral|2|float32|float32": (4, 4, False, True, False),
        "mistral|2|bfloat16|bfloat16": (2, 2, False, True, False),
        "mistral|2|float32|bfloat16": (4, 2, False, False, True),
        "mistral|4|float32|float32": (4, 4, False, True, False),
        "mistral|4|bfloat16|bfloat16": (2, 2, False, True, False),
        "mistral|4|float32|bfloat16": (4, 2, False, False, True),
        "qwen2|1|float32|float32": (4, 4, False, True, False),
        "qwen2|1|bfloat16|bfloat16": (2, 2, False, True, False),
        "qwen2|1|float32|bfloat16": (4, 2, False, False, True),
        "qwen2|2|float32|float32": (4, 4, False, True, False),
        "qwen2|2|bfloat16|bfloat16": (2, 2, False, True, False),
        "qwen2|2|float32|bfloat16": (4, 2, False, False, True),
        "qwen2|4|float32|float32": (4, 4, False, True, False),
        "qwen2|4|bfloat16|bfloat16": (2, 2, False, True, False),
        "qwen2|4|float32|bfloat16": (4, 2, False, False, True),
        "falcon|1|float32|float32": (4, 4, True, True, False),
        "falcon|1|bfloat16|bfloat16": (2, 2, True, True, False),
        "falcon|1|float32|bfloat16": (4, 2, True, False, True),
        "falcon|2|float32|float32": (4, 4, True, True, False),
        "falcon|2|bfloat16|bfloat16": (2, 2, True, True, False),
        "falcon|2|float32|bfloat16": (4, 2, True, False, True),
        "falcon|4|float32|float32": (4, 4, False, True, False),
        "falcon|4|bfloat16|bfloat16": (2, 2, False, True, False),
        "falcon|4|float32|bfloat16": (4, 2, False, False, True),
        "gpt2|4|float32|float32": (4, 4, False, True, False),
        "gpt2|4|bfloat16|bfloat16": (2, 2, False, True, False),
        "gpt2|4|float32|bfloat16": (2, 2, False, False, True),
    },
}
# The version whose cache ``cache_layout`` answers with, where ``KEPT_UNDER`` has it (``kept_under``)
_UNDER: ContextVar[str | None] = ContextVar("transformers_version", default=None)


@contextmanager
def kept_under(version: str | None) -> Iterator[None]:
    """Within the block, ``cache_layout`` gives the cache transformers ``version`` kept, where
    ``KEPT_UNDER`` has it, else the installed version's: re-predicting a row measured under another
    version than the installed one."""
    token = _UNDER.set(version)
    try:
        yield
    finally:
        _UNDER.reset(token)


@dataclass(frozen=True)
class CacheLayout:
    """One layer's cache per token and kv head, as the installed transformers keeps it.

    ``key_bytes``, ``value_bytes``: bytes per element of the cached keys and values; ``query_heads``:
    the layer caches every query head's keys and values instead of its kv heads'; ``static``: the cache
    is allocated once for prompt + new tokens; ``copies_on_growth``: a decode step writes the grown
    cache anew, so it reads every earlier position once more; ``source``: the transformers version."""

    key_bytes: int
    value_bytes: int
    query_heads: bool
    static: bool
    copies_on_growth: bool
    source: str

    def bytes_per_token(self, arch: Architecture) -> int:
        """(k + v bytes) x cached heads x head dim x layers: what one sequence adds per position."""
        heads = arch.num_heads if self.query_heads else arch.num_kv_heads
        return (self.key_bytes + self.value_bytes) * heads * arch.head_dim * arch.num_layers

    @property
    def formula(self) -> str:
        """How the cache holds a position, for a planner term's formula."""
        heads = "every query head" if self.query_heads else "the kv heads"
        kind = "StaticCache (prompt + new tokens)" if self.static else "DynamicCache"
        return (f"{kind} of {heads}, keys {self.key_bytes} B and values {self.value_bytes} B, as {self.source} "
                f"keeps them (read by running a one-layer model of the family)")


def cache_layout(arch: Architecture, weight_dtype: str, compute_dtype: str) -> CacheLayout:
    """The installed transformers' cache for ``arch``'s model type with weights in ``weight_dtype`` and
    activations in ``compute_dtype`` (names of torch dtypes: "float32", "bfloat16"), read from a run
    or from fitbench's cache of earlier runs with the same transformers and torch; within ``kept_under``
    a version of ``KEPT_UNDER``, that version's."""
    key = f"{arch.hf_model_type}|{probe_kv_heads(arch)}|{weight_dtype}|{compute_dtype}"
    version = _UNDER.get()
    kept = KEPT_UNDER.get(version or "", {}).get(key)
    if kept is not None:
        return CacheLayout(*kept, source=f"transformers {version}")
    return _layout(arch.hf_model_type, probe_kv_heads(arch), weight_dtype, compute_dtype)


@lru_cache(maxsize=None)
def _layout(model_type: str, kv_heads: int, weight_dtype: str, compute_dtype: str) -> CacheLayout:
    def measure() -> dict:
        return dataclasses.asdict(measure_layout(model_type, kv_heads, weight_dtype, compute_dtype))

    kept = remembered("hf-cache-layouts.json", installed_versions("transformers", "torch"),
                      f"{model_type}|{kv_heads}|{weight_dtype}|{compute_dtype}", measure)
    try:
        return CacheLayout(**kept)
    except TypeError:  # kept by a fitbench whose layout had other fields
        return CacheLayout(**measure())


def probe_kv_heads(arch: Architecture) -> int:
    """The probe's kv heads for ``arch``'s kind of attention among ``HEADS`` query heads: every head its
    own (multi-head), one for all (multi-query), or groups of two (grouped-query)."""
    return HEADS if arch.num_kv_heads == arch.num_heads else (1 if arch.num_kv_heads == 1 else HEADS // 2)


def probe_model(model_type: str, kv_heads: int, layers: int, dtype):
    """transformers' model of ``model_type`` with small sizes (``HEADS`` heads of 8, ``kv_heads`` kv heads,
    ``layers`` layers, vocabulary 64), built on the CPU with weights in ``dtype`` as the hf backend builds it."""
    from fitbench.models.hf import build_hf
    from fitbench.models.presets import PRESETS

    from transformers.utils import logging

    template = next(arch for arch in PRESETS if arch.hf_model_type == model_type)
    arch = dataclasses.replace(template, name=f"probe-{model_type}", hidden_size=8 * HEADS,
                               num_layers=layers, num_heads=HEADS, num_kv_heads=kv_heads, ffn_size=64, vocab_size=64,
                               max_seq_len=16)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the small vocabulary leaves the family's special token ids outside it
    try:
        return build_hf(arch, "cpu", dtype)
    finally:
        logging.set_verbosity(verbosity)


def measure_layout(model_type: str, kv_heads: int, weight_dtype: str, compute_dtype: str) -> CacheLayout:
    """Run a one-layer model of ``model_type`` (``probe_model``) on the CPU
    as the hf backend runs it (``fitbench.models.backends.HuggingFaceLM``): a prompt of 3 tokens, then
    one decode step; read the first layer's cache."""
    import torch
    import transformers

    from fitbench.models.backends import HuggingFaceLM

    weights, compute = getattr(torch, weight_dtype), getattr(torch, compute_dtype)
    lm = HuggingFaceLM(probe_model(model_type, kv_heads, 1, weights), static_cache=weights == compute)
    tokens = torch.zeros((1, PROMPT), dtype=torch.long)
    with torch.inference_mode(), torch.autocast("cpu", dtype=compute, enabled=weights != compute):
        lm.prefill(tokens, PROMPT + 2)
        layer = lm.cache.layers[0]
        before = layer.keys.untyped_storage().data_ptr()
        lm.decode(tokens[:, :1])
        layer = lm.cache.layers[0]
        copies = layer.keys.untyped_storage().data_ptr() != before
    return CacheLayout(key_bytes=layer.keys.element_size(), value_bytes=layer.values.element_size(),
                       query_heads=layer.keys.shape[1] == HEADS != kv_heads, static=lm.static_cache,
                       copies_on_growth=copies and not lm.static_cache,
                       source=f"transformers {transformers.__version__}")
