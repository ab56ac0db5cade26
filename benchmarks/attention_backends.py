"""Causal self-attention, forward and backward, through each of ``F.scaled_dot_product_attention``'s
CUDA backends at the training shapes of fitbench's presets, as the native decoder calls it: bf16
q (B, H, T, D), k and v (B, KV, T, D), ``is_causal``, ``enable_gqa`` where KV < H.

Each backend is first checked against flash attention (rel. diff: the largest ||x - flash|| /
||flash|| over the output and the three input gradients; bf16 rounding puts it near 1e-3), then timed
with device events after a warm-up, the median of the repeats. TFLOP/s counts the causal half of the
score and value matmuls: forward 2 B H T^2 D (4 B H T^2 D for the full square, halved), backward 2.5
times the forward (five matmuls against two; FlashAttention-2, Dao 2023, section 3.1), so the pair is
7 B H T^2 D. A backend that refuses the shape says why.

Usage: python benchmarks/attention_backends.py [--repeats 20] [--smoke]
  --smoke: a small shape on the CPU through the math backend, in a second.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fitbench.worker.timing import DeviceClock, time_steps


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def flops(self) -> int:
        """Forward and backward of causal attention: 7 B H T^2 D (module docstring)."""
        return 7 * self.batch * self.heads * self.seq ** 2 * self.head_dim


SHAPES = (Shape("1B, 8 x 2048", 8, 2048, 32, 8, 64),
          Shape("CS336 xl, 4 x 1024", 4, 1024, 25, 25, 64),
          Shape("7B, 1 x 4096", 1, 4096, 32, 32, 128))
SMOKE = (Shape("smoke", 2, 64, 4, 2, 16),)
CUDA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def attention_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                   backend: SDPBackend) -> tuple[torch.Tensor, ...]:
    """The output and the gradients of q, k and v for ``grad``, through ``backend`` only."""
    with sdpa_kernel([backend]):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    dq, dk, dv = torch.autograd.grad(y, (q, k, v), grad)
    return y, dq, dk, dv


def relative_difference(outputs: tuple[torch.Tensor, ...], reference: tuple[torch.Tensor, ...]) -> float:
    return max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(outputs, reference))


def measure(shape: Shape, backends: tuple[SDPBackend, ...], device: torch.device, repeats: int) -> list[str]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device).manual_seed(0)

    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(shape.batch, heads, shape.seq, shape.head_dim, device=device, dtype=dtype,
                           generator=generator).requires_grad_()

    q, k, v = tensor(shape.heads), tensor(shape.kv_heads), tensor(shape.kv_heads)
    grad = torch.randn(q.shape, device=device, dtype=dtype, generator=generator)
    clock = DeviceClock(device)
    reference = None
    lines = []
    for backend in backends:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outputs = attention_pass(q, k, v, grad, backend)
        except RuntimeError as error:
            lines.append(f"  {backend.name:20s} refused: {str(error).splitlines()[0][:100]}")
            continue
        reference = reference or outputs
        seconds, _ = time_steps(lambda: attention_pass(q, k, v, grad, backend), clock, warmup=3, repeats=repeats)
        median = statistics.median(seconds)
        lines.append(f"  {backend.name:20s} {median * 1e3:8.3f} ms  {shape.flops / median / 1e12:6.0f} TFLOP/s  "
                     f"rel. diff {relative_difference(outputs, reference):.1e}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a small shape on the CPU, the math backend")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    shapes, backends = (SMOKE, (SDPBackend.MATH,)) if device.type == "cpu" else (SHAPES, CUDA_BACKENDS)
    if device.type == "cuda":
        print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())
    for shape in shapes:
        print(f"{shape.name}: heads {shape.heads}, kv heads {shape.kv_heads}, head dim {shape.head_dim}, "
              f"{shape.flops / 1e12:.2f} TFLOP forward and backward")
        for line in measure(shape, backends, device, args.repeats):
            print(line)


if __name__ == "__main__":
    main()
