"""How fitbench's training loop forms its loss, as plain data every floor may read: the loop
(``fitbench.run.loops.chunked_cross_entropy``) and the memory model (``fitbench.plan.memory``)
both follow it.

The cross-entropy upcasts the logits to fp32 a chunk of rows at a time, as torchtune's
``CEWithChunkedOutputLoss`` does, with each chunk's fp32 log-probabilities at most
``LOSS_CHUNK_BYTES``. The whole loss over (n, V) logits would hold three n x V fp32 tensors at once
in its backward pass (the log-softmax output and the gradients into and out of it), each longer
than any hole the previous step's gradients left when they were set to None, so the caching
allocator places them above everything and its reserve outgrows what is allocated (measured: 9.4 GB
beyond the allocations for Llama-3.1-8B at 2 x 4096 tokens on an H200, 2026-11-23).
"""

from __future__ import annotations

LOSS_CHUNK_BYTES = 64 * 2**20


def loss_chunk_rows(vocab: int) -> int:
    """Rows of logits per chunk of the loss: ``max(1, LOSS_CHUNK_BYTES // (4 V))``."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab))


def loss_chain_bytes(tokens: int, vocab: int, compute_bytes: int) -> float:
    """Bytes the loss holds at its peak, beside every saved activation: ``4 n V + max(c n V + 4 r V,
    8 r V)`` for ``r = min(rows, n)`` rows in a chunk, the larger of two moments.

    - The forward pass ends with the ``c``-byte logits (``c n V``), every chunk's fp32
      log-probabilities, saved for the backward pass (``4 n V``), and the last chunk's fp32 upcast
      (``4 r V``).
    - The backward pass begins, the logits freed (nothing it needs holds them), with the first
      chunk's two fp32 gradients, into and out of its log-softmax (``8 r V``), beside the saved
      log-probabilities. Each chunk's share of those is freed as its gradients form, and the
      ``c``-byte gradients joined at the end take ``2 c n V``, no more than the forward's moment."""
    rows = min(loss_chunk_rows(vocab), tokens)
    return 4 * tokens * vocab + max(compute_bytes * tokens * vocab + 4 * rows * vocab, 8 * rows * vocab)
