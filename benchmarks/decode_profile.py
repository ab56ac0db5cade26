"""Where a decode step's device time goes: the kernels of the decode steps of one generation under
``torch.profiler``, per token and summed by kind (``train_profile.KINDS``), beside the bytes of the
weights a step reads and the bandwidth the matmul kernels reach over them.

The model is fitbench's native decoder as ``fitbench run --mode infer`` builds it on one GPU (quantized
layer by layer with ``--precision`` int4, fp8, int8-weight-only, ...), decoding through its compiled
regions in a CUDA graph; two generations warm it up (compile and capture), the third is profiled.
The kernels of a graph's replays are the step's, so their sum over the steps is the step's device
time; prefill kernels are left out (the profile starts after the prefill).

Matmul bandwidth = the weight bytes of the decoder layers and the output projection (what a step
must read, ``fitbench.worker.weight_bytes.weight_storage_bytes`` less the embedding table, which a step reads
one row of) / the matmul kernels' time per step: the share of the copy bandwidth the format's
kernels reach.

Usage: python benchmarks/decode_profile.py --model llama-2-7b --precision int4 --batch-size 1
       [--seq-len 512] [--new-tokens 64] OUT.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fitbench.models.backends import NativeLM, load_model
from fitbench.models.registry import resolve
from fitbench.precisions import entry, policy
from fitbench.worker.loops import random_tokens
from fitbench.worker.quantize import build_quantized_native
from fitbench.worker.weight_bytes import weight_storage_bytes
from train_profile import kind_of


def build(model: str, precision: str, device: torch.device) -> NativeLM:
    arch = resolve(model)
    rules = policy(precision)
    if not rules.quantized:
        lm = load_model(arch, "native", device, rules.weight_dtype, compute_dtype=rules.compute_dtype,
                        cuda_graphs=True)
    else:
        probe = random_tokens(arch.vocab_size, 1, 64, device, 1)
        module, _ = build_quantized_native(arch, device, precision, probe)
        lm = NativeLM(module, cache_dtype=torch.bfloat16, cuda_graphs=True, graph_problem=entry(precision).graph_problem)
    lm.compile_decode = True
    return lm


def profile_decode(model: str, precision: str, batch: int, seq_len: int, new_tokens: int,
                   device: torch.device) -> dict:
    arch = resolve(model)
    lm = build(model, precision, device)
    prompt = random_tokens(arch.vocab_size, batch, seq_len, device, 0)
    max_len = seq_len + new_tokens

    def generation() -> torch.Tensor:
        token = lm.prefill(prompt, max_len).argmax(dim=-1, keepdim=True)
        for _ in range(new_tokens - 1):
            token = lm.decode(token).argmax(dim=-1, keepdim=True)
        return token

    with torch.inference_mode():
        for _ in range(2):  # the first compiles and captures; the second runs as measured ones do
            generation()
        token = lm.prefill(prompt, max_len).argmax(dim=-1, keepdim=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            for _ in range(new_tokens - 1):
                token = lm.decode(token).argmax(dim=-1, keepdim=True)
            end.record()
            torch.cuda.synchronize()
    steps = new_tokens - 1
    by_kind: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        seconds = event.self_device_time_total / 1e6 / steps
        if seconds <= 0 or event.device_type.name != "CUDA":
            continue
        by_kind[kind_of(event.key)] += seconds
        kernels.append({"name": event.key[:160], "kind": kind_of(event.key), "us": seconds * 1e6,
                        "calls": round(event.count / steps, 1)})
    kernels.sort(key=lambda k: -k["us"])
    embedding = lm.module.model.embed_tokens.weight
    read_bytes = weight_storage_bytes(lm.module) - (0 if arch.tie_embeddings else embedding.numel() *
                                                     embedding.element_size())
    matmul_s = by_kind.get("matmul", 0.0)
    return {"model": model, "precision": precision, "batch": batch, "seq_len": seq_len, "new_tokens": new_tokens,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "decoding": lm.decoding,
            "step_ms": start.elapsed_time(end) / steps, "kernels_ms": sum(by_kind.values()) * 1e3,
            "weight_bytes_read": read_bytes,
            "matmul_gb_per_s": read_bytes / matmul_s / 1e9 if matmul_s else None,
            "kinds_ms": {kind: s * 1e3 for kind, s in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": kernels[:25]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--precision", default="bf16-pure")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    result = profile_decode(args.model, args.precision, args.batch_size, args.seq_len, args.new_tokens,
                            torch.device("cuda"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    bandwidth = result["matmul_gb_per_s"]
    print(f"{args.model} {args.precision} batch {args.batch_size}: step {result['step_ms']:.3f} ms, kernels "
          f"{result['kernels_ms']:.3f} ms, weights {result['weight_bytes_read'] / 1e9:.2f} GB, matmuls at "
          f"{bandwidth or 0:.0f} GB/s")
    for kind, ms in result["kinds_ms"].items():
        print(f"  {kind:12s} {ms * 1e3:8.1f} us")
    for kernel in result["top"][:15]:
        print(f"  {kernel['us']:8.1f} us x{kernel['calls']:<5} {kernel['kind']:11s} {kernel['name'][:90]}")


if __name__ == "__main__":
    main()
