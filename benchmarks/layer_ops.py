"""Forward + backward of the decoder's elementwise training operators, old against new: the tensor
operations the native modules ran (and still run without autograd) against the autograd Functions of
``fitbench.models.layer_ops``, at the 1B preset's shapes (8 x 2048 tokens, dim 2048, 32 heads, 8 kv
heads of 64, MLP 8192) under bf16 autocast with fp32 weights, as ``fitbench run --mode train
--precision bf16`` runs them:

- RMSNorm of the fp32 residual stream (n, dim), its output cast to bf16 for the matmuls after it (the
  old module returns fp32, which autocast casts; the Function returns bf16);
- rotary positions of q and k, with v, from the fused qkv projection's bf16 output (n, (H + 2 KV) D);
- SwiGLU of the fused gate/up projection of the bf16 normalized input (n, dim), the projection
  included: the old ``F.linear`` gives (n, 2 F), gate and up side by side in each row, the new
  ``stacked_linear`` (2, n, F), each contiguous, which is what speeds up the SwiGLU kernels after it;
  and SwiGLU alone on separate gate and up outputs (n, F), as the unfused model has them: the Function
  recomputes silu(gate) rather than saving it, one F-wide tensor per token less.

Each case first checks that old and new compute the same function (rel. diff: the largest
||new - old|| / ||old|| over outputs and input gradients; bf16 rounding puts it near 1e-3), then times
a forward pass and its backward pass from a random output gradient, with device events after a
warm-up, the median of the repeats. GB/s is the least traffic the pair must move (each
input read once, each output and gradient written once) over the median time, in both columns; for
the case with the projection, TFLOP/s of its three matmuls (6 n dim 2 F) instead.

Usage: python benchmarks/layer_ops.py [--repeats 20] [--smoke]
  --smoke: small shapes on the CPU (B 2, T 64, dim 256, 4 heads, 2 kv heads, MLP 512), in a few seconds.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from fitbench.models.layer_ops import rms_norm, rotary, stacked_linear, swiglu
from fitbench.models.native import apply_rope
from fitbench.worker.timing import DeviceClock, time_steps


@dataclass(frozen=True)
class Shapes:
    batch: int
    seq: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


PRESET_1B = Shapes(batch=8, seq=2048, dim=2048, heads=32, kv_heads=8, ffn=8192)
SMOKE = Shapes(batch=2, seq=64, dim=256, heads=4, kv_heads=2, ffn=512)


@dataclass(frozen=True)
class Case:
    """One operator: its old and new forward over ``inputs()``, and the least bytes a forward and
    backward pass of it moves, or the FLOPs of its matmuls."""

    name: str
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    old: Callable[..., tuple[torch.Tensor, ...]]
    new: Callable[..., tuple[torch.Tensor, ...]]
    bytes: int = 0
    flops: int = 0

    def rate(self, seconds: float) -> str:
        if self.bytes:
            return f"{self.bytes / seconds / 1e9:7.0f} GB/s"
        return f"{self.flops / seconds / 1e12:4.0f} TFLOP/s"


def old_norm(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    return ((weight * normed.type_as(x)).to(torch.bfloat16),)


def new_norm(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (rms_norm(x, weight, 1e-5),)


def cases(s: Shapes, device: torch.device) -> list[Case]:
    n, h, f, d = s.tokens, s.dim, s.ffn, s.head_dim
    kv = s.kv_heads * d
    angles = torch.outer(torch.arange(s.seq, device=device, dtype=torch.float32),
                         1e4 ** -(torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    cos, sin = (torch.cat((table, table), dim=-1) for table in (angles.cos(), angles.sin()))  # (T, D) fp32
    heads = (s.heads, s.kv_heads, s.kv_heads)

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16).requires_grad_()

    def old_rotary(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = (part.view(s.batch, s.seq, -1, d).transpose(1, 2) for part in qkv.split((h, kv, kv), dim=-1))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def new_rotary(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # the tables cast once per forward pass, not per layer
        return rotary(qkv.view(s.batch, s.seq, sum(heads), d), cos.to(qkv.dtype), sin.to(qkv.dtype), heads, 2)

    def old_swiglu(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (F.silu(gate) * up,)

    def new_swiglu(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (swiglu(gate, up),)

    def old_mlp(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return old_swiglu(*F.linear(x, weight).chunk(2, dim=-1))

    def new_mlp(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (swiglu(stacked_linear(x, weight, 2)),)

    def mlp_inputs() -> tuple[torch.Tensor, ...]:
        return bf16(s.batch, s.seq, h), (0.02 * torch.randn(2 * f, h, device=device)).requires_grad_()

    def norm_inputs() -> tuple[torch.Tensor, ...]:
        return (torch.randn(s.batch, s.seq, h, device=device).requires_grad_(),
                (1 + 0.1 * torch.randn(h, device=device)).requires_grad_())

    return [
        # x (4 B) read, output (2 B) written; grad (2 B) and x read, dx (4 B) written
        Case("rms_norm", norm_inputs, old_norm, new_norm,
             bytes=4 * n * h + 2 * n * h + 2 * n * h + 4 * n * h + 4 * n * h),
        # q, k, v read and written, each way
        Case("rotary", lambda: (bf16(s.batch, s.seq, h + 2 * kv),), old_rotary, new_rotary,
             bytes=4 * 2 * n * (h + 2 * kv)),
        # gate and up read, product written; its gradient, gate and up read, their gradients written
        Case("swiglu", lambda: (bf16(s.batch, s.seq, f), bf16(s.batch, s.seq, f)), old_swiglu, new_swiglu,
             bytes=2 * (2 * n * f + n * f + n * f + 2 * n * f + 2 * n * f)),
        Case("gate_up+swiglu", mlp_inputs, old_mlp, new_mlp, flops=3 * 2 * n * h * 2 * f),
    ]


def results(forward: Callable, inputs: tuple[torch.Tensor, ...], device: torch.device) -> list[torch.Tensor]:
    """The outputs of ``forward`` and the gradients of its inputs from fixed random output gradients."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        outputs = forward(*inputs)
    generator = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(out.shape, generator=generator, device=device, dtype=out.dtype) for out in outputs]
    return [*outputs, *torch.autograd.grad(outputs, inputs, grads)]


