"""Measured ceilings: a large matmul per precision and a device-to-device copy, which give the
throughput this particular machine and software stack actually reach (``measure_ceilings``,
``fitbench env --measure``). They are cached per device name and torch version, because both change
the answer (``save_ceilings``, ``load_ceilings``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fitbench.hardware.devices import cpu_device_name
from fitbench.hardware.environment import torch_version, utc_now
from fitbench.util.cache import cache_directory

if TYPE_CHECKING:
    import torch

_MIB = 1024**2


@dataclass(frozen=True)
class Ceilings:
    """Throughput one device actually reached under one torch version."""

    device_name: str
    torch_version: str
    matmul_flops: dict[str, float]
    bandwidth: float
    measured_at: str
    method: str


_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch attributes
_CUDA_KINDS = ("bf16", "fp16", "tf32", "fp32")
_CPU_KINDS = ("fp32", "bf16")
_CUDA_MATMUL_SIZE = 8192
_CPU_MATMUL_SIZE = 1024
_CUDA_COPY_BYTES = 1024 * _MIB
_CPU_COPY_BYTES = 256 * _MIB


def _median_seconds(
    operation: Callable[[], object], device: torch.device, repeats: int, warmup: int
) -> float:
    """Median wall time of one call of ``operation`` over ``repeats`` timed calls.

    On CUDA each call gets its own start/end event pair, so host-side launch gaps
    between calls are excluded and one slow call cannot skew the median.
    """
    import torch

    for _ in range(warmup):
        operation()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pairs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for start, end in pairs:
            start.record()
            operation()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in pairs]
    else:
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            operation()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _matmul_flops(kind: str, size: int, device: torch.device, repeats: int, warmup: int) -> float:
    """FLOP/s of an ``size``^3 matmul: 2 * size^3 / median seconds."""
    import torch

    dtype = getattr(torch, _DTYPES[kind])
    left = torch.randn(size, size, device=device, dtype=dtype)
    right = torch.randn(size, size, device=device, dtype=dtype)
    # A preallocated output keeps the allocator out of the timed region.
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds = _median_seconds(lambda: torch.mm(left, right, out=out), device, repeats, warmup)
    return 2 * size**3 / seconds


def _cuda_matmul_flops(
    kind: str, size: int, device: torch.device, repeats: int, warmup: int
) -> float:
    """Like ``_matmul_flops``, with TF32 on only for the ``tf32`` kind and restored after."""
    import torch

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
    try:
        return _matmul_flops(kind, size, device, repeats, warmup)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _copy_bandwidth(nbytes: int, device: torch.device, repeats: int, warmup: int) -> float:
    """Bytes/s of ``dst.copy_(src)``: 2 * nbytes (read + write) / median seconds."""
    import torch

    # Filled, not torch.empty: untouched host pages can map to the shared zero
    # page and make reads look faster than memory is.
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    seconds = _median_seconds(lambda: destination.copy_(source), device, repeats, warmup)
    return 2 * nbytes / seconds


def measure_ceilings(
    device: str, *, size: int | None = None, repeats: int = 10, warmup: int = 3
) -> Ceilings:
    """Measure matmul FLOP/s per precision and copy bandwidth on ``device``.

    ``device`` is ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Matmuls are
    ``size x size x size`` (default 8192 on CUDA, 1024 on CPU) of random
    normal data, counted as 2 * size^3 FLOPs. CUDA measures bf16, fp16, tf32
    and fp32 (TF32 disabled); CPU measures fp32 and bf16. Bandwidth copies a
    1 GiB (CUDA) or 256 MiB (CPU) buffer and counts bytes read plus written.
    Each figure uses the median of ``repeats`` timed calls after ``warmup``
    untimed ones.
    """
    import torch

    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats=} {warmup=}")
    target = torch.device(device)
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} requested but CUDA is not available")
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        size = size or _CUDA_MATMUL_SIZE
        copy_bytes = _CUDA_COPY_BYTES
        # Events record on the current device's stream, so make it the target.
        with torch.cuda.device(target):
            matmul = {
                kind: _cuda_matmul_flops(kind, size, target, repeats, warmup) for kind in _CUDA_KINDS
            }
            bandwidth = _copy_bandwidth(copy_bytes, target, repeats, warmup)
        device_name = torch.cuda.get_device_name(target)
        timer = "CUDA events"
    elif target.type == "cpu":
        size = size or _CPU_MATMUL_SIZE
        copy_bytes = _CPU_COPY_BYTES
        matmul = {kind: _matmul_flops(kind, size, target, repeats, warmup) for kind in _CPU_KINDS}
        bandwidth = _copy_bandwidth(copy_bytes, target, repeats, warmup)
        device_name = cpu_device_name()
        timer = f"perf_counter, {torch.get_num_threads()} threads"
    else:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    method = (
        f"matmul {size}x{size}x{size} (2*n^3 FLOPs) for {', '.join(matmul)}; "
        f"copy_ of {copy_bytes // _MIB} MiB (2*nbytes); "
        f"median of {repeats} after {warmup} warm-up; {timer}"
    )
    return Ceilings(
        device_name=device_name,
        torch_version=torch.__version__,
        matmul_flops=matmul,
        bandwidth=bandwidth,
        measured_at=utc_now(),
        method=method,
    )


def ceilings_path() -> pathlib.Path:
    """``ceilings.json`` in ``cache_directory()``."""
    return cache_directory() / "ceilings.json"


def _ceilings_key(device_name: str, torch_version: str) -> str:
    return f"{device_name}|torch {torch_version}"


def _read_ceilings_file(path: pathlib.Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        entries = json.load(handle)
    if not isinstance(entries, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return entries


def save_ceilings(ceilings: Ceilings) -> pathlib.Path:
    """Add ``ceilings`` to the cache file, keeping other entries; returns the path.

    The file is replaced atomically so a concurrent reader never sees half of it.
    """
    path = ceilings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        entries = _read_ceilings_file(path)
    except (OSError, ValueError):
        entries = {}  # missing or corrupt: nothing worth keeping
    entries[_ceilings_key(ceilings.device_name, ceilings.torch_version)] = dataclasses.asdict(ceilings)
    handle = tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=".ceilings-", suffix=".tmp", delete=False
    )
    try:
        with handle:
            json.dump(entries, handle, indent=2, sort_keys=True)
        os.replace(handle.name, path)
    except BaseException:
        os.unlink(handle.name)
        raise
    return path


def load_ceilings(device_name: str) -> Ceilings | None:
    """Cached ceilings of ``device_name`` under the running torch version, else ``None``.

    A missing, unreadable or malformed file or entry gives ``None``.
    """
    try:
        entry = _read_ceilings_file(ceilings_path())[_ceilings_key(device_name, torch_version())]
        ceilings = Ceilings(
            device_name=str(entry["device_name"]),
            torch_version=str(entry["torch_version"]),
            matmul_flops={str(kind): float(value) for kind, value in entry["matmul_flops"].items()},
            bandwidth=float(entry["bandwidth"]),
            measured_at=str(entry["measured_at"]),
            method=str(entry["method"]),
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    numbers = [ceilings.bandwidth, *ceilings.matmul_flops.values()]
    if not all(math.isfinite(number) and number > 0 for number in numbers):
        return None
    return ceilings
