"""The two kinds of kernel a decode step is made of, one format or backend against another, at the
Llama-2-7B decode shapes: what each reaches of the device's copy bandwidth.

- ``linears``: the MLP's three matmuls of one layer (4096 -> 11008 twice, 11008 -> 4096) for each of
  ``LAYERS`` layers, batch 1, 8 and 32, in each weight format: bf16 and torchao's int4 (tinygemm, and
  its prototype of gemlite's bit-packed uint4),
  int8 weight-only (also without the inductor settings torchao makes, process-wide: run it alone
  with ``--formats``), fp8 with row-wise dynamic activations (its AUTO kernel choice and its Triton
  one) and fp8 weight-only. The stack is compiled by inductor (as fitbench compiles a decode step)
  and captured in one CUDA graph; GB/s = the formats' weight bytes (``weight_storage_bytes``) over
  a replay's time, median of the repeats. Each format is checked against bf16 (rel. diff of the
  stack's output, from the format's rounding).
- ``attention``: one query per sequence against a 640-slot cache (a 512-token prompt and 128 new
  tokens, the decode step's masked attention of ``fitbench.models.native.Attention.decode``), 32
  heads of 128 (``--heads``), for each of ``LAYERS`` layers' caches, through each SDPA backend that
  takes a mask, eager and compiled, and FlexAttention compiled (the mask as a score modification
  reading the position from the device; a query this short runs its split-KV decoding kernel), each
  captured in a graph; GB/s = the keys and values read (2 B S KV D 2 bytes a layer) over the replay's
  time.

A layer's weights and cache are its own, ``LAYERS`` of them, so that no kernel reads from L2.

Usage: python benchmarks/decode_kernels.py [--repeats 20] [--only linears|attention] [--heads 32]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fitbench.worker.timing import DeviceClock, time_steps
from fitbench.worker.weight_bytes import weight_storage_bytes

LAYERS = 8
DIM, FFN = 4096, 11008
HEADS, HEAD_DIM, SLOTS = 32, 128, 640


def formats() -> dict[str, Callable[[], object] | None]:
    """torchao's config of each format by name; bf16 has none."""
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig,
                                      Int4WeightOnlyConfig, Int8WeightOnlyConfig)
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.common import KernelPreference

    return {
        "bf16": None,
        "int4 (tinygemm)": lambda: Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"),
        "int4 (gemlite)": gemlite_int4,
        "int8 weight-only": Int8WeightOnlyConfig,
        "int8 weight-only, inductor as is": lambda: Int8WeightOnlyConfig(set_inductor_config=False),
        "fp8 row-wise, auto": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        "fp8 row-wise, triton": lambda: Float8DynamicActivationFloat8WeightConfig(
            granularity=PerRow(), kernel_preference=KernelPreference.TRITON),
        "fp8 weight-only": lambda: Float8WeightOnlyConfig(granularity=PerRow()),
    }


def gemlite_int4() -> object:
    """torchao's prototype of uint4 weights, groups of 128, bit-packed for gemlite's Triton kernels
    (the ``gemlite`` package: its GEMV at one row, split-K GEMM past it)."""
    from torchao.prototype.quantization.quant_api import UIntxWeightOnlyConfig

    return UIntxWeightOnlyConfig(group_size=128, bit_width=4)


class MLPStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList((nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False),
                                                   nn.Linear(FFN, DIM, bias=False))) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for gate, up, down in self.layers:
            x = x + down(F.silu(gate(x)) * up(x))
        return x


