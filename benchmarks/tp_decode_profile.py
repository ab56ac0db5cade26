"""Where a tensor-parallel generation's time goes: the prefill and the decode steps of one generation
of fitbench's native decoder built as ``fitbench run --mode infer --strategy tp`` builds it (local
shards, one all-reduce after each row-wise matmul, compiled regions, the decode step in a CUDA
graph), profiled on rank 0 with ``torch.profiler``; beside it the same on one GPU when run without
torchrun.

Per decode step and for the prefill: the wall time (CUDA events on rank 0's stream), the kernels'
summed device time by kind (``train_profile.KINDS``, with ``collective`` first: NCCL's and the
symmetric-memory kernels), and the kernels' count; for the prefill also the host's operators by
their own time (the profile's CPU side). A step's wall time above its kernels' sum is
time the GPU waited: for the host to launch, or in a collective for a peer.

``--one-shot``: the small all-reduces through symmetric memory
(``fitbench.worker.tensor_parallel.one_shot_small_all_reduces``), for the side-by-side comparison.
``--eager-embedding``: the decode step's embedding (and its all-reduce, NCCL's) outside the compiled
regions, as before they held it.

Usage: torchrun --standalone --nproc-per-node N benchmarks/tp_decode_profile.py --model 13B [--one-shot]
           [--eager-embedding] OUT.json
       python benchmarks/tp_decode_profile.py --model 13B OUT.json     (one GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from decode_profile import build
from fitbench.models.backends import compile_regions
from fitbench.models.native import EAGER
from fitbench.models.registry import resolve
from fitbench.precisions import policy
from fitbench.worker.build import build_layout
from fitbench.worker.loops import random_tokens
from fitbench.worker.ranks import Rank, process_group
from fitbench.worker.tensor_parallel import one_shot_small_all_reduces, tensor_mesh
from fitbench.spec import Layout
from train_profile import KINDS

COLLECTIVE = ("collective", r"nccl|all_reduce|allreduce|one_shot|two_shot|multimem|symm")


def kind_of(name: str) -> str:
    import re

    lowered = name.lower()
    return next((kind for kind, pattern in (COLLECTIVE, *KINDS) if re.search(pattern, lowered)), "other")


def summarize(prof, calls: int) -> dict:
    """The profile's device kernels per call, summed by kind, and the 12 longest."""
    by_kind: dict[str, float] = defaultdict(float)
    count = 0
    kernels = []
    for event in prof.key_averages():
        if event.device_type.name != "CUDA" or event.self_device_time_total <= 0:
            continue
        us = event.self_device_time_total / calls
        by_kind[kind_of(event.key)] += us
        count += event.count
        kernels.append({"name": event.key[:140], "kind": kind_of(event.key), "us": us,
                        "calls": round(event.count / calls, 1)})
    kernels.sort(key=lambda k: -k["us"])
    host = sorted(({"name": event.key[:140], "self_us": event.self_cpu_time_total / calls,
                    "calls": round(event.count / calls, 1)}
                   for event in prof.key_averages() if event.self_cpu_time_total > 0),
                  key=lambda op: -op["self_us"])
    return {"kernels_us": sum(by_kind.values()), "kernels_per_call": count / calls,
            "kinds_us": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])), "top": kernels[:12],
            "host_us": sum(op["self_us"] for op in host), "host_top": host[:25]}


def timed(function, calls: int = 1) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        function()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="13B")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--one-shot", action="store_true")
    parser.add_argument("--eager-embedding", action="store_true")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    rank = Rank.from_environment("cuda")
    arch = resolve(args.model)
    with process_group(rank, timedelta(minutes=10)):
        if rank.world_size == 1:
            lm = build(args.model, "bf16-pure", rank.device)
        else:
            lm, mesh, _ = build_layout(arch, Layout(tp=rank.world_size), policy("bf16-pure"), "infer", args.seq_len,
                                       rank, cuda_graphs=True)
            lm.compile_decode = True
            if args.one_shot:
                one_shot_small_all_reduces(tensor_mesh(mesh).get_group())
        if args.eager_embedding:
            lm.regions = dataclasses.replace(compile_regions(), embed=EAGER.embed)
        prompt = random_tokens(arch.vocab_size, args.batch_size, args.seq_len, rank.device, 0)
        max_len = args.seq_len + args.new_tokens
        token = None

        def prefill():
            nonlocal token
            token = lm.prefill(prompt, max_len).argmax(dim=-1, keepdim=True)

        def decode():
            nonlocal token
            token = lm.decode(token).argmax(dim=-1, keepdim=True)

        steps = args.new_tokens - 1
        with torch.inference_mode():
            for _ in range(2):  # the first compiles and captures; the second runs as measured ones do
                prefill()
                for _ in range(steps):
                    decode()
            if rank.launched:
                dist.barrier()
            prefill_us = timed(prefill)
            decode_us = timed(decode, steps)
            if rank.launched:
                dist.barrier()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prefill_profile:
                prefill()
                torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as decode_profile:
                for _ in range(steps):
                    decode()
                torch.cuda.synchronize()
        if rank.main:
            result = {"model": args.model, "tp": rank.world_size, "one_shot": args.one_shot,
                      "eager_embedding": args.eager_embedding,
                      "batch": args.batch_size, "seq_len": args.seq_len, "new_tokens": args.new_tokens,
                      "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())), "decoding": lm.decoding,
                      "prefill": {"wall_us": prefill_us, **summarize(prefill_profile, 1)},
                      "decode_step": {"wall_us": decode_us, **summarize(decode_profile, steps)}}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
            for part in ("prefill", "decode_step"):
                figures = result[part]
                kinds = ", ".join(f"{kind} {us:.0f}" for kind, us in figures["kinds_us"].items())
                print(f"{args.model} TP {rank.world_size}{' one-shot' if args.one_shot else ''} {part}: "
                      f"wall {figures['wall_us']:.0f} us, kernels {figures['kernels_us']:.0f} us "
                      f"({figures['kernels_per_call']:.0f}): {kinds}")
            for op in result["prefill"]["host_top"][:10]:
                print(f"  host {op['self_us']:8.0f} us x{op['calls']:<6} {op['name'][:100]}")
        if rank.launched:
            dist.barrier()
            os._exit(0)  # the figures are on disk; the process group's teardown hung after profiling


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    main()
