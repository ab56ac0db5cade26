"""Replicas: N independent copies of a model, one per rank, each with its own batch, measured side by side;
their throughput is the sum of theirs. And the automatic choice among every layout of N GPUs, one GPU and
replicas included, by forecast throughput on described hardware."""

import json

import pytest

from conftest import cli
from fitbench.models.registry import resolve
from fitbench.planning.calibration import DEFAULT
from fitbench.planning.planner import Candidate, GpuTarget, assess, forecast_tokens_per_s, plan, predict_spec
from fitbench.precisions import PRECISIONS
from fitbench.spec import Layout, RunSpec

H100 = "NVIDIA H100 80GB HBM3"
H100_MEMORY = 85.0e9  # what torch reports of an H100 80GB (79.2 GiB)
SEED, BATCH, NEW_TOKENS, STEPS = 3, 2, 4, 2


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)


@pytest.mark.slow
def test_replicas_on_two_cpu_ranks_sum_their_own_batches(tmp_path, capsys):
    """`fitbench run --device cpu --gpus 2 --strategy replicas --mode infer`: one torchrun job of two gloo
    ranks, each a whole model and a batch of its own; the row's decode tokens/s is the sum of the rates
    it lists per replica, and each replica's batch came from its own seed."""
    code, out, err = cli(["run", "--models", "tiny", "--device", "cpu", "--gpus", "2", "--strategy", "replicas",
                          "--mode", "infer", "--batch-size", str(BATCH), "--seq-len", "16", "--new-tokens",
                          str(NEW_TOKENS), "--seed", str(SEED), "--warmup-steps", "1", "--measure-steps", str(STEPS),
                          "--out", "r"], capsys)
    assert code == 0, out + err
    [row] = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert row["status"] == "ok" and row["ranks"] == 2, row.get("error")
    assert Layout.model_validate(row["layout"]) == Layout(replicas=2) and "replicas x 2" in row["label"]
    replicas = row["parallel"]["replicas"]
    assert [replica["rank"] for replica in replicas] == [0, 1]
    rates = [replica["tokens_per_s"] for replica in replicas]
    assert all(rate > 0 for rate in rates)
    throughput = row["throughput"]
    assert throughput["decode_tokens_per_s"] == pytest.approx(sum(rates))
    assert throughput["decode_tokens_per_s_per_rank"] == rates
    assert throughput["prefill_tokens_per_s"] == pytest.approx(sum(throughput["prefill_tokens_per_s_per_rank"]))
    # each rank drew its own batch, from the seed of its rank, and ran it
    assert [replica["data_seed"] for replica in replicas] == [SEED, SEED + 1]
    assert replicas[0]["batch_digest"] != replicas[1]["batch_digest"]
    # each replica's own peak memory (a CPU's: its process's resident peak), as the row lists it per rank
    assert [replica["peak_memory_bytes"] for replica in replicas] == row["memory"]["host_peak_rss_per_rank"]
    # every replica's latencies are the row's sample; each replica's rate is B over its own median
    samples = row["timing"]["samples"]
    assert len(samples["time_to_first_token"]) == 2 * STEPS
    assert len(samples["token_latency"]) == 2 * STEPS * (NEW_TOKENS - 1)
    for rate, median in zip(rates, row["timing"]["rank_token_latency_medians"]):
        assert rate == pytest.approx(BATCH / median)


def test_replicas_plan_one_gpus_memory_and_n_times_its_forecast():
    """A replica holds what one GPU's run holds (no NCCL communicator: its ranks talk over gloo), and N
    of them forecast N times one GPU's tokens/s."""
    arch, target = resolve("1B"), GpuTarget(H100, 4, H100_MEMORY, described=True)
    one, four = (assess(arch, "infer", Candidate("bf16-pure", layout, False, 1), target, seq_len=128,
                        new_tokens=128) for layout in (Layout(), Layout(replicas=4)))
    assert one.fits and four.fits and four.predicted_peak == one.predicted_peak
    assert "NCCL buffers" not in {term.name for term in four.overheads}
    rates = [forecast_tokens_per_s(arch, "infer", a.candidate, target, seq_len=128, new_tokens=128,
                                   calibration=DEFAULT) for a in (one, four)]
    assert rates[1] == pytest.approx(4 * rates[0])


