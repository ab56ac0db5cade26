"""One row of activations times a weight (a decode step's matmul at batch 1), per shape of a
tensor-parallel shard, three ways: cuBLAS (``F.linear``, what inductor calls for a matmul), and the
product written as an elementwise multiply and a sum over the input dimension, which inductor turns
into one reduction kernel of its own (with and without its coordinate-descent tuning).

A shape is (name, K, N) of ``F.linear(x (B, K), W (N, K))``: the 13B preset's and Llama-2-70B's
q/k/v (stacked), output, gate/up (stacked) and down projections at TP 1, 2 and 4 (``--tp``), each
run over ``LAYERS`` weights of its own, so that no weight is read from L2, compiled, in one CUDA
graph, median of ``--repeats`` replays. GB/s = the weights' bytes (2 N K a layer) over a replay's
time; each variant is checked against cuBLAS (rel. diff of the outputs).

The kernels alone: in a decoder layer inductor fuses each matmul's producer (the RMSNorm, SwiGLU) into
the reduction and recomputes it for every output column, and the step is slower than through cuBLAS
(``benchmarks/results/2026-11-27-h100x4-tp-decode-kernels``).

Usage: python benchmarks/gemv.py [--tp 1 2 4] [--batch 1] [--repeats 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from decode_kernels import replay_seconds

LAYERS = 8
# (model, dim, heads, kv heads, head dim, ffn)
MODELS = (("13B", 5120, 40, 40, 128, 13824), ("llama-2-70b", 8192, 64, 8, 128, 28672))


def shapes(tp: int) -> list[tuple[str, int, int]]:
    """(name, K, N) of each projection's shard at tensor-parallel degree ``tp``."""
    out = []
    for model, dim, heads, kv, head_dim, ffn in MODELS:
        out += [(f"{model} qkv", dim, (heads + 2 * kv) * head_dim // tp), (f"{model} o", heads * head_dim // tp, dim),
                (f"{model} gate_up", dim, 2 * ffn // tp), (f"{model} down", ffn // tp, dim)]
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def reduction(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(-2) * weight).sum(-1, dtype=torch.float32).to(x.dtype)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    variants = {"cublas": (linear, {}), "reduction": (reduction, {}),
                "reduction, tuned": (reduction, {"coordinate_descent_tuning": True})}
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch}, {LAYERS} weights a shape")
    for tp in args.tp:
        for name, k, n in shapes(tp):
            torch.manual_seed(0)
            weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(LAYERS)]
            x = torch.randn(args.batch, k, device=device, dtype=torch.bfloat16)
            nbytes = sum(w.nbytes for w in weights)
            row = {"tp": tp, "shape": name, "K": k, "N": n, "batch": args.batch}
            reference = None
            for variant, (function, options) in variants.items():
                torch._dynamo.reset()
                compiled = torch.compile(function, dynamic=False, options=options or None)
                step = lambda: [compiled(x, w) for w in weights]  # noqa: E731  a kernel per weight, in order
                out = torch.stack(step())
                reference = out if reference is None else reference
                difference = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
                seconds = replay_seconds(step, device, args.repeats)
                row[variant] = {"us_per_layer": seconds / LAYERS * 1e6, "gb_s": nbytes / seconds / 1e9,
                                "rel_diff": difference}
            rows.append(row)
            print(f"TP {tp} {name:20s} K {k:6d} N {n:6d}  " + "  ".join(
                f"{v}: {row[v]['us_per_layer']:6.1f} us {row[v]['gb_s']:5.0f} GB/s ({row[v]['rel_diff']:.0e})"
                for v in variants), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
