"""Where a training step's device time goes: the kernels of a few steps under ``torch.profiler``, summed
by kind (matmuls, attention, normalization, the loss, the optimizer, other elementwise work, copies), with
the step's wall time beside the kernels' sum; the gap is time the device waited for the host.

The step is fitbench's own (``fitbench.worker.loops.make_step``) on either backend, so the profile is of what
``fitbench run --mode train`` times. A kernel's kind is read from its name (``KINDS``, first match wins;
ATen's ``gpu_kernel_impl_nocast`` wraps every elementwise functor, so ``nocast`` is no cast).

Usage: python benchmarks/train_profile.py --model 1B --backend native --batch-size 8 --seq-len 2048 [--compile] OUT.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fitbench.models.backends import load_model
from fitbench.models.registry import resolve
from fitbench.precisions import policy
from fitbench.worker.loops import make_step, random_tokens
from fitbench.worker.parallelize import parallelize
from fitbench.worker.ranks import Rank
from fitbench.spec import Layout

KINDS: tuple[tuple[str, str], ...] = (
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("attention", r"flash|fmha|attention|sdpa|efficient"),
    ("loss", r"log_softmax|softmax|nll|cross_entropy"),
    ("norm", r"rms|norm|rsqrt"),
    ("matmul", r"gemm|cutlass|sm\d\d_|nvjet|cublas|matmul|addmm|\bmm\b|xmma|wgmma|int4pack|f8f8|e4m3"),
    ("copy", r"copy|(?<!no)cast|fill|memcpy|memset|catarray|index"),
    ("elementwise", r"elementwise|vectorized|reduce|unrolled|pointwise|triton"),
)


def kind_of(name: str) -> str:
    """The first kind of ``KINDS`` whose pattern the kernel's name matches (case-insensitive), else ``other``."""
    lowered = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, lowered)), "other")


def profile_step(model: str, backend: str, batch: int, seq_len: int, precision: str, steps: int,
                 device: torch.device, compile: bool = False) -> dict:
    arch = resolve(model)
    rules = policy(precision)
    lm = load_model(arch, backend, device, rules.weight_dtype, compute_dtype=rules.compute_dtype)
    if compile:
        single = Rank(rank=0, local_rank=0, world_size=1, local_world_size=1, device=device, launched=False)
        parallelize(lm, Layout(), rules, single, compile=True)
    step = make_step("train", lm, rules, random_tokens(arch.vocab_size, batch, seq_len + 1, device, 0), device)
    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - started) / steps
    by_kind: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        seconds = (event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total) / 1e6 / steps
        if seconds <= 0 or (device.type == "cuda" and event.device_type.name != "CUDA"):
            continue
        by_kind[kind_of(event.key)] += seconds
        kernels.append({"name": event.key[:160], "kind": kind_of(event.key), "ms": seconds * 1e3,
                        "calls": event.count // steps})
    kernels.sort(key=lambda k: -k["ms"])
    busy = sum(by_kind.values())
    return {"model": model, "backend": backend, "batch": batch, "seq_len": seq_len, "precision": precision,
            "compile": compile,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "step_ms": wall * 1e3, "kernels_ms": busy * 1e3,
            "kinds_ms": {kind: ms * 1e3 for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": kernels[:30]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1B")
    parser.add_argument("--backend", default="native", choices=("native", "hf"))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the module, as fitbench run --compile")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    result = profile_step(args.model, args.backend, args.batch_size, args.seq_len, args.precision, args.steps,
                          torch.device(args.device), args.compile)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.model} {args.backend} {args.batch_size}x{args.seq_len}: step {result['step_ms']:.1f} ms, "
          f"kernels {result['kernels_ms']:.1f} ms")
    for kind, ms in result["kinds_ms"].items():
        print(f"  {kind:12s} {ms:8.1f} ms")
    for kernel in result["top"][:15]:
        print(f"  {kernel['ms']:8.2f} ms x{kernel['calls']:<4d} {kernel['kind']:11s} {kernel['name'][:90]}")


if __name__ == "__main__":
    main()
