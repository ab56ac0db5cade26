"""PyTorch's CUDA caching allocator with expandable segments, replayed over a sequence of allocations.

NVML's per-process peak counts the allocator's *reserved* memory, the pages it has mapped, not the
bytes of live tensors. The two part when a request finds no free range long enough: the segment
grows at its end although smaller free ranges add up to more than the request. This module replays
a step's allocations and frees, in order, through the same rules and reports both peaks.

The rules (``c10/cuda/CUDACachingAllocator.cpp``, PyTorch 2.4 to 2.11, with
``expandable_segments:True``, the setting fitbench's workers run with):

- a request is rounded up to a multiple of 512 bytes; requests of at most 1 MiB go to the small
  pool, larger ones to the large pool; each pool is one segment of virtual addresses that is mapped
  in pages of 2 MiB (small) or 20 MiB (large) as it grows, and never unmapped during a step;
- best fit: the smallest free block of the pool at least as long as the request (the lowest
  address among equals), split when what remains is longer than 1 MiB (large pool) or at least
  512 bytes (small pool);
- with no such block, the segment grows at its end: a free block that ends the mapped range is
  used together with newly mapped pages;
- a freed block merges with free neighbours.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20  # at most this goes to the small pool
SMALL_PAGE = 2 << 20
LARGE_PAGE = 20 << 20


def rounded(size: int) -> int:
    """The request size the allocator serves: ``max(512, 512 x ceil(size / 512))``."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


class Segment:
    """One pool's expandable segment: free ranges by (size, address) and by address, the mapped end."""

    def __init__(self, page: int, split_above: int) -> None:
        self.page = page
        self.split_above = split_above  # a split leaves a free block only longer than this
        self.mapped = 0
        self.by_size: list[tuple[int, int]] = []  # (size, start) of every free block
        self.free_at: dict[int, int] = {}  # start -> size
        self.free_ending: dict[int, int] = {}  # end -> start
        self.allocated: dict[int, int] = {}  # start -> size of the block handed out

    def _add_free(self, start: int, size: int) -> None:
        bisect.insort(self.by_size, (size, start))
        self.free_at[start] = size
        self.free_ending[start + size] = start

    def _remove_free(self, start: int) -> int:
        size = self.free_at.pop(start)
        del self.free_ending[start + size]
        self.by_size.pop(bisect.bisect_left(self.by_size, (size, start)))
        return size

    def allocate(self, size: int) -> int:
        """The start of the block given to a request of ``size`` (already rounded) bytes."""
        index = bisect.bisect_left(self.by_size, (size, -1))
        if index < len(self.by_size):
            start = self.by_size[index][1]
            block = self._remove_free(start)
        else:
            # grow: a free block at the mapped end joins the newly mapped pages
            start = self.free_ending.get(self.mapped, self.mapped)
            if start != self.mapped:
                self._remove_free(start)
            missing = size - (self.mapped - start)
            self.mapped += -(-missing // self.page) * self.page
            block = self.mapped - start
        if block - size > self.split_above:
            self._add_free(start + size, block - size)
        else:
            size = block
        self.allocated[start] = size
        return start

    def free(self, start: int) -> None:
        size = self.allocated.pop(start)
        end = start + size
        if end in self.free_at:
            size += self._remove_free(end)
        if start in self.free_ending:
            previous = self.free_ending[start]
            size += self._remove_free(previous)
            start = previous
        self._add_free(start, size)


@dataclass
class Allocator:
    """The caching allocator's two pools, with live and reserved bytes and their peaks.

    ``allocated`` counts the rounded requests, as ``torch.cuda.memory_allocated`` does; ``reserved``
    the mapped pages of both pools, as ``torch.cuda.memory_reserved`` does."""

    allocated: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0

    def __post_init__(self) -> None:
        self.small = Segment(SMALL_PAGE, split_above=MIN_BLOCK - 1)
        self.large = Segment(LARGE_PAGE, split_above=SMALL_REQUEST)
        self._blocks: dict[object, tuple[Segment, int, int]] = {}

    @property
    def reserved(self) -> int:
        return self.small.mapped + self.large.mapped

    def malloc(self, key: object, size: int) -> None:
        """Serve ``size`` bytes for the tensor storage named ``key``."""
        size = rounded(size)
        pool = self.small if size <= SMALL_REQUEST else self.large
        start = pool.allocate(size)
        self._blocks[key] = (pool, start, size)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, key: object) -> None:
        pool, start, size = self._blocks.pop(key)
        pool.free(start)
        self.allocated -= size
