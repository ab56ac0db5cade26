"""Out-of-memory fallback and ``--batch-size auto``: the ladder's rules, the batch searches, the YAML
spelling, and whole sweeps whose workers run out of memory through ``FITBENCH_INJECT``.

The end-to-end sweeps are real ``python -m fitbench run`` processes with real worker processes; they
start together (``sweeps``) so that they share the cores, and each test reads its own results.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import yaml

from fitbench.config import SweepConfig, fallback_ladder, load_yaml, merge_sources
from fitbench.launch.fallback import FallbackPolicy, Rung, next_attempt, next_rung, search_max_batch
from fitbench.planning.search import largest
from fitbench.launch.job import predicted_max_batch
from fitbench.launch.orders import assign
from fitbench.models.registry import resolve
from fitbench.planning.memory import estimate_memory
from fitbench.results.store import ResultStore
from fitbench.spec import RunSpec
from conftest import cli

TINY = ["--models", "tiny", "--device", "cpu", "--seq-len", "16", "--new-tokens", "4", "--warmup-steps", "1",
        "--measure-steps", "1"]
def shapes_for(args: list[str]) -> list[str]:
    """TINY's shapes for a sweep of ``args``: --new-tokens only where a mode generates (elsewhere it is refused)."""
    shapes = TINY[2:]
    if "--mode" in args and "infer" not in args[args.index("--mode"):]:
        at = shapes.index("--new-tokens")
        shapes = shapes[:at] + shapes[at + 2:]
    return shapes


# The seeds' config layout, read as fp32, bf16-pure, int8, nf4.
SEEDS_YAML = {"models": {"sizes": ["tiny"], "quantization": {"enabled": True, "fallback_strategy": True,
                                                             "priority_order": ["none", "fp16", "8bit", "4bit"]}},
              "mode": "infer"}
AUTO_BATCH = 19  # the batch the injected memory limit leaves room for in the --batch-size auto sweep
# (below 15 sequences of 16 tokens the peak is the end of the backward pass, the same for every batch)
RESIDENT = 2  # the decoder layers (of tiny's 4) the injected memory limit leaves room for in the --offload sweep


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)


# The tokens a sweep without --new-tokens keeps in its specs on a CPU (fitbench.config.expand): those of
# sweeps that generate nothing, which are not given --new-tokens (shapes_for).
CPU_NEW_TOKENS = 32


def spec(**fields) -> RunSpec:
    """A tiny CPU configuration as the command line above expands it, with ``fields`` changed."""
    base = dict(model="tiny", backend="native", mode="infer", precision="bf16-pure", batch_size=1, seq_len=16,
                new_tokens=4, device="cpu", warmup_steps=1, measure_steps=1)
    return RunSpec(**{**base, **fields})


def environment(inject: str | None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "FITBENCH_INJECT"}
    if inject is not None:
        env["FITBENCH_INJECT"] = inject
    return env


def peak(mode: str, precision: str, batch: int, *, new_tokens: int = 4, recompute: bool = False,
         resident: int | None = None) -> float:
    return estimate_memory(resolve("tiny"), mode, precision, batch, 16, new_tokens=new_tokens,
                           activation_checkpointing=recompute, resident_layers=resident).peak_bytes


def auto_budget() -> int:
    """A memory budget that holds tiny train fp32 16 tokens at batch AUTO_BATCH and not one more."""
    budget = int(peak("train", "fp32", AUTO_BATCH)) + 1
    assert peak("train", "fp32", AUTO_BATCH) <= budget < peak("train", "fp32", AUTO_BATCH + 1)
    return budget


def fitting_budget() -> int:
    """A memory budget in which tiny infer bf16-pure at batch 1 is predicted to fit, every layer on the
    device, and not one byte more."""
    return int(peak("infer", "bf16-pure", 1)) + 1


def offload_budget(mode: str, resident: int) -> int:
    """A memory budget that holds tiny bf16-pure at batch 1 with ``resident`` decoder layers on the
    device and the rest offloaded, and not one layer more."""
    budget = int(peak(mode, "bf16-pure", 1, resident=resident)) + 1
    assert peak(mode, "bf16-pure", 1, resident=resident) <= budget < peak(mode, "bf16-pure", 1, resident=resident + 1)
    return budget


# ---- next_attempt ---------------------------------------------------------------------------------

INFER_LADDER = FallbackPolicy(("bf16-pure", "int8", "nf4"))
TRAIN_LADDER = FallbackPolicy(("bf16", "bf16-pure", "int8", "nf4"))


def walk(start: RunSpec, policy: FallbackPolicy, limit: int = 30) -> list[tuple[RunSpec, str]]:
    """Every attempt after ``start`` until next_attempt gives up (bounded, so a cycle fails the test)."""
    steps, current = [], start
    for _ in range(limit):
        following = next_attempt(current, policy)
        if following is None:
            return steps
        steps.append(following)
        current = following[0]
    raise AssertionError(f"next_attempt still going after {limit} attempts: {[c for _, c in steps[-4:]]}")


def test_inference_steps_down_the_precision_ladder_halves_the_batch_then_offloads():
    steps = walk(spec(precision="bf16-pure", batch_size=4), INFER_LADDER)
    assert [change for _, change in steps] == [
        "precision bf16-pure -> int8", "precision int8 -> nf4", "batch 4 -> 2", "batch 2 -> 1",
        "offload on, precision nf4 -> bf16-pure"]
    assert [(s.precision, s.batch_size, s.offload) for s, _ in steps] == [
        ("int8", 4, False), ("nf4", 4, False), ("nf4", 2, False), ("nf4", 1, False), ("bf16-pure", 1, True)]
    # Inference never turns on activation checkpointing, and nothing else of the spec changes.
    assert not any(s.activation_checkpointing for s, _ in steps)
    for s, _ in steps:
        assert s.model_dump(exclude={"precision", "batch_size", "offload"}) == \
            spec().model_dump(exclude={"precision", "batch_size", "offload"})


