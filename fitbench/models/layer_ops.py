"""The decoder's elementwise training operators as autograd Functions: RMSNorm, rotary positions and
SwiGLU, each with its backward pass written out, so that it saves less and launches fewer kernels
than the same math in tensor operations, whose every operation is a kernel reading and writing its
operands in full and whose autograd saves what each operation needs.

Profiled on one H200 (torch 2.11, the 1B preset at 8 x 2048 under bf16 autocast), these operations
written in tensor operations took about 120 ms of a 295 ms step (the matmuls 131 ms): memory-bound
kernels, many on torch's slow path for strided and broadcast operands (the fused projections'
outputs are strided views, the rotary tables broadcast), the casts between them, and the
concatenations of the parts' gradients in the backward pass. With these Functions the step takes
245 ms, 1.24 times faster than transformers' (``benchmarks/results/2026-11-24-h200-eager-ops``).

- ``rms_norm``: x / sqrt(mean(x^2) + eps) x weight in fp32, returned in the autocast dtype where
  autocast is on (its consumers are matmuls, which would cast it), else in x's dtype; saves x and
  1/rms (the backward pass recomputes the normalized x). On CUDA one kernel each way, torch's fused
  RMSNorm (``aten::_fused_rms_norm`` and its backward, the kernels ``F.rms_norm`` runs there).
- ``rotary``: the rotation of q and k by position (Su et al. 2021, half-split layout) over the heads
  of one projection's output, q, k and v of the fused projection at once, into one buffer laid out
  (B, T, heads, D), whose per-head views are what attention takes; saves nothing but the tables:
  the rotation is orthogonal, so the backward pass is the same rotation with -sin. The q, k and v
  gradients are written into one tensor of the input's shape, the fused projection's gradient
  with no concatenation.
- ``swiglu``: silu(gate) x up of the fused gate/up projection (or of the two projections' outputs);
  saves its input, recomputes silu(gate) in the backward pass and writes the gradients of gate and up
  straight into one tensor of the input's shape. The fused projection runs as ``stacked_linear``,
  which lays gate and up out one after the other rather than side by side in each row, so that
  every elementwise kernel of SwiGLU reads and writes contiguous tensors, torch's vectorized path.

Each Function saves the same tensors on every device (the memory model counts them, and its tests
check it against CPU traces); only the kernels differ. They serve eager training
(``eager_training``): without autograd, and under ``torch.compile``, which fuses the tensor
operations itself, the modules keep the plain expressions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def eager_training(x: torch.Tensor) -> bool:
    """Whether a module runs its Function for ``x``: autograd records, the module is not being
    traced by ``torch.compile`` (inductor fuses the plain expressions, and what its graph saves is
    what ``fitbench.planning.compiled`` models), and ``x`` is a plain tensor, not a DTensor of tensor
    parallelism, whose sharding rules are written for the operations themselves."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and not hasattr(x, "to_local")


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul reading ``x`` computes in: autocast's where it is on, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


# ---- RMSNorm ------------------------------------------------------------------------------------


