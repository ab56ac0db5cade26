"""The training loss: mean cross-entropy of (n, V) logits in the compute dtype against (n,) targets,
with fp32 arithmetic, never an fp32 copy of the whole logits (``fitbench.models.loss`` says what each way
holds, for the memory model).

``cross_entropy`` is what the loops call. Where it may, it takes the fused loss
(``FusedCrossEntropy``): a chunk of ``loss_chunk_rows(V)`` rows at a time, the forward pass forms
the fp32 log-sum-exp, the loss and the gradient with respect to the logits, and writes the gradient
over that chunk of the logits, in their dtype. Nothing else needs the logits once the loss is
known: the output projection's backward pass reads its input and its weight, not its output. The
backward pass scales the stored gradient by the incoming one, in place, and hands it on. The loss
then costs one chunk's fp32 temporaries beyond the logits, which exist anyway, and one pass over
the logits per chunk of a handful of kernels: the row maximum, the shifted upcast, its exponential
in place, a row sum, and the product (less the one-hot) written back over the chunk.

Writing over the logits is safe when nothing else reads them later, which the loops guarantee (the
logits die with the frame that forms the loss; a pipeline's last stage keeps its output only for a
backward pass that starts from the loss), and when no node of the autograd graph saved them for
its own backward pass, which ``_saved_on_the_way`` checks. Elsewhere ``chunked_cross_entropy``
forms the same loss out of place: DTensor logits, logits that are a leaf (the caller's own tensor),
logits whose producing operator kept them (an exponential, a tanh soft-cap without the final scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fitbench.models.loss import FP16_GRADIENT_SCALE, loss_chunk_rows


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (n, V) against ``targets`` (n,): the value of
    ``F.cross_entropy(logits.float(), targets)``. Logits that require a gradient it may overwrite
    with it: the caller must not read them afterwards, nor have given them to another
    differentiable operator before."""
    gradient = torch.is_grad_enabled() and logits.requires_grad
    if gradient and not _writable(logits):
        return chunked_cross_entropy(logits, targets)
    return FusedCrossEntropy.apply(logits, targets, gradient)


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same loss out of place: ``F.cross_entropy`` on each chunk of ``loss_chunk_rows(V)`` rows
    upcast to fp32, summed. The whole upcast copy never exists, but autograd saves every chunk's
    fp32 log-probabilities, 4 n V bytes, and the backward pass forms each chunk's two fp32 gradients
    one chunk at a time. Any tensor type autograd and ``F.cross_entropy`` take will do (DTensor)."""
    rows = loss_chunk_rows(logits.shape[-1])
    total = sum(F.cross_entropy(chunk.float(), target, reduction="sum")
                for chunk, target in zip(logits.split(rows), targets.split(rows)))
    return total / targets.numel()


class FusedCrossEntropy(torch.autograd.Function):
    """The loss and, with ``gradient``, its gradient with respect to the logits, written over them in
    the forward pass (module docstring). The stored gradient is ``(softmax - one_hot) m`` for
    ``m = 1 / n``, the mean's factor, except in fp16: there probabilities near ``1 / V``, divided by
    ``n``, fall below fp16's smallest normal (``2^-14``) and lose their bits before the GradScaler's
    factor could lift them, so fp16 stores ``m = FP16_GRADIENT_SCALE`` and the backward pass divides
    by ``n m`` as it applies the incoming gradient."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, gradient: bool) -> torch.Tensor:
        n, fp16 = targets.numel(), logits.dtype == torch.float16
        scale = FP16_GRADIENT_SCALE if fp16 else 1 / n
        ctx.unscale = 1 / (n * scale) if fp16 else None  # what the backward pass applies beyond its input
        # An alias outside autograd: the logits may be a view a custom Function returned (a DTensor's
        # local tensor), which autograd forbids writing through where it tracks them. The alias
        # shares their version counter, so autograd's checks still see the writes.
        logits = logits.detach()
        rows = loss_chunk_rows(logits.shape[-1])
        total = sum(_chunk_loss(chunk, target, scale if gradient else None)
                    for chunk, target in zip(logits.split(rows), targets.split(rows)))
        if gradient:
            ctx.save_for_backward(logits)
        return total / n

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # saved as it was written: a second backward pass (retain_graph) would fail autograd's
        # version check on it rather than scale it twice
        (gradient,) = ctx.saved_tensors
        return gradient.mul_(grad_output if ctx.unscale is None else grad_output * ctx.unscale), None, None


def _chunk_loss(chunk: torch.Tensor, target: torch.Tensor, scale: float | None) -> torch.Tensor:
    """The summed fp32 loss of one chunk of logits (r, V) against ``target`` (r,); with ``scale``, the
    chunk overwritten by ``(softmax - one_hot) x scale``. Its fp32 temporary dies with this frame,
    before the next chunk's is formed."""
    target = target.unsqueeze(1)  # (r, 1)
    picked = chunk.gather(1, target).float()  # (r, 1), read before the chunk is overwritten
    peak = chunk.amax(dim=1, keepdim=True).float()  # (r, 1)
    exp = torch.sub(chunk, peak).exp_()  # (r, V) fp32: the upcast and the shift in one kernel
    sums = exp.sum(dim=1, keepdim=True)  # (r, 1)
    if scale is not None:
        # exp - sums at the targets, times scale / sums: (softmax - one_hot) x scale, cast back
        exp.scatter_add_(1, target, -sums)
        torch.mul(exp, scale / sums, out=chunk)
    return (peak + sums.log() - picked).sum()


def _writable(logits: torch.Tensor) -> bool:
    """Whether the fused loss may write over ``logits``: a plain tensor (not a DTensor) formed by
    autograd (not a leaf the caller owns) that no node on its way back saved (``_saved_on_the_way``)."""
    return not hasattr(logits, "to_local") and logits.grad_fn is not None and not _saved_on_the_way(logits)


def _saved_on_the_way(logits: torch.Tensor) -> bool:
    """Whether a node that formed ``logits`` saved a tensor of their storage for its backward pass, as
    a tanh or an exponential keeps its output; writing over it would fail that node's version check.
    The nodes are followed through their first input from ``logits.grad_fn``: views, which save
    none, then the first node that saved any tensor, the operator that computed the logits (a
    matmul saves its input and weight), where the search ends. A node reading the logits beside
    this loss is not on that way; avoiding one is the caller's part (``cross_entropy``)."""
    storage = logits.untyped_storage()
    node = logits.grad_fn
    while node is not None:
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            saved = list(node.saved_tensors)
        else:
            values = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
            saved = [t for v in values for t in (v if isinstance(v, (list, tuple)) else [v])
                     if isinstance(t, torch.Tensor)]
        if any(_storage(t) is storage for t in saved):
            return True
        if saved or not node.next_functions:
            return False
        node = node.next_functions[0][0]
    return False


def _storage(tensor: torch.Tensor):
    """The storage of ``tensor``, of its local shard for a DTensor (which has none of its own)."""
    with torch.no_grad():
        return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).untyped_storage()