def test_the_middle_of_the_ladder_goes_on_from_there():
    following, change = next_attempt(spec(precision="int8", batch_size=1), INFER_LADDER)
    assert (following.precision, change) == ("nf4", "precision int8 -> nf4")


def test_training_skips_quantized_rungs_then_checkpoints_then_halves_the_batch():
    steps = walk(spec(mode="train", precision="bf16", batch_size=5), TRAIN_LADDER)
    assert [change for _, change in steps] == [
        "precision bf16 -> bf16-pure", "activation checkpointing on", "batch 5 -> 2", "batch 2 -> 1"]
    assert [(s.precision, s.activation_checkpointing, s.batch_size) for s, _ in steps] == [
        ("bf16-pure", False, 5), ("bf16-pure", True, 5), ("bf16-pure", True, 2), ("bf16-pure", True, 1)]
    assert not any(s.precision in ("int8", "nf4") for s, _ in steps)


def test_forward_backward_is_a_training_mode():
    steps = walk(spec(mode="forward-backward", precision="bf16-pure", batch_size=2), TRAIN_LADDER)
    assert [change for _, change in steps] == ["activation checkpointing on", "batch 2 -> 1"]


def test_forward_uses_quantized_rungs_then_offloads():
    steps = walk(spec(mode="forward", precision="bf16-pure"), INFER_LADDER)
    assert [change for _, change in steps] == ["precision bf16-pure -> int8", "precision int8 -> nf4",
                                               "offload on, precision nf4 -> bf16-pure"]
    assert steps[-1][0] == spec(mode="forward", precision="bf16-pure", offload=True)


def test_training_with_checkpointing_already_on_goes_to_the_batch():
    steps = walk(spec(mode="train", precision="bf16-pure", batch_size=3, activation_checkpointing=True), TRAIN_LADDER)
    assert [change for _, change in steps] == ["batch 3 -> 1"]


def test_training_with_some_layers_checkpointed_checkpoints_every_layer_before_the_batch():
    start = spec(mode="train", precision="bf16-pure", batch_size=4, activation_checkpointing=True,
                 checkpointed_layers=3)
    steps = walk(start, TRAIN_LADDER)
    assert [change for _, change in steps] == [
        "activation checkpointing of 3 layers -> every layer", "batch 4 -> 2", "batch 2 -> 1"]
    assert [(s.activation_checkpointing, s.checkpointed_layers, s.batch_size) for s, _ in steps] == [
        (True, None, 4), (True, None, 2), (True, None, 1)]
    assert steps[0][0].key != start.key and "recompute 3 layers" in start.label


def test_offload_at_batch_one_is_the_end():
    assert next_attempt(spec(precision="bf16-pure", batch_size=1, offload=True), INFER_LADDER) is None
    assert next_attempt(spec(mode="forward", precision="bf16-pure", offload=True), INFER_LADDER) is None
    assert next_attempt(spec(mode="train", precision="bf16-pure", activation_checkpointing=True), TRAIN_LADDER) is None


@pytest.mark.parametrize("mode", ["train", "forward-backward"])
@pytest.mark.parametrize("ladder", [TRAIN_LADDER, INFER_LADDER, FallbackPolicy(())])
def test_training_never_offloads(mode, ladder):
    for start in (spec(mode=mode, precision="bf16", batch_size=4), spec(mode=mode, precision="fp32", batch_size=1)):
        steps = walk(start, ladder)
        assert not any(s.offload for s, _ in steps)
        assert not any("offload" in change for _, change in steps)


def test_offload_goes_back_to_the_first_floating_point_rung():
    seeds = FallbackPolicy(("fp32", "bf16-pure", "int8", "nf4"))
    following, change = next_attempt(spec(precision="nf4"), seeds)
    assert (following.precision, following.offload, change) == ("fp32", True, "offload on, precision nf4 -> fp32")
    # A ladder of quantized rungs only: bf16 weights.
    following, change = next_attempt(spec(precision="nf4"), FallbackPolicy(("int8", "nf4")))
    assert (following.precision, following.offload, change) == ("bf16-pure", True, "offload on, precision nf4 -> bf16-pure")


def test_an_offloaded_run_steps_through_floating_point_rungs_and_the_batch_only():
    start = spec(precision="fp32", batch_size=2, offload=True)
    steps = walk(start, FallbackPolicy(("fp32", "int8", "bf16-pure", "nf4")))
    assert [change for _, change in steps] == ["precision fp32 -> bf16-pure", "batch 2 -> 1"]
    assert all(s.offload for s, _ in steps)


@pytest.mark.parametrize("fields", [{"backend": "hf"}, {"compile": True}])
def test_no_offload_where_it_cannot_run(fields):
    steps = walk(spec(precision="bf16-pure", batch_size=2, **fields), INFER_LADDER)
    assert [change for _, change in steps] == [
        "precision bf16-pure -> int8", "precision int8 -> nf4", "batch 2 -> 1"]


def test_disabled_policy_never_retries():
    disabled = FallbackPolicy(("bf16-pure", "int8", "nf4"), enabled=False)
    assert next_attempt(spec(precision="bf16-pure", batch_size=8), disabled) is None
    assert next_attempt(spec(mode="train", precision="bf16", batch_size=8), disabled) is None