def _fused_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's fused RMSNorm kernels take one dtype for input and weight; they run on CUDA."""
    return x.is_cuda and weight.dtype == x.dtype


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x / rms(x) x weight, computed in fp32 (in x's dtype on CUDA, fp32 elsewhere), and 1/rms (fp32, (..., 1))."""
    if _fused_norm(x, weight):
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    upcast = x.float()
    inverse_rms = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
    return upcast * inverse_rms * weight.float(), inverse_rms


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, inverse_rms: torch.Tensor,
                      needs: tuple[bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of x and of the weight (those ``needs`` asks for), in fp32 arithmetic: with
    x^ = x / rms and g' = g x weight, dx = (g' - x^ mean(g' x^)) / rms and dweight = sum over tokens
    of g x^."""
    if _fused_norm(x, weight):
        return torch.ops.aten._fused_rms_norm_backward(grad.to(x.dtype), x, [x.shape[-1]], inverse_rms, weight,
                                                       list(needs))
    # One (..., C) fp32 temporary, which becomes dx, beside the upcasts of 16-bit operands, as the
    # fused kernel's output beside the gradient's upcast: g x^ first, then g' / rms - x (mean / rms^2).
    upcast, grad, scale = x.float(), grad.float(), weight.float()
    work = torch.mul(grad, upcast).mul_(inverse_rms)  # g x^
    grad_w = work.flatten(0, -2).sum(0).to(weight.dtype) if needs[1] else None
    if not needs[0]:
        return None, grad_w
    mean = (work @ scale).unsqueeze(-1) / x.shape[-1]  # mean(g' x^), (..., 1)
    grad_x = torch.mul(grad, scale, out=work).mul_(inverse_rms)
    grad_x.addcmul_(upcast, inverse_rms.square().mul_(mean), value=-1)
    return grad_x.to(x.dtype), grad_w


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            normalized, inverse_rms = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, inverse_rms)
        return normalized.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, inverse_rms = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            grad_x, grad_w = rms_norm_backward(grad, x, weight, inverse_rms, ctx.needs_input_grad[:2])
        return grad_x, grad_w, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., C) by ``weight`` (C,), in ``output_dtype(x)``; saves x and 1/rms."""
    return _RMSNorm.apply(x, weight, eps, output_dtype(x))


# ---- rotary positions ---------------------------------------------------------------------------


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, inverse: bool = False) -> None:
    """out = x cos + rotate_half(x) sin (``inverse``: with -sin) for x (B, T, heads, D), tables (T, D)
    in x's dtype, half-split: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin over the halves of D.
    Three kernels, each product accumulated in fp32 before its one rounding."""
    half = x.shape[-1] // 2
    sign = -1 if inverse else 1
    cos, sin = cos[:, None, :], sin[:, None, :half]  # (T, 1, D), (T, 1, D/2): over batch and heads
    torch.mul(x, cos, out=out)
    out[..., :half].addcmul_(x[..., half:], sin, value=-sign)
    out[..., half:].addcmul_(x[..., :half], sin, value=sign)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, splits: tuple[int, ...],
                rotated: int) -> tuple[torch.Tensor, ...]:
        heads = sum(splits[:rotated])
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # (B, T, heads, D)
        rotate(x[:, :, :heads], cos, sin, out[:, :, :heads])
        if heads < x.shape[2]:
            out[:, :, heads:].copy_(x[:, :, heads:])
        ctx.save_for_backward(cos, sin)
        ctx.splits, ctx.rotated = splits, rotated
        return tuple(part.transpose(1, 2) for part in out.split(splits, dim=2))  # (B, heads, T, D) each

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        cos, sin = ctx.saved_tensors
        first = next(g for g in grads if g is not None)
        B, _, T, D = first.shape
        grad_x = torch.empty((B, T, sum(ctx.splits), D), dtype=first.dtype, device=first.device)
        for index, (grad, part) in enumerate(zip(grads, grad_x.split(ctx.splits, dim=2))):
            if grad is None:
                part.zero_()
            elif index < ctx.rotated:
                rotate(grad.transpose(1, 2), cos, sin, part, inverse=True)
            else:
                part.copy_(grad.transpose(1, 2))
        return grad_x, None, None, None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, splits: tuple[int, ...],
           rotated: int) -> tuple[torch.Tensor, ...]:
    """x (B, T, heads, D): one projection's output by heads, in ``splits`` groups of heads (q, k, v
    of the fused projection: (H, KV, KV)), of which the first ``rotated`` are rotated by position
    (``rotate``) and the rest copied, each returned as (B, heads, T, D), views of one new (B, T,
    heads, D) buffer. The tables (T, D) are cast to x's dtype where they are not in it already (the
    model casts them once per forward pass, a pipeline stage's layers each time). Saves the tables only."""
    return _Rotary.apply(x, cos.to(x.dtype), sin.to(x.dtype), tuple(splits), rotated)