def difference(case: Case, inputs: tuple[torch.Tensor, ...], device: torch.device) -> float:
    """The largest ||new - old|| / ||old|| over the outputs and the input gradients: a check that both
    compute the same function before they are timed."""
    old, new = (results(forward, inputs, device) for forward in (case.old, case.new))
    return max(((b.float() - a.float()).norm() / a.float().norm()).item() for a, b in zip(old, new, strict=True))


def time_pass(forward: Callable, inputs: tuple[torch.Tensor, ...], repeats: int, device: torch.device) -> float:
    """Median seconds of forward + backward from a fixed random output gradient, after a warm-up."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        outputs = forward(*inputs)
    grads = [torch.randn_like(out) for out in outputs]

    def once() -> None:
        for tensor in inputs:
            tensor.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            outs = forward(*inputs)
        torch.autograd.backward(outs, grads)

    seconds, _ = time_steps(once, DeviceClock(device), warmup=3, repeats=repeats)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="small shapes on the CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a check that the pieces run: on a shared machine more threads only add noise
    shapes = SMOKE if args.smoke else PRESET_1B
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{where}, torch {torch.__version__}, {shapes}")
    print(f"{'op':15s} {'old ms':>9s} {'new ms':>9s} {'speed-up':>9s} {'old':>14s} {'new':>14s} {'rel. diff':>10s}")
    for case in cases(shapes, device):
        torch.manual_seed(0)
        inputs = case.inputs()
        diff = difference(case, inputs, device)
        old, new = (time_pass(forward, inputs, args.repeats, device) for forward in (case.old, case.new))
        print(f"{case.name:15s} {old * 1e3:9.3f} {new * 1e3:9.3f} {old / new:8.2f}x {case.rate(old):>14s} "
              f"{case.rate(new):>14s} {diff:10.1e}")


if __name__ == "__main__":
    main()
