"""The KV cache's terms: fitbench's preallocated cache, and transformers' as the installed version
keeps it (``fitbench.models.hf_cache``).
"""

from __future__ import annotations

from fitbench.models.architecture import Architecture
from fitbench.models.hf_cache import CacheLayout, cache_layout
from fitbench.planning.terms import Widths


def hf_cache(arch: Architecture, widths: Widths) -> CacheLayout:
    """The KV cache the installed transformers keeps for ``arch`` at these widths: weights of 4 bytes
    are fp32, of 2 bf16; activations likewise (``fitbench.models.hf_cache``, which runs it once)."""
    return cache_layout(arch, "float32" if widths.weights == 4 else "bfloat16",
                        "float32" if widths.compute == 4 else "bfloat16")


def kv_cache_bytes(arch: Architecture, batch: int, length: int, widths: Widths, tp: int = 1,
                   backend: str = "native") -> float:
    """2 x L x kv heads x head dim x c x tokens x batch (keys and values, c bytes each); preallocated for the whole
    prompt + generation. transformers' cache is the installed version's (``hf_cache``): its keys and
    values each at their own width, and Falcon's of every query head."""
    if backend == "hf":
        return hf_cache(arch, widths).bytes_per_token(arch) * batch * length / tp
    return arch.kv_cache_bytes_per_token(widths.compute) * batch * length / tp


def kv_bytes_read_per_position(arch: Architecture, widths: Widths, backend: str = "native") -> float:
    """What a decode step reads of the KV cache per cached position (``CausalLM.kv_bytes_read``): the
    cache's bytes per token, twice over for a transformers ``DynamicCache`` that each step writes anew
    (the copy reads the earlier positions, then attention reads them: 2 p + 1 slots at position p)."""
    if backend != "hf":
        return arch.kv_cache_bytes_per_token(widths.compute)
    layout = hf_cache(arch, widths)
    return layout.bytes_per_token(arch) * (2 if layout.copies_on_growth else 1)
