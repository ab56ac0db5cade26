"""The record of one precision: everything fitbench knows about it, as plain data that every floor may
read without torch (``fitbench.precisions`` holds the entries).

A record says how the precision runs inside a worker (``PrecisionPolicy``), which library's tensors hold
its weights and how many bytes they take (``StorageFormat``), what quantizing them costs while a model
is built, how a decode step reads them (``DecodeFormats``), which tensor cores do most of its FLOPs, how
it trains, what the device must offer (``DeviceNeed``), why a decode step cannot be captured in a CUDA
graph, and of which modes' default fallback ladder it is a rung.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

TRAINING_MODES = ("train", "forward-backward")
# The tensor-core kinds of the peak tables (``fitbench.hardware.datasheet``): the kinds a precision's MFU may divide by.
PEAK_KINDS = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # torch attributes, bytes per element

# How a precision trains (``Precision.training``): every weight in its own dtypes; every weight with the
# decoder's matmuls in float8 (torchao's float8 training); low-rank adapters on the frozen quantized base.
EVERY_WEIGHT, FLOAT8, ADAPTERS = "every weight", "float8", "adapters"


@dataclass(frozen=True)
class PrecisionPolicy:
    """How a precision runs inside a worker. Its dtypes are named, not torch objects, so that the
    registry (and the parent process, which plans and launches) never imports torch: a sweep's
    parent and ``fitbench plan`` start in a fraction of a second instead of torch's seconds."""

    name: str
    weight_dtype_name: str  # an attribute of torch: "float32", "bfloat16"
    autocast_dtype_name: str | None
    allow_tf32: bool
    scale_loss: bool
    quantized: bool = False

    @property
    def weight_bytes(self) -> int:
        """Bytes per element of the weights as built (before any quantization)."""
        return DTYPE_BYTES[self.weight_dtype_name]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the activations (and the KV cache)."""
        return DTYPE_BYTES[self.autocast_dtype_name or self.weight_dtype_name]

    @property
    def weight_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.weight_dtype_name)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        import torch

        return None if self.autocast_dtype_name is None else getattr(torch, self.autocast_dtype_name)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations (and the KV cache) have."""
        return self.autocast_dtype or self.weight_dtype

    @contextlib.contextmanager
    def autocast(self, device_type: str) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        import torch

        with torch.autocast(device_type=device_type, dtype=self.autocast_dtype):
            yield

    def apply_backend_flags(self) -> None:
        """Process-wide matmul precision. Each run is its own process, so this never leaks."""
        import torch

        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        torch.backends.cudnn.allow_tf32 = self.allow_tf32


@dataclass(frozen=True)
class StorageFormat:
    """Storage of one quantized weight matrix: ``bits`` per element, plus one scale of
    ``scale_bytes`` per group: a row (``group = 0``), or a block of ``group`` elements."""

    bits: int
    scale_bytes: float
    group: int
    source: str

    def matrix_bytes(self, rows: int, columns: int) -> float:
        scales = rows if self.group == 0 else rows * columns / self.group
        return rows * columns * self.bits / 8 + scales * self.scale_bytes


@dataclass(frozen=True)
class DecodeFormat:
    """How a decode step's matmuls read one weight format: ``efficiency``, the share of the copy
    bandwidth its kernels reach reading the weights; ``extra_kernels``, kernels each matmul launches
    beyond one (activation quantization, a dequantized copy, scaling); ``dequantized``, bytes per weight
    of a 16-bit copy written and read again at every matmul; ``source``, the row it comes from;
    ``bytes_per_matmul_flop``, for kernels whose unpacking arithmetic rather than the memory sets their
    pace, the weight bytes they read per second for each bf16 FLOP/s the GPU's tensor cores reach (0:
    no such bound)."""

    efficiency: float = 1.0
    extra_kernels: float = 0.0
    dequantized: float = 0.0
    source: str = "dense: the weights read once at the copy bandwidth"
    bytes_per_matmul_flop: float = 0.0

    def read_rate(self, bandwidth: float, matmul_flops: float) -> float:
        """Bytes per second the kernels read the weights at, on a GPU whose copy moves ``bandwidth`` and
        whose bf16 matmul reaches ``matmul_flops``: min(efficiency x bandwidth, bytes_per_matmul_flop x
        matmul_flops), the second where given. An arithmetic-bound kernel reads as fast on a GPU of more
        bandwidth and the same processor."""
        rate = self.efficiency * bandwidth
        return min(rate, self.bytes_per_matmul_flop * matmul_flops) if self.bytes_per_matmul_flop else rate


DENSE = DecodeFormat()


@dataclass(frozen=True)
class DecodeFormats:
    """A format's decode terms by how the step runs: ``eager``, the eager step, replayed from a CUDA
    graph or launched without one; ``compiled``, the compiled step's (a decoder layer compiled by
    inductor, in a graph), the dense step's for a format not timed compiled; each for one token per
    step and, where it differs, for more (``..._more_tokens``; None: as for one)."""

    eager: DecodeFormat = DENSE
    eager_more_tokens: DecodeFormat | None = None
    compiled: DecodeFormat = DENSE
    compiled_more_tokens: DecodeFormat | None = None

    def at(self, decode: str, tokens: int) -> DecodeFormat:
        """The terms of a step of ``tokens`` tokens that runs as ``decode`` says ("compiled", or a step
        run eagerly: "graph", "eager")."""
        one, more = ((self.compiled, self.compiled_more_tokens) if decode == "compiled"
                     else (self.eager, self.eager_more_tokens))
        return more if tokens > 1 and more is not None else one