# ---- SwiGLU -------------------------------------------------------------------------------------


class _StackedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, parts: int, dtype: torch.dtype) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            inputs = x.reshape(-1, x.shape[-1]).to(dtype)  # (n, C): autocast's cast, or x itself
            weights = weight.to(dtype).view(parts, -1, x.shape[-1])  # (parts, F, C)
            # one batched matmul, the input broadcast over the parts (stride 0: no copy)
            out = torch.bmm(inputs.expand(parts, *inputs.shape), weights.transpose(1, 2))  # (parts, n, F)
        ctx.save_for_backward(inputs, weights)
        ctx.input_shape, ctx.input_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        return out.view(parts, *x.shape[:-1], weights.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs, weights = ctx.saved_tensors
        parts = weights.shape[0]
        grad = grad.reshape(parts, inputs.shape[0], weights.shape[1])  # (parts, n, F)
        grad_x = grad_w = None
        with torch.autocast(grad.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = torch.mm(grad[0], weights[0])
                for part in range(1, parts):
                    grad_x.addmm_(grad[part], weights[part])
                grad_x = grad_x.view(ctx.input_shape).to(ctx.input_dtype)
            if ctx.needs_input_grad[1]:
                grad_w = torch.bmm(grad.transpose(1, 2), inputs.expand(parts, *inputs.shape))  # (parts, F, C)
                grad_w = grad_w.flatten(0, 1).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None


def stacked_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x (..., C) by ``weight`` (parts x F, C), the weights of ``parts`` projections of x stacked by rows
    (``fitbench.models.native.FusedLinear``, no bias), as (parts, ..., F): each part's output
    contiguous, where ``F.linear`` interleaves them in each row (..., parts x F) and every elementwise
    kernel reading one part then takes torch's slow path for strided operands (measured on one H200:
    silu and the products of SwiGLU 2.3 times slower on the halves of (n, 2 F) than on contiguous
    tensors). The output and the weight's gradient are one batched matmul each, over the parts; the
    input's gradient is the parts' sum, one matmul per part accumulating into it. In
    ``output_dtype(x)``, saving what ``F.linear`` saves: x in that dtype and the weight cast to it
    (autocast's copy)."""
    return _StackedLinear.apply(x, weight, parts, output_dtype(x))


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) x up, a new contiguous tensor: two kernels."""
    return F.silu(gate).mul_(up)


def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, grad_gate: torch.Tensor,
                    grad_up: torch.Tensor) -> None:
    """Writes d up = grad x silu(gate) and d gate = grad x up x silu'(gate) into ``grad_up`` and
    ``grad_gate``: four kernels, silu(gate) recomputed into ``grad_up`` and grad x up formed in
    ``grad_gate``, so no temporary."""
    torch.ops.aten.silu.out(gate, out=grad_up)
    grad_up.mul_(grad)
    torch.mul(grad, up, out=grad_gate)
    torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return swiglu_forward(gate_up[0], gate_up[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        grad_gate_up = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
        swiglu_backward(grad, gate_up[0], gate_up[1], grad_gate_up[0], grad_gate_up[1])
        return grad_gate_up


class _SwiGLUParts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        grad_gate = torch.empty_like(gate, memory_format=torch.contiguous_format)
        grad_up = torch.empty_like(up, memory_format=torch.contiguous_format)
        swiglu_backward(grad, gate, up, grad_gate, grad_up)
        return grad_gate, grad_up


def swiglu(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) x up, of gate and up stacked (2, ..., F) as ``stacked_linear`` gives them, or of
    ``gate_up`` the gate and ``up`` the up projection's output; saves its inputs (2 F per token)."""
    if up is None:
        return _SwiGLU.apply(gate_up)
    return _SwiGLUParts.apply(gate_up, up)
