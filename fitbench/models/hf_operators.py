"""The operators one transformers decoder layer launches in a decode step, counted in the installed version.

The forecast's host and kernel-launch terms take a layer's operator count (``fitbench.planning.forecast``,
``layer_ops``). The native decoder's is fitbench's own code, a constant the tests count again; a
transformers model's is whatever the installed release's modeling code dispatches (Falcon's layer
launched 37 under transformers 5.24 and 31 under 5.25). ``layer_operators`` counts it: the probe model of
the family (``fitbench.models.hf_cache.probe_model``) with one layer and with two, each prefilled and
decoded twice in bf16 as the hf backend runs it (``HuggingFaceLM``, a ``StaticCache``), the second decode
step counted; the layer's count is the difference. Kept per transformers and torch version
(``fitbench.util.cache.remembered``).

A row measured under another transformers ran that version's layers: its forecast, and the constants
solved from such rows, take that version's count where ``COUNTED_UNDER`` has it (the versions of the
committed rows), else the installed one's.
"""

from __future__ import annotations

from functools import lru_cache

from fitbench.models.architecture import Architecture
from fitbench.util.cache import installed_versions, remembered

# ATen's views and the allocations of storage nobody has written yet: nothing launches, so nothing counts.
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "t", "transpose", "expand", "split", "chunk", "slice", "select", "unsqueeze", "squeeze",
    "reshape", "alias", "detach", "split_with_sizes", "as_strided", "permute", "_reshape_alias", "unbind", "empty",
    "empty_like", "lift_fresh", "new_empty", "empty_strided", "new_empty_strided"})
BATCH, PROMPT = 2, 8
# The count under the transformers versions of the committed rows, by "model type|probe kv heads": each
# printed by ``python -m fitbench.models.hf_operators`` in an environment of that version with torch
# 2.11, as the rows ran (benchmarks/results: every hf row names its versions).
_COUNTED_517_524 = {"falcon|2": 37, "gpt2|4": 24, "llama|2": 43, "llama|4": 43, "mistral|2": 43, "qwen2|2": 43}
COUNTED_UNDER = {"5.17.0": _COUNTED_517_524, "5.24.0": _COUNTED_517_524}


def launches_kernel(func) -> bool:
    """Whether an ATen operator (``func``, as a dispatch mode sees it) launches work: not in ``NO_KERNEL``."""
    return func.__name__.split(".")[0] not in NO_KERNEL


def layer_operators(arch: Architecture, transformers: str | None = None) -> int:
    """Operators one decoder layer of ``arch``'s transformers model launches in a decode step, under
    ``transformers`` (a version; ``COUNTED_UNDER``'s) or else as the installed version runs it (read
    once per version)."""
    from fitbench.models.hf_cache import probe_kv_heads

    key = f"{arch.hf_model_type}|{probe_kv_heads(arch)}"
    counted = COUNTED_UNDER.get(transformers or "", {})
    if key in counted:
        return counted[key]
    return _operators(arch.hf_model_type, probe_kv_heads(arch))


@lru_cache(maxsize=None)
def _operators(model_type: str, kv_heads: int) -> int:
    kept = remembered("hf-layer-operators.json", installed_versions("transformers", "torch"),
                      f"{model_type}|{kv_heads}",
                      lambda: {"operators": count_layer_operators(model_type, kv_heads)})
    return int(kept["operators"])


def count_layer_operators(model_type: str, kv_heads: int) -> int:
    """The second decode step's operators with two layers less those with one (``layer_operators``)."""
    return decode_operators(model_type, kv_heads, 2) - decode_operators(model_type, kv_heads, 1)


def decode_operators(model_type: str, kv_heads: int, layers: int) -> int:
    """Operators that launch in the second decode step of the probe model with ``layers`` layers."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from fitbench.models.backends import HuggingFaceLM
    from fitbench.models.hf_cache import probe_model

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.operators = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.operators += launches_kernel(func)
            return func(*args, **(kwargs or {}))

    lm = HuggingFaceLM(probe_model(model_type, kv_heads, layers, torch.bfloat16), static_cache=True)
    token = torch.zeros((BATCH, 1), dtype=torch.long)
    with torch.inference_mode():
        lm.prefill(torch.zeros((BATCH, PROMPT), dtype=torch.long), PROMPT + 4)
        lm.decode(token)
        with Count() as counted:
            lm.decode(token)
    return counted.operators


if __name__ == "__main__":  # the counts of the presets' model types under the installed transformers
    import json
    from importlib.metadata import version

    from fitbench.models.hf_cache import probe_kv_heads
    from fitbench.models.presets import PRESETS

    kinds = sorted({(arch.hf_model_type, probe_kv_heads(arch)) for arch in PRESETS if arch.hf_model_type})
    print(json.dumps({version("transformers"): {f"{model_type}|{kv}": count_layer_operators(model_type, kv)
                                                 for model_type, kv in kinds}}, indent=1))