def test_precision_outside_the_ladder_goes_straight_to_checkpointing_and_batch():
    assert [c for _, c in walk(spec(precision="fp32", batch_size=2), INFER_LADDER)] == [
        "batch 2 -> 1", "offload on, precision fp32 -> bf16-pure"]
    steps = walk(spec(mode="train", precision="fp32", batch_size=2), TRAIN_LADDER)
    assert [c for _, c in steps] == ["activation checkpointing on", "batch 2 -> 1"]
    assert all(s.precision == "fp32" for s, _ in steps)
    # An empty ladder behaves the same, and offloads in bf16.
    assert [c for _, c in walk(spec(precision="bf16-pure", batch_size=2), FallbackPolicy(()))] == [
        "batch 2 -> 1", "offload on"]


def test_ladder_with_a_repeated_precision_ends():
    # Reachable from the command line (--fallback bf16-pure int8 bf16-pure) and from the seeds' YAML
    # (priority_order: [fp16, bf16-pure] maps to bf16-pure twice): a repeated rung counts once.
    assert fallback_ladder(SweepConfig(fallback=["bf16-pure", "int8", "bf16-pure"]), "infer") == ["bf16-pure", "int8"]
    steps = walk(spec(precision="bf16-pure"), FallbackPolicy(("bf16-pure", "int8", "bf16-pure")))
    assert [change for _, change in steps] == ["precision bf16-pure -> int8", "offload on, precision int8 -> bf16-pure"]


# ---- next_rung: the layout over the GPUs at hand --------------------------------------------------


def walk_rungs(start: RunSpec, policy: FallbackPolicy, strategy: str, gpus: int, at_hand: int,
               limit: int = 30) -> list[Rung]:
    """Every rung after ``start`` (run with ``strategy`` over ``gpus``) until next_rung gives up."""
    rungs: list[Rung] = []
    current = Rung(start, strategy, gpus, "as planned")
    for _ in range(limit):
        following = next_rung(current.spec, policy, strategy=current.strategy, gpus=current.gpus,
                              gpus_at_hand=at_hand)
        if following is None:
            return rungs
        rungs.append(following)
        current = following
    raise AssertionError(f"next_rung still going after {limit} attempts: {[r.change for r in rungs[-4:]]}")


def test_full_training_shards_over_the_gpus_at_hand_before_any_precision_rung():
    start = spec(mode="train", precision="bf16", batch_size=4)
    rungs = walk_rungs(start, TRAIN_LADDER, "single", 1, 2)
    assert [r.change for r in rungs] == ["1 GPU -> fsdp x 2", "precision bf16 -> bf16-pure",
                                         "activation checkpointing on", "batch 4 -> 2", "batch 2 -> 1"]
    # the same configuration first, sharded; then the ladder goes on in that layout
    assert rungs[0].spec == start
    assert all((r.strategy, r.gpus) == ("fsdp", 2) for r in rungs)
    assert not any(r.spec.precision in ("int8", "nf4") for r in rungs)


@pytest.mark.parametrize("mode", ["train", "forward-backward"])
@pytest.mark.parametrize("strategy, gpus, at_hand, change", [
    ("ddp", 2, 2, "ddp x 2 -> fsdp x 2"), ("fsdp", 2, 4, "fsdp x 2 -> fsdp x 4"), ("ddp", 4, 8, "ddp x 4 -> fsdp x 8"),
    ("single", 1, 8, "1 GPU -> fsdp x 8")])
def test_replicated_or_partly_sharded_training_moves_to_fsdp_over_every_gpu(mode, strategy, gpus, at_hand, change):
    start = spec(mode=mode, precision="bf16-pure", batch_size=2)
    rung = next_rung(start, TRAIN_LADDER, strategy=strategy, gpus=gpus, gpus_at_hand=at_hand)
    assert (rung.spec, rung.strategy, rung.gpus, rung.change) == (start, "fsdp", at_hand, change)


def test_fsdp_over_every_gpu_goes_on_down_the_ladder():
    rung = next_rung(spec(mode="train", precision="bf16"), TRAIN_LADDER, strategy="fsdp", gpus=2, gpus_at_hand=2)
    assert (rung.spec.precision, rung.strategy, rung.gpus, rung.change) == (
        "bf16-pure", "fsdp", 2, "precision bf16 -> bf16-pure")


def test_one_gpu_at_hand_walks_the_one_gpu_ladder():
    for start, policy in ((spec(mode="train", precision="bf16", batch_size=5), TRAIN_LADDER),
                          (spec(precision="bf16-pure", batch_size=4), INFER_LADDER)):
        rungs = walk_rungs(start, policy, "single", 1, 1)
        assert [(r.spec, r.change) for r in rungs] == walk(start, policy)
        assert all((r.strategy, r.gpus) == ("single", 1) for r in rungs)


def test_full_training_never_becomes_adapters():
    # a ladder of adapter bases only: none is a rung of full training, on one GPU or several
    adapters_only = FallbackPolicy(("nf4", "int8"))
    for at_hand in (1, 2):
        rungs = walk_rungs(spec(mode="train", precision="bf16", batch_size=2), adapters_only, "single", 1, at_hand)
        assert all(r.spec.precision == "bf16" for r in rungs)
        assert [r.change for r in rungs][-2:] == ["activation checkpointing on", "batch 2 -> 1"]


@pytest.mark.parametrize("start, strategy, gpus", [
    (spec(mode="infer", precision="bf16-pure", batch_size=2), "single", 1),  # inference has no data parallelism
    (spec(mode="train", precision="nf4", batch_size=2), "single", 1),  # adapters on a quantized base
    (spec(mode="train", precision="bf16", batch_size=2), "tp", 2),  # tensor parallel keeps its layout
])
def test_only_full_training_in_a_data_parallel_layout_is_sharded(start, strategy, gpus):
    rungs = walk_rungs(start, INFER_LADDER if start.mode == "infer" else TRAIN_LADDER, strategy, gpus, 4)
    assert rungs and all((r.strategy, r.gpus) == (strategy, gpus) for r in rungs)
    assert not any("fsdp" in r.change for r in rungs)