def test_1b_decoding_at_batch_1_on_four_h100s_runs_replicas_not_tensor_parallel(capsys):
    """The default job on 4 H100s: the 1B preset at batch 1. Tensor parallelism over 4 measured 424 tokens/s
    (eager kernels in a graph) against one GPU's 753: at batch 1 its all-reduces cost about what the quarter
    of the weights saves. Four replicas make four times one GPU's tokens; the plan picks them, and a run
    left to choose does the same."""
    code, out, err = cli(["plan", "--models", "1B", "--mode", "infer", "--gpu", "H100-80GB", "--gpus", "4",
                          "--batch-size", "1", "--json"], capsys)
    assert code == 0, err
    (result,) = json.loads(out)
    chosen = result["chosen"]
    assert Layout.model_validate(chosen["candidate"]["layout"]) == Layout(replicas=4)
    rates = {f["label"]: f["forecast_tokens_per_s"] for f in result["feasible"]}
    one, tp4 = rates["bf16-pure, 1 GPU, batch 1"], rates["bf16-pure, tp x 4, batch 1"]
    assert max(tp4, one) < chosen["forecast_tokens_per_s"] == pytest.approx(4 * one)
    spec = RunSpec(model="1B", backend="native", mode="infer", precision="bf16-pure", batch_size=1, seq_len=128,
                   new_tokens=128, device="cuda:0", warmup_steps=1, measure_steps=1)
    planned, prediction = predict_spec(resolve("1B"), spec, GpuTarget(H100, 4, H100_MEMORY, described=False), DEFAULT,
                                       choose_precision=True, choose_recompute=False, runnable=PRECISIONS,
                                       choose_strategy=True, gpus=4)
    assert planned.layout == Layout(replicas=4) and planned.precision == "bf16-pure" and prediction["fits"]


def test_a_model_one_gpu_cannot_hold_is_sharded_and_replicas_are_rejected_for_memory():
    """Llama-2-70B in bf16 (138 GB of weights) on four H100s: one GPU, and so each replica, is short of
    memory; the choice is a layout that divides the weights, the fastest forecast among them."""
    arch, target = resolve("llama-2-70b"), GpuTarget(H100, 4, H100_MEMORY, described=True)
    result = plan(arch, "infer", target, seq_len=128, new_tokens=128, batch_sizes=[1], precisions=["bf16-pure"])
    layout = result.chosen.candidate.layout
    assert layout.replicas == 1 and layout.world_size > 1 and (layout.tp > 1 or layout.pp > 1)
    assert all(a.forecast_tokens_per_s <= result.chosen.forecast_tokens_per_s for a in result.feasible)
    replicas = [a for a in result.rejected if a.candidate.layout.replicas > 1]
    assert replicas and all("GB per GPU" in a.reason for a in replicas)


def test_training_ranks_data_parallel_and_sharded_layouts_by_forecast():
    """In training on several GPUs, replicas are no layout (their gradients would not meet); every
    launchable layout that fits is ranked, and the choice is the fastest forecast."""
    arch, target = resolve("7B"), GpuTarget(H100, 4, H100_MEMORY, described=True)
    result = plan(arch, "train", target, seq_len=512, new_tokens=1, batch_sizes=[1], precisions=["bf16"])
    assert not any(a.candidate.layout.replicas > 1 for a in (*result.feasible, *result.rejected))
    assert result.feasible[0] is result.chosen
    assert [a.forecast_tokens_per_s for a in result.feasible] == sorted(
        (a.forecast_tokens_per_s for a in result.feasible), reverse=True)
    assert len({a.candidate.layout.strategy for a in result.feasible}) > 1
