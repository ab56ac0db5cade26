"""``fitbench.planning.search.largest`` against a scan, from every first guess, with and without a limit."""

import math

import pytest

from fitbench.planning.search import largest


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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_largest_batch_of_a_job_of_ranks_is_planned_per_rank_under_its_strategy(strategy, monkeypatch):
    from fitbench.launch.job import predicted_max_batch
    from fitbench.models.registry import resolve
    from fitbench.planning.memory import estimate_memory
    from fitbench.planning.sharding import Parallelism
    from fitbench.spec import Layout, RunSpec

    fields = dict(model="small", backend="native", mode="train", precision="fp32", batch_size=1, seq_len=128,
                  new_tokens=4, warmup_steps=1, measure_steps=2, device="cpu", auto_batch=True)
    single, ranks = RunSpec(**fields), RunSpec(**fields, layout=Layout.of_strategy(strategy, 2))

    def peak(batch: int, parallelism: Parallelism) -> float:
        """What must fit: the largest moment's tensors, streams' cached pools aside (a CPU has none, and a
        GPU's allocator releases them before it fails: ``fitbench.planning.planner.assess``)."""
        memory = estimate_memory(resolve("small"), "train", "fp32", batch, 128, new_tokens=4, parallelism=parallelism)
        return max(memory.total_at(moment, cached=False) for moment in memory.moments)

    # a limit between FSDP's per-rank peak at batch 4 and one process's at batch 1
    limit = int(peak(4, Parallelism("fsdp", 2)) + 1)
    monkeypatch.setenv("FITBENCH_INJECT", f"mem-limit:{limit}")
    by_hand = max((b for b in range(1, 64) if peak(b, Parallelism(strategy, 2)) <= limit), default=0)
    assert predicted_max_batch(ranks, "cpu") == by_hand
    assert predicted_max_batch(single, "cpu") == max((b for b in range(1, 64) if peak(b, Parallelism()) <= limit),
                                                     default=0)
    if strategy == "fsdp":
        assert by_hand >= 4 > predicted_max_batch(single, "cpu")
