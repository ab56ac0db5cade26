"""Per-GPU timeline of one job, sampled from NVML by a thread of the parent process.

The parent, not the ranks: a rank that crashes, hangs or is killed takes an in-process sampler with
it, and no rank sees its own CUDA context being created or torn down. The parent's thread covers the
whole run, and its file is on disk however the job ends.

**Which GPUs.** The job's GPUs are named as ``CUDA_VISIBLE_DEVICES`` names them (``job_gpus`` reads
it), entry k being the device that LOCAL_RANK k uses, and resolved to UUIDs through NVML:

- an index is NVML's, which counts in PCI bus order. CUDA counts the same way under
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and also under its default order (FASTEST_FIRST) on a host
  whose GPUs are all one model, since that order breaks ties by PCI bus id;
- ``GPU-…`` is a UUID or, as CUDA accepts, a prefix of one that only one GPU has;
- ``MIG-…`` is a MIG device's UUID. MIG devices report memory and utilization only; power,
  temperature, clocks and energy are the whole GPU's and come back null.

**A sample** is one line of the timeline for one GPU. Sources are the NVML API reference
(docs.nvidia.com/deploy/nvml-api, "Device Queries"); a figure the GPU does not give is null:

- ``t`` (s): ``time.monotonic()`` midway through the GPU's queries. It is CLOCK_MONOTONIC, the
  same clock in every process of a host, so a rank's timestamps fall on the same axis.
- ``gpu``: the GPU's position in the job (entry k of the list given).
- ``memory_used_bytes`` (B): ``nvmlDeviceGetMemoryInfo_v2().used``, memory allocated on the device
  by every process on it, without what the driver reserves for itself (``reserved`` in v2); where
  the driver has no v2, ``nvmlDeviceGetMemoryInfo().used``, which includes it. The header says which.
- ``utilization_percent`` (%): ``nvmlDeviceGetUtilizationRates().gpu``, the share of the driver's
  last sample period (1/6 s to 1 s by product) in which one or more kernels ran: busy, not
  efficient (one small kernel counts as 100%).
- ``memory_utilization_percent`` (%): ``.memory`` of the same call, the share of that period in
  which device memory was read or written.
- ``power_w`` (W): ``nvmlDeviceGetPowerUsage()`` (mW) / 1000, board power (GPU and memory). On
  Ampere (except GA100) and later it is the average over the last second; earlier, instantaneous.
- ``temperature_c`` (°C): ``nvmlDeviceGetTemperatureV(NVML_TEMPERATURE_GPU)``, the GPU die's sensor
  (``nvmlDeviceGetTemperature`` where the binding or the driver lacks the V form).
- ``sm_clock_mhz`` (MHz): ``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)``, the SM clock now; it falls when
  the GPU throttles for power or heat.
- ``energy_j`` (J): ``nvmlDeviceGetTotalEnergyConsumption()`` (mJ) / 1000, the energy the GPU has
  used since the driver was loaded (Volta and later).

**The timeline file** (``nvml.jsonl`` in the directory given) is JSON lines: a header object first
(``"format": "fitbench-nvml-timeline"``: version, target interval, start time in both clocks, per
GPU its request, UUID, name, total memory, the NVML call behind each figure and the figures it
refused, and the column definitions with units), then one sample object per line with the columns
above. Each sampling round is written and flushed as one write, so the file holds every round
taken until the parent dies; a killed parent leaves at most the last line cut, which
``read_timeline`` counts as damaged and skips (a prefix of a JSON object never parses). A sweep
writes it plain; a timeline kept for long (committed under ``benchmarks/results/``) is gzipped as
``nvml.jsonl.gz``, and ``open_timeline`` reads either, so a row's ``timeline`` path still reads once
its file is compressed.

**The summary** (``summarize``, a pure function of the samples) per GPU, over the samples or the
part of the run inside a window (a rank's measured stage, in ``t``'s clock):

- ``samples``, ``duration_s``: how many samples, and the time from the first to the last.
- ``interval_s``: mean, median and largest gap between successive samples, as measured.
- ``peak_memory_used_bytes``, ``peak_power_w``, ``peak_temperature_c``: the largest sample.
- ``mean_utilization_percent``, ``mean_memory_utilization_percent``, ``mean_power_w``,
  ``mean_sm_clock_mhz``: time-weighted means, the integral of the figure (linear between
  samples: the trapezoid rule) over the time it covers, divided by that time; a null sample is
  left out, not read as zero. So gaps between samples weigh what they lasted.
- ``energy_j``: the energy counter's rise over the window (read linearly between samples at the
  window's edges), ``energy_method`` ``"nvml_energy_counter"``; where the GPU has no counter, or it
  went back (the driver reloaded), the trapezoid integral of ``power_w`` over time,
  ``"trapezoid_power"``. A trapezoid on power averaged over the last second lags the load by half
  a second, so it misplaces energy at the window's edges where the counter does not.
- ``energy_per_token_j``: ``energy_j / tokens``, tokens being the job's count over the same
  window (all ranks), so the GPUs' figures add up to the job's.

The job's ``energy_j`` and ``energy_per_token_j`` are the sums over its GPUs, null where one GPU
has no energy figure.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from itertools import pairwise
from pathlib import Path
from typing import IO, Any

from fitbench.util.stats import SampleStats

INTERVAL_S = 0.1
TIMELINE_NAME = "nvml.jsonl"
FORMAT = "fitbench-nvml-timeline"
FORMAT_VERSION = 1
STOP_TIMEOUT_S = 10.0  # longer than any NVML query takes short of a GPU falling off the bus
EXCERPT = 40  # characters of a requested GPU name quoted back in a message

COLUMNS = {
    "t": "s; time.monotonic() (CLOCK_MONOTONIC, shared by the processes of a host) midway through the GPU's queries",
    "gpu": "position of the GPU in the job: entry k of the job's list, the device LOCAL_RANK k uses",
    "memory_used_bytes": "B; nvmlDeviceGetMemoryInfo_v2().used (all processes, without the driver's reserve), "
                         "or v1 .used (with it) where v2 is missing: see the GPU's sources",
    "utilization_percent": "%; nvmlDeviceGetUtilizationRates().gpu: share of the driver's last sample period "
                           "(1/6 s to 1 s) in which a kernel ran",
    "memory_utilization_percent": "%; nvmlDeviceGetUtilizationRates().memory: share of that period in which "
                                  "device memory was read or written",
    "power_w": "W; nvmlDeviceGetPowerUsage() / 1000: board power, a 1 s average on Ampere (but GA100) and later",
    "temperature_c": "degrees Celsius; nvmlDeviceGetTemperatureV(NVML_TEMPERATURE_GPU), the die's sensor",
    "sm_clock_mhz": "MHz; nvmlDeviceGetClockInfo(NVML_CLOCK_SM)",
    "energy_j": "J; nvmlDeviceGetTotalEnergyConsumption() / 1000: energy since the driver loaded (Volta and later)",
}


@dataclass(frozen=True, slots=True)
class Sample:
    """One GPU at one moment; units and sources in ``COLUMNS``."""

    t: float
    gpu: int
    memory_used_bytes: int | None = None
    utilization_percent: float | None = None
    memory_utilization_percent: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    energy_j: float | None = None

    def to_line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":")) + "\n"

    @classmethod
    def from_record(cls, record: object) -> Sample:
        """A sample from a parsed timeline line; ValueError for anything else (unknown keys are
        ignored, so a later version's extra columns still read)."""
        if not isinstance(record, dict):
            raise ValueError("a timeline sample is a JSON object")
        values = {}
        for column in fields(cls):
            value = record.get(column.name)
            if value is None and column.name not in ("t", "gpu"):
                values[column.name] = None
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"timeline column {column.name!r} is not a number")
            values[column.name] = value
        if not isinstance(values["gpu"], int):
            raise ValueError("timeline column 'gpu' is not an integer")
        return cls(**values)


