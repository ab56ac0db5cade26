"""The training loss (``fitbench.worker.cross_entropy``): the fused loss's value and gradients against
the whole fp32 cross-entropy, where it writes over the logits and where it must not, a model's
gradients through it against the out-of-place loss's, and what it holds (``fitbench.models.loss``), traced
and recomputed by hand."""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from fitbench.models import loss as loss_rule
from fitbench.models.backends import load_model
from fitbench.models.loss import loss_chain_bytes, loss_chunk_rows
from fitbench.models.registry import resolve
from fitbench.precisions import policy
from fitbench.worker.cross_entropy import chunked_cross_entropy, cross_entropy
from fitbench.worker.loops import make_step, random_tokens
from fitbench.worker.trace import LiveStorage


def random_logits(dtype: torch.dtype, n: int = 60, vocab: int = 50, spread: float = 3.0):
    generator = torch.Generator().manual_seed(0)
    logits = (spread * torch.randn(n, vocab, generator=generator)).to(dtype).requires_grad_()
    return logits, torch.randint(0, vocab, (n,), generator=generator)


def reference(logits: torch.Tensor, targets: torch.Tensor, grad_output: float):
    """The whole loss in fp32, and its gradient with respect to ``logits`` for the loss scaled by
    ``grad_output`` (as the GradScaler scales it), through autograd."""
    whole = F.cross_entropy(logits.float(), targets)
    (grad,) = torch.autograd.grad(whole * grad_output, logits)
    return whole, grad


def test_chunk_rows_bound_the_fp32_chunk():
    assert loss_chunk_rows(128_256) == 64 * 2**20 // (4 * 128_256) == 130
    assert loss_chunk_rows(4096) == 4096
    assert loss_chunk_rows(10**9) == 1  # a vocabulary larger than the bound still takes a row at a time


@pytest.mark.parametrize("chunk_bytes", [4 * 50 * 7, 4 * 50 * 64])  # 7 rows (60 is no multiple), one chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_output", [1.0, 3.0, 2.0**16])  # unscaled, scaled, the GradScaler's first factor
def test_fused_loss_has_the_whole_losss_value_and_gradient(monkeypatch, chunk_bytes, dtype, grad_output):
    monkeypatch.setattr(loss_rule, "LOSS_CHUNK_BYTES", chunk_bytes)
    leaf, targets = random_logits(dtype)
    whole, whole_grad = reference(leaf, targets, grad_output)
    logits = leaf * 1  # formed by autograd, as a model's logits are: the fused loss may write over them
    loss = cross_entropy(logits, targets)
    assert not torch.equal(logits, leaf)  # the fused loss ran, and wrote its gradient there
    (grad,) = torch.autograd.grad(loss * grad_output, leaf)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, whole_grad)


def test_fp16_keeps_small_probabilities_for_the_scaler():
    """(softmax - one-hot) / n for probabilities far below 1 / V lies under fp16's smallest normal; the
    GradScaler's factor lifts it back into range only if it was kept, which FP16_GRADIENT_SCALE does."""
    leaf, targets = random_logits(torch.float16, n=4096, spread=4.0)
    _, whole_grad = reference(leaf, targets, 2.0**16)
    (grad,) = torch.autograd.grad(cross_entropy(leaf * 1, targets) * 2.0**16, leaf)
    tiny = (whole_grad != 0) & (whole_grad.abs() < 2**-14 * 2**16 / 4096)  # below the normal range, unscaled
    assert tiny.sum() > 1000
    torch.testing.assert_close(grad, whole_grad)
    assert (grad[tiny] != 0).all()


