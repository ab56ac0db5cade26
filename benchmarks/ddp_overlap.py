"""Data parallelism's weak scaling against one GPU, DDP built several ways and FSDP, side by side in one
torchrun job.

Each variant (``VARIANTS``) builds the model afresh from one seed on every rank, wraps it (or not), and
times fitbench's own training step (``fitbench.worker.loops.make_step``: gradients set to None, forward,
fp32 loss, backward, fused AdamW) on a batch of each rank's own (``data_seed``): ``--warmup`` untimed
steps, then ``--steps`` timed ones between two barriers (``fitbench.worker.timing.time_steps``: CUDA events
on a GPU, wall time on CPU). The variant, its optimizer and its gradients are freed before the next is
built, so one variant at a time holds memory.

- ``one-gpu``: no DDP; every rank trains its own model at once, the one-GPU baseline on the same GPUs;
- ``current``: ``fitbench.worker.parallel.wrap_ddp``, as ``fitbench run --strategy ddp`` builds it;
- ``bucket-100``, ``bucket-400``, ``bucket-1000``: buckets of 100, 400 or 1000 MiB instead of 25 (the first one too, where
  25 MiB's default makes it 1 MiB): fewer all-reduces, and a larger last one after the backward pass;
- ``no-static-graph``: ``static_graph=False``;
- ``bf16-compress``: ``default_hooks.bf16_compress_hook``: each bucket is cast to bf16, all-reduced
  (half the bytes) and cast back into the fp32 gradients;
- ``batched-grad-copy``: ``batched_grad_copy=True`` (torch 2.13): with gradients set to None each step,
  DDP copies every gradient into its bucket (dividing by the world size); this copies a bucket's
  gradients in one ``_foreach_copy_`` and divides once;
- ``high-priority-stream``, ``nccl-8-ctas`` (NCCL only): the all-reduces on a communicator of their own
  (``new_group`` with ``ProcessGroupNCCL.Options``), whose stream has high priority, or whose
  collectives run on at most 8 CTAs (SMs) instead of NCCL's choice, leaving more SMs to the backward pass;
- ``sm-carveout-8``, ``sm-carveout-16``, ``sm-carveout-8-bucket-400`` (NCCL only): the all-reduces on at
  most 8 or 16 CTAs and cuBLAS's matmuls told to leave as many SMs free, so that neither waits for SMs
  the other holds (the last with 400 MiB buckets); PyTorch passes the carve-out to cuBLASLt only;
- ``cublaslt``, ``sm-carveout-8-cublaslt``, ``sm-carveout-16-cublaslt`` (NCCL only): the matmuls through
  cuBLASLt (``torch.backends.cuda.preferred_blas_library``), alone and with the carve-outs above;
  ``one-gpu-cublaslt`` (GPU only): the one-GPU baseline through cuBLASLt, to tell the library's own
  speed from the carve-out's;
- ``fsdp``: FSDP2 as fitbench builds it, for its step against one GPU's and its kernels beside its
  collectives (``--variants fsdp`` alone for a model one GPU cannot train).

Definitions:

- a variant's step time: the median over the timed steps of the slowest rank's time of each step (under
  DDP the ranks wait for one another in the all-reduces, so they agree within noise); for ``one-gpu``,
  rank 0's median, the slowest rank's median beside it;
- tokens/s per GPU = batch x seq_len / step time;
- weak-scaling efficiency = tokens/s per GPU under a variant / tokens/s of ``one-gpu`` (rank 0) with
  the same per-GPU batch, i.e. one-gpu's step time / the variant's;
- ``one-gpu-again`` (``--baseline-again``): ``one-gpu`` timed once more after every other variant, its
  efficiency against the first; a GPU's clock falls as it warms, so the first baseline, on GPUs that
  were idle before it, may run faster than the variants after it would on the same GPUs;
- peak memory: the allocator's largest allocated and reserved bytes per rank over the variant's build
  and steps;
- power and SM clock (on a GPU): NVML's time-weighted means per rank over the warm-up and timed steps
  (``power_and_clock``);
- ``profile`` (on a GPU, one more step of ``one-gpu``, ``current``, ``sm-carveout-8`` and
  ``sm-carveout-8-cublaslt`` under ``torch.profiler``, per rank): the kernels' summed time, NCCL's
  (which includes waiting for the other ranks) and the rest ("compute"), and the exposed communication:
  from the end of the last compute kernel before the last NCCL kernel ends, to that end; the optimizer
  waits for it, so nothing else runs then. Compute time above one-gpu's is the reducer's copies plus
  kernels slowed by the all-reduces beside them.

OUT.json is written after every variant, so a job cut short keeps what it measured.

Usage (one node, N GPUs):
    torchrun --standalone --nproc-per-node N benchmarks/ddp_overlap.py OUT.json [--model 1B --batch-size 8
        --seq-len 2048 --precision bf16 --steps 10 --warmup 3] [--variants NAME ...] [--baseline-again]
FSDP alone on a model one GPU cannot train: ``... OUT.json --model 30B --batch-size 4 --seq-len 512
--precision bf16-pure --variants fsdp``.
NCCL reads its NCCL_* variables when a communicator is created, so a setting of them is a second job,
its variants timed again under it, e.g. ``NCCL_MAX_NCHANNELS=8 torchrun ...``; OUT.json records the
NCCL_* and TORCH_NCCL_* variables set. On CPU ranks (gloo) the script runs to be checked, with the
NCCL-only variants skipped: ``torchrun --nproc-per-node 2 benchmarks/ddp_overlap.py OUT.json --model
tiny --batch-size 2 --seq-len 32 --steps 2 --warmup 1``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from fitbench.hardware.environment import environment
from fitbench.models.backends import CausalLM, load_model
from fitbench.models.registry import resolve
from fitbench.monitor.nvml import GpuMonitor, job_gpus
from fitbench.precisions import PrecisionPolicy, policy
from fitbench.worker.loops import make_step, random_tokens
from fitbench.worker.parallel import data_seed, wrap_ddp
from fitbench.worker.parallelize import parallelize
from fitbench.worker.ranks import Rank, gather_json, process_group
from fitbench.worker.timing import DeviceClock, time_steps
from fitbench.spec import Layout

SEED = 0
# a collective that waits this long has lost a rank: the job ends instead of hanging
TIMEOUT = timedelta(minutes=3)
GIB = 1024**3


@dataclass(frozen=True)
class Variant:
    """A way to train: ``wrap`` replaces ``lm.module`` by its wrapper and returns what to release after
    (a process group of its own), ``unsupported`` says why this job cannot run it, else None."""

    name: str
    wrap: Callable[[CausalLM, Rank, PrecisionPolicy], Callable[[], None] | None]
    unsupported: Callable[[Rank], str | None] = lambda rank: None
    profiled: bool = False


def ddp(**options) -> Callable[[CausalLM, Rank], None]:
    def wrap(lm: CausalLM, rank: Rank, rules: PrecisionPolicy) -> None:
        lm.module = wrap_ddp(lm.module, rank, **options)
    return wrap


def bf16_compressed(lm: CausalLM, rank: Rank, rules: PrecisionPolicy) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    lm.module = wrap_ddp(lm.module, rank)
    lm.module.register_comm_hook(None, bf16_compress_hook)  # None: the default process group


def own_communicator(high_priority: bool = False, max_ctas: int | None = None, **ddp_options):
    """DDP (with ``ddp_options`` over ``wrap_ddp``'s) over a new NCCL communicator of every rank, built
    with these options."""
    def wrap(lm: CausalLM, rank: Rank, rules: PrecisionPolicy) -> Callable[[], None]:
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
        if max_ctas is not None:
            options.config.max_ctas = max_ctas
        group = dist.new_group(backend="nccl", pg_options=options)
        lm.module = wrap_ddp(lm.module, rank, process_group=group, **ddp_options)
        return lambda: dist.destroy_process_group(group)
    return wrap


def sm_carveout(sms: int, bucket_cap_mb: float | None = None, cublaslt: bool = False):
    """DDP over a communicator whose collectives run on at most ``sms`` CTAs, with cuBLAS's matmuls told to
    leave ``sms`` SMs free (``torch._C._set_sm_carveout_experimental``), so the two need not wait for
    each other's SMs; the carve-out is lifted on release. PyTorch sets the carve-out on cuBLASLt's
    matmuls only (``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``): a plain matmul goes through cuBLAS unless
    cuBLASLt is the preferred library, which ``cublaslt`` makes it for the variant."""
    communicator = own_communicator(max_ctas=sms, **({"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb else {}))

    def wrap(lm: CausalLM, rank: Rank, rules: PrecisionPolicy) -> Callable[[], None]:
        release = communicator(lm, rank, rules)
        torch._C._set_sm_carveout_experimental(sms)
        undo_library = preferred_cublaslt() if cublaslt else (lambda: None)

        def undo() -> None:
            torch._C._set_sm_carveout_experimental(None)
            undo_library()
            release()
        return undo
    return wrap


def preferred_cublaslt() -> Callable[[], None]:
    """Make cuBLASLt the preferred BLAS library; returns what restores the one before."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    return lambda: torch.backends.cuda.preferred_blas_library(before)


def ddp_on_cublaslt(lm: CausalLM, rank: Rank, rules: PrecisionPolicy) -> Callable[[], None]:
    """DDP as ``current``, its matmuls through cuBLASLt: the library alone, without a carve-out."""
    lm.module = wrap_ddp(lm.module, rank)
    return preferred_cublaslt()


def fsdp(lm: CausalLM, rank: Rank, rules: PrecisionPolicy) -> None:
    """FSDP2 as ``fitbench run --strategy fsdp`` builds it (``fitbench.worker.parallelize.parallelize``): each
    decoder layer and the root sharded over every rank, gathered in the compute dtype."""
    parallelize(lm, Layout(dp_shard=rank.world_size), rules, rank)


def nccl_only(rank: Rank) -> str | None:
    return None if rank.device.type == "cuda" else "an NCCL communicator's option; these ranks use gloo"


def gpu_only(rank: Rank) -> str | None:
    return None if rank.device.type == "cuda" else "a CUDA library's choice; these ranks run on the CPU"


def needs_batched_grad_copy(rank: Rank) -> str | None:
    from torch.nn.parallel import DistributedDataParallel

    if "batched_grad_copy" in inspect.signature(DistributedDataParallel).parameters:
        return None
    return f"DistributedDataParallel of torch {torch.__version__} has no batched_grad_copy (2.13 added it)"


BASELINE = "one-gpu"
BASELINE_AGAIN = "one-gpu-again"  # the baseline once more after the others (``--baseline-again``)
VARIANTS = (
    Variant(BASELINE, lambda lm, rank, rules: None, profiled=True),
    Variant("current", ddp(), profiled=True),
    Variant("bucket-100", ddp(bucket_cap_mb=100)),
    Variant("bucket-400", ddp(bucket_cap_mb=400)),
    Variant("bucket-1000", ddp(bucket_cap_mb=1000)),
    Variant("no-static-graph", ddp(static_graph=False)),
    Variant("bf16-compress", bf16_compressed),
    Variant("batched-grad-copy", ddp(batched_grad_copy=True), needs_batched_grad_copy),
    Variant("high-priority-stream", own_communicator(high_priority=True), nccl_only),
    Variant("nccl-8-ctas", own_communicator(max_ctas=8), nccl_only),
    Variant("sm-carveout-8", sm_carveout(8), nccl_only, profiled=True),
    Variant("sm-carveout-16", sm_carveout(16), nccl_only),
    Variant("sm-carveout-8-bucket-400", sm_carveout(8, bucket_cap_mb=400), nccl_only),
    Variant("one-gpu-cublaslt", lambda lm, rank, rules: preferred_cublaslt(), gpu_only),
    Variant("cublaslt", ddp_on_cublaslt, nccl_only),
    Variant("sm-carveout-8-cublaslt", sm_carveout(8, cublaslt=True), nccl_only, profiled=True),
    Variant("sm-carveout-16-cublaslt", sm_carveout(16, cublaslt=True), nccl_only),
    Variant("fsdp", fsdp, profiled=True),
)


def measure(variant: Variant, args: argparse.Namespace, rank: Rank) -> dict:
    """This rank's timings of ``variant``: its step seconds, last loss, peak memory, its buckets and profile."""
    device, cuda = rank.device, rank.device.type == "cuda"
    arch, rules = resolve(args.model), policy(args.precision)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(SEED)
    lm = load_model(arch, "native", device, rules.weight_dtype, compute_dtype=rules.compute_dtype)
    release = variant.wrap(lm, rank, rules)
    try:
        tokens = random_tokens(arch.vocab_size, args.batch_size, args.seq_len + 1, device, data_seed(SEED, rank.rank))
        step = make_step("train", lm, rules, tokens, device)
        with tempfile.TemporaryDirectory() as timeline, GpuMonitor(
                job_gpus(1, first=rank.local_rank) if cuda else [], timeline) as monitor:
            seconds, losses = time_steps(step, DeviceClock(device), warmup=args.warmup, repeats=args.steps,
                                         barrier=dist.barrier)
        row = {"seconds": seconds, "loss": losses[-1].item(), "buckets_bytes": bucket_sizes(lm.module),
               **power_and_clock(monitor)}
        if cuda:
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
            if variant.profiled:
                row["profile"] = profile_one_step(step)
        dist.barrier()
        return row
    finally:
        if release:
            lm.module = None  # the wrapper, and its reducer, before their process group
            gc.collect()
            release()


def power_and_clock(monitor: GpuMonitor) -> dict:
    """This rank's GPU over the warm-up and timed steps: its mean power (W) and SM clock (MHz), time-weighted
    over NVML's samples (``fitbench.monitor.nvml``); None where NVML has none (a CPU rank). A GPU at its
    power limit lowers its clock: work beside the matmuls (the all-reduces) then slows them."""
    gpus = monitor.summary()["gpus"]
    figures = gpus[0] if gpus else {}
    return {"power_w": figures.get("mean_power_w"), "sm_clock_mhz": figures.get("mean_sm_clock_mhz")}


def bucket_sizes(module: torch.nn.Module) -> list[int] | None:
    """DDP's buckets in bytes from its logging data (which ``static_graph``'s documentation reads): as
    rebuilt in the order the gradients became ready, the last holding the embedding's, once the first
    steps have recorded that order (two with ``static_graph``, one without), else as first built;
    None without DDP."""
    if not hasattr(module, "_get_ddp_logging_data"):
        return None
    logged = module._get_ddp_logging_data()
    text = logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes") or ""
    return [int(size) for size in str(text).split(",") if size.strip()]


def profile_one_step(step: Callable[[], torch.Tensor]) -> dict:
    """One more step under ``torch.profiler``, summed by ``communication_summary``. The step runs whatever
    the profiler does, since every rank's all-reduces wait for it; a profiler that fails says why."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CUDA])
    try:
        profiler.start()
    except Exception as error:  # the profiler is a diagnosis: the timings stand without it
        step()
        torch.cuda.synchronize()
        return {"error": described(error)}
    step()
    torch.cuda.synchronize()
    try:
        profiler.stop()
        kernels = [(event.name, event.time_range.start, event.time_range.end) for event in profiler.events()
                   if event.device_type == DeviceType.CUDA]
        return communication_summary(kernels)
    except Exception as error:
        return {"error": described(error)}


def communication_summary(kernels: list[tuple[str, float, float]]) -> dict:
    """Of one step's kernels, (name, start, end) in microseconds: the summed milliseconds of NCCL's and of
    the others ("compute"), and the exposed communication, from the end of the last compute kernel
    that ends before the last NCCL kernel does, to that end (0 without NCCL kernels)."""
    nccl = [kernel for kernel in kernels if "nccl" in kernel[0].lower()]
    compute = [kernel for kernel in kernels if "nccl" not in kernel[0].lower()]
    exposed = 0.0
    if nccl and compute:
        last = max(end for _, _, end in nccl)
        before = [end for _, _, end in compute if end <= last]
        exposed = (last - max(before)) / 1e3 if before else 0.0
    by_name: dict[str, list[float]] = {}
    for name, start, end in kernels:
        by_name.setdefault(name, []).append((end - start) / 1e3)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:12]
    return {"nccl_ms": sum(end - start for _, start, end in nccl) / 1e3, "nccl_kernels": len(nccl),
            "compute_ms": sum(end - start for _, start, end in compute) / 1e3, "compute_kernels": len(compute),
            "exposed_communication_ms": exposed,
            "top": [{"name": name[:120], "ms": sum(times), "calls": len(times)} for name, times in top]}


def summarize(variant: str, ranks: list[dict], args: argparse.Namespace, baseline: float | None) -> dict:
    """Rank 0's row of a variant from every rank's (the module docstring's definitions); ``baseline``:
    one-gpu's step seconds (None where it failed)."""
    row = {"variant": variant}
    if any("skipped" in rank or "error" in rank for rank in ranks):
        return {**row, **{key: rank[key] for rank in ranks for key in ("skipped", "error") if key in rank}}
    samples = [rank["seconds"] for rank in ranks]
    if variant in (BASELINE, BASELINE_AGAIN):
        step = statistics.median(samples[0])
        baseline = baseline if variant == BASELINE_AGAIN else step
        row["slowest_rank_step_s"] = max(statistics.median(seconds) for seconds in samples)
    else:
        step = statistics.median(max(seconds) for seconds in zip(*samples))
    tokens = args.batch_size * args.seq_len
    row.update({"step_s": step, "tokens_per_s_per_gpu": tokens / step,
                "efficiency": baseline / step if baseline else None,
                "loss": [rank["loss"] for rank in ranks], "rank_step_s": samples,
                "buckets_bytes": ranks[0]["buckets_bytes"]})
    for key in ("peak_allocated_gib", "peak_reserved_gib", "profile", "power_w", "sm_clock_mhz"):
        if key in ranks[0]:
            row[key] = [rank[key] for rank in ranks]
    return row


def described(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:300]


def provenance(args: argparse.Namespace, rank: Rank) -> dict:
    cuda = rank.device.type == "cuda"
    return {**environment(), "world_size": rank.world_size, "backend": dist.get_backend(),
            "device": torch.cuda.get_device_name(rank.device) if cuda else "cpu",
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "nccl_environment": {name: value for name, value in sorted(os.environ.items())
                                 if name.startswith(("NCCL_", "TORCH_NCCL_"))},
            "command": " ".join(["torchrun", "--standalone", "--nproc-per-node", str(rank.world_size), *sys.argv]),
            "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "precision": args.precision, "steps": args.steps, "warmup": args.warmup}


TABLE_HEADER = ("| variant | step ms | tokens/s per GPU | efficiency | buckets (last MiB) | peak alloc. GiB | "
                "exposed comm. ms (rank 0) | W, MHz (rank 0) |\n|---|---|---|---|---|---|---|---|")


def table_line(row: dict) -> str:
    """A variant's line of the markdown table printed as the job goes (peak memory: the largest rank's)."""
    if "step_s" not in row:
        return f"| {row['variant']} | {row.get('skipped') or row.get('error')} | | | | | | |"
    peak = f"{max(row['peak_allocated_gib']):.1f}" if "peak_allocated_gib" in row else "-"
    profile = row.get("profile", [{}])[0]
    exposed = f"{profile['exposed_communication_ms']:.1f}" if "exposed_communication_ms" in profile else "-"
    sizes = row["buckets_bytes"]
    buckets = f"{len(sizes)} ({sizes[-1] / 2**20:.0f})" if sizes else "-"
    power, clock = row["power_w"][0], row["sm_clock_mhz"][0]
    nvml = f"{power:.0f}, {clock:.0f}" if power is not None and clock is not None else "-"
    return (f"| {row['variant']} | {row['step_s'] * 1e3:.1f} | {row['tokens_per_s_per_gpu']:,.0f} | "
            f"{row['efficiency'] or float('nan'):.3f} | {buckets} | {peak} | {exposed} | {nvml} |")


def run(args: argparse.Namespace, rank: Rank) -> None:
    result = {"environment": provenance(args, rank) if rank.main else None, "variants": []}
    baseline = None
    if rank.main:
        print(TABLE_HEADER, flush=True)
    chosen = [v for v in VARIANTS if not args.variants or v.name in args.variants]
    if args.baseline_again:
        chosen.append(dataclasses.replace(VARIANTS[0], name=BASELINE_AGAIN, profiled=False))
    for variant in chosen:
        reason = variant.unsupported(rank)
        if reason:
            row = {"skipped": reason}
        else:
            try:
                row = measure(variant, args, rank)
            except Exception as error:  # a variant every rank fails (an option this torch lacks) ends only itself
                row = {"error": described(error)}
        gc.collect()
        if rank.device.type == "cuda":
            torch.cuda.empty_cache()
        ranks = gather_json(rank, row)
        if rank.main:
            summary = summarize(variant.name, ranks, args, baseline)
            if variant.name == BASELINE:
                baseline = summary.get("step_s")
            result["variants"].append(summary)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
            print(table_line(summary), flush=True)


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="1B")
    parser.add_argument("--variants", nargs="+", choices=[variant.name for variant in VARIANTS],
                        help="only these (the baseline first); default every one")
    parser.add_argument("--baseline-again", action="store_true",
                        help="time one-gpu once more after every other variant, on GPUs as warm as theirs")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps; at least 3 for DDP's steady state: under static_graph the first "
                             "backward pass reduces every gradient at its end, the second records the order "
                             "they come in, and the third step's forward pass rebuilds the buckets in it"),
    args = parser.parse_args()
    rank = Rank.from_environment("cuda" if torch.cuda.is_available() else "cpu")
    if not rank.launched:
        parser.error("start it with torchrun (Usage in the module docstring)")
    with process_group(rank, TIMEOUT):
        run(args, rank)


if __name__ == "__main__":
    main()
