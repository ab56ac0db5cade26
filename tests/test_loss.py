"""The training loop's chunked loss: the value and gradients of the whole cross-entropy, and what it
holds (``fitbench.loss``), recomputed by hand."""

import pytest
import torch
import torch.nn.functional as F

from fitbench import loss as loss_rule
from fitbench.loss import loss_chain_bytes, loss_chunk_rows
from fitbench.run.loops import chunked_cross_entropy


def test_chunk_rows_bound_the_fp32_chunk():
    assert loss_chunk_rows(128_256) == 64 * 2**20 // (4 * 128_256) == 130
    assert loss_chunk_rows(4096) == 4096
    assert loss_chunk_rows(10**9) == 1  # a vocabulary larger than the bound still takes a row at a time


@pytest.mark.parametrize("chunk_bytes", [4 * 50 * 7, 4 * 50 * 64, 64 * 2**20])  # 7 rows, 64 rows, one chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_has_the_whole_losss_value_and_gradient(monkeypatch, chunk_bytes, dtype):
    monkeypatch.setattr(loss_rule, "LOSS_CHUNK_BYTES", chunk_bytes)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(60, 50, generator=generator).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (60,), generator=generator)
    chunked = chunked_cross_entropy(logits, targets)
    (chunked_grad,) = torch.autograd.grad(chunked, logits)
    whole = F.cross_entropy(logits.float(), targets)
    (whole_grad,) = torch.autograd.grad(whole, logits)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked_grad, whole_grad)


def test_loss_chain_bytes_by_hand():
    # one chunk (4096 rows of a 4096 vocabulary fit 64 MiB): the backward's two fp32 gradients and
    # the saved log-probabilities, 12 n V, outweigh the forward's 4 n V + 2 n V + 4 n V
    n, V = 1024, 4096
    assert loss_chain_bytes(n, V, 2) == 4 * n * V + 8 * n * V
    # many chunks of 130 rows: the forward's end, with the 16-bit logits, is the larger moment
    n, V = 8192, 128_256
    assert loss_chain_bytes(n, V, 2) == 4 * n * V + 2 * n * V + 4 * 130 * V
    assert loss_chain_bytes(100, V, 4) == 4 * 100 * V + max(4 * 100 * V + 4 * 100 * V, 8 * 100 * V)