def test_a_layout_of_several_gpus_never_offloads():
    rungs = walk_rungs(spec(precision="bf16-pure", batch_size=2), INFER_LADDER, "tp", 2, 2)
    assert [r.change for r in rungs] == ["precision bf16-pure -> int8", "precision int8 -> nf4", "batch 2 -> 1"]


def test_a_disabled_policy_has_no_rung():
    disabled = FallbackPolicy(("bf16", "bf16-pure"), enabled=False)
    assert next_rung(spec(mode="train", precision="bf16"), disabled, strategy="single", gpus=1, gpus_at_hand=8) is None


# ---- the largest batch within a budget, and search_max_batch -----------------------------------------------------------


def largest_by_scan(peak_of, budget: float) -> int:
    batch = 0
    while peak_of(batch + 1) <= budget:
        batch += 1
    return batch


def largest_batch(peak, budget: float) -> int:
    """The largest batch whose ``peak`` is within ``budget``, as the planner bisects for it."""
    return largest(lambda batch: peak(batch) <= budget, limit=1 << 16)


@pytest.mark.parametrize("peak_of", [
    lambda b: 1000 + 37 * b,
    lambda b: 500 + 3 * b * b,
    lambda b: 100 * ((b + 4) // 5),  # flat steps: several batches share a peak
], ids=["linear", "quadratic", "steps"])
def test_largest_batch_matches_a_scan(peak_of):
    budgets = {peak_of(1) - 1, peak_of(1), peak_of(1) + 1, peak_of(2), peak_of(7) - 1, peak_of(7), peak_of(64),
               peak_of(65) - 1, peak_of(300) + 5, peak_of(1000)}
    for budget in sorted(budgets):
        assert largest_batch(peak_of, budget) == largest_by_scan(peak_of, budget), budget


def test_largest_batch_hand_computed():
    # 1000 + 37 b <= 2000  <=>  b <= 27.03
    assert largest_batch(lambda b: 1000 + 37 * b, 2000) == 27
    assert largest_batch(lambda b: 1000 + 37 * b, 1000 + 37 * 27) == 27  # the budget itself still fits
    assert largest_batch(lambda b: 1000 + 37 * b, 1000 + 37 * 27 - 1) == 26


def test_largest_batch_is_zero_when_batch_one_does_not_fit():
    assert largest_batch(lambda b: 1000 + 37 * b, 1036) == 0
    assert largest_batch(lambda b: 1000 + 37 * b, 1037) == 1


def threshold_fits(threshold: int, calls: list[RunSpec]):
    """A fake worker: batches up to ``threshold`` run, larger ones run out of memory."""
    def fits(probe: RunSpec) -> bool:
        calls.append(probe)
        return probe.batch_size <= threshold
    return fits


def probe_bound(predicted: int, threshold: int) -> int:
    """The most probes search_max_batch may make.

    Prediction at or above the threshold: one probe at the prediction, one just above it when it fits
    (that is where the search stops), otherwise a bisection of (0, predicted), which halves an interval
    of ``predicted`` batches: at most ceil(log2(predicted)) probes. So ceil(log2(predicted)) + 2.

    Prediction below the threshold: the two probes above, then doubling until a batch fails (at most
    ceil(log2(threshold)) probes, each at least twice the last, starting from 2(predicted + 1) >= 4),
    then a bisection of the last doubled interval, no longer than the threshold: at most
    ceil(log2(threshold)) probes. So 2 ceil(log2(threshold)) + 2.
    """
    start = max(1, predicted)
    if threshold <= start:
        return math.ceil(math.log2(start)) + 2
    return 2 * math.ceil(math.log2(threshold)) + 2


@pytest.mark.parametrize("predicted", [0, 1, 2, 5, 8, 37, 64])
def test_search_max_batch_finds_the_threshold(predicted):
    start = spec(mode="train", precision="fp32", batch_size=1, warmup_steps=5, measure_steps=10, auto_batch=True)
    for threshold in sorted({0, 1, 2, 3, max(predicted - 1, 0), predicted, predicted + 1, predicted + 2,
                             2 * predicted + 3, 5 * predicted + 11, 100}):
        calls: list[RunSpec] = []
        found, probes = search_max_batch(start, predicted, threshold_fits(threshold, calls))
        assert found == threshold, (predicted, threshold, probes)
        # Every probe is recorded, in order, with its outcome; the first is at the prediction.
        assert probes == [{"batch_size": c.batch_size, "fits": c.batch_size <= threshold} for c in calls]
        assert probes[0]["batch_size"] == max(1, predicted)
        assert len(probes) <= probe_bound(predicted, threshold), (predicted, threshold, probes)
        # The answer is pinned by the probes themselves: it ran, and the next batch up did not.
        outcomes = {p["batch_size"]: p["fits"] for p in probes}
        assert outcomes.get(threshold + 1) is False
        assert threshold == 0 or outcomes.get(threshold) is True
        # Probes are short runs of the same configuration: two training steps, the second with the
        # optimizer's state beside the activations.
        for call in calls:
            assert (call.warmup_steps, call.measure_steps) == (1, 1)
            assert call.model_dump(exclude={"batch_size", "warmup_steps", "measure_steps"}) == \
                start.model_dump(exclude={"batch_size", "warmup_steps", "measure_steps"})


def test_generation_probes_are_one_generation():
    calls: list[RunSpec] = []
    search_max_batch(spec(mode="infer", warmup_steps=5, measure_steps=10), 3, threshold_fits(3, calls))
    assert {(c.warmup_steps, c.measure_steps) for c in calls} == {(0, 1)}


def test_search_max_batch_exact_prediction_takes_two_probes():
    calls: list[RunSpec] = []
    found, probes = search_max_batch(spec(), 6, threshold_fits(6, calls))
    assert (found, probes) == (6, [{"batch_size": 6, "fits": True}, {"batch_size": 7, "fits": False}])


def test_search_max_batch_when_batch_one_fails():
    calls: list[RunSpec] = []
    found, probes = search_max_batch(spec(), 1, threshold_fits(0, calls))
    assert (found, probes) == (0, [{"batch_size": 1, "fits": False}])


# ---- the YAML spelling ----------------------------------------------------------------------------


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_seeds_priority_order_under_quantization(tmp_path):
    data = load_yaml(write_yaml(tmp_path / "c.yaml", SEEDS_YAML))
    assert data["models"] == ["tiny"]
    assert data["fallback"] == ["fp32", "bf16-pure", "int8", "nf4"]
    assert "priority_order" not in data and not data.get("no_fallback", False)
    config = merge_sources({}, data, {})
    assert config.fallback == ["fp32", "bf16-pure", "int8", "nf4"] and config.no_fallback is False
    assert fallback_ladder(config, "infer") == ["fp32", "bf16-pure", "int8", "nf4"]
    assert fallback_ladder(config, "train") == ["fp32", "bf16-pure"]


def test_priority_order_at_top_level_and_in_any_case(tmp_path):
    data = load_yaml(write_yaml(tmp_path / "c.yaml", {"models": ["tiny"], "priority_order": ["FP16", "4bit"]}))
    assert data["fallback"] == ["bf16-pure", "nf4"]
    # A precision fitbench knows passes through as it is.
    data = load_yaml(write_yaml(tmp_path / "d.yaml", {"priority_order": ["bf16", "8bit"]}))
    assert data["fallback"] == ["bf16", "int8"]


def test_explicit_fallback_wins_over_priority_order(tmp_path):
    data = load_yaml(write_yaml(tmp_path / "c.yaml", {"fallback": ["nf4"], "priority_order": ["none"]}))
    assert data["fallback"] == ["nf4"]


@pytest.mark.parametrize("switch", ["enabled", "fallback_strategy"])
def test_quantization_switched_off_means_no_fallback(tmp_path, switch):
    seeds = json.loads(json.dumps(SEEDS_YAML))
    seeds["models"]["quantization"][switch] = False
    config = merge_sources({}, load_yaml(write_yaml(tmp_path / "c.yaml", seeds)), {})
    assert config.no_fallback is True


def test_unknown_priority_is_a_user_error(tmp_path):
    from fitbench.util.errors import UserError

    data = load_yaml(write_yaml(tmp_path / "c.yaml", {"priority_order": ["16bit"]}))
    with pytest.raises(UserError, match="priority_order: .*got '16bit'.* Fix the `priority_order` key of"):
        merge_sources({}, data, {})


def test_fallback_ladder_defaults_and_training_filter():
    assert fallback_ladder(SweepConfig(), "infer") == ["bf16-pure", "int8", "nf4"]
    assert fallback_ladder(SweepConfig(), "forward") == ["bf16-pure", "int8", "nf4"]
    assert fallback_ladder(SweepConfig(), "train") == ["bf16", "bf16-pure"]
    assert fallback_ladder(SweepConfig(fallback=["bf16-pure", "int8", "nf4"]), "train") == ["bf16-pure"]
    # Nothing trainable left: the mode's default.
    assert fallback_ladder(SweepConfig(fallback=["int8", "nf4"]), "forward-backward") == ["bf16", "bf16-pure"]


# ---- predicted_max_batch ----------------------------------------------------------------------------


def test_predicted_max_batch_on_cpu_reads_the_injected_limit(monkeypatch):
    monkeypatch.setenv("FITBENCH_INJECT", f"oom:int4, mem-limit:{auto_budget()}")
    auto = spec(mode="train", precision="fp32", batch_size=1, auto_batch=True)
    assert predicted_max_batch(auto, "cpu") == AUTO_BATCH
    # Checkpointing shrinks the activations, so at least as many sequences fit.
    assert predicted_max_batch(auto.model_copy(update={"activation_checkpointing": True}), "cpu") >= AUTO_BATCH
    monkeypatch.setenv("FITBENCH_INJECT", f"mem-limit:{int(peak('train', 'fp32', 1)) - 1}")
    assert predicted_max_batch(auto, "cpu") == 0


# ---- the worker's mem-limit injection alone -------------------------------------------------------


def test_worker_mem_limit_injection(tmp_path):
    limit = int(peak("train", "fp32", AUTO_BATCH))  # exactly at the limit still fits
    assert peak("train", "fp32", AUTO_BATCH + 1) > limit
    specs = {"over": spec(mode="train", precision="fp32", batch_size=AUTO_BATCH + 1),
             "under": spec(mode="train", precision="fp32", batch_size=AUTO_BATCH)}
    workers = {}
    for name, s in specs.items():
        (tmp_path / f"{name}.json").write_text(assign(s, None, None).model_dump_json())
        workers[name] = subprocess.Popen(
            [sys.executable, "-m", "fitbench.worker.worker", str(tmp_path / f"{name}.json"), str(tmp_path / f"{name}.out")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
            env=environment(f"mem-limit:{limit}"))
    results = {}
    for name, worker in workers.items():
        _, stderr = worker.communicate(timeout=120)
        results[name] = (worker.returncode, json.loads((tmp_path / f"{name}.out").read_text()), stderr)

    code, over, stderr = results["over"]
    assert over["status"] == "oom" and code == 3, stderr
    assert f"{limit:,}" in over["error"] and "FITBENCH_INJECT" in over["error"]
    assert f"{peak('train', 'fp32', AUTO_BATCH + 1):,.0f}" in over["error"]  # the predicted peak it compared
    assert "OutOfMemoryError" in over["error"] and "OutOfMemoryError" in stderr
    assert "timing" not in over

    code, under, stderr = results["under"]
    assert under["status"] == "ok" and code == 0, under.get("error") or stderr
    assert len(under["timing"]["samples"]["step"]) == 1  # it measured its one step


# ---- end to end -----------------------------------------------------------------------------------


@dataclass
class Sweep:
    out: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def rows(self) -> list[dict]:
        return list(ResultStore(self.out).rows())

    @property
    def row(self) -> dict:
        rows = self.rows
        assert len(rows) == 1, rows
        return rows[0]

    def row_of(self, **spec) -> dict:
        """The one row whose spec has these fields (a sweep of several configurations)."""
        (row,) = [row for row in self.rows if all(row["spec"][key] == value for key, value in spec.items())]
        return row

    def logs_of(self, row: dict) -> list[str]:
        return [name for name in self.logs if name.startswith(row["key"])]

    @property
    def logs(self) -> list[str]:
        return sorted(path.name for path in (self.out / "logs").glob("*.log"))


def start_sweep(directory: Path, args: list[str], inject: str | None) -> tuple[subprocess.Popen, Path]:
    directory.mkdir(parents=True)
    out = directory / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "fitbench", "run", *args, "--out", str(out)], cwd=directory, env=environment(inject),
        stdout=(directory / "stdout").open("w"), stderr=(directory / "stderr").open("w"), stdin=subprocess.DEVNULL)
    return process, out