@dataclass(frozen=True)
class DequantizedCopy:
    """The copy of a weight a prefill matmul makes before multiplying: ``bytes`` per element of the
    matrix, alive at the MLP; ``why``, what makes it."""

    bytes: float
    why: str


@dataclass(frozen=True)
class PrefillReserve:
    """The caching allocator's reserve at a quantized model's prefill MLP (``fitbench.planning.memory.
    prefill_reserve_term``): ``bytes`` per element of n x f of the MLP's largest temporary, ``what`` it is."""

    bytes: float
    what: str


@dataclass(frozen=True)
class DeviceNeed:
    """What a precision's kernels need of the device: a CUDA GPU (``on_cpu``: why not the CPU), and of
    compute ``capability`` or newer, which ``generations`` names."""

    on_cpu: str
    capability: tuple[int, int] | None = None
    generations: str = ""


@dataclass(frozen=True)
class Precision:
    """One precision: its ``name`` and ``summary``; how it runs in a worker (``policy``); for a quantized
    one the ``library`` whose tensors hold its weights (``fitbench.worker.quantize`` converts a plain model
    with it), their ``storage`` and the bytes per element of the largest matrix the quantizer holds beside
    a layer in bf16 while the model is built (``build_temporary_bytes``); how a decode step reads them
    (``decode``) and, at prefill, the weight copy each matmul makes (``dequantized``), the activations
    quantized on the fly through torchao's dynamic scaling (``activation_scaling``), LLM.int8's outlier
    columns (``outlier_columns``) and the allocator's reserve at the MLP (``prefill_reserve``).
    ``peak_kinds``: the tensor cores doing most of the FLOPs, for inference and for training (None:
    no training). ``training``: how it trains (``EVERY_WEIGHT``, ``FLOAT8``, ``ADAPTERS``) or None, refused
    for ``no_training``. ``device``: what the device must offer; ``graph_problem``: why a decode step cannot
    be captured in a CUDA graph; ``default_rung``: the modes whose default fallback ladder it is a rung of."""

    name: str
    summary: str
    policy: PrecisionPolicy
    peak_kinds: tuple[str, str | None]
    training: str | None = EVERY_WEIGHT
    no_training: str = ""
    library: str | None = None
    storage: StorageFormat | None = None
    build_temporary_bytes: float = 0.0
    decode: DecodeFormats = field(default_factory=DecodeFormats)
    dequantized: DequantizedCopy | None = None
    activation_scaling: bool = False
    outlier_columns: bool = False
    prefill_reserve: PrefillReserve | None = None
    device: DeviceNeed | None = None
    graph_problem: str | None = None
    default_rung: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        kinds = [kind for kind in self.peak_kinds if kind is not None]
        if not set(kinds) <= set(PEAK_KINDS):
            raise ValueError(f"{self.name}: peak kinds {kinds} are not all among {PEAK_KINDS}")
        if (self.library is None) != (self.storage is None) or self.policy.quantized != (self.library is not None):
            raise ValueError(f"{self.name}: a quantized precision has a library and a storage format, others neither")
        if (self.training is None) != (self.peak_kinds[1] is None) or (self.training is None) != bool(self.no_training):
            raise ValueError(f"{self.name}: a precision without training has no training peak and says why")

    @property
    def quantized(self) -> bool:
        return self.library is not None

    @property
    def trains_every_weight(self) -> bool:
        """Whether training updates the whole model; adapters on a frozen base do not, so a fallback from
        full training never lands there (it would measure another workload)."""
        return self.training in (EVERY_WEIGHT, FLOAT8)

    @property
    def weight_only(self) -> bool:
        """Whether the weights are stored small and dequantized for matmuls that run in bf16, so that what
        it buys is the bytes a decode step reads, which its kernels must beat bf16's at the batch asked to
        gain anything."""
        return self.quantized and self.peak_kinds[0] == "bf16"

    def peak_kind(self, mode: str) -> str:
        """Which peak FLOP/s MFU divides ``mode`` by: the tensor cores that do most of its FLOPs."""
        inference, training = self.peak_kinds
        if mode not in TRAINING_MODES:
            return inference
        if training is None:
            raise ValueError(f"{self.name} has no backward pass, so no training peak")
        return training

    @property
    def training_problem(self) -> str | None:
        """Why a training-style mode cannot run this precision, or None."""
        return self.no_training or None

    def hardware_problem(self, device_type: str, capability: tuple[int, int] | None) -> str | None:
        """Why a device of ``device_type`` (``cpu``, ``cuda``) and compute ``capability`` cannot run this
        precision, or None."""
        need = self.device
        if need is None:
            return None
        if device_type != "cuda":
            return need.on_cpu
        if need.capability is not None and capability is not None and capability < need.capability:
            major, minor = need.capability
            return (f"{self.name} needs compute capability {major}.{minor} or newer ({need.generations}); this GPU "
                    f"has {capability[0]}.{capability[1]}")
        return None
