"""The caching allocator's replay (``fitbench.worker.allocator``) on hand-made sequences, and on traced
training steps: a whole-logits loss makes the reserve outgrow the allocations."""

import dataclasses

import torch.nn.functional as F

from fitbench.models.registry import resolve
from fitbench.worker import trace
from fitbench.worker import loops
from fitbench.worker.allocator import LARGE_PAGE, SMALL_PAGE, Allocator, rounded
from fitbench.worker.cross_entropy import chunked_cross_entropy

MiB = 2**20


def test_requests_round_to_512_bytes():
    assert [rounded(s) for s in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]


def test_small_requests_take_2_mib_pages_and_large_ones_20_mib():
    allocator = Allocator()
    allocator.malloc("a", 1000)
    assert allocator.reserved == SMALL_PAGE and allocator.allocated == 1024
    allocator.malloc("b", 3 * MiB)
    assert allocator.reserved == SMALL_PAGE + LARGE_PAGE
    allocator.malloc("c", 30 * MiB)  # 17 MiB left at the end of the first page join a second one
    assert allocator.large.mapped == 2 * LARGE_PAGE
    assert allocator.peak_allocated == 1024 + 33 * MiB


def test_a_freed_block_is_reused_by_best_fit_and_merges_with_its_neighbours():
    allocator = Allocator()
    for key, size in (("a", 10), ("b", 4), ("c", 6), ("d", 40)):
        allocator.malloc(key, size * MiB)
    assert allocator.large.mapped == 3 * LARGE_PAGE  # 60 MiB
    allocator.free("a")
    allocator.free("c")
    allocator.malloc("e", 5 * MiB)  # best fit: c's 6 MiB hole, not a's 10 MiB
    assert allocator.large.allocated[14 * MiB] == 6 * MiB  # a remainder of 1 MiB is not split off
    allocator.free("b")  # merges with a's hole: 14 MiB free from address 0
    allocator.malloc("f", 14 * MiB)
    assert allocator.large.mapped == 3 * LARGE_PAGE and 0 in allocator.large.allocated


def test_a_request_no_hole_holds_grows_the_segment_though_the_holes_add_up_to_more():
    allocator = Allocator()
    for index in range(6):
        allocator.malloc(("hole", index), 20 * MiB)
        allocator.malloc(("kept", index), 20 * MiB)
    for index in range(6):
        allocator.free(("hole", index))
    allocator.malloc("big", 40 * MiB)  # 120 MiB free in six 20 MiB holes
    assert allocator.reserved == 240 * MiB + 40 * MiB
    assert allocator.reserved - allocator.allocated == 120 * MiB


def test_a_free_block_at_the_end_joins_the_growth():
    allocator = Allocator()
    allocator.malloc("a", 10 * MiB)  # a 10 MiB free tail in the first page
    allocator.malloc("b", 25 * MiB)  # the tail and 15 MiB more: one page added
    assert allocator.large.mapped == 2 * LARGE_PAGE
    assert allocator.large.allocated[10 * MiB] == 25 * MiB


def _traced(arch) -> trace.TracedPeak:
    return trace.trace_peak(arch, "train", "bf16-pure", 2, 1024, activation_checkpointing=True, device="cpu")


def test_the_fused_loss_maps_less_than_the_chunked_loss_holds(monkeypatch):
    """A vocabulary large beside the layers, checkpointed. The whole loss's three n x V fp32 tensors
    find no hole the previous step's gradients left and grow the reserve 22% beyond the allocations;
    the chunked loss's pieces fit. The fused loss holds none of them: the second step's logits find no
    hole of their length (AdamW's state, created in the first step, took the first step's logits'),
    and map pages of their own, 18% beyond its allocations, and yet less than the chunked loss holds."""
    arch = dataclasses.replace(resolve("tiny"), vocab_size=128_256, hidden_size=512, ffn_size=1536,
                               tie_embeddings=False)
    fused = _traced(arch)
    monkeypatch.setattr(loops, "cross_entropy", chunked_cross_entropy)
    chunked = _traced(arch)
    assert chunked.peak_reserved / chunked.peak_bytes - 1 < 0.06
    assert fused.peak_reserved < chunked.peak_bytes
    monkeypatch.setattr(loops, "cross_entropy", lambda logits, targets: F.cross_entropy(logits.float(), targets))
    whole = _traced(arch)
    assert whole.peak_reserved / whole.peak_bytes - 1 > 0.15