def finish_sweep(process: subprocess.Popen, out: Path, timeout: float = 240) -> Sweep:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    directory = out.parent
    return Sweep(out, process.returncode, (directory / "stdout").read_text(), (directory / "stderr").read_text())


# Room for anything tiny runs: the planner predicts every configuration on the CPU, as on a GPU.
AMPLE = 10**12


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory, tiny_checkpoint) -> dict[str, Sweep]:
    """Every end-to-end sweep below, started at once; a sweep of several configurations serves the
    tests whose options and injected faults agree (each reads its own row)."""
    root = tmp_path_factory.mktemp("sweeps")
    nan = str(tiny_checkpoint(root / "nan", fill=math.nan))  # tiny, weights all NaN
    seeds = write_yaml(root / "seeds.yaml", SEEDS_YAML)
    planned = {
        "out_of_memory": (["--mode", "infer", "train", "--precision", "bf16-pure", "--batch-size", "2"],
                          f"oom:bf16-pure,mem-limit:{AMPLE}"),
        "no_fallback": (["--mode", "infer", "--precision", "bf16-pure", "--batch-size", "1", "--no-fallback"],
                        "oom:bf16-pure"),
        "skip_int8": (["--mode", "infer", "--precision", "bf16-pure", "--batch-size", "1",
                       "--fallback", "bf16-pure", "nf4"], "oom:bf16-pure"),
        "seeds": (["--config", str(seeds), "--batch-size", "1"], "oom:fp32"),
        "auto": (["--mode", "train", "--precision", "fp32", "--batch-size", "auto"], f"mem-limit:{auto_budget()}"),
        # apart from "auto", so that the two chains of probes run side by side
        "auto_nan": (["--models", nan, "--mode", "train", "--precision", "fp32", "--batch-size", "auto"],
                     f"mem-limit:{auto_budget()}"),
        "offload": (["--mode", "infer", "--precision", "bf16-pure", "--batch-size", "1"],
                    f"oom:bf16-pure,oom:int8,oom:nf4,mem-limit:{fitting_budget()}"),
        "offload_option": (["--mode", "forward", "--precision", "bf16-pure", "--batch-size", "1", "--offload"],
                           f"mem-limit:{offload_budget('forward', RESIDENT)}"),
        "invalid": (["--models", nan, "--mode", "infer", "--precision", "bf16-pure", "--batch-size", "1"], None),
    }
    started = {name: start_sweep(root / name, [*([] if "--models" in args else TINY[:2]), *shapes_for(args), *args],
                                 inject) for name, (args, inject) in planned.items()}
    return {name: finish_sweep(*pair) for name, pair in started.items()}