@pytest.mark.parametrize("chunk_bytes", [4 * 50 * 7, 4 * 50 * 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_has_the_whole_losss_value_and_gradient(monkeypatch, chunk_bytes, dtype):
    monkeypatch.setattr(loss_rule, "LOSS_CHUNK_BYTES", chunk_bytes)
    leaf, targets = random_logits(dtype)
    whole, whole_grad = reference(leaf, targets, 1.0)
    chunked = chunked_cross_entropy(leaf, targets)
    (grad,) = torch.autograd.grad(chunked, leaf)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, whole_grad)


def test_without_a_gradient_the_logits_are_left_as_they_are():
    leaf, targets = random_logits(torch.bfloat16)
    whole, _ = reference(leaf, targets, 1.0)
    logits = leaf * 1
    kept = logits.detach().clone()
    with torch.no_grad():
        torch.testing.assert_close(cross_entropy(logits, targets), whole, rtol=1e-6, atol=1e-6)
    plain = kept.clone()
    torch.testing.assert_close(cross_entropy(plain, targets), whole, rtol=1e-6, atol=1e-6)
    assert torch.equal(logits, kept) and torch.equal(plain, kept)


@pytest.mark.parametrize("form", ["leaf", "exp", "tanh"])
def test_logits_it_must_not_overwrite_take_the_out_of_place_loss(form):
    """A leaf is the caller's own tensor; exp and tanh save their output for their backward pass, whose
    version check would fail on the overwritten logits: each gets the out-of-place loss, correctly."""
    leaf, targets = random_logits(torch.float32)
    formed = {"leaf": lambda x: x, "exp": lambda x: (x / 4).exp(), "tanh": lambda x: x.tanh()}[form]
    logits = formed(leaf)
    before = logits.detach().clone()
    loss = cross_entropy(logits, targets)
    assert torch.equal(logits, before)
    (grad,) = torch.autograd.grad(loss, leaf)
    whole = F.cross_entropy(formed(leaf).float(), targets)
    (whole_grad,) = torch.autograd.grad(whole, leaf)
    torch.testing.assert_close(loss, whole)
    torch.testing.assert_close(grad, whole_grad)


class Alias(torch.autograd.Function):
    """Returns its input as a view, as DTensor's ``to_local`` returns the logits under tensor parallelism."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_logits_a_custom_function_returned_as_a_view_are_written_over_too():
    leaf, targets = random_logits(torch.bfloat16)
    whole, whole_grad = reference(leaf, targets, 1.0)
    logits = Alias.apply(leaf * 1)
    loss = cross_entropy(logits, targets)
    assert type(loss.grad_fn).__name__ == "FusedCrossEntropyBackward"
    (grad,) = torch.autograd.grad(loss, leaf)
    torch.testing.assert_close(grad, whole_grad)


def test_a_second_backward_pass_fails_instead_of_scaling_twice():
    leaf, targets = random_logits(torch.float32)
    loss = cross_entropy(leaf * 1, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_models_gradients_equal_the_out_of_place_losss(precision):
    """One forward-backward step of the tiny preset through the loop's loss (fused) and through the
    out-of-place loss: the same loss, the same gradient for every parameter (in fp16 both scaled by
    the GradScaler's first factor, 2^16)."""
    arch, device = resolve("tiny"), torch.device("cpu")
    torch.manual_seed(0)
    lm = load_model(arch, "native", device, torch.float32)
    rule = policy(precision)
    tokens = random_tokens(arch.vocab_size, 2, 33, device, seed=1)
    fused_loss = make_step("forward-backward", lm, rule, tokens, device)()
    fused = {name: p.grad.clone() for name, p in lm.module.named_parameters()}
    lm.module.zero_grad(set_to_none=True)
    with rule.autocast(device.type):
        loss = chunked_cross_entropy(lm.logits(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    (loss * (2.0**16 if rule.scale_loss else 1.0)).backward()
    torch.testing.assert_close(fused_loss, loss.detach())
    for name, parameter in lm.module.named_parameters():
        if precision == "fp32":
            torch.testing.assert_close(fused[name], parameter.grad, msg=name)
        else:
            # the logits' 16-bit gradients differ by a rounding here and there (formed from the
            # exponentials, or from the log-probabilities), and the 16-bit backward pass sums them
            error = (fused[name] - parameter.grad).norm() / parameter.grad.norm()
            assert error < 1e-2, name


def test_the_step_keeps_nothing_of_the_overwritten_logits():
    """The logits, which hold the gradient once the loss is formed, are referenced by nothing the step
    returns: once the step is done they are gone, and its loss is a fresh scalar without a graph."""
    arch, device = resolve("tiny"), torch.device("cpu")
    lm = load_model(arch, "native", device, torch.float32)
    seen = []
    module_logits = lm.logits

    def logits(tokens):
        out = module_logits(tokens)
        seen.append(weakref.ref(out))
        return out

    lm.logits = logits
    step = make_step("train", lm, policy("fp32"), random_tokens(arch.vocab_size, 2, 17, device, seed=1), device)
    loss = step()
    assert len(seen) == 1 and seen[0]() is None
    assert loss.grad_fn is None and loss.numel() == 1


@pytest.mark.parametrize("loss", [cross_entropy, chunked_cross_entropy])
def test_traced_peak_of_the_loss_is_the_loss_chain(monkeypatch, loss):
    """Fake (n, V) bf16 logits of a matmul, several chunks: beside the matmul's operands the fused loss
    holds the logits and one chunk's fp32 exponentials at most (``loss_chain_bytes``), the out-of-place
    one also every chunk's fp32 log-probabilities (4 n V more)."""
    n, V, h = 2000, 50_000, 8
    rows = loss_chunk_rows(V)
    assert n % rows and n // rows > 3
    with FakeTensorMode():
        x = torch.empty(n, h, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(V, h, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.zeros(n, dtype=torch.long)
        tracker = LiveStorage()
        for tensor in (x, weight, targets):
            tracker.adopt(tensor)
        with tracker:
            loss(x @ weight.t(), targets).backward()
    operands = 2 * (n * h + V * h) + 8 * n  # the matmul's operands, their gradients, the targets
    beyond = tracker.peak - operands
    chain = loss_chain_bytes(n, V, 2)
    if loss is cross_entropy:
        assert chain <= beyond < chain + 64 * rows  # a few fp32 numbers per row besides
    else:
        assert beyond > 2 * n * V + 4 * n * V


def test_loss_chain_bytes_by_hand():
    # one chunk: 1024 rows of a 4096 vocabulary fit 64 MiB; the 16-bit logits and the chunk's exponentials
    n, V = 1024, 4096
    assert loss_chain_bytes(n, V, 2) == 2 * n * V + 4 * n * V
    # many chunks of 130 rows: the logits and one chunk
    n, V = 8192, 128_256
    assert loss_chain_bytes(n, V, 2) == 2 * n * V + 4 * 130 * V
    assert loss_chain_bytes(100, V, 4) == 4 * 100 * V + 4 * 100 * V
