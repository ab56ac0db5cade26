"""The eager training operators of ``fitbench.models.layer_ops`` against the tensor expressions they
replace: outputs and gradients (inputs and weights) from random output gradients, at odd sizes, in
fp32 and bf16, what each saves for the backward pass, and a whole model's logits and gradients against
the modules' plain expressions."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fitbench.models.native as native
from fitbench.models.layer_ops import eager_training, rms_norm, rotary, stacked_linear, swiglu
from fitbench.models.native import apply_rope, build_native
from fitbench.models.registry import resolve
from fitbench.planning.memory import estimate_memory
from fitbench.planning.terms import START
from fitbench.worker.trace import trace_peak

B, T, C, HEADS, KV_HEADS, D, FFN = 3, 7, 40, 5, 1, 6, 13
# bf16 keeps 8 bits of mantissa: two roundings apart, results differ by a few units of the last place
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(seed)).to(dtype)


def gradients(outputs, inputs, seed: int = 1) -> list[torch.Tensor]:
    """d(sum of outputs x random weights)/d inputs, the same random output gradients for any implementation."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [randn(*out.shape, dtype=out.dtype, seed=seed + i) for i, out in enumerate(outputs)]
    return list(torch.autograd.grad(outputs, inputs, grads))


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def saved_tensors(function) -> list[torch.Tensor]:
    """What autograd saves for the backward pass while ``function()`` runs."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return saved


def assert_close(ours, theirs, dtype) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **TOLERANCE[dtype])


# ---- RMSNorm ------------------------------------------------------------------------------------


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``fitbench.models.native.RMSNorm`` without autograd's Function."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.type_as(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_plain_expression(dtype):
    x, weight = leaves(randn(B, T, C, dtype=dtype), 1 + 0.1 * randn(C, dtype=dtype, seed=2))
    ours = rms_norm(x, weight, 1e-5)
    theirs = plain_rms_norm(x, weight, 1e-5)
    assert_close([ours, *gradients(ours, [x, weight])], [theirs, *gradients(theirs, [x, weight])], dtype)


def test_rms_norm_under_autocast_returns_the_compute_dtype_and_saves_its_input_and_inverse_rms():
    x, weight = leaves(randn(B, T, C), 1 + 0.1 * randn(C, seed=2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = saved_tensors(lambda: rms_norm(x, weight, 1e-5))
        ours = rms_norm(x, weight, 1e-5)
    assert ours.dtype == torch.bfloat16
    # x itself (no copy), the weight (a parameter) and 1/rms, one fp32 per token
    assert saved[0] is x and saved[1] is weight and saved[2].shape == (B, T, 1) and len(saved) == 3
    theirs = plain_rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(ours, theirs.to(torch.bfloat16), atol=0, rtol=0)
    assert_close(gradients(ours, [x, weight]), gradients(theirs.to(torch.bfloat16), [x, weight]), torch.float32)


def fused_operator(operator):
    """``operator`` where this torch has a CPU kernel for it, else its registered decomposition: the
    definition the CUDA kernel implements."""
    def call(*args):
        try:
            return operator(*args)
        except NotImplementedError:
            return torch._decomp.decomposition_table[operator](*args)
    return call


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_fused_rms_norm_operators_compute_what_the_composite_math_does(dtype):
    """The operators the CUDA path calls, with the arguments it gives them (1/rms as the forward
    returns it, the gradient in the input's dtype), on the CPU."""
    x, weight = randn(B, T, C, dtype=dtype), 1 + 0.1 * randn(C, dtype=dtype, seed=2)
    fused, inverse_rms = fused_operator(torch.ops.aten._fused_rms_norm.default)(x, [C], weight, 1e-5)
    upcast = x.float()
    expected_rms = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(inverse_rms, expected_rms)
    torch.testing.assert_close(fused, (upcast * expected_rms * weight.float()).to(dtype), atol=0, rtol=0)
    grad = randn(B, T, C, dtype=dtype, seed=3)
    grad_x, grad_w = fused_operator(torch.ops.aten._fused_rms_norm_backward.default)(
        grad, x, [C], inverse_rms, weight, [True, True])
    upcast_x, upcast_weight = leaves(x.float(), weight.float())
    expected = torch.autograd.grad(plain_rms_norm(upcast_x, upcast_weight, 1e-5), [upcast_x, upcast_weight],
                                   grad.float())
    assert_close([grad_x, grad_w], [g.to(dtype) for g in expected], dtype)


# ---- rotary positions ---------------------------------------------------------------------------


def tables(dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(T, dtype=torch.float32), 1e4 ** -(torch.arange(0, D, 2) / D))
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_of_the_fused_projection_matches_apply_rope(dtype):
    cos, sin = tables(dtype)
    heads = (HEADS, KV_HEADS, KV_HEADS)
    (qkv,) = leaves(randn(B, T, sum(heads) * D, dtype=dtype))

    def theirs():
        q, k, v = (part.view(B, T, -1, D).transpose(1, 2) for part in qkv.split((HEADS * D, KV_HEADS * D,
                                                                                  KV_HEADS * D), dim=-1))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    ours = rotary(qkv.view(B, T, sum(heads), D), cos, sin, heads, rotated=2)
    assert [t.shape for t in ours] == [(B, HEADS, T, D), (B, KV_HEADS, T, D), (B, KV_HEADS, T, D)]
    assert_close([*ours, *gradients(ours, [qkv])], [*theirs(), *gradients(theirs(), [qkv])], dtype)
    # nothing but the tables is saved: the backward pass rotates back with -sin
    assert all(t.shape == (T, D) for t in saved_tensors(lambda: rotary(qkv.view(B, T, sum(heads), D), cos, sin,
                                                                       heads, rotated=2)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_of_one_projection_matches_apply_rope(dtype):
    cos, sin = tables(dtype)
    (q,) = leaves(randn(B, T, HEADS * D, dtype=dtype))
    (ours,) = rotary(q.view(B, T, HEADS, D), cos, sin, (HEADS,), rotated=1)
    theirs = apply_rope(q.view(B, T, HEADS, D).transpose(1, 2), cos, sin)
    assert_close([ours, *gradients(ours, [q])], [theirs, *gradients(theirs, [q])], dtype)


def test_rotary_gradient_of_an_unused_output_is_zero():
    cos, sin = tables(torch.float32)
    (qkv,) = leaves(randn(B, T, (HEADS + 2 * KV_HEADS) * D))
    q, _, v = rotary(qkv.view(B, T, HEADS + 2 * KV_HEADS, D), cos, sin, (HEADS, KV_HEADS, KV_HEADS), rotated=2)
    (grad,) = torch.autograd.grad((q.sum(), v.sum()), [qkv])
    assert grad.view(B, T, -1, D)[:, :, HEADS:HEADS + KV_HEADS].abs().sum() == 0
    assert grad.view(B, T, -1, D)[:, :, HEADS + KV_HEADS:].eq(1).all()


# ---- SwiGLU -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_the_plain_expression(dtype):
    gate, up = leaves(randn(B, T, FFN, dtype=dtype), randn(B, T, FFN, dtype=dtype, seed=2))
    (stacked,) = leaves(torch.stack((gate, up)))
    theirs = F.silu(gate) * up
    expected = [theirs, *gradients(theirs, [gate, up])]
    ours = swiglu(gate, up)
    assert_close([ours, *gradients(ours, [gate, up])], expected, dtype)
    ours = swiglu(stacked)
    grad_gate, grad_up = gradients(ours, [stacked])[0]
    assert_close([ours, grad_gate, grad_up], expected, dtype)
    # the stacked input and nothing else: silu(gate) is recomputed in the backward pass
    assert [t.shape for t in saved_tensors(lambda: swiglu(stacked))] == [(2, B, T, FFN)]


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_stacked_linear_is_the_fused_projection_with_its_parts_one_after_the_other(dtype, autocast):
    x, weight = leaves(randn(B, T, C, dtype=dtype), 0.2 * randn(2 * FFN, C, dtype=dtype, seed=2))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ours = stacked_linear(x, weight, 2)
        theirs = torch.stack(F.linear(x, weight).chunk(2, dim=-1))
    assert ours.shape == (2, B, T, FFN) and ours.is_contiguous() and ours.dtype == theirs.dtype
    expected_dtype = torch.bfloat16 if autocast else dtype
    assert_close([ours, *gradients(ours, [x, weight])], [theirs, *gradients(theirs, [x, weight])], expected_dtype)


# ---- when the Functions run, and a whole model ----------------------------------------------------


def test_the_functions_serve_eager_training_only():
    x = torch.ones(2)
    assert eager_training(x)
    with torch.no_grad():
        assert not eager_training(x)
    with torch.inference_mode():
        assert not eager_training(x)


def forward_backward(model, tokens, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens)
    (randn(*logits.shape, dtype=logits.dtype, seed=7) * logits).float().sum().backward()
    return logits, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
def test_a_model_trains_as_with_the_plain_expressions(fused, precision, monkeypatch):
    """A tiny model's logits and every parameter's gradient, with the Functions and with the
    expressions the modules run outside eager training (the previous implementation)."""
    arch = resolve("tiny")
    torch.manual_seed(0)
    model = build_native(arch, "cpu", torch.bfloat16 if precision == "bf16-pure" else torch.float32, fused=fused)
    plain = copy.deepcopy(model)
    tokens = torch.randint(0, arch.vocab_size, (2, 19), generator=generator(3))
    ours = forward_backward(model, tokens, precision == "bf16")
    monkeypatch.setattr(native, "eager_training", lambda x: False)
    theirs = forward_backward(plain, tokens, precision == "bf16")
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    assert ours[1].keys() == theirs[1].keys()
    assert_close([ours[0]], [theirs[0]], dtype)
    for name in ours[1]:
        a, b = ours[1][name].float(), theirs[1][name].float()
        # bf16: relative to the gradient as a whole, elementwise ratios of tiny entries mean nothing
        limit = 1e-5 if dtype == torch.float32 else 3e-2
        assert (a - b).norm() <= limit * b.norm(), name


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fused_projections_save_what_separate_ones_save(precision):
    """The memory model has one per-layer figure for both builds (``fitbench.planning.activations.saved_per_layer``):
    traced, their forward-backward peaks, where every layer's saved tensors are alive, are the same
    (bf16: no cast per projection; fp32, whose grouped k and v are expanded: q apart from the buffer
    the fused rotation shares with k and v)."""
    arch = resolve("tiny")
    assert arch.num_kv_heads < arch.num_heads
    peaks = [trace_peak(arch, "forward-backward", precision, 4, 256, fused=fused).peak_bytes for fused in (False, True)]
    assert peaks[0] == peaks[1]
    estimate = estimate_memory(arch, "forward-backward", precision, 4, 256)
    assert estimate.peak_moment == START
    assert estimate.peak_bytes == pytest.approx(peaks[0], rel=1e-3)