def replay_seconds(step: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> float:
    """Median seconds of a replay of ``step`` captured in a CUDA graph (after three warm-up calls)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seconds, _ = time_steps(graph.replay, DeviceClock(device), warmup=3, repeats=repeats)
    return statistics.median(seconds)


@torch.inference_mode()
def linears(device: torch.device, repeats: int, names: list[str] | None) -> None:
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    reference = MLPStack().to(device, torch.bfloat16)
    state = reference.state_dict()
    print(f"linears: {LAYERS} layers of 4096 -> 11008 x 2, 11008 -> 4096, compiled, in a CUDA graph")
    for name, config in formats().items():
        if names and not any(name.startswith(wanted) for wanted in names):
            continue
        stack = MLPStack().to(device, torch.bfloat16)
        stack.load_state_dict(state)
        try:
            if config is not None:
                quantize_(stack, config())
            compiled = torch.compile(stack, dynamic=False)
            weight_bytes = weight_storage_bytes(stack)
            cells = []
            for batch in (1, 8, 32):
                x = torch.randn(batch, DIM, device=device, dtype=torch.bfloat16)
                out = compiled(x)
                expected = reference(x)
                difference = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
                seconds = replay_seconds(lambda: compiled(x), device, repeats)
                cells.append(f"b{batch} {seconds * 1e6:7.1f} us {weight_bytes / seconds / 1e9:5.0f} GB/s "
                             f"(rel. diff {difference:.1e})")
            print(f"  {name:22s} {weight_bytes / 1e9:5.2f} GB  " + "  ".join(cells))
        except Exception as error:  # a kernel this GPU or build lacks
            print(f"  {name:22s} failed: {str(error).splitlines()[0][:120]}")
        torch._dynamo.reset()


@torch.inference_mode()
def attention(device: torch.device, repeats: int, heads: int = HEADS) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    print(f"attention: {LAYERS} layers' caches of {SLOTS} slots, {heads} heads of {HEAD_DIM}, one query each")
    backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH, "flex": "flex"}
    position = torch.tensor([600], device=device)

    def hide_later(score, b, h, q_idx, kv_idx):  # the decode step's mask as a score modification
        return torch.where(kv_idx <= position[0], score, -float("inf"))

    for batch in (1, 8, 32):
        caches = [(torch.randn(batch, heads, SLOTS, HEAD_DIM, device=device, dtype=torch.bfloat16),
                   torch.randn(batch, heads, SLOTS, HEAD_DIM, device=device, dtype=torch.bfloat16))
                  for _ in range(LAYERS)]
        q = torch.randn(batch, heads, 1, HEAD_DIM, device=device, dtype=torch.bfloat16)
        visible = torch.arange(SLOTS, device=device).view(1, 1, 1, SLOTS) <= position
        kv_bytes = sum(k.nbytes + v.nbytes for k, v in caches)
        reference = None
        cells = []
        for name, backend in backends.items():
            def step() -> torch.Tensor:
                outs = []
                if backend == "flex":  # FlexAttention: compiled, a query this short takes its decoding kernel
                    return torch.stack([flex_attention(q, k, v, score_mod=hide_later) for k, v in caches])
                with sdpa_kernel([backend]) if backend else contextlib.nullcontext():
                    for k, v in caches:
                        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=visible))
                return torch.stack(outs)
            calls = ((f"{name}+compile", torch.compile(step, dynamic=False)),) if backend == "flex" else (
                (name, step), (f"{name}+compile", torch.compile(step, dynamic=False)))
            for label, call in calls:
                try:
                    out = call()
                    reference = reference if reference is not None else out
                    difference = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
                    seconds = replay_seconds(call, device, repeats)
                    cells.append(f"{label} {seconds / LAYERS * 1e6:5.1f} us/layer "
                                 f"{kv_bytes / seconds / 1e9:5.0f} GB/s ({difference:.0e})")
                except Exception as error:
                    cells.append(f"{label} failed: {str(error).splitlines()[0][:60]}")
            torch._dynamo.reset()
        print(f"  batch {batch}:\n    " + "\n    ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", choices=("linears", "attention"))
    parser.add_argument("--formats", nargs="+", help="the linears' formats whose names start so (default: all)")
    parser.add_argument("--heads", type=int, default=HEADS,
                        help="attention's heads (default 32, Llama-2-7B's; 10 is 13B's under TP 4)")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.only != "attention":
        linears(device, args.repeats, args.formats)
    if args.only != "linears":
        attention(device, args.repeats, args.heads)


if __name__ == "__main__":
    main()
