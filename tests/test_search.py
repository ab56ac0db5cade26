"""``fitbench.search.largest`` against a scan, from every first guess, with and without a limit."""

import math

import pytest

from fitbench.search import largest


@pytest.mark.parametrize("limit", [None, 1, 7, 64])
def test_largest_equals_a_scan_from_any_first_guess(limit):
    for answer in range(0, 70):
        for start in (1, 2, 3, 5, 17, 40, 100):
            tests = []

            def fits(n):
                tests.append(n)
                return n <= answer

            expected = answer if limit is None else min(answer, limit)
            assert largest(fits, start=start, limit=limit) == expected, (answer, start, limit)
            assert all(n >= 1 and (limit is None or n <= limit) for n in tests)
            # a guess, its successor, doubling and bisection: about 2 log2 of the larger of the two, plus 3
            assert len(tests) <= 2 * math.log2(max(answer, start) + 2) + 3, (answer, start, tests)


def test_a_guess_that_is_the_answer_takes_two_tests():
    tests = []
    assert largest(lambda n: tests.append(n) or n <= 12, start=12) == 12
    assert tests == [12, 13]