def ran(sweep: Sweep, **spec) -> dict:
    """The row of ``sweep`` (with ``spec``'s fields when it ran several), checked for its exit status."""
    rows = sweep.rows
    assert sweep.returncode == (0 if all(row["status"] == "ok" for row in rows) else 1), sweep.stderr
    assert "Traceback" not in sweep.stderr, sweep.stderr
    return sweep.row_of(**spec) if spec else sweep.row


def check_attempt(attempt: dict, expected_spec: RunSpec, change: str, status: str) -> None:
    assert set(attempt) == {"spec", "change", "status", "error"}
    assert attempt["spec"] == expected_spec.model_dump()
    assert (attempt["change"], attempt["status"]) == (change, status)
    if status == "oom":
        assert "out of memory" in attempt["error"].lower() and "OutOfMemoryError" in attempt["error"]
    else:
        assert attempt["error"] is None


def test_infer_out_of_memory_falls_back_to_int8(sweeps):
    sweep = sweeps["out_of_memory"]
    row = ran(sweep, mode="infer")
    planned, int8 = spec(precision="bf16-pure", batch_size=2), spec(precision="int8", batch_size=2)
    assert row["status"] == "ok", row.get("error")
    assert row["spec"] == int8.model_dump()
    assert row["key"] == planned.key != int8.key
    assert len(row["attempts"]) == 2
    check_attempt(row["attempts"][0], planned, "as planned", "oom")
    check_attempt(row["attempts"][1], int8, "precision bf16-pure -> int8", "ok")
    assert "FITBENCH_INJECT" in row["attempts"][0]["error"] and "bf16-pure" in row["attempts"][0]["error"]
    assert row["quality"] is not None  # int8 really ran: its logits were compared with bf16
    assert sweep.logs_of(row) == [f"{planned.key}-1.log", f"{planned.key}-2.log"]
    assert f"ok {planned.label} (ran as {int8.label})" in " ".join(sweep.stdout.split())
    # The prediction stored is for what ran: bf16-pure's beside int8's measured peak would report the
    # planner's error wrongly.
    assert peak("infer", "int8", 2) != peak("infer", "bf16-pure", 2)
    assert row["prediction"]["predicted_peak_bytes"] == peak("infer", "int8", 2)