# ---------------------------------------------------------------------------------------------
# Which GPUs


def visible_devices(value: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: None where unset (every GPU is visible), else its
    entries up to the first that is neither an index nor a UUID (CUDA hides that one and all after
    it: "0,2,-1,1" shows 0 and 2)."""
    if value is None:
        return None
    entries = []
    for entry in value.split(","):
        entry = entry.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def job_gpus(count: int, environ: Mapping[str, str] | None = None, first: int = 0) -> list[str]:
    """The GPUs a job of ``count`` ranks on this host uses, rank k's first, from the ``first`` visible
    one (``cuda:first``, a one-GPU job's device): ``count`` entries of ``CUDA_VISIBLE_DEVICES`` from
    there, or indices first..first+count-1 where it is unset. Shorter than ``count`` where fewer are
    visible (the job will fail on its own; the monitor watches those)."""
    environ = os.environ if environ is None else environ
    visible = visible_devices(environ.get("CUDA_VISIBLE_DEVICES"))
    return ([str(index) for index in range(first, first + count)] if visible is None
            else visible[first:first + count])


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _why(error: BaseException) -> str:
    return str(error) or type(error).__name__


def _excerpt(text: str) -> str:
    return text if len(text) <= EXCERPT else text[:EXCERPT] + "…"


@dataclass
class _Gpu:
    """One GPU of the job, as resolved and as sampled so far."""

    gpu: int
    requested: str
    handle: Any = None
    uuid: str | None = None
    name: str | None = None
    memory_total_bytes: int | None = None
    reason: str | None = None  # why it is not sampled
    queries: dict[str, list[tuple[str, Callable]]] = field(default_factory=dict)  # alternatives left
    sources: dict[str, str] = field(default_factory=dict)  # query -> the NVML call that answered
    refused: dict[str, str] = field(default_factory=dict)  # column -> why it is null throughout
    errors: dict[str, dict] = field(default_factory=dict)  # query -> first passing error and count

    def identity(self) -> dict:
        return {"gpu": self.gpu, "requested": self.requested, "uuid": self.uuid, "name": self.name,
                "memory_total_bytes": self.memory_total_bytes}


def _resolve(nvml, requested: Sequence[str]) -> list[_Gpu]:
    """Each request matched to one NVML device handle and its UUID, or to the reason it matches none."""
    count = nvml.nvmlDeviceGetCount()
    devices: list[tuple[Any, str | None]] = []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            devices.append((handle, _text(nvml.nvmlDeviceGetUUID(handle))))
        except nvml.NVMLError:  # a GPU NVML cannot name matches no request; asked for by index, it says so
            devices.append((None, None))
    gpus = []
    for position, entry in enumerate(requested):
        gpu = _Gpu(gpu=position, requested=entry)
        if entry.isdigit():
            index = int(entry)
            if index >= count:
                gpu.reason = f"GPU index {index}: NVML sees {count} GPU(s)"
            elif devices[index][0] is None:
                gpu.reason = f"GPU index {index}: NVML could not name it"
            else:
                gpu.handle, gpu.uuid = devices[index]
        elif entry.startswith("GPU-"):
            matches = [d for d in devices if d[1] and d[1].lower().startswith(entry.lower())]
            if len(matches) == 1:
                gpu.handle, gpu.uuid = matches[0]
            else:
                gpu.reason = (f"no GPU's UUID starts with {_excerpt(entry)!r}" if not matches
                              else f"{len(matches)} GPUs' UUIDs start with {_excerpt(entry)!r}")
        elif entry.startswith("MIG-"):
            try:
                gpu.handle = nvml.nvmlDeviceGetHandleByUUID(entry)
                gpu.uuid = _text(nvml.nvmlDeviceGetUUID(gpu.handle))
            except Exception as error:  # an NVML error, or a binding too old for MIG
                gpu.handle, gpu.reason = None, f"MIG device {_excerpt(entry)!r}: {_why(error)}"
        else:
            gpu.reason = f"{_excerpt(entry)!r} is neither a GPU index nor a GPU-/MIG- UUID"
        if gpu.handle is not None:
            gpu.queries = _queries(nvml)
            # name and total memory label the GPU for people; sampling goes on without them
            try:
                gpu.name = _text(nvml.nvmlDeviceGetName(gpu.handle))
            except nvml.NVMLError:
                pass
            try:
                gpu.memory_total_bytes = int(nvml.nvmlDeviceGetMemoryInfo(gpu.handle).total)
            except nvml.NVMLError:
                pass
        gpus.append(gpu)
    return gpus


# ---------------------------------------------------------------------------------------------
# Reading a GPU

QUERY_COLUMNS = {
    "memory": ("memory_used_bytes",),
    "utilization": ("utilization_percent", "memory_utilization_percent"),
    "power": ("power_w",),
    "temperature": ("temperature_c",),
    "sm_clock": ("sm_clock_mhz",),
    "energy": ("energy_j",),
}


def _queries(nvml) -> dict[str, list[tuple[str, Callable]]]:
    """Per query, the NVML calls that answer it, preferred first; each returns column -> value."""

    def utilization(handle):
        rates = nvml.nvmlDeviceGetUtilizationRates(handle)
        return {"utilization_percent": rates.gpu, "memory_utilization_percent": rates.memory}

    memory = [("nvmlDeviceGetMemoryInfo", lambda h: {"memory_used_bytes": int(nvml.nvmlDeviceGetMemoryInfo(h).used)})]
    if hasattr(nvml, "nvmlMemory_v2"):
        memory.insert(0, ("nvmlDeviceGetMemoryInfo_v2", lambda h: {
            "memory_used_bytes": int(nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2).used)}))
    temperature = [("nvmlDeviceGetTemperature",
                    lambda h: {"temperature_c": nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)})]
    if hasattr(nvml, "nvmlDeviceGetTemperatureV"):
        temperature.insert(0, ("nvmlDeviceGetTemperatureV",
                               lambda h: {"temperature_c": nvml.nvmlDeviceGetTemperatureV(h, nvml.NVML_TEMPERATURE_GPU)}))
    return {
        "memory": memory,
        "utilization": [("nvmlDeviceGetUtilizationRates", utilization)],
        "power": [("nvmlDeviceGetPowerUsage", lambda h: {"power_w": nvml.nvmlDeviceGetPowerUsage(h) / 1000})],
        "temperature": temperature,
        "sm_clock": [("nvmlDeviceGetClockInfo(NVML_CLOCK_SM)",
                      lambda h: {"sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)})],
        "energy": [("nvmlDeviceGetTotalEnergyConsumption",
                    lambda h: {"energy_j": nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000})],
    }


def _refusals(nvml) -> set[int]:
    """NVML errors that will not pass: the GPU, driver or binding lacks the call, or we may not make it."""
    names = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NO_PERMISSION",
             "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", "NVML_ERROR_INVALID_ARGUMENT")
    return {getattr(nvml, name) for name in names if hasattr(nvml, name)}


def _read(nvml, refusals: set[int], gpu: _Gpu) -> dict:
    """The columns this GPU gives now. A call it refuses for good is replaced by the next one that
    answers the same query, or dropped with its reason; any other error nulls this sample only."""
    values: dict = {}
    for query in list(gpu.queries):
        alternatives = gpu.queries[query]
        while alternatives:
            source, call = alternatives[0]
            try:
                values.update(call(gpu.handle))
                gpu.sources[query] = source
                break
            except Exception as error:  # a failing query must null a figure, not end the run
                passing = isinstance(error, nvml.NVMLError) and getattr(error, "value", None) not in refusals
                if passing:
                    note = gpu.errors.setdefault(query, {"first": f"{source}: {error}", "count": 0})
                    note["count"] += 1
                    break
                alternatives.pop(0)
                if not alternatives:
                    del gpu.queries[query]
                    gpu.sources.pop(query, None)
                    for column in QUERY_COLUMNS[query]:
                        gpu.refused[column] = f"{source}: {_why(error)}"
    return values


# ---------------------------------------------------------------------------------------------
# The timeline file


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as file:
        file.seek(-1, os.SEEK_END)
        return file.read(1)


class TimelineWriter:
    """Appends a header and rounds of samples to a timeline file, each round one write, flushed.

    Flushing hands the bytes to the kernel, which keeps them when the process dies, however it
    dies; only a crash of the machine needs an fsync, and one per round would cost more than the
    sampling itself.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut = self.path.exists() and self.path.stat().st_size > 0 and _last_byte(self.path) != b"\n"
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")
        if cut:
            self._write("\n")  # a killed writer's cut line must not swallow our first one

    def header(self, record: dict) -> None:
        self._write(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, **record}) + "\n")

    def samples(self, samples: Iterable[Sample]) -> None:
        self._write("".join(sample.to_line() for sample in samples))

    def _write(self, text: str) -> None:
        if self._file is None:
            raise ValueError(f"timeline {self.path} is closed")
        self._file.write(text)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True)
