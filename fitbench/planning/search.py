"""One search for the largest batch, whether its test is the planner's prediction or a real run.

``largest`` finds the largest n >= 1 for which ``fits(n)`` holds, for a predicate that holds for
every n below one where it holds (memory grows with the batch). From a first guess ``start`` it
tries ``start`` and ``start + 1``: a guess that fits but whose successor does not is the answer in
two tests; one that fits with room to spare doubles (2 (start + 1), 4 (start + 1), ...) until a test
fails or ``limit`` is passed; one that does not fit bisects below it. Then it bisects the gap
between the last n that fit and the first that did not: at most about 2 log2(answer) + 2 tests,
which matters when each is a run of its own (``fitbench.launch.fallback.search_max_batch``).
"""

from __future__ import annotations

from typing import Callable


def largest(fits: Callable[[int], bool], *, start: int = 1, limit: int | None = None) -> int:
    """The largest n in 1 .. ``limit`` (unbounded when None) with ``fits(n)``; 0 when ``fits(1)`` is
    false. ``start``: the first guess (clamped into that range)."""
    start = max(1, start if limit is None else min(start, limit))
    if not fits(start):
        low, high = 0, start
    elif limit is not None and start >= limit:
        return start
    elif not fits(start + 1):
        return start
    else:
        low, high = start + 1, 2 * (start + 1)
        while (limit is None or high <= limit) and fits(high):
            low, high = high, 2 * high
        if limit is not None:
            high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