def test_resume_skips_the_fallen_back_configuration(sweeps, tmp_path, capsys, monkeypatch):
    out = tmp_path / "resumed"
    shutil.copytree(sweeps["out_of_memory"].out, out)
    before = {path.name: path.stat().st_mtime_ns for path in (out / "logs").glob("*.log")}
    rows_before = (out / "results.jsonl").read_text()
    monkeypatch.setenv("FITBENCH_INJECT", "oom:bf16-pure")
    code, stdout, stderr = cli(["run", "--resume", str(out)], capsys)
    assert code == 1, stderr  # the training row ran out of memory on every rung
    assert "2 already finished" in stdout
    assert (out / "results.jsonl").read_text() == rows_before
    assert {path.name: path.stat().st_mtime_ns for path in (out / "logs").glob("*.log")} == before


def test_no_fallback_records_the_out_of_memory(sweeps):
    row = ran(sweeps["no_fallback"])
    planned = spec(precision="bf16-pure")
    assert row["status"] == "oom" and "out of memory" in row["error"].lower()
    assert row["spec"] == planned.model_dump() and row["key"] == planned.key
    assert len(row["attempts"]) == 1
    check_attempt(row["attempts"][0], planned, "as planned", "oom")
    assert sweeps["no_fallback"].logs == [f"{planned.key}-1.log"]


def test_fallback_ladder_from_the_command_line_skips_int8(sweeps):
    row = ran(sweeps["skip_int8"])
    planned = spec(precision="bf16-pure")
    assert row["status"] == "ok", row.get("error")
    assert row["spec"] == spec(precision="nf4").model_dump() and row["key"] == planned.key
    assert len(row["attempts"]) == 2
    check_attempt(row["attempts"][0], planned, "as planned", "oom")
    check_attempt(row["attempts"][1], spec(precision="nf4"), "precision bf16-pure -> nf4", "ok")
    assert len(sweeps["skip_int8"].logs) == 2


def test_training_out_of_memory_walks_checkpointing_then_the_batch(sweeps):
    row = ran(sweeps["out_of_memory"], mode="train")
    planned = spec(mode="train", precision="bf16-pure", batch_size=2)
    recompute = planned.model_copy(update={"activation_checkpointing": True})
    halved = recompute.model_copy(update={"batch_size": 1})
    assert row["status"] == "oom" and "out of memory" in row["error"].lower()
    assert row["key"] == planned.key
    assert row["spec"] == halved.model_dump()
    assert len(row["attempts"]) == 3
    check_attempt(row["attempts"][0], planned, "as planned", "oom")
    check_attempt(row["attempts"][1], recompute, "activation checkpointing on", "oom")
    check_attempt(row["attempts"][2], halved, "batch 2 -> 1", "oom")
    assert len(sweeps["out_of_memory"].logs_of(row)) == 3


def test_seeds_yaml_priority_order_drives_the_fallback(sweeps):
    sweep = sweeps["seeds"]
    row = ran(sweep)
    planned = spec(precision="fp32")  # "none": the first rung is where the sweep starts
    assert row["status"] == "ok", row.get("error")
    assert row["key"] == planned.key
    assert row["spec"] == spec(precision="bf16-pure").model_dump()
    assert len(row["attempts"]) == 2
    check_attempt(row["attempts"][0], planned, "as planned", "oom")
    check_attempt(row["attempts"][1], spec(precision="bf16-pure"), "precision fp32 -> bf16-pure", "ok")
    saved = json.loads((sweep.out / "sweep.json").read_text())["config"]
    assert saved["fallback"] == ["fp32", "bf16-pure", "int8", "nf4"] and saved["no_fallback"] is False


def auto_row(sweeps) -> dict:
    return ran(sweeps["auto"])


def test_auto_batch_finds_the_largest_batch_under_the_limit(sweeps):
    row = auto_row(sweeps)
    budget = auto_budget()
    original = spec(mode="train", precision="fp32", batch_size=1, auto_batch=True, new_tokens=CPU_NEW_TOKENS)
    final = spec(mode="train", precision="fp32", batch_size=AUTO_BATCH, new_tokens=CPU_NEW_TOKENS)
    assert row["status"] == "ok", row.get("error")
    assert row["key"] == original.key
    assert "autox16" in original.label  # what the sweep calls this configuration before it runs
    assert row["max_batch"] == AUTO_BATCH and row["predicted_batch"] == AUTO_BATCH
    assert row["spec"] == final.model_dump()
    probes = row["batch_probes"]
    assert probes, row
    for probe in probes:
        assert set(probe) == {"batch_size", "fits"}
        assert probe["fits"] == (peak("train", "fp32", probe["batch_size"]) <= budget), probe
    # The prediction is exact here, so the search confirms it and rules out one more.
    assert probes == [{"batch_size": AUTO_BATCH, "fits": True}, {"batch_size": AUTO_BATCH + 1, "fits": False}]
    assert len(row["attempts"]) == 1
    check_attempt(row["attempts"][0], final, "as planned", "ok")
    assert len(sweeps["auto"].logs_of(row)) == len(probes) + 1  # every probe was a worker of its own