class Timeline:
    header: dict | None
    samples: tuple[Sample, ...]
    damaged_lines: int  # lines that are not a whole sample: the last one of a killed run, cut short


GZIP_SUFFIX = ".gz"


def open_timeline(path: str | os.PathLike) -> IO[str]:
    """A timeline's lines as text, plain or gzipped: ``x.jsonl.gz`` is read through gzip, and
    ``x.jsonl``, where only ``x.jsonl.gz`` exists, from the compressed file beside it.
    FileNotFoundError names the path given when neither exists."""
    path = Path(path)
    compressed = path if path.name.endswith(GZIP_SUFFIX) else path.with_name(path.name + GZIP_SUFFIX)
    if path == compressed or (not path.exists() and compressed.exists()):
        return gzip.open(compressed, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def read_timeline(path: str | os.PathLike) -> Timeline:
    """A timeline file as written (plain or gzipped: ``open_timeline``), skipping (and counting)
    lines that do not parse; a gzipped file cut short reads as far as its stream can be decoded
    and counts the break as one damaged line."""
    header, samples, damaged = None, [], 0
    with open_timeline(path) as lines:
        try:
            for line in lines:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("format") == FORMAT:
                        header = header or record
                        continue
                    samples.append(Sample.from_record(record))
                except ValueError:
                    damaged += 1
        except EOFError:
            damaged += 1
    return Timeline(header=header, samples=tuple(samples), damaged_lines=damaged)


# ---------------------------------------------------------------------------------------------
# The summary


def _lerp(t0: float, v0: float, t1: float, v1: float, t: float) -> float:
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def _value_at(points: list[tuple[float, float]], t: float) -> float:
    """The piecewise-linear curve through ``points`` (sorted by time) at ``t`` inside their span."""
    for (t0, v0), (t1, v1) in pairwise(points):
        if t0 <= t <= t1 and t1 > t0:
            return _lerp(t0, v0, t1, v1, t)
    return next(v for tp, v in points if tp == t)


def _integral(points: list[tuple[float, float]], start: float, end: float) -> tuple[float, float] | None:
    """(∫ v dt, covered time) of the piecewise-linear curve through ``points`` over the part of
    [start, end] they span (the trapezoid rule on the samples, cut at the window's edges); None
    where they span none of it."""
    if not points:
        return None
    low, high = max(start, points[0][0]), min(end, points[-1][0])
    if high < low:
        return None
    total = 0.0
    for (t0, v0), (t1, v1) in pairwise(points):
        left, right = max(t0, low), min(t1, high)
        if right > left:
            total += (right - left) * (_lerp(t0, v0, t1, v1, left) + _lerp(t0, v0, t1, v1, right)) / 2
    return total, high - low


def _mean(points: list[tuple[float, float]], start: float, end: float) -> float | None:
    integral = _integral(points, start, end)
    if integral is None:
        return None
    total, span = integral
    return total / span if span > 0 else _value_at(points, max(start, points[0][0]))


def _energy(samples: list[Sample], start: float, end: float) -> tuple[float | None, str | None]:
    counter = [(s.t, float(s.energy_j)) for s in samples if s.energy_j is not None]
    rising = all(b[1] >= a[1] for a, b in pairwise(counter))
    if len(counter) >= 2 and rising:
        low, high = max(start, counter[0][0]), min(end, counter[-1][0])
        if high > low:
            return _value_at(counter, high) - _value_at(counter, low), "nvml_energy_counter"
    integral = _integral([(s.t, float(s.power_w)) for s in samples if s.power_w is not None], start, end)
    if integral is not None and integral[1] > 0:
        return integral[0], "trapezoid_power"
    return None, None


def summarize_gpu(samples: Iterable[Sample], tokens: float | None = None,
                  window: tuple[float, float] | None = None) -> dict:
    """The figures of one GPU from its samples, over ``window`` (start, end in ``t``'s clock) or all
    of them; definitions in the module's docstring."""
    ordered = sorted(samples, key=lambda s: s.t)
    start, end = window if window is not None else (-math.inf, math.inf)
    inside = [s for s in ordered if start <= s.t <= end]

    def points(name: str) -> list[tuple[float, float]]:
        return [(s.t, float(getattr(s, name))) for s in ordered if getattr(s, name) is not None]

    def peak(name: str) -> float | None:
        values = [getattr(s, name) for s in inside if getattr(s, name) is not None]
        return max(values) if values else None

    gaps = [b.t - a.t for a, b in pairwise(inside)]
    interval = SampleStats.of(gaps) if gaps else None
    covered = (min(end, ordered[-1].t) - max(start, ordered[0].t)) if ordered else None
    energy, method = _energy(ordered, start, end)
    return {
        "samples": len(inside),
        "duration_s": covered if covered is not None and covered >= 0 else None,
        "interval_s": {"mean": interval.mean, "median": interval.median, "max": interval.max} if interval else None,
        "peak_memory_used_bytes": peak("memory_used_bytes"),
        "mean_utilization_percent": _mean(points("utilization_percent"), start, end),
        "mean_memory_utilization_percent": _mean(points("memory_utilization_percent"), start, end),
        "mean_power_w": _mean(points("power_w"), start, end),
        "peak_power_w": peak("power_w"),
        "peak_temperature_c": peak("temperature_c"),
        "mean_sm_clock_mhz": _mean(points("sm_clock_mhz"), start, end),
        "energy_j": energy,
        "energy_method": method,
        "energy_per_token_j": energy / tokens if energy is not None and tokens else None,
    }


def summarize(samples: Iterable[Sample], gpus: Sequence[int], tokens: float | None = None,
              window: tuple[float, float] | None = None) -> dict:
    """Figures per GPU of the job (``gpus``: their positions) and the job's energy, the sum over
    them (null where one has none), per token of ``tokens``: the job's count over the window."""
    if tokens is not None and tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    if window is not None and window[1] < window[0]:
        raise ValueError(f"window ends ({window[1]}) before it starts ({window[0]})")
    by_gpu: dict[int, list[Sample]] = {gpu: [] for gpu in gpus}
    for sample in samples:
        if sample.gpu in by_gpu:
            by_gpu[sample.gpu].append(sample)
    figures = {gpu: summarize_gpu(by_gpu[gpu], tokens, window) for gpu in gpus}
    energies = [f["energy_j"] for f in figures.values()]
    energy = math.fsum(energies) if energies and None not in energies else None
    return {
        "gpus": figures,
        "energy_j": energy,
        "energy_per_token_j": energy / tokens if energy is not None and tokens else None,
    }


# ---------------------------------------------------------------------------------------------
# The sampler


class GpuMonitor:
    """Samples the GPUs of one job every ``interval_s`` from a daemon thread, for as long as it runs.

    ``gpus`` are the job's GPUs, rank k's first, as indices or UUIDs (``job_gpus`` gives them);
    ``directory`` receives the timeline (``TIMELINE_NAME``). Used as a context manager around the
    job::

        with GpuMonitor(job_gpus(n), artifacts) as monitor:
            outcome = launcher.run(job)
        row["nvml"] = monitor.summary(tokens=outcome.tokens, window=outcome.measured_window)

    Nothing in it raises for want of NVML, a GPU or a figure: ``summary()`` then says
    ``available: false`` and why, or gives null for the figure and the reason under ``refused``.
    ``start`` returns once every GPU has its first sample on disk; ``stop`` takes a last one, joins
    the thread and shuts NVML down. A monitor runs once.
    """

    def __init__(self, gpus: Sequence[int | str], directory: str | os.PathLike,
                 interval_s: float = INTERVAL_S, name: str = TIMELINE_NAME) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.requested = [str(gpu).strip() for gpu in gpus]
        self.path = Path(directory) / name
        self.interval_s = interval_s
        self.available = False
        self.reason: str | None = "not started"
        self._gpus: list[_Gpu] = []
        self._samples: list[Sample] = []
        self._nvml = None
        self._refusals: set[int] = set()
        self._writer: TimelineWriter | None = None
        self._timeline: str | None = None  # set once the file is opened: it holds what was written
        self._timeline_error: str | None = None
        self._failure: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False

    def __enter__(self) -> GpuMonitor:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def samples(self) -> tuple[Sample, ...]:
        return tuple(self._samples)

    def start(self) -> None:
        if self._started:
            raise RuntimeError("a GpuMonitor runs once; make a new one")
        self._started = True
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as error:  # no binding, no driver, no GPU: the summary says which
            self.reason = f"NVML unavailable: {_why(error)}"
            return
        self._nvml, self._refusals = pynvml, _refusals(pynvml)
        try:
            self._gpus = _resolve(pynvml, self.requested)
            sampled = [gpu for gpu in self._gpus if gpu.handle is not None]
            if not sampled:
                reasons = "; ".join(gpu.reason or "" for gpu in self._gpus) or "the job names no GPU"
                self.reason = f"none of the job's GPUs found: {reasons}"
                self._shutdown()
                return
            first = self._round()
            try:
                self._writer = TimelineWriter(self.path)
                self._timeline = str(self.path)
                self._writer.header({
                    "interval_target_s": self.interval_s,
                    "started_unix_s": time.time(),
                    "started_monotonic_s": first[0].t,
                    "pid": os.getpid(),
                    "gpus": [{**gpu.identity(), "reason": gpu.reason, "sources": dict(gpu.sources),
                              "refused": dict(gpu.refused)} for gpu in self._gpus],
                    "columns": COLUMNS,
                })
            except OSError as error:
                self._writer, self._timeline_error = None, f"timeline not written: {error}"
            self._record(first)
            self.available, self.reason = True, None
            self._thread = threading.Thread(target=self._run, name="fitbench-nvml", daemon=True)
            self._thread.start()
        except Exception as error:  # the run goes on without a timeline
            self.available, self.reason = False, f"NVML sampling failed to start: {_why(error)}"
            self._close_timeline()
            self._shutdown()

    def _round(self) -> list[Sample]:
        """One sample of every sampled GPU, each stamped midway through its own queries."""
        samples = []
        for gpu in self._gpus:
            if gpu.handle is None:
                continue
            before = time.monotonic()
            values = _read(self._nvml, self._refusals, gpu)
            samples.append(Sample(t=(before + time.monotonic()) / 2, gpu=gpu.gpu, **values))
        return samples

    def _record(self, samples: list[Sample]) -> None:
        self._samples.extend(samples)
        if self._writer is not None:
            try:
                self._writer.samples(samples)
            except (OSError, ValueError) as error:  # a full disk loses the file, not the summary
                self._timeline_error = f"timeline cut short: {error}"
                self._close_timeline()

    def _run(self) -> None:
        """Rounds on a fixed schedule from the first; one that falls behind (a slow query) starts
        the next at once rather than bursting to catch up. A last round when told to stop."""
        try:
            deadline = time.monotonic()
            while True:
                deadline += self.interval_s
                now = time.monotonic()
                deadline = max(deadline, now)
                if self._stop.wait(deadline - now):
                    break
                self._record(self._round())
            self._record(self._round())
        except Exception as error:  # recorded in the summary; the run goes on
            self._failure = f"sampling stopped early: {_why(error)}"
        finally:
            self._close_timeline()

    def _close_timeline(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except OSError as error:
                self._timeline_error = f"timeline not closed cleanly: {error}"
            self._writer = None

    def _shutdown(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # NVML going away under us changes no figure
                pass
            self._nvml = None

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                # A hung NVML call: the daemon thread dies with the process. Shutting NVML down
                # under a call in flight is undefined, so NVML stays up.
                self._failure = f"the sampling thread did not stop within {STOP_TIMEOUT_S:.0f} s (an NVML call hung)"
                self._thread = None
                return
            self._thread = None
        self._shutdown()

    def summary(self, tokens: float | None = None, window: tuple[float, float] | None = None) -> dict:
        """The job's figures for its row, as plain data (definitions in the module's docstring):
        ``available`` and ``reason``; the timeline's path; the target interval; the job's energy and
        energy per token; per GPU its identity, whether it was sampled and why not, the NVML call
        behind each figure (``sources``), the figures it refused for good with NVML's reason
        (``refused``), passing query errors with their count (``errors``) and its figures."""
        computed = summarize(self._samples, [gpu.gpu for gpu in self._gpus if gpu.handle is not None],
                             tokens, window)
        gpus = []
        for gpu in self._gpus:
            figures = computed["gpus"].get(gpu.gpu) or summarize_gpu((), tokens, window)
            answered = gpu.handle is not None and bool(gpu.sources)
            reason = gpu.reason or (None if answered else "NVML answered none of its queries")
            gpus.append({**gpu.identity(), "available": answered, "reason": reason,
                         "sources": dict(gpu.sources), "refused": dict(gpu.refused),
                         "errors": {query: dict(note) for query, note in gpu.errors.items()}, **figures})
        return {
            "available": self.available,
            "reason": self.reason,
            "failure": self._failure,
            "timeline": self._timeline,
            "timeline_error": self._timeline_error,
            "interval_target_s": self.interval_s,
            "window": list(window) if window is not None else None,
            "tokens": tokens,
            "energy_j": computed["energy_j"] if self.available else None,
            "energy_per_token_j": computed["energy_per_token_j"] if self.available else None,
            "gpus": gpus,
        }
