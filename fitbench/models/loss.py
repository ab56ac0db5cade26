"""How fitbench's training loop forms its loss, as plain data every floor may read: the loss
(``fitbench.worker.cross_entropy``) and the memory model (``fitbench.planning.memory``) both follow it.

The loss works on the logits ``LOSS_CHUNK_BYTES`` of fp32 at a time: ``loss_chunk_rows(V)`` rows,
upcast, as torchtune's ``CEWithChunkedOutputLoss`` chunks them. The whole loss over (n, V) logits
in fp32 would hold three n x V fp32 tensors at once in its backward pass (the log-softmax output
and the gradients into and out of it), each longer than any hole the previous step's gradients left
when they were set to None, so the caching allocator places them above everything and its reserve
outgrows what is allocated (measured: 9.4 GB beyond the allocations for Llama-3.1-8B at 2 x 4096
tokens on an H200, 2026-11-23). Chunked out of place (``chunked_cross_entropy``) it still keeps
every chunk's fp32 log-probabilities, 4 n V bytes; fused (``FusedCrossEntropy``, what training
runs) it keeps nothing in fp32: each chunk's gradient is formed in the forward pass and written
over the chunk's logits.
"""

from __future__ import annotations

LOSS_CHUNK_BYTES = 64 * 2**20

# fp16's largest power of two below its largest value (65504): (softmax - one-hot) times it stays finite.
FP16_GRADIENT_SCALE = 2.0**15


def loss_chunk_rows(vocab: int) -> int:
    """Rows of logits per chunk of the loss: ``max(1, LOSS_CHUNK_BYTES // (4 V))``."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab))


def loss_chain_bytes(tokens: int, vocab: int, compute_bytes: int) -> float:
    """Bytes the fused loss holds at its peak, beside every saved activation: ``c n V + 4 r V`` for
    ``r = min(rows, n)`` rows in a chunk.

    The ``c``-byte logits (``c n V``) exist when the loss begins, and the loss writes each chunk's
    gradient over them, so they are held into the backward pass until the output projection's
    backward has read them; nothing else of theirs is kept. A chunk's one large fp32 temporary is the
    exponential of its logits less each row's largest (``4 r V``), formed by the shifted upcast and
    worked on in place to the end; the rest are a few numbers per row. Before
    (out of place, ``chunked_cross_entropy``) the forward pass also kept every chunk's fp32
    log-probabilities for the backward pass, ``4 n V`` more, and the backward pass formed two fp32
    gradients per chunk: ``4 n V + max(c n V + 4 r V, 8 r V)``."""
    rows = min(loss_chunk_rows(vocab), tokens)
    return compute_bytes * tokens * vocab + 4 * rows * vocab