def test_auto_batch_row_label_shows_auto(sweeps):
    # The row is the configuration the user asked for; its spec says what finally ran.
    assert auto_row(sweeps)["label"] == spec(mode="train", precision="fp32", batch_size=1, auto_batch=True).label


def test_out_of_memory_on_every_rung_ends_in_offload(sweeps):
    # Predicted to fit, then out of memory on every rung (injected, as an under-prediction would do):
    # the ladder ends in offload, which gets around it, with the layers the budget has room for.
    sweep = sweeps["offload"]
    row = ran(sweep)
    budget = fitting_budget()
    planned = spec(precision="bf16-pure")
    final = spec(precision="bf16-pure", offload=True)
    assert row["status"] == "ok", row.get("error")
    assert row["key"] == planned.key and row["label"] == planned.label
    assert row["spec"] == final.model_dump()
    expected = [(planned, "as planned", "oom"),
                (spec(precision="int8"), "precision bf16-pure -> int8", "oom"),
                (spec(precision="nf4"), "precision int8 -> nf4", "oom"),
                (final, "offload on, precision nf4 -> bf16-pure", "ok")]
    assert len(row["attempts"]) == len(expected)
    for attempt, (tried, change, status) in zip(row["attempts"], expected):
        check_attempt(attempt, tried, change, status)
        if status == "oom":  # within the budget, out of memory only by injection
            assert peak("infer", tried.precision, tried.batch_size) <= budget
            assert f"injected by FITBENCH_INJECT for {tried.precision}" in attempt["error"]
    # The budget holds the whole model: all 4 layers stay on the device, beside the edges.
    arch = resolve("tiny")
    layer = 2 * arch.params_per_layer
    assert row["offload"] == {
        "tier": "disk", "resident_layers": 4, "offloaded_layers": 0, "resident_bytes": 2 * arch.total_params,
        "offloaded_bytes": 0, "max_memory": {"cpu": budget - peak("infer", "bf16-pure", 1, resident=0) + layer},
        "stream_gbs": None}
    assert row["weights"]["bytes"] == 2 * arch.total_params  # every weight, wherever it lives
    assert row["prediction"]["fits"] and row["prediction"]["resident_layers"] == 4  # for what ran
    assert len(row["timing"]["samples"]["end_to_end"]) == 1  # it measured its one generation
    assert len(sweep.logs) == len(expected)
    printed = " ".join(sweep.stdout.split())  # as one line, however the console wrapped it
    assert f"ok {planned.label} (ran as {final.label})" in printed
    assert "0 of 4 layers (0 MB) offloaded to disk" in printed


def test_offload_option_keeps_on_the_device_the_layers_the_budget_holds(sweeps):
    sweep = sweeps["offload_option"]
    row = ran(sweep)
    planned = spec(mode="forward", precision="bf16-pure", offload=True, new_tokens=CPU_NEW_TOKENS)
    assert row["status"] == "ok", row.get("error")
    assert row["key"] == planned.key and row["spec"] == planned.model_dump()
    assert " offload " in row["label"]
    assert len(row["attempts"]) == 1
    check_attempt(row["attempts"][0], planned, "as planned", "ok")
    offload = row["offload"]
    assert (offload["tier"], offload["resident_layers"], offload["offloaded_layers"]) == ("disk", RESIDENT, 4 - RESIDENT)
    assert offload["offloaded_bytes"] == (4 - RESIDENT) * 2 * resolve("tiny").params_per_layer
    # Planned with its split, on the CPU against the injected budget: the tensors alone.
    prediction = row["prediction"]
    assert prediction["fits"] and prediction["resident_layers"] == RESIDENT
    assert prediction["predicted_peak_bytes"] == peak("forward", "bf16-pure", 1, resident=RESIDENT)
    assert prediction["gpu_memory_bytes"] == offload_budget("forward", RESIDENT)
    assert len(row["timing"]["samples"]["step"]) == 1
    assert f"{4 - RESIDENT} of 4 layers (3 MB) offloaded to disk" in " ".join(sweep.stdout.split())


def test_an_invalid_run_is_a_finished_failed_row_without_fallback(sweeps):
    sweep = sweeps["invalid"]
    row = ran(sweep)
    assert row["status"] == "invalid"
    assert "prefill logits not finite in 1 of 1 measured steps" in row["error"]
    # NaN weights are NaN on every rung: the ladder is for running out of memory only
    assert [attempt["status"] for attempt in row["attempts"]] == ["invalid"]
    assert row["spec"]["precision"] == "bf16-pure" and len(sweep.logs) == 1
    printed = " ".join(sweep.stdout.split())
    assert "invalid" in printed and "1 of 1 configuration(s) did not finish or gave invalid numbers" in printed
    table = pd.read_csv(sweep.out / "results.csv")
    assert list(table["status"]) == ["invalid"]


def test_auto_batch_counts_an_invalid_probe_as_fitting(sweeps):
    # its memory held to the end: the batch fits, whatever the weights make of the numbers
    row = ran(sweeps["auto_nan"])
    assert row["spec"]["model"].endswith("nan")
    assert row["status"] == "invalid" and "loss not finite" in row["error"]
    assert row["batch_probes"] == [{"batch_size": AUTO_BATCH, "fits": True},
                                   {"batch_size": AUTO_BATCH + 1, "fits": False}]
    assert row["max_batch"] == AUTO_BATCH and row["spec"]["batch_size"] == AUTO_BATCH
    assert [attempt["status"] for attempt in row["attempts"]] == ["invalid"]
