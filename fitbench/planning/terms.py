"""A peak as terms: ``Term`` (bytes, formula, the moments it is alive at), the byte ``Widths`` of a
precision, the ``MemoryEstimate`` of a configuration, and the moments a peak can fall at.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fitbench.planning.sharding import Parallelism
from fitbench.precisions import entry
from fitbench.spec import Stage


@dataclass(frozen=True)
class Term:
    """One kind of memory, and the moments of the step at which it is alive (None: all of them).
    ``cached``: pages a CUDA stream's pool keeps mapped with no tensor in them (the caching allocator
    keeps a pool per stream, and a block freed on one stream serves only that stream); the allocator
    unmaps them, after a synchronizing retry, when a request on another stream would not fit, so they
    count in the peak NVML reads but not in what must fit."""

    name: str
    bytes: float
    formula: str
    moments: frozenset[str] | None = None
    cached: bool = False


@dataclass(frozen=True)
class Widths:
    """Byte widths of weights (w), activations (c) and the residual stream (r), and whether
    autocast casts inputs and weights to 16 bits."""

    weights: float
    compute: int
    residual: int
    autocast: bool

    @classmethod
    def of(cls, precision: str, parallelism: Parallelism | None = None) -> Widths:
        """``precision``'s widths, from its policy's dtypes: the weights' as built (a quantized model's
        weights outside the layers' matmuls stay bf16), the activations' and a residual stream as wide as
        the weights; under FSDP (``parallelism``), a mixed precision's: 16-bit gathered weights and
        inputs, so 16-bit activations and no autocast, beside its fp32 shards."""
        policy = entry(precision).policy
        mixed = policy.autocast_dtype_name is not None
        if parallelism is not None and parallelism.shards > 1 and mixed:
            return cls(policy.weight_bytes, policy.compute_bytes, policy.compute_bytes, False)
        return cls(policy.weight_bytes, policy.compute_bytes, policy.weight_bytes, mixed)


@dataclass(frozen=True)
class MemoryEstimate:
    """Terms, and the moment at which the most of them coexist: the peak."""

    terms: tuple[Term, ...]
    moments: tuple[str, ...]
    stage: Stage | None = None  # the pipeline stage estimated, where there are several

    def total_at(self, moment: str, cached: bool = True) -> float:
        """Bytes at ``moment``; without ``cached``, the tensors alone (what must fit)."""
        return sum(t.bytes for t in self.terms if (t.moments is None or moment in t.moments) and (cached or not t.cached))

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.total_at)

    @property
    def peak_bytes(self) -> float:
        return self.total_at(self.peak_moment)

    def at_peak(self, term: Term) -> bool:
        return term.moments is None or self.peak_moment in term.moments

    def as_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "peak_moment": self.peak_moment,
            "stage": self.stage.label if self.stage else None,
            "moments": {moment: self.total_at(moment) for moment in self.moments},
            "terms": [{"name": t.name, "bytes": t.bytes, "formula": t.formula, "at_peak": self.at_peak(t),
                       **({"cached": True} if t.cached else {})} for t in self.terms],
        }


def with_stage(estimate: MemoryEstimate, stage: Stage) -> MemoryEstimate:
    """``estimate`` naming its pipeline stage, where there are several."""
    return replace(estimate, stage=stage) if stage.count > 1 else estimate


# RECOMPUTE: of the last layer that recomputes (the last of a stage under full checkpointing, the
# last of the first N under ``checkpointed_layers`` N).
START, RECOMPUTE, FIRST, END = ("start of the backward pass", "recompute of the last layer",
                                "backward of the first layer", "end of the backward pass")
# GPipe with two microbatches or more: the second microbatch's backward, beside the first one's gradients
LATER = "backward of the second microbatch"


MLP, OUTPUT, BUILD = "prefill MLP", "output projection", "quantizing a layer"
SHARDS = "building the tensor-parallel shards"
OUTLIERS = "LLM.int8 outlier columns"
