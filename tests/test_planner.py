"""The planner (``fitbench.planning.planner``), its roofline (``fitbench.planning.speed``), its overheads
(``fitbench.planning.calibration``) and the ``fitbench plan`` / ``fitbench calibrate`` commands.

Expected values are worked out here from the models' published shapes and the GPUs' datasheet
figures, with the formulas the modules document, never read back from the code under test.
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from fitbench.hardware import devices
from fitbench.hardware.datasheet import gpu_spec
from fitbench.launch.calibrate import fit_collective, measure_bus_bandwidth, with_bus_bandwidth
from fitbench.models.architecture import default_backend
from fitbench.models.presets import PRESETS
from fitbench.models.registry import resolve
from fitbench.planning.calibration import (DEFAULT, NCCL_TENSOR_PARALLEL_GENERATION, TENSORS_ONLY, Calibration,
                                      calibration_path, ensure_calibration, load_calibration, save_calibration)
from fitbench.planning.collectives import NVLINK_LATENCY_S, BusBandwidth, bus_bandwidth
from fitbench.planning.memory import estimate_memory, stage_estimates
from fitbench.planning.sharding import Parallelism
from fitbench.planning.planner import (
    GPU_ALIASES,
    MAX_AUTO_BATCH,
    MOST_GPUS,
    RETRY_MARGIN,
    Candidate,
    GpuTarget,
    alternatives,
    assess,
    fewest_gpus,
    layouts_for,
    minimum_gpus,
    offload_split,
    overhead_terms,
    plan,
    predict_spec,
    refusal,
    unsplittable,
)
from fitbench.planning.speed import bubble_fraction, estimate_step_time
from fitbench.precisions import ADAPTERS, PRECISIONS, entry
from fitbench.spec import Layout, RunSpec
from fitbench.sweep import gpu_target
from fitbench.sweep import run_target
from fitbench.util.errors import UserError
from conftest import cli

# ---- datasheet figures and published shapes ---------------------------------------------------

H100 = "NVIDIA H100 80GB HBM3"
H100_BF16_FLOPS = 989.4e12  # dense bf16 (the datasheet's 1,979 TFLOP/s is with 2:4 sparsity)
H100_BANDWIDTH = 3.35e12  # HBM3, 3.35 TB/s
H200_BANDWIDTH = 4.8e12  # HBM3e, 4.8 TB/s
PCIE5_PER_DIRECTION = 128e9 / 2  # H100 and H200 datasheets: PCIe Gen5, 128 GB/s both directions together
PCIE4_PER_DIRECTION = 64e9 / 2  # A100 datasheet: PCIe Gen4, 64 GB/s
NVLINK4_PER_DIRECTION = 900e9 / 2  # NVLink 4: 900 GB/s total, both directions together
GB = 1e9
MIB = 1024**2

# What the device gives a process (torch.cuda.get_device_properties().total_memory, CUDA's totalGlobalMem):
# the committed H100 run's environment (read from the file in a test below); an H200 under torch
# 2.11.0+cu130, whose repr prints the same figure in whole MiB, "total_memory=143155MB"; deviceQuery's
# "40339 MBytes (42298834944 bytes)" on an A100-SXM4-40GB (github.com/bottlerocket-os/bottlerocket/pull/3873).
H100_TOTAL_MEMORY = 85_017_493_504
H200_TOTAL_MEMORY = 150_109_880_320
A100_40GB_TOTAL_MEMORY = 42_298_834_944

# Llama-2 config.json: hidden, layers, heads, kv heads, MLP width, vocabulary (untied embeddings).
LLAMA2_7B = dict(h=4096, L=32, H=32, kv=32, f=11008, V=32000)
LLAMA2_70B = dict(h=8192, L=80, H=64, kv=8, f=28672, V=32000)


def layer_params(s: dict) -> int:
    """q and o (h x h), k and v (h x kv*d), gate/up/down (h x f), two RMSNorm weights."""
    d = s["h"] // s["H"]
    return 2 * s["h"] * s["h"] + 2 * s["h"] * s["kv"] * d + 3 * s["h"] * s["f"] + 2 * s["h"]


def edge_params(s: dict) -> int:
    """Input embedding, untied output projection, final norm."""
    return 2 * s["V"] * s["h"] + s["h"]


def total_params(s: dict) -> int:
    return s["L"] * layer_params(s) + edge_params(s)


def matmul_params(s: dict) -> int:
    """Every parameter but the input embedding's lookup table (the output projection is a matmul)."""
    return total_params(s) - s["V"] * s["h"]


def kv_bytes_per_token(s: dict, width: int = 2) -> int:
    return 2 * s["L"] * s["kv"] * (s["h"] // s["H"]) * width


P7 = total_params(LLAMA2_7B)
P70 = total_params(LLAMA2_70B)


def needed_gb(reason: str) -> float:
    match = re.search(r"needs ([\d.]+) GB per GPU; ([\d.]+) GB available", reason)
    assert match, reason
    return float(match.group(1))


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No stored calibration of this machine leaks in, and nothing is written outside tmp_path."""
    monkeypatch.setenv("FITBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def test_published_parameter_counts():
    # The hand counts used below are the published ones, and the presets have the same shapes.
    assert P7 == 6_738_415_616
    assert P70 == 68_976_648_192
    assert resolve("7B").total_params == P7
    assert resolve("llama-2-70b").total_params == P70


# ---- 1. described hardware: llama-2-70b inference on 80 GB GPUs --------------------------------

def infer_70b(gpus: int, **kwargs):
    return plan(resolve("llama-2-70b"), "infer", GpuTarget(H100, gpus, 80e9, described=True), seq_len=128,
                new_tokens=128, batch_sizes=[1], **kwargs)


def bf16_step_weights(s: dict, batch: int) -> float:
    """What a decode step reads of untied bf16 weights: all but the input table, of which a row per sequence."""
    return 2 * (total_params(s) - s["V"] * s["h"] + batch * s["h"])


def hand_decode_seconds(weight_bytes: float, s: dict, batch: int, seq_len: int, new_tokens: int, *,
                        tp: int = 1, stages: int = 1) -> float:
    """One decode step: a read of ``weight_bytes`` and of the whole preallocated KV cache (prompt + new
    tokens, as a CUDA graph's step reads it) at HBM bandwidth, tensor-parallel ranks reading their
    share at once, pipeline stages one after another (so, as slow as one GPU); plus two ring
    all-reduces of the hidden state per layer over NVLink, and the hidden state sent over each
    boundary between stages; each message also costs the link's latency."""
    cache = kv_bytes_per_token(s) * batch * (seq_len + new_tokens)
    memory = (weight_bytes + cache) / tp / H100_BANDWIDTH
    compute = 2 * batch * matmul_params(s) / (H100_BF16_FLOPS * tp)
    communication = 0.0
    if tp > 1:  # two all-reduces per layer and the embedding's, then the logits gathered
        communication += (2 * s["L"] + 1) * (NVLINK_LATENCY_S + 2 * (tp - 1) / tp * batch * s["h"] * 2
                                             / NVLINK4_PER_DIRECTION)
        communication += NVLINK_LATENCY_S + (tp - 1) / tp * batch * s["V"] * 2 / NVLINK4_PER_DIRECTION
    communication += (stages - 1) * (NVLINK_LATENCY_S + batch * s["h"] * 2 / NVLINK4_PER_DIRECTION)
    return max(memory, compute) + communication


def test_70b_bf16_rejected_on_one_80gb_gpu_and_a_quantized_plan_chosen():
    result = infer_70b(1)
    bf16 = [a for a in result.rejected if a.candidate.precision == "bf16-pure"]
    assert len(bf16) == 1 and bf16[0].candidate.gpus == 1
    reason = bf16[0].reason
    # bf16 weights alone are 2 bytes x 68.98e9 parameters = 137.95 GB.
    assert needed_gb(reason) >= 2 * P70 / GB - 0.05
    assert needed_gb(reason) > 80
    assert "80.0 GB available" in reason
    chosen = result.chosen
    assert chosen is not None
    assert chosen.candidate.precision in ("int8", "nf4") and chosen.candidate.gpus == 1
    assert chosen.fits and chosen.predicted_peak <= 80e9
    # int8 keeps ~1 byte per layer-matmul parameter: at least 68.4 GB.
    if chosen.candidate.precision == "int8":
        assert chosen.predicted_peak > LLAMA2_70B["L"] * (layer_params(LLAMA2_70B) - 2 * LLAMA2_70B["h"])


def test_70b_on_four_80gb_gpus_chooses_bf16_tensor_parallel_4():
    result = infer_70b(4)
    chosen = result.chosen.candidate
    assert (chosen.precision, chosen.strategy, chosen.gpus) == ("bf16-pure", "tp", 4)
    # By hand, tp x 4 is the fastest bf16 layout: a quarter of the weights per rank.
    weights = bf16_step_weights(LLAMA2_70B, 1)
    hand = {("tp", 2): hand_decode_seconds(weights, LLAMA2_70B, 1, 128, 128, tp=2),
            ("tp", 4): hand_decode_seconds(weights, LLAMA2_70B, 1, 128, 128, tp=4),
            ("pipeline", 2): hand_decode_seconds(weights, LLAMA2_70B, 1, 128, 128),
            ("pipeline", 4): hand_decode_seconds(weights, LLAMA2_70B, 1, 128, 128)}
    assert min(hand, key=hand.get) == ("tp", 4)
    assert chosen.label == "bf16-pure, tp x 4, batch 1"
    # Per rank: a quarter of the layers' weights plus the unsharded embeddings, in bf16.
    per_gpu = 2 * (LLAMA2_70B["L"] * layer_params(LLAMA2_70B) / 4 + edge_params(LLAMA2_70B))
    assert per_gpu < result.chosen.predicted_peak < per_gpu + 2e9


def test_70b_on_two_80gb_gpus_tp2_fits_and_beats_pipeline2():
    result = infer_70b(2)
    by_layout = {(a.candidate.precision, a.candidate.strategy, a.candidate.gpus): a for a in result.feasible}
    tp2 = by_layout[("bf16-pure", "tp", 2)]
    pipeline2 = by_layout[("bf16-pure", "pipeline", 2)]
    per_gpu = 2 * (LLAMA2_70B["L"] * layer_params(LLAMA2_70B) / 2 + edge_params(LLAMA2_70B))  # 69.50 GB
    assert per_gpu < tp2.predicted_peak < 80e9
    assert tp2.predicted_peak - per_gpu < 2e9
    # The roofline by hand: tp 2 reads half the weights per step, the pipeline all of them.
    tp2_seconds = hand_decode_seconds(bf16_step_weights(LLAMA2_70B, 1), LLAMA2_70B, 1, 128, 128, tp=2)
    pipeline2_seconds = hand_decode_seconds(bf16_step_weights(LLAMA2_70B, 1), LLAMA2_70B, 1, 128, 128, stages=2)
    assert tp2.speed.seconds == pytest.approx(tp2_seconds, rel=1e-9)
    assert pipeline2.speed.seconds == pytest.approx(pipeline2_seconds, rel=1e-9)
    assert tp2_seconds < pipeline2_seconds
    # 71 GB of 80 is clear of the allocator-retry margin (9.2%): the first rung's fastest layout is chosen
    assert tp2.clear and tp2.predicted_peak <= (1 - RETRY_MARGIN) * 80e9
    assert result.chosen.candidate == tp2.candidate


def test_70b_within_the_retry_margin_takes_the_next_rung_clear_of_it():
    """On two GPUs of 77 GB, bf16-pure's 71 GB (tp 2) and 70.8 GB (two stages) fit but lie within
    RETRY_MARGIN of the memory: the ladder's next rung, clear of it, comes first, and tp 2 only where the
    ladder has nothing else, with a note saying so."""
    def infer(**kwargs):
        return plan(resolve("llama-2-70b"), "infer", GpuTarget(H100, 2, 77e9, described=True), seq_len=128,
                    new_tokens=128, batch_sizes=[1], **kwargs)
    result = infer()
    by_layout = {(a.candidate.precision, a.candidate.strategy, a.candidate.gpus): a for a in result.feasible}
    tp2 = by_layout[("bf16-pure", "tp", 2)]
    assert tp2.fits and not tp2.clear and tp2.predicted_peak > (1 - RETRY_MARGIN) * 77e9
    assert result.chosen.clear and result.chosen.candidate.precision != "bf16-pure"
    bf16_only = infer(precisions=["bf16-pure"])
    assert bf16_only.chosen.candidate == tp2.candidate
    assert any(f"within {RETRY_MARGIN:.1%} of the GPU's memory" in note for note in bf16_only.notes)
    assert f"{RETRY_MARGIN:.1%}" == "9.2%"


# ---- 2. the precision ladder ---------------------------------------------------------------------

def test_first_fitting_rung_wins_over_a_faster_later_rung():
    # default ladder bf16-pure, int8, nf4; on a GPU of 94 GB bf16-pure does not fit and int8's 74 GB are
    # clear of the allocator-retry margin
    result = plan(resolve("llama-2-70b"), "infer", GpuTarget(H100, 1, 94e9, described=True), seq_len=128,
                  new_tokens=128, batch_sizes=[1])
    int8 = [a for a in result.feasible if a.candidate.precision == "int8"]
    nf4 = [a for a in result.feasible if a.candidate.precision == "nf4"]
    assert int8 and nf4
    # nf4 reads about half the bytes per decode step, so it is faster, yet int8 comes first.
    assert max(a.speed.tokens_per_s for a in nf4) > max(a.speed.tokens_per_s for a in int8)
    assert result.chosen.candidate.precision == "int8"


@pytest.mark.parametrize("ladder", [["bf16-pure", "nf4"], ["nf4", "bf16-pure"], ["int8", "bf16-pure", "nf4"]])
def test_ladder_that_starts_with_a_fitting_precision_chooses_it(ladder):
    result = infer_70b(4, precisions=ladder)
    assert result.chosen.candidate.precision == ladder[0]
    first = [a for a in result.feasible if a.candidate.precision == ladder[0]]
    later = [a for a in result.feasible if a.candidate.precision != ladder[0]]
    # Only layouts the run can launch fit (quantized weights are not split by tensor parallelism); within
    # the rung, the fastest forecast; the ranked list starts with the chosen one.
    assert all(a.candidate.layout.problem(resolve("llama-2-70b"), "infer", a.candidate.precision, "native") is None
               for a in result.feasible)
    if ladder[0] != "bf16-pure":
        assert all(a.candidate.layout.tp == 1 for a in first)
    # int8's replicas (74 GB each of 80) fit, within the allocator-retry margin: not chosen
    assert result.chosen.clear
    assert result.chosen.forecast_tokens_per_s == max(a.forecast_tokens_per_s for a in first if a.clear)
    assert result.feasible[0] is result.chosen
    clear = [a.candidate.precision for a in result.feasible if a.clear]
    assert list(result.feasible[:len(clear)]) == [a for a in result.feasible if a.clear]
    assert clear == sorted(clear, key=ladder.index)
    if ladder[0] == "bf16-pure":
        # 4-bit weights read a quarter of the bytes: a later rung would be faster.
        assert max(a.forecast_tokens_per_s for a in later) > result.chosen.forecast_tokens_per_s


def test_equal_roofline_prefers_fewer_gpus():
    # One micro-batch through S stages takes S x (1/S) of the time (a bubble of (S - 1) / S), no faster
    # than one GPU, and its activations cross each boundary forward and their gradient back.
    result = plan(resolve("7B"), "train", GpuTarget(H100, 4, 80e9, described=True), seq_len=512, new_tokens=1,
                  batch_sizes=[1], precisions=["bf16-pure"], strategies=["single", "pipeline"], checkpointing=[False])
    seconds = {a.candidate.gpus: 512 / a.speed.tokens_per_s for a in result.feasible}
    assert set(seconds) == {1, 2, 4}
    for stages in (2, 4):
        sends = 2 * (stages - 1) * (NVLINK_LATENCY_S + 512 * LLAMA2_7B["h"] * 2 / NVLINK4_PER_DIRECTION)
        assert seconds[stages] == pytest.approx(seconds[1] + sends, rel=1e-9)
    assert result.chosen.candidate.gpus == 1


# ---- 3. rejected candidates and layouts ----------------------------------------------------------

def test_every_rejection_has_a_reason_and_tp3_is_rejected_for_64_heads():
    result = infer_70b(3)
    assert result.rejected
    for rejected in result.rejected:
        assert not rejected.fits and rejected.reason and rejected.reason.strip()
    tp3 = [a for a in result.rejected if a.candidate.strategy == "tp" and a.candidate.gpus == 3]
    assert {a.candidate.precision for a in tp3} == {"bf16-pure", "int8", "nf4"}
    for rejected in tp3:
        assert "3 ranks do not divide the model's 64 heads" in rejected.reason
    # 80 layers split unevenly into 3 stages: 27, 27 and 26 (80 % 3 == 2)
    pipeline3 = [a for a in result.feasible if a.candidate.strategy == "pipeline" and a.candidate.gpus == 3]
    assert pipeline3
    for feasible in pipeline3:
        assert len(feasible.memory.stage.layers) in (26, 27)
    for feasible in result.feasible:
        assert feasible.fits and feasible.reason is None and feasible.predicted_peak <= 80e9
    # Nothing asks for more GPUs than the three there are.
    assert {a.candidate.gpus for a in (*result.feasible, *result.rejected)} == {1, 2, 3}


def test_tp_stays_in_one_node_and_replicates_kv_heads_it_cannot_split():
    arch = resolve("llama-2-70b")
    result = plan(arch, "infer", GpuTarget(H100, 16, 80e9, described=True), seq_len=128,
                  new_tokens=128, batch_sizes=[1], precisions=["bf16-pure"], strategies=["tp"])
    assert result.feasible and all(a.candidate.layout.tp <= 8 for a in (*result.feasible, *result.rejected))
    tp16 = Candidate.of_strategy("bf16-pure", "tp", 16, False, 1)
    beyond = assess(arch, "infer", tp16, GpuTarget(H100, 16, 80e9, described=True), seq_len=128, new_tokens=128)
    assert not beyond.fits and "more than the 8 GPUs of one node" in beyond.reason
    # on a node of 16, 64 heads split 16 ways; the 8 kv heads do not: each rank caches all of them
    wide = GpuTarget(H100, 16, 80e9, described=True, node_gpus=16)
    caches = [{t.name: t.bytes for t in assess(arch, "infer", Candidate("bf16-pure", Layout(tp=tp), False, 1), wide,
                                               seq_len=128, new_tokens=128).memory.terms}["KV cache"]
              for tp in (8, 16)]
    assert caches[1] == 8 * caches[0] == kv_bytes_per_token(LLAMA2_70B) * (128 + 128)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 6])
def test_candidates_never_need_more_gpus_than_exist(count):
    result = plan(resolve("7B"), "train", GpuTarget(H100, count, 80e9, described=True), seq_len=256, new_tokens=1,
                  batch_sizes=[1, 2])
    proposed = {a.candidate.gpus for a in (*result.feasible, *result.rejected)}
    assert max(proposed) == count
    assert all("GPUs;" not in (a.reason or "") for a in result.rejected)
    # assess itself refuses a layout wider than the target.
    wide = assess(resolve("7B"), "train", Candidate.of_strategy("bf16", "fsdp", count + 1, False, 1),
                  GpuTarget(H100, count, 80e9, described=True), seq_len=256, new_tokens=1)
    assert not wide.fits and f"needs {count + 1} GPUs; {count} available" in wide.reason


# ---- 4. automatic batch size ---------------------------------------------------------------------

@pytest.mark.parametrize("model, mode, memory, seq_len", [
    ("7B", "train", 80e9, 512), ("1B", "train", 40e9, 2048), ("7B", "infer", 24e9, 512), ("small", "train", 24e9, 512),
])
def test_auto_batch_is_the_largest_clear_of_the_retry_margin(model, mode, memory, seq_len):
    """Each layout's automatic batch is the largest predicted within (1 - RETRY_MARGIN) of the memory;
    one more sequence would bring the step to the edge where the allocator retries, or past it."""
    arch, target = resolve(model), GpuTarget(H100, 1, memory, described=True)
    result = plan(arch, mode, target, seq_len=seq_len, new_tokens=128, batch_sizes=None)
    assert result.chosen is not None and result.chosen.clear
    for chosen in result.feasible:
        b = chosen.candidate.batch_size
        assert 1 <= b < MAX_AUTO_BATCH
        here = assess(arch, mode, chosen.candidate, target, seq_len=seq_len, new_tokens=128)
        above = assess(arch, mode, replace(chosen.candidate, batch_size=b + 1), target, seq_len=seq_len,
                       new_tokens=128)
        if here.clear:
            assert here.predicted_peak <= (1 - RETRY_MARGIN) * memory
            assert not above.clear and above.predicted_peak > (1 - RETRY_MARGIN) * memory
        else:  # batch 1 is already at the edge: the largest that fits, as before
            assert b == 1 or (here.fits and not above.fits)


@pytest.mark.parametrize("model, mode, precision, seq_len", [
    ("1B", "train", "bf16", 2048), ("7B", "train", "bf16-pure", 512), ("7B", "infer", "bf16-pure", 512),
    ("7B", "infer", "nf4", 2048),
])
def test_auto_batch_grows_with_gpu_memory(model, mode, precision, seq_len):
    batches = []
    for memory in (24e9, 40e9, 48e9, 80e9, 94e9, 141e9, 192e9):
        result = plan(resolve(model), mode, GpuTarget(None, 1, memory, described=True), seq_len=seq_len,
                      new_tokens=128, batch_sizes=None, precisions=[precision], checkpointing=[False])
        batches.append(result.chosen.candidate.batch_size if result.chosen else 0)
    assert batches == sorted(batches), batches
    assert batches[-1] > batches[0]


# ---- 5. minimum GPU counts -----------------------------------------------------------------------

def layouts(arch, mode: str, gpus: int, precision: str, batch: int):
    for layout in layouts_for(arch, mode, gpus):
        for recompute in ([False, True] if mode == "train" else [False]):
            yield Candidate(precision, layout, recompute, batch)


@pytest.mark.parametrize("model, mode, precision, seq_len, expected", [
    ("7B", "train", "bf16", 512, None),  # 16 B/parameter = 107.8 GB > 80 GB: more than one
    ("7B", "infer", "bf16-pure", 512, 1),  # 2 B/parameter = 13.5 GB
    ("llama-2-70b", "infer", "bf16-pure", 128, 2),  # 137.95 GB of weights: two halves of 69.5 GB
])
def test_minimum_gpus(model, mode, precision, seq_len, expected):
    arch = resolve(model)
    need = minimum_gpus(arch, mode, precision, 80e9, seq_len=seq_len, new_tokens=128)
    assert need is not None
    count, how = need
    if expected is None:
        assert 16 * P7 > 80e9 and count > 1
    else:
        assert count == expected
    target = GpuTarget(None, 64, 80e9, described=True)
    fitting = [c.label for c in layouts(arch, mode, count, precision, 1)
               if assess(arch, mode, c, target, seq_len=seq_len, new_tokens=128).fits]
    assert how in fitting
    if count > 1:
        for candidate in layouts(arch, mode, count - 1, precision, 1):
            assert not assess(arch, mode, candidate, target, seq_len=seq_len, new_tokens=128).fits, candidate.label


def test_minimum_gpus_agrees_with_the_planner():
    arch = resolve("llama-2-70b")
    count, _ = minimum_gpus(arch, "infer", "bf16-pure", 80e9, seq_len=128, new_tokens=128)
    fewer = infer_70b(count - 1, precisions=["bf16-pure"])
    enough = infer_70b(count, precisions=["bf16-pure"])
    assert fewer.chosen is None
    assert enough.chosen is not None and enough.chosen.candidate.gpus == count


# ---- 6. the roofline -----------------------------------------------------------------------------

def test_decode_at_batch_1_is_memory_bound_at_hbm_bandwidth():
    arch = resolve("7B")
    speed = estimate_step_time(arch, "infer", "bf16-pure", 1, 128, new_tokens=128, parallelism=Parallelism(),
                               gpu_name=H100)
    # every weight but the untied embedding table, of which one row (batch 1)
    weight_bytes = 2 * (P7 - LLAMA2_7B["V"] * LLAMA2_7B["h"] + LLAMA2_7B["h"])
    # the CUDA graph's step reads every slot of the cache: 128 prompt + 128 new positions
    kv_bytes = kv_bytes_per_token(LLAMA2_7B) * (128 + 128)  # 524,288 B per token
    assert speed.bound == "memory"
    assert speed.seconds == pytest.approx((weight_bytes + kv_bytes) / H100_BANDWIDTH, rel=1e-9)
    assert speed.tokens_per_s == pytest.approx(1 / speed.seconds, rel=1e-12)
    assert speed.compute_s == pytest.approx(2 * matmul_params(LLAMA2_7B) / H100_BF16_FLOPS, rel=1e-9)
    # Same step on an H200: only the bandwidth changes.
    h200 = estimate_step_time(arch, "infer", "bf16-pure", 1, 128, new_tokens=128, parallelism=Parallelism(),
                              gpu_name="NVIDIA H200")
    assert h200.seconds == pytest.approx((weight_bytes + kv_bytes) / H200_BANDWIDTH, rel=1e-9)
    # The planner reports the same figure for the one-GPU candidate.
    chosen = assess(arch, "infer", Candidate("bf16-pure", Layout(), False, 1), GpuTarget(H100, 1, 80e9, True),
                    seq_len=128, new_tokens=128)
    assert chosen.speed.seconds == pytest.approx((weight_bytes + kv_bytes) / H100_BANDWIDTH, rel=1e-9)


def test_decode_step_bytes_by_hand_eager_autocast_and_tied():
    s, batch, prompt, new = LLAMA2_7B, 4, 128, 64
    arch = resolve("7B")
    table, rows = s["V"] * s["h"], batch * s["h"]
    norms = s["L"] * 2 * s["h"] + s["h"]
    matrices = P7 - table - norms  # every matmul weight, the untied output projection included

    def step(precision, **options):
        return estimate_step_time(arch, "infer", precision, batch, prompt, new_tokens=new,
                                  parallelism=Parallelism(), gpu_name=H100, **options)

    # eager decoding reads positions 0..p at position p: on average prompt + new / 2
    eager = step("bf16-pure", whole_cache=False)
    kv_eager = batch * kv_bytes_per_token(s) * (prompt + new / 2)
    assert eager.memory_s == pytest.approx((2 * (P7 - table + rows) + kv_eager) / H100_BANDWIDTH, rel=1e-12)
    # autocast over fp32 weights: 4 B read, 2 B written and read again per matmul weight; norms 4 B;
    # the table's rows in fp32; the KV cache in bf16
    autocast = step("bf16", whole_cache=False)
    weights = 8 * matrices + 4 * norms + 4 * rows
    assert autocast.memory_s == pytest.approx((weights + kv_eager) / H100_BANDWIDTH, rel=1e-12)

    # tied (1B, Llama-3.2-1B's shape): the output projection reads the whole table; nothing is subtracted
    one = resolve("1B")
    h, L, V, kv_heads, f = 2048, 16, 32000, 8, 8192
    d = h // 32
    params = L * (2 * h * h + 2 * h * kv_heads * d + 3 * h * f + 2 * h) + V * h + h
    tied = estimate_step_time(one, "infer", "bf16-pure", batch, prompt, new_tokens=new, parallelism=Parallelism(),
                              gpu_name=H100)
    kv_whole = batch * 2 * L * kv_heads * d * 2 * (prompt + new)
    assert tied.memory_s == pytest.approx((2 * params + kv_whole) / H100_BANDWIDTH, rel=1e-12)
    tied_autocast = estimate_step_time(one, "infer", "bf16", batch, prompt, new_tokens=new, parallelism=Parallelism(),
                                       gpu_name=H100)
    tied_norms = L * 2 * h + h
    assert tied_autocast.memory_s == pytest.approx((8 * (params - tied_norms) + 4 * tied_norms + kv_whole)
                                                   / H100_BANDWIDTH, rel=1e-12)


def hand_train_flops_per_token(s: dict, seq_len: int, recompute: bool = False) -> float:
    """6 N + 12 L h T (PaLM), or 8 N + 16 L h T when the forward pass runs twice."""
    forward = 2 * matmul_params(s) + 4 * s["L"] * s["h"] * seq_len
    return (4 if recompute else 3) * forward


def test_training_roofline_ddp_by_hand():
    batch, seq_len, g = 4, 2048, 4
    speed = estimate_step_time(resolve("7B"), "train", "bf16", batch, seq_len, new_tokens=1,
                               parallelism=Parallelism("ddp", g), gpu_name=H100)
    n = batch * seq_len
    compute = n * hand_train_flops_per_token(LLAMA2_7B, seq_len) / H100_BF16_FLOPS
    # fp32 master weights read 3 times, AdamW touching weights, gradients and both moments.
    memory = (3 * 4 * P7 + 4 * 4 * P7) / H100_BANDWIDTH
    # fp32 gradients, ring all-reduce, one message per 25 MiB bucket
    buckets = math.ceil(4 * P7 / (25 * 2**20))
    allreduce = buckets * NVLINK_LATENCY_S + 2 * (g - 1) / g * 4 * P7 / NVLINK4_PER_DIRECTION
    # The buckets are all-reduced during the backward pass (2/3 of the step); the input embedding's
    # gradient (fp32, 524 MB, more than a 25 MiB bucket) forms last and is reduced after it.
    last = NVLINK_LATENCY_S + 2 * (g - 1) / g * 4 * LLAMA2_7B["V"] * LLAMA2_7B["h"] / NVLINK4_PER_DIRECTION
    busy = max(compute, memory)
    seconds = busy / 3 + max(2 * busy / 3, allreduce - last) + last
    assert speed.communication_s == pytest.approx(allreduce, rel=1e-9)
    assert speed.seconds == pytest.approx(seconds, rel=1e-9)
    assert speed.tokens_per_s == pytest.approx(n * g / seconds, rel=1e-9)
    assert speed.bound == "compute"
    # hidden but the last bucket: more than 99% of the step is compute
    assert speed.seconds < 1.01 * compute


def test_training_roofline_fsdp_by_hand():
    batch, seq_len, g = 4, 2048, 4
    speed = estimate_step_time(resolve("7B"), "train", "bf16", batch, seq_len, new_tokens=1,
                               parallelism=Parallelism("fsdp", g), gpu_name=H100)
    n = batch * seq_len
    compute = n * hand_train_flops_per_token(LLAMA2_7B, seq_len) / H100_BF16_FLOPS
    # bf16 gathered weights read 3 times; AdamW on this rank's quarter of the fp32 state
    memory = (3 * 2 * P7 + 4 * 4 * P7 / g) / H100_BANDWIDTH
    busy = max(compute, memory)
    ring = (g - 1) / g / NVLINK4_PER_DIRECTION
    root, L, latency = edge_params(LLAMA2_7B), LLAMA2_7B["L"], NVLINK_LATENCY_S  # one message per unit
    gather_forward = (L + 1) * latency + ring * 2 * P7  # bf16, every unit
    first = 2 * latency + ring * 2 * (root + layer_params(LLAMA2_7B))  # the root and the first layer, first
    gather_backward = L * latency + ring * 2 * (P7 - root)  # the root stays gathered
    reduce = (L + 1) * latency + ring * 4 * P7  # fp32 reduce dtype
    root_reduce = latency + ring * 4 * root  # the root's reduce-scatter, after the backward pass
    seconds = (max(busy / 3, gather_forward - first) + first
               + max(2 * busy / 3, gather_backward + reduce - root_reduce) + root_reduce)
    assert speed.communication_s == pytest.approx(gather_forward + gather_backward + reduce, rel=1e-9)
    assert speed.seconds == pytest.approx(seconds, rel=1e-9)
    assert speed.tokens_per_s == pytest.approx(n * g / seconds, rel=1e-9)
    # at batch 1 x 512 the collectives outlast the compute in both passes: the step is theirs
    small = estimate_step_time(resolve("7B"), "train", "bf16", 1, 512, new_tokens=1,
                               parallelism=Parallelism("fsdp", g), gpu_name=H100)
    assert small.bound == "communication" and small.communication_s > 3 * small.compute_s
    assert small.seconds == pytest.approx(small.communication_s, rel=1e-12)


def test_a_measured_bus_bandwidth_replaces_the_datasheet():
    measured = replace(DEFAULT, all_reduce_bus_bandwidth=100e9, all_gather_bus_bandwidth=150e9,
                       collectives_source="measured on 2 x NVIDIA H200 with nccl")
    links = bus_bandwidth("NVIDIA H200", measured)
    assert (links.all_reduce, links.all_gather, links.source) == (100e9, 150e9, "measured on 2 x NVIDIA H200 with nccl")
    default = bus_bandwidth("NVIDIA H200", DEFAULT)
    assert default.all_reduce == default.all_gather == NVLINK4_PER_DIRECTION and "datasheet" in default.source
    assert bus_bandwidth("NVIDIA L4").all_reduce == PCIE4_PER_DIRECTION
    g = 2
    # a calibration stored before latencies were measured: the interconnect's default per message
    assert links.all_reduce_latency == links.all_gather_latency == NVLINK_LATENCY_S
    buckets, L = math.ceil(4 * P7 / (25 * 2**20)), LLAMA2_7B["L"]
    for strategy, expected in (("ddp", buckets * NVLINK_LATENCY_S + 2 * (g - 1) / g * 4 * P7 / 100e9),
                               ("fsdp", (3 * L + 2) * NVLINK_LATENCY_S
                                + (g - 1) / g * (2 * P7 + 2 * (P7 - edge_params(LLAMA2_7B)) + 4 * P7) / 150e9)):
        speed = estimate_step_time(resolve("7B"), "train", "bf16", 1, 512, new_tokens=1,
                                   parallelism=Parallelism(strategy, g), gpu_name="NVIDIA H200", links=links)
        assert speed.communication_s == pytest.approx(expected, rel=1e-9), strategy
    # the planner takes it from the calibration
    target = GpuTarget("NVIDIA H200", 2, H200_TOTAL_MEMORY, described=True)
    slow, fast = (assess(resolve("7B"), "train", Candidate("bf16-pure", Layout(dp_shard=2), False, 1), target, seq_len=512,
                         new_tokens=1, calibration=c).speed for c in (measured, DEFAULT))
    assert slow.communication_s > fast.communication_s


def test_training_roofline_tp_by_hand():
    batch, seq_len, tp = 4, 2048, 4
    speed = estimate_step_time(resolve("7B"), "train", "bf16", batch, seq_len, new_tokens=1,
                               parallelism=Parallelism("tp", tp), gpu_name=H100)
    n = batch * seq_len
    compute = n * hand_train_flops_per_token(LLAMA2_7B, seq_len) / (H100_BF16_FLOPS * tp)
    memory = (3 * 4 * P7 + 4 * 4 * P7) / (H100_BANDWIDTH * tp)
    # Two all-reduces of the bf16 activations per layer forward, two backward, each a message.
    per_layer = 2 * (NVLINK_LATENCY_S * NVLINK4_PER_DIRECTION + 2 * (tp - 1) / tp * n * LLAMA2_7B["h"] * 2)
    communication = 2 * LLAMA2_7B["L"] * per_layer / NVLINK4_PER_DIRECTION
    seconds = max(compute, memory) + communication
    assert speed.communication_s == pytest.approx(communication, rel=1e-9)
    assert speed.seconds == pytest.approx(seconds, rel=1e-9)
    assert speed.tokens_per_s == pytest.approx(n / seconds, rel=1e-9)  # one data-parallel rank


def test_activation_checkpointing_costs_a_third_more_compute():
    arch, batch, seq_len = resolve("7B"), 4, 2048
    plain, recompute = (estimate_step_time(arch, "train", "bf16", batch, seq_len, new_tokens=1,
                                           parallelism=Parallelism(), gpu_name=H100, activation_checkpointing=ac)
                        for ac in (False, True))
    n = batch * seq_len
    assert recompute.compute_s == pytest.approx(n * hand_train_flops_per_token(LLAMA2_7B, seq_len, True)
                                                / H100_BF16_FLOPS, rel=1e-9)
    assert recompute.compute_s / plain.compute_s == pytest.approx(4 / 3, rel=1e-12)
    assert plain.bound == recompute.bound == "compute"
    assert recompute.seconds == pytest.approx(4 / 3 * plain.seconds, rel=1e-9)
    assert recompute.tokens_per_s < plain.tokens_per_s


def test_unknown_gpu_names_use_h100_figures_and_say_so():
    target = GpuTarget(None, 1, 80e9, described=True)
    assert target.speed_name == H100
    assert GpuTarget("Some Future GPU", 1, 80e9, described=True).speed_name == H100
    assert GpuTarget("NVIDIA H200", 1, 141e9, described=True).speed_name == "NVIDIA H200"
    result = plan(resolve("tiny"), "infer", target, seq_len=64, new_tokens=8, batch_sizes=[1])
    assert any(H100 in note for note in result.notes)
    with pytest.raises(ValueError):
        estimate_step_time(resolve("tiny"), "infer", "bf16-pure", 1, 64, new_tokens=8, parallelism=Parallelism(),
                           gpu_name="Some Future GPU")


# ---- 7. calibration and overheads ----------------------------------------------------------------

def test_default_calibration_constants():
    assert DEFAULT.workspace_training == 2 * 32 * MIB  # two cuBLAS handles of 32 MiB
    assert DEFAULT.workspace_inference == 2 * 32 * MIB  # the forward stream's and the decode graph's
    assert DEFAULT.workspace_eager == 32 * MIB  # one stream
    # NVML minus reserved on each rank of 2 x H200 training (1.682 GB) less one GPU's context (0.795 GB)
    assert DEFAULT.nccl_per_communicator == round(1.682e9 - 0.795e9)
    assert [DEFAULT.context(mode) for mode in ("train", "forward-backward", "infer", "forward")] == [
        795e6, 795e6, 797e6, 721e6]
    assert (DEFAULT.context("infer", decode_graph=False), DEFAULT.workspace("infer", decode_graph=False)) == (
        721e6, 32 * MIB)
    # A calibration stored before the eager figures existed answers with its inference ones.
    old = Calibration(1e9, 0.9e9, 70e6, 35e6, 300e6, "measured before")
    assert (old.context("forward"), old.workspace("forward")) == (0.9e9, 35e6)
    assert Calibration.page_rounding(3 * MIB) == MIB
    assert Calibration.page_rounding(4 * MIB) == 0


def test_calibration_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("FITBENCH_CACHE_DIR", str(tmp_path / "store"))
    measured = Calibration(1.1e9, 0.9e9, 70e6, 35e6, 300e6, "measured on NVIDIA H100 80GB HBM3 for a test")
    other = Calibration(2e9, 1e9, 1e6, 2e6, 3e6, "measured on NVIDIA H200 for a test")
    path = save_calibration(H100, measured)
    save_calibration("NVIDIA H200", other)
    assert path == tmp_path / "store" / "calibration.json" == calibration_path()
    assert load_calibration(H100) == measured
    assert load_calibration("NVIDIA H200") == other
    stored = json.loads(path.read_text())
    assert set(stored) == {f"{H100}|torch {torch.__version__}", f"NVIDIA H200|torch {torch.__version__}"}
    assert load_calibration("NVIDIA A100-SXM4-80GB") == DEFAULT
    assert load_calibration(None) == DEFAULT


UNREADABLE = ["{not json", "", "[1, 2]", "null", json.dumps({f"{H100}|torch {torch.__version__}": {"x": 1}})]


def write_calibration_file(content: str) -> None:
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)


@pytest.mark.parametrize("content", UNREADABLE)
def test_unreadable_calibration_falls_back_to_default(content):
    write_calibration_file(content)
    assert load_calibration(H100) == DEFAULT


@pytest.mark.parametrize("content", UNREADABLE)
def test_saving_over_an_unreadable_calibration_file(content):
    write_calibration_file(content)
    measured = replace(DEFAULT, source="measured again")
    save_calibration(H100, measured)
    assert load_calibration(H100) == measured


def names(terms) -> list[str]:
    return [t.name for t in terms]


def test_fragmentation_overhead_late_in_the_backward_pass():
    arch = resolve("small")  # CS336 small: h 768, f 3072, 12 heads, vocab 10000
    candidate = Candidate("bf16", Layout(), False, 2)
    memory = estimate_memory(arch, "train", "bf16", 2, 128)
    assert memory.peak_moment == "end of the backward pass"
    terms = overhead_terms(arch, "train", candidate, memory, memory.peak_moment, 128, DEFAULT)
    assert names(terms) == ["CUDA context", "workspaces", "allocator fragmentation"]
    # One layer's saved activations under autocast (fp32 residual, bf16 compute), multi-head
    # attention, tensor by tensor from the memory model's docstring:
    # 2 norms x (4nh + 4n) + 2nh (q/k/v input) + (2nh + 2 x 2nh + 2nh + 4nH) (attention)
    # + 2nh (gate/up input) + 3 x 2nf (SwiGLU) = 20 nh + 6 nf + 8 n + 4 nH
    n, h, f, H = 2 * 128, 768, 3072, 12
    assert terms[2].bytes == 20 * n * h + 6 * n * f + 8 * n + 4 * n * H == 8_665_088
    assert terms[0].bytes == 795e6 and terms[1].bytes == 2 * 32 * MIB


def test_page_rounding_overhead_when_the_peak_is_early_or_in_inference():
    arch = resolve("small")
    for mode, precision, batch, seq_len in (("train", "bf16", 32, 512), ("infer", "bf16-pure", 1, 128)):
        candidate = Candidate(precision, Layout(), False, batch)
        memory = estimate_memory(arch, mode, precision, batch, seq_len, new_tokens=16)
        assert memory.peak_moment in ("start of the backward pass", "prefill MLP", "output projection")
        terms = overhead_terms(arch, mode, candidate, memory, memory.peak_moment, seq_len, DEFAULT)
        assert names(terms) == ["CUDA context", "workspaces", "allocator page rounding"]
        page = 2 * MIB
        assert terms[2].bytes == math.ceil(memory.peak_bytes / page) * page - memory.peak_bytes
        assert 0 <= terms[2].bytes < page
        assessed = assess(arch, mode, candidate, GpuTarget(H100, 1, 80e9, True), seq_len=seq_len, new_tokens=16)
        context = {"train": 795e6, "infer": 797e6, "forward": 721e6}[mode]
        workspace = 32 * MIB if mode == "forward" else 2 * 32 * MIB
        # The predicted peak is the tensors rounded up to a whole page, plus context and workspaces.
        assert assessed.predicted_peak == pytest.approx(math.ceil(memory.peak_bytes / page) * page + context
                                                        + workspace, rel=1e-12)


def test_nccl_buffers_only_with_several_gpus():
    arch = resolve("small")
    for strategy, gpus in (("single", 1), ("tp", 2), ("ddp", 2), ("fsdp", 4), ("pipeline", 2)):
        candidate = Candidate.of_strategy("bf16", strategy, gpus, False, 2)
        memory = estimate_memory(arch, "train", "bf16", 2, 128, parallelism=candidate.parallelism)
        terms = overhead_terms(arch, "train", candidate, memory, memory.peak_moment, 128, DEFAULT)
        nccl = [t.bytes for t in terms if t.name == "NCCL buffers"]
        assert nccl == ([] if gpus == 1 else [DEFAULT.nccl_per_communicator])
    # a generation's tensor-parallel communicator holds the figure measured for it; FSDP x TP's two hold
    # one figure each, and a generation over stages of TP 2 the stages' and the tensor-parallel one
    for mode, candidate, expected in (
            ("infer", Candidate.of_strategy("bf16", "tp", 2, False, 2), NCCL_TENSOR_PARALLEL_GENERATION),
            ("train", Candidate("bf16", Layout(dp_shard=2, tp=2), False, 2),
             2 * DEFAULT.nccl_per_communicator),
            ("infer", Candidate("bf16", Layout(tp=2, pp=2), False, 2),
             DEFAULT.nccl_per_communicator + NCCL_TENSOR_PARALLEL_GENERATION)):
        memory = estimate_memory(arch, mode, "bf16", 2, 128, parallelism=candidate.parallelism)
        terms = overhead_terms(arch, mode, candidate, memory, memory.peak_moment, 128, DEFAULT)
        assert [t.bytes for t in terms if t.name == "NCCL buffers"] == [expected]


# ---- 8. predict_spec, as `fitbench run` uses it on a GPU ----------------------------------------

def spec_7b(precision="bf16", batch=1, seq_len=512, mode="train"):
    return RunSpec(model="7B", backend="native", mode=mode, precision=precision, batch_size=batch, seq_len=seq_len,
                   new_tokens=8, device="cuda:0", warmup_steps=1, measure_steps=1)


TARGET_80 = GpuTarget(H100, 1, 80e9, described=False)
PREDICTION_KEYS = {"predicted_peak_bytes", "tensor_peak_bytes", "peak_moment", "terms", "fits", "chosen_by_planner",
                   "rejected", "gpu_memory_bytes", "step_time_estimate_s", "step_time_forecast_s", "calibration"}


def test_predict_spec_chooses_bf16_pure_for_7b_training_on_80gb():
    planned, prediction = predict_spec(resolve("7B"), spec_7b(), TARGET_80, DEFAULT, choose_precision=True,
                                       choose_recompute=False, runnable=PRECISIONS)
    assert planned.precision == "bf16-pure" and not planned.activation_checkpointing
    assert prediction["chosen_by_planner"] == ["precision"]
    assert PREDICTION_KEYS <= set(prediction)
    assert prediction["fits"] is True
    # bf16-pure: 2 (weights) + 2 (gradients) + 4 (AdamW) bytes per parameter = 53.9 GB.
    assert 8 * P7 < prediction["predicted_peak_bytes"] <= 80e9
    assert prediction["tensor_peak_bytes"] < prediction["predicted_peak_bytes"]
    assert prediction["peak_moment"] in ("start of the backward pass", "backward of the first layer",
                                         "end of the backward pass")
    at_peak = sum(t["bytes"] for t in prediction["terms"] if t["at_peak"])
    assert at_peak == pytest.approx(prediction["predicted_peak_bytes"], rel=1e-12)
    assert {"weights", "gradients", "optimizer state", "CUDA context"} <= {t["name"] for t in prediction["terms"]}
    # bf16 autocast was tried first and needs 16 bytes per parameter, 107.8 GB.
    assert len(prediction["rejected"]) == 1 and prediction["rejected"][0].startswith("bf16, 1 GPU")
    assert needed_gb(prediction["rejected"][0]) > 16 * P7 / GB
    assert prediction["gpu_memory_bytes"] == 80e9
    assert prediction["step_time_estimate_s"] > 0


def test_predict_spec_keeps_the_users_precision():
    planned, prediction = predict_spec(resolve("7B"), spec_7b(), TARGET_80, DEFAULT, choose_precision=False,
                                       choose_recompute=False, runnable=PRECISIONS)
    assert planned.precision == "bf16"
    assert prediction["fits"] is False
    assert prediction["predicted_peak_bytes"] > 16 * P7 > 80e9
    assert prediction["chosen_by_planner"] == []
    assert PREDICTION_KEYS <= set(prediction)


def test_predict_spec_turns_on_recompute_when_only_that_fits():
    # bf16-pure, 8 x 2048 tokens: at the start of the backward pass, weights and AdamW state (6 B x P)
    # beside 32 layers of saved activations, 16 nh + 6 nf + 8 n + 4 nH bytes each (16-bit residuals).
    n, h, f, H = 8 * 2048, 4096, 11008, 32
    assert 6 * P7 + 32 * (16 * n * h + 6 * n * f + 8 * n + 4 * n * H) > 80e9
    planned, prediction = predict_spec(resolve("7B"), spec_7b("bf16-pure", 8, 2048), TARGET_80, DEFAULT,
                                       choose_precision=False, choose_recompute=True, runnable=PRECISIONS)
    assert planned.precision == "bf16-pure" and planned.activation_checkpointing
    assert prediction["fits"] and prediction["chosen_by_planner"] == ["activation_checkpointing"]
    # Only precisions that can run are considered.
    planned, prediction = predict_spec(resolve("7B"), spec_7b(), TARGET_80, DEFAULT, choose_precision=True,
                                       choose_recompute=False, runnable=("bf16",))
    assert planned.precision == "bf16" and not prediction["fits"]


def test_predict_spec_prefers_the_first_rung_without_recompute_when_all_fit():
    # small trains in a few GB: every option fits; bf16 is the first rung, and recomputing costs a
    # third more arithmetic for the same memory traffic, so it is never the faster option.
    spec = RunSpec(model="small", backend="native", mode="train", precision="fp32", batch_size=2, seq_len=128,
                   new_tokens=8, device="cuda:0", warmup_steps=1, measure_steps=1)
    planned, prediction = predict_spec(resolve("small"), spec, TARGET_80, DEFAULT, choose_precision=True,
                                       choose_recompute=True, runnable=PRECISIONS)
    assert (planned.precision, planned.activation_checkpointing) == ("bf16", False)
    assert prediction["fits"] and prediction["rejected"] == []
    assert prediction["chosen_by_planner"] == ["precision", "activation_checkpointing"]


# ---- 8b. offload: layers beyond the GPU in host memory ------------------------------------------

OFFLOAD_SHAPE = dict(seq_len=512, new_tokens=128)


def offload_fits(arch, resident: int, memory: float) -> bool:
    candidate = Candidate("bf16-pure", Layout(), False, 1, resident)
    return assess(arch, "infer", candidate, GpuTarget(H100, 1, memory, True), **OFFLOAD_SHAPE).fits


def test_offload_split_of_llama_2_70b_on_80gb_by_hand():
    arch = resolve("llama-2-70b")
    S = 2 * layer_params(LLAMA2_70B)  # bf16 weights of one layer: 1.71 GB
    # Every layer offloaded: the edges, one layer in flight, the KV cache of 512 + 128 positions, the
    # rotary tables (fp32 cos and sin for 4096 positions x 128), and the prefill's MLP temporaries
    # (3 c n f + 3 r n h + 8 n, n = 512).
    P0 = estimate_memory(arch, "infer", "bf16-pure", 1, 512, new_tokens=128, resident_layers=0).peak_bytes
    n, h, f = 512, LLAMA2_70B["h"], LLAMA2_70B["f"]
    assert P0 == (2 * edge_params(LLAMA2_70B) + S + kv_bytes_per_token(LLAMA2_70B) * 640 + 2 * 4096 * 128 * 4
                  + 3 * 2 * n * f + 3 * 2 * n * h + 8 * n) == 3_087_060_992
    # CUDA context and one cuBLAS workspace of eager decoding, one page of rounding, 1% of the GPU kept free
    overheads = 721e6 + 32 * MIB + 2 * MIB + 0.8e9
    split = offload_split(arch, "infer", "bf16-pure", 1, budget=80e9, calibration=DEFAULT, **OFFLOAD_SHAPE)
    X = 80e9 - overheads - P0 + S
    assert split.layer_bytes == S and split.layer_memory == pytest.approx(X, rel=1e-12)
    assert split.resident_layers == math.floor(X / S) - 1 == 44
    # The split is the most layers that fit in 99% of the GPU with one in flight.
    assert offload_fits(arch, 44, 0.99 * 80e9) and not offload_fits(arch, 45, 0.99 * 80e9)
    # Without a calibration, the tensors alone.
    tensors = offload_split(arch, "infer", "bf16-pure", 1, budget=80e9, **OFFLOAD_SHAPE)
    assert tensors.layer_memory == pytest.approx(80e9 - P0 + S, rel=1e-12)


def test_offload_split_at_its_edges():
    arch = resolve("llama-2-70b")
    S = 2 * layer_params(LLAMA2_70B)
    P0 = estimate_memory(arch, "infer", "bf16-pure", 1, 512, new_tokens=128, resident_layers=0).peak_bytes

    def split(budget: float):
        return offload_split(arch, "infer", "bf16-pure", 1, budget=budget, **OFFLOAD_SHAPE)

    # Room for the rest and one layer in flight, none to keep: every layer offloaded.
    assert split(P0).resident_layers == 0 and split(P0).layer_memory == S
    assert split(P0 - 1).resident_layers == 0 and split(P0 - 1).layer_memory < S  # not even that fits
    assert split(P0 + S).resident_layers == 1
    # The last layer needs no room in flight: all 80 stay once they fit on their own.
    assert split(P0 - S + 80 * S).resident_layers == 80
    assert split(P0 - S + 80 * S - 1).resident_layers == 78
    assert split(1e15).resident_layers == 80


def test_offload_adds_the_host_link_to_the_roofline():
    arch = resolve("llama-2-70b")
    offloaded = 36 * 2 * layer_params(LLAMA2_70B)  # 44 of 80 layers resident
    # offloaded layers decode eagerly, reading the KV cache up to the position, not every slot
    plain = estimate_step_time(arch, "infer", "bf16-pure", 1, 512, new_tokens=128, parallelism=Parallelism(),
                               gpu_name=H100, whole_cache=False)
    for gpu, link in ((H100, PCIE5_PER_DIRECTION), ("NVIDIA H200", PCIE5_PER_DIRECTION),
                      ("NVIDIA A100-SXM4-80GB", PCIE4_PER_DIRECTION)):
        speed = estimate_step_time(arch, "infer", "bf16-pure", 1, 512, new_tokens=128, parallelism=Parallelism(),
                                   gpu_name=gpu, offloaded_bytes=offloaded)
        assert speed.communication_s == pytest.approx(offloaded / link, rel=1e-12)
        assert speed.bound == "communication"
    assert speed.memory_s > plain.memory_s  # the A100's HBM is slower too
    h100 = assess(arch, "infer", Candidate("bf16-pure", Layout(), False, 1, 44), GpuTarget(H100, 1, 80e9, True),
                  **OFFLOAD_SHAPE).speed
    assert h100.seconds == pytest.approx(plain.seconds + offloaded / PCIE5_PER_DIRECTION, rel=1e-9)
    assert h100.tokens_per_s == pytest.approx(1 / h100.seconds, rel=1e-12)  # about 1 token/s


def test_offloaded_candidates_are_one_gpu_inference():
    arch = resolve("llama-2-70b")
    candidate = Candidate.of_strategy("bf16-pure", "tp", 2, False, 1, 40)
    rejected = assess(arch, "infer", candidate, GpuTarget(H100, 2, 80e9, True), **OFFLOAD_SHAPE)
    assert not rejected.fits and "one GPU" in rejected.reason
    assert "offload (40 layers on the GPU)" in candidate.label


def test_predict_spec_keeps_on_the_gpu_the_layers_that_fit():
    # 65B in bf16 is 131 GB: it does not fit on one 80 GB GPU, offloaded it does.
    spec = RunSpec(model="65B", backend="native", mode="infer", precision="bf16-pure", batch_size=1, seq_len=128,
                   new_tokens=128, device="cuda:0", warmup_steps=1, measure_steps=1)
    arch = resolve("65B")
    _, plain = predict_spec(arch, spec, TARGET_80, DEFAULT, choose_precision=False, choose_recompute=False,
                            runnable=PRECISIONS)
    assert not plain["fits"] and plain["resident_layers"] is None
    offloaded = spec.model_copy(update={"offload": True})
    planned, prediction = predict_spec(arch, offloaded, TARGET_80, DEFAULT, choose_precision=True,
                                       choose_recompute=False, runnable=PRECISIONS)
    assert planned == offloaded  # quantized rungs are not for offload; bf16-pure stays
    split = offload_split(arch, "infer", "bf16-pure", 1, seq_len=128, new_tokens=128, budget=80e9, calibration=DEFAULT)
    assert prediction["fits"] and prediction["resident_layers"] == split.resident_layers == 46
    assert prediction["predicted_peak_bytes"] <= 80e9
    terms = {t["name"]: t["bytes"] for t in prediction["terms"]}
    assert terms["offloaded layer in flight"] == split.layer_bytes
    # 34 layers, 55 GB, cross PCIe Gen5 for every token.
    assert prediction["step_time_estimate_s"] > 34 * split.layer_bytes / PCIE5_PER_DIRECTION


# ---- 9. the commands -----------------------------------------------------------------------------

PLAN_70B = ["plan", "--models", "llama-2-70b", "--mode", "infer", "--gpus", "4", "--gpu-memory", "80GB"]


def test_plan_command_prints_the_breakdown_and_the_rejections(capsys):
    code, out, err = cli(PLAN_70B, capsys)
    assert code == 0, err
    assert "llama-2-70b infer (native build) on 4 x 80.0 GB" in out
    chosen = [line for line in out.splitlines() if line.startswith("chosen:")]
    assert len(chosen) == 1 and "bf16-pure, tp x 4, batch 1" in chosen[0]
    for term in ("weights", "KV cache", "CUDA context", "workspaces", "NCCL buffers", "predicted peak"):
        assert term in out
    rejected = [line.strip() for line in out.splitlines() if line.strip().startswith("rejected:")]
    assert rejected
    for line in rejected:  # short of memory, or a layout the run cannot launch (quantized weights under TP)
        assert re.search(r"needs [\d.]+ GB per GPU; 80\.0 GB available|the run cannot launch [^:]+: (int8|nf4) "
                         r"weights cannot be sharded", line), line


LLAMA_20B = dict(h=6144, L=50, H=48, kv=8, f=16384, V=32000)  # fitbench's 20B preset: a Llama-2 shape, untied


def test_20b_training_on_two_h200s_chooses_fsdp_and_says_why_ddp_does_not_fit(capsys):
    p20 = total_params(LLAMA_20B)
    assert resolve("20B").total_params == p20
    code, out, err = cli(["plan", "--models", "20B", "--mode", "train", "--gpus", "2", "--gpu", "H200"], capsys)
    assert code == 0, err
    text = " ".join(out.split())  # the terminal wraps long lines
    # bf16 keeps 16 B per parameter (318 GB), more than two H200s share; bf16-pure's 8 B, halved, fit
    chosen = re.search(r"chosen: (\S+), (\w+) x (\d), (?:recompute, )?batch 1: ([\d.]+) GB per GPU", text)
    assert chosen, text[:400]
    assert chosen.group(1, 2, 3) == ("bf16-pure", "fsdp", "2")
    assert 8 * p20 / 2 / GB < float(chosen.group(4)) <= H200_TOTAL_MEMORY / GB
    # DDP keeps all 8 B per parameter on each GPU: weights 2, gradients (its buckets) 2, AdamW's moments 4
    ddp = re.search(r"rejected: bf16-pure, ddp x 2, batch 1: needs ([\d.]+) GB per GPU; ([\d.]+) GB available "
                    r"\(weights, gradients and optimizer state replicated on each GPU: ([\d.]+) GB\)", text)
    assert ddp, text
    need, available, replicated = map(float, ddp.groups())
    assert available == round(H200_TOTAL_MEMORY / GB, 1)
    assert replicated == round(8 * p20 / GB, 1)
    assert need > replicated > available
    # tensor parallelism fits too, but its all-reduces and DTensor's host work forecast it slower
    forecast = re.search(r"chosen: .*? forecast ([\d,]+) tokens/s", text)
    result = plan(resolve("20B"), "train", GpuTarget("NVIDIA H200", 2, H200_TOTAL_MEMORY, described=True), seq_len=512,
                  new_tokens=128, batch_sizes=[1])
    tp2 = next(a for a in result.feasible if a.candidate.layout == Layout(tp=2))
    assert tp2.forecast_tokens_per_s < result.chosen.forecast_tokens_per_s
    assert round(result.chosen.forecast_tokens_per_s) == int(forecast.group(1).replace(",", ""))


def test_fsdp_cpu_offload_fits_what_sharding_alone_does_not_and_pays_the_host_link():
    """20B in bf16 keeps 16 B per parameter: 159 GB per H200 when sharded over two, more than one holds.
    With FSDP's CPU offload (``--offload``) the shards, gradients and AdamW's moments go to host memory;
    what stays is in flight, and the step pays for the shards crossing the host link."""
    from fitbench.planning.speed import HOST_LINK_BANDWIDTH, PCIE_BANDWIDTH
    from fitbench.spec import Layout

    target = GpuTarget("NVIDIA H200", 2, H200_TOTAL_MEMORY, described=False)
    arch = resolve("20B")
    results = {}
    for offload in (False, True):
        spec = RunSpec(model="20B", backend="native", mode="train", precision="bf16", batch_size=1, seq_len=512,
                       new_tokens=8, device="cuda:0", warmup_steps=1, measure_steps=1, offload=offload,
                       layout=Layout(dp_shard=2))
        results[offload] = predict_spec(arch, spec, target, DEFAULT, choose_precision=False, choose_recompute=False,
                                        runnable=PRECISIONS, choose_strategy=True)
    (_, alone), (offloaded, prediction) = results[False], results[True]
    assert not alone["fits"] and 16 * arch.total_params / 2 > H200_TOTAL_MEMORY
    assert prediction["fits"] and offloaded.layout == Layout(dp_shard=2) and offloaded.offload
    terms = {term["name"]: term["bytes"] for term in prediction["terms"]}
    assert terms["weights"] == terms["gradients"] == terms["optimizer state"] == 0
    assert prediction["predicted_peak_bytes"] < alone["predicted_peak_bytes"] - 16 * arch.total_params / 2 * 0.9
    on_gpu, off = (estimate_step_time(arch, "train", "bf16", 1, 512, new_tokens=8, gpu_name="NVIDIA H200",
                                      parallelism=Parallelism("fsdp", 2, offload=offload)) for offload in (False, True))
    shards_in_and_out = 3 * 4 * arch.total_params / 2  # fp32 shards in twice, their gradients out once
    link = HOST_LINK_BANDWIDTH.get("NVIDIA H200", PCIE_BANDWIDTH)
    assert off.seconds - on_gpu.seconds == pytest.approx(shards_in_and_out / link, rel=1e-9)
    assert Candidate("bf16", Layout(dp_shard=2), False, 1, cpu_offload=True).label == "bf16, fsdp x 2, CPU offload, batch 1"


def test_training_chooses_among_one_gpu_ddp_and_fsdp_by_throughput():
    # 1B fits on one H200: two GPUs with DDP or FSDP double the tokens; the fastest of the fitting
    # data-parallel layouts is chosen, and it is the first of the feasible list
    target = GpuTarget("NVIDIA H200", 2, H200_TOTAL_MEMORY, described=True)
    result = plan(resolve("1B"), "train", target, seq_len=2048, new_tokens=1, batch_sizes=[8], precisions=["bf16"],
                  checkpointing=[False])
    by_layout = {(a.candidate.strategy, a.candidate.gpus): a for a in result.feasible}
    assert {("single", 1), ("ddp", 2), ("fsdp", 2)} <= set(by_layout)
    data_parallel = [by_layout[k] for k in (("single", 1), ("ddp", 2), ("fsdp", 2))]
    fastest = max(data_parallel, key=lambda a: a.forecast_tokens_per_s)
    assert result.chosen is fastest is result.feasible[0]
    assert fastest.candidate.gpus == 2
    assert fastest.speed.tokens_per_s > 1.9 * by_layout[("single", 1)].speed.tokens_per_s
    # FSDP halves the 16 B per parameter that DDP replicates
    assert by_layout[("fsdp", 2)].predicted_peak < by_layout[("ddp", 2)].predicted_peak
    # asked for tensor parallel alone, the planner chooses it
    only_tp = plan(resolve("1B"), "train", target, seq_len=2048, new_tokens=1, batch_sizes=[8], precisions=["bf16"],
                   strategies=["tp"], checkpointing=[False])
    assert only_tp.chosen.candidate.strategy == "tp"


def test_plan_command_json_has_sizes_in_bytes(capsys):
    code, out, err = cli([*PLAN_70B, "--json"], capsys)
    assert code == 0, err
    (result,) = json.loads(out)
    assert {"chosen", "rejected", "feasible", "hardware", "calibration"} <= set(result)
    assert result["hardware"] == {"name": None, "count": 4, "memory": 80e9, "described": True,
                                  "memory_source": "--gpu-memory", "node_gpus": 8, "inter_node_bandwidth": None}
    chosen = result["chosen"]
    assert chosen["candidate"] == {"precision": "bf16-pure", "strategy": "tp", "gpus": 4,
                                   "activation_checkpointing": False, "batch_size": 1, "resident_layers": None,
                                   "compiled": False, "cpu_offload": False, "checkpointed_layers": None,
                                   "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 4, "pp": 1, "replicas": 1},
                                   "microbatches": None}
    # every layer matrix in quarters (8 kv heads split 4 ways), the embedding and the output projection
    # over the vocabulary; the norms whole on each rank
    s, norms = LLAMA2_70B, 2 * LLAMA2_70B["h"]
    per_gpu = 2 * (s["L"] * ((layer_params(s) - norms) / 4 + norms) + 2 * s["V"] * s["h"] / 4 + s["h"])
    assert per_gpu < chosen["predicted_peak_bytes"] < per_gpu + 3e9
    terms = {t["name"]: t["bytes"] for t in chosen["memory"]["terms"]}
    assert terms["weights"] == per_gpu
    # Default prompt 512 + 128 new tokens, the cache split over 4 ranks.
    assert terms["KV cache"] == kv_bytes_per_token(LLAMA2_70B) * (512 + 128) / 4 == 52_428_800
    overheads = {t["name"]: t["bytes"] for t in chosen["overheads"]}
    assert overheads["CUDA context"] == 797e6 and overheads["NCCL buffers"] == NCCL_TENSOR_PARALLEL_GENERATION
    assert result["feasible"][0]["label"] == chosen["label"]
    assert all(f["fits"] and f["predicted_peak_bytes"] <= 80e9 for f in result["feasible"])
    assert result["rejected"]
    for rejected in result["rejected"]:  # short of memory, or a layout the run cannot launch, never estimated
        assert not rejected["fits"] and rejected["reason"]
        assert rejected["predicted_peak_bytes"] > 80e9 or (
            "the run cannot launch" in rejected["reason"] and rejected["memory"] is None)


def test_plan_uses_a_stored_calibration(capsys):
    save_calibration(H100, Calibration(2.5e9, 1.5e9, 100e6, 50e6, 300e6, "measured on a test bench"))
    code, out, err = cli(["plan", "--models", "7B", "--mode", "infer", "--gpu", "H100-80GB", "--json"], capsys)
    assert code == 0, err
    (result,) = json.loads(out)
    assert result["calibration"] == "measured on a test bench"
    assert result["hardware"]["name"] == H100 and result["hardware"]["memory"] == H100_TOTAL_MEMORY
    overheads = {t["name"]: t["bytes"] for t in result["chosen"]["overheads"]}
    assert overheads["CUDA context"] == 1.5e9 and overheads["workspaces"] == 50e6


def test_requirements_table_and_json(capsys):
    argv = ["plan", "--requirements", "--gpu-memory", "80GB", "--models", "7B", "--mode", "train", "infer"]
    code, out, err = cli(argv, capsys)
    assert code == 0, err
    assert "GPUs of 80.0 GB needed" in out and "min GPUs" in out
    code, out, err = cli([*argv, "--json"], capsys)
    assert code == 0, err
    rows = {(r["mode"], r["precision"]): r for r in json.loads(out)}
    assert set(rows) == {("train", "bf16"), ("train", "bf16-pure"), ("infer", "bf16-pure"), ("infer", "int8"),
                         ("infer", "nf4")}
    # Training: 16 B/param (107.8 GB) needs a second GPU, FSDP halves it to 8 B/param (53.9 GB);
    # bf16-pure is 8 B/param on one GPU; inference weights are at most 13.5 GB.
    assert rows[("train", "bf16")]["min_gpus"] == 2 and "fsdp x 2" in rows[("train", "bf16")]["how"]
    assert rows[("train", "bf16-pure")]["min_gpus"] == 1
    assert all(rows[("infer", p)]["min_gpus"] == 1 for p in ("bf16-pure", "int8", "nf4"))
    for row in rows.values():
        assert row["model"] == "7B"
    # The batch counts: 64 x (3968 + 128) tokens of KV cache at 524,288 B each is 137.4 GB.
    assert kv_bytes_per_token(LLAMA2_7B) * 64 * (3968 + 128) > 80e9
    code, out, err = cli(["plan", "--requirements", "--gpu-memory", "80GB", "--models", "7B", "--mode", "infer",
                          "--precision", "bf16-pure", "--batch-size", "64", "--seq-len", "3968", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)[0]["min_gpus"] > 1


def test_trace_prints_the_traced_peak(capsys):
    code, out, err = cli(["plan", "--models", "small", "--mode", "train", "--batch-size", "2", "--seq-len", "128",
                          "--gpu", "H100-80GB", "--trace"], capsys)
    assert code == 0, err
    match = re.search(r"traced peak \(fake tensors on \w+\): ([\d.]+) (GB|MB) of tensors; analytic ([\d.]+) (GB|MB) "
                      r"\(([+-][\d.]+)%\)", out)
    assert match, out
    # The trace and the analytic model are independent estimates of the same tensors.
    assert abs(float(match.group(5))) < 10
    # small bf16 training holds fp32 weights, gradients and AdamW state: at least 16 B x 128.6M = 2.06 GB.
    assert match.group(2) == "GB" and float(match.group(1)) >= 2.0


def test_plan_on_detected_gpus(capsys, monkeypatch):
    detected = [devices.GpuInfo(i, H100, 85_520_809_984, (9, 0)) for i in range(2)]
    monkeypatch.setattr(devices, "detect_gpus", lambda: detected)
    code, out, err = cli(["plan", "--models", "7B", "--mode", "infer", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)[0]["hardware"] == {"name": H100, "count": 2, "memory": 85_520_809_984.0, "described": False,
                                           "memory_source": "torch.cuda.get_device_properties().total_memory",
                                           "node_gpus": 8, "inter_node_bandwidth": None}


@pytest.mark.parametrize("gpu, gpu_memory, gpus, expected", [
    ("H100-80GB", None, None, GpuTarget(H100, 1, H100_TOTAL_MEMORY, True)),
    ("a100-40gb", None, 8, GpuTarget("NVIDIA A100-SXM4-40GB", 8, A100_40GB_TOTAL_MEMORY, True)),
    ("NVIDIA H200", None, 2, GpuTarget("NVIDIA H200", 2, H200_TOTAL_MEMORY, True)),
    ("H100-PCIE", None, None, GpuTarget("NVIDIA H100 PCIe", 1, 80e9, True)),  # no published figure found
    (None, "79.2GiB", 4, GpuTarget(None, 4, 79.2 * 2**30, True)),
])
def test_gpu_target_from_the_command_line(gpu, gpu_memory, gpus, expected):
    target = gpu_target(gpu=gpu, gpu_memory=gpu_memory, gpus=gpus)
    assert target.name == expected.name and target.count == expected.count and target.described
    assert target.memory == pytest.approx(expected.memory, rel=1e-12)


@pytest.mark.parametrize("argv, field", [
    (["plan", "--models", "7B"], "gpus: no GPU is visible"),
    (["plan", "--models", "7B", "--gpu", "NOPE"], "gpu: 'NOPE' is not a known GPU"),
    (["plan", "--models", "7B", "--gpu-memory", "lots"], "gpu-memory: 'lots' is not a size"),
    (["plan", "--models", "7B", "--gpu-memory", "80GB", "--batch-size", "0"], "batch_size: must be positive"),
    (["plan", "--models", "7B", "--gpu-memory", "80GB", "--batch-size", "many"], "--batch-size: expected a positive"),
    (["plan", "--models", "7B", "--gpu-memory", "80GB", "--seq-len", "x"], "--seq-len/--context-length: expected a whole number, got 'x'"),
    (["plan", "--models", "no-such-model", "--gpu-memory", "80GB"], "models: unknown model 'no-such-model'"),
    (["plan", "--models", "7B", "--gpus", "2"], "gpu-memory: no GPU is visible here, so with --gpus"),
    (["plan", "--models", "7B", "--gpus", "-1", "--gpu-memory", "80GB"], "gpus: must be a number of GPUs from 1"),
    (["plan", "--models", "7B", "--gpu-memory", "80GB", "--mode", "bogus"], "invalid choice: 'bogus'"),
    (["plan", "--gpu-memory", "80GB"], "--models"),
])
def test_bad_plan_input_is_one_paragraph_and_exit_2(argv, field, capsys, monkeypatch):
    monkeypatch.setattr(devices, "detect_gpus", lambda: [])
    code, out, err = cli(argv, capsys)
    assert code == UserError.exit_code == 2
    assert out == ""
    assert field in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, message", [
    (["calibrate"], "calibration measures GPU overheads"),
    (["calibrate", "--device", "cuda"], "sees no CUDA GPU"),
])
def test_calibrate_without_a_gpu_exits_2(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = cli(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert not calibration_path().exists()


def test_calibrate_command_on_a_cpu_only_machine(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "FITBENCH_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "fitbench", "calibrate"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert "calibration measures GPU overheads" in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "--device", "cpu", "--gpus", "1"], "gpus: 1 to measure; give 2 to"),
    (["calibrate", "--device", "cpu", "--gpus", "-3"], "gpus: -3 to measure"),
    (["calibrate", "--device", "cpu", "--gpus", "100000"], "(the CPU cores)"),
])
def test_calibrate_bus_bandwidth_out_of_range_exits_2(argv, message, capsys):
    code, out, err = cli(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert not calibration_path().exists()


@pytest.mark.slow
def test_bus_bandwidth_of_two_gloo_ranks(tmp_path):
    bus = measure_bus_bandwidth(2, "cpu", tmp_path, timeout_s=120)
    timed = json.loads((tmp_path / "collectives.json").read_text())
    assert (timed["world"], timed["backend"]) == (2, "gloo")
    small, large = timed["runs"]
    assert (small["message_bytes"], large["message_bytes"]) == (16 * 1024, 4 * MIB)
    for run in timed["runs"]:
        assert 0 < run["all_reduce_s"] < 10 and 0 < run["all_gather_s"] < 10
    # t = latency + factor x S / B through both points; nccl-tests' factors over 2 ranks: an all-reduce
    # moves 2 (g - 1) / g = 1 of its bytes through each link, an all-gather (g - 1) / g = 1/2
    for factor, bandwidth, latency, name in ((1.0, bus.all_reduce, bus.all_reduce_latency, "all_reduce_s"),
                                             (0.5, bus.all_gather, bus.all_gather_latency, "all_gather_s")):
        assert bandwidth > 0 and latency > 0
        assert latency + factor * small["message_bytes"] / bandwidth == pytest.approx(small[name], rel=1e-9)
        assert latency + factor * large["message_bytes"] / bandwidth == pytest.approx(large[name], rel=1e-9)
    assert bus.source.startswith("measured on 2 CPU processes with gloo, 16 KiB and 4 MiB messages, torch ")
    assert {path.name for path in tmp_path.glob("rank*.log")} == {"rank0.log", "rank1.log"}
    # stored with a calibration, it is what the speed model uses, latencies included
    save_calibration("NVIDIA H200", with_bus_bandwidth(DEFAULT, bus))
    assert bus_bandwidth("NVIDIA H200", load_calibration("NVIDIA H200")) == bus
    arch = resolve("13B")
    decode = estimate_step_time(arch, "infer", "bf16-pure", 1, 512, new_tokens=8, parallelism=Parallelism("tp", 2),
                                gpu_name="NVIDIA H200", links=bus_bandwidth("NVIDIA H200", load_calibration("NVIDIA H200")))
    messages = 2 * arch.num_layers + 1
    expected = (messages * (bus.all_reduce_latency + arch.hidden_size * 2 / bus.all_reduce)
                + bus.all_gather_latency + arch.vocab_size * 2 / 2 / bus.all_gather)
    assert decode.communication_s == pytest.approx(expected, rel=1e-9)


def test_a_fit_through_two_timed_messages_by_hand():
    # 2 ranks' all-reduce (factor 1): 1 kB in 12 us and 1 MB in 21 us -> 1e6 - 1e3 bytes per 9 us
    latency, bandwidth = fit_collective(1e3, 12e-6, 1e6, 21e-6, 1.0)
    assert bandwidth == pytest.approx(999e3 / 9e-6, rel=1e-12)
    assert latency == pytest.approx(12e-6 - 1e3 * 9e-6 / 999e3, rel=1e-12)
    with pytest.raises(RuntimeError, match="too noisy"):
        fit_collective(1e3, 12e-6, 1e6, 11e-6, 1.0)


def test_calibrations_stored_without_bus_bandwidth_keep_the_datasheet():
    calibration_path().parent.mkdir(parents=True, exist_ok=True)
    older = {key: value for key, value in asdict(DEFAULT).items() if "bus" not in key and "collectives" not in key}
    calibration_path().write_text(json.dumps({f"NVIDIA H200|torch {torch.__version__}": older}))
    loaded = load_calibration("NVIDIA H200")
    assert loaded.all_reduce_bus_bandwidth is None and loaded.cuda_context_training == DEFAULT.cuda_context_training
    assert bus_bandwidth("NVIDIA H200", loaded).all_reduce == NVLINK4_PER_DIRECTION


# ---- 10. responsiveness --------------------------------------------------------------------------

def test_plan_for_a_70b_model_answers_in_seconds(capsys):
    started = time.perf_counter()
    code, out, _ = cli([*PLAN_70B, "--batch-size", "auto"], capsys)
    elapsed = time.perf_counter() - started
    assert code == 0 and "chosen:" in out
    assert elapsed < 10, f"fitbench plan took {elapsed:.1f} s"


# ---- defects found and fixed, kept as regressions ------------------------------------

def test_zero_gpus_is_rejected(capsys):
    code, out, err = cli(["plan", "--models", "7B", "--gpus", "0", "--gpu-memory", "80GB"], capsys)
    assert code == 2 and "gpus:" in err


def test_predicted_peak_grows_with_the_batch():
    arch, target = resolve("small"), GpuTarget(None, 1, 1e12, described=True)
    peaks = [assess(arch, "train", Candidate("bf16", Layout(), True, b), target, seq_len=128,
                    new_tokens=1).predicted_peak for b in range(28, 40)]
    assert peaks == sorted(peaks)


def test_quantized_training_counts_saved_activations():
    # nf4 weights are at least half a byte per parameter; without recompute each of the 32 layers
    # keeps its SwiGLU tensors for the backward pass, 4 x 2 B x n x f.
    n, f = 4 * 512, 11008
    result = plan(resolve("7B"), "train", GpuTarget(H100, 1, 24e9, described=True), seq_len=512, new_tokens=1,
                  batch_sizes=[4], precisions=["nf4"], checkpointing=[False])
    for assessed in result.feasible:
        assert assessed.predicted_peak >= 0.5 * P7 + 32 * 4 * 2 * n * f


def test_pipeline_stage_holds_only_its_layers_kv_cache():
    memory = estimate_memory(resolve("llama-2-70b"), "infer", "bf16-pure", 32, 2048, new_tokens=128,
                             parallelism=Parallelism("pipeline", 4))
    cache = {t.name: t.bytes for t in memory.terms}["KV cache"]
    assert cache == pytest.approx(kv_bytes_per_token(LLAMA2_70B) * 32 * (2048 + 128) / 4, rel=1e-12)


def test_fsdp_ranks_read_all_gathered_weights():
    # Each rank reads the whole model's (gathered, 16-bit) weights in the forward and the two backward matmuls.
    speed = estimate_step_time(resolve("7B"), "train", "bf16-pure", 1, 512, new_tokens=1,
                               parallelism=Parallelism("fsdp", 4), gpu_name=H100)
    assert speed.memory_s >= 3 * 2 * P7 / H100_BANDWIDTH


@pytest.mark.parametrize("mode, precision, expected", [
    ("infer", "bf16-pure", (797e6, 2 * 32 * MIB)),  # decode steps replayed from a graph
    ("infer", "nf4", (797e6, 2 * 32 * MIB)),
    ("infer", "bf16", (797e6, 2 * 32 * MIB)),  # autocast decodes through a graph too
    ("infer", "int8", (721e6, 32 * MIB)),  # LLM.int8's outlier search cannot be captured
    ("forward", "bf16-pure", (721e6, 32 * MIB)),
    ("train", "bf16", (795e6, 2 * 32 * MIB)),
])
def test_overheads_follow_how_the_step_runs(mode, precision, expected):
    arch = resolve("small")
    candidate = Candidate(precision, Layout(), False, 1)
    memory = estimate_memory(arch, mode, precision, 1, 128, new_tokens=16)
    terms = overhead_terms(arch, mode, candidate, memory, memory.peak_moment, 128, DEFAULT)
    assert (terms[0].bytes, terms[1].bytes) == expected


@pytest.mark.parametrize("precision, batch", [("bf16", 1), ("fp16", 8)])
def test_a_decode_graph_captured_under_autocast_keeps_its_casts_pool(precision, batch):
    # small: V 10000, h 768, f 3072; the output projection (V h) is the largest matrix cast to 16 bits.
    arch = resolve("small")
    candidate = Candidate(precision, Layout(), False, batch)
    memory = estimate_memory(arch, "infer", precision, batch, 128, new_tokens=16)
    terms = {t.name: t.bytes for t in overhead_terms(arch, "infer", candidate, memory, memory.peak_moment, 128,
                                                      DEFAULT)}
    assert terms["decode graph pool"] == 2 * (10000 * 768 + batch * 10000)
    pure = overhead_terms(arch, "infer", Candidate("bf16-pure", Layout(), False, batch), memory,
                          memory.peak_moment, 128, DEFAULT)
    assert "decode graph pool" not in {t.name for t in pure}


# ---- 11. refusal before launch: the need and the alternatives ----------------------------------------

LLAMA_30B = dict(h=6656, L=60, H=52, kv=52, f=17920, V=32000)  # LLaMA-30B (Touvron et al. 2023, table 2)
P30 = total_params(LLAMA_30B)
H200_TARGET = GpuTarget("NVIDIA H200", 1, H200_TOTAL_MEMORY, described=False)


def run_spec(model, mode, precision, batch, seq_len, **fields):
    return RunSpec(model=model, backend="native", mode=mode, precision=precision, batch_size=batch, seq_len=seq_len,
                   new_tokens=128, device="cuda:0", warmup_steps=1, measure_steps=1, **fields)


def by_change(found) -> dict:
    return {alternative.change: alternative.assessment for alternative in found}


def test_30b_training_on_an_h200_is_refused_with_fsdp_and_adapters_as_alternatives():
    arch = resolve("30B")
    assert arch.total_params == P30
    planned, prediction = predict_spec(arch, run_spec("30B", "train", "bf16", 1, 512), H200_TARGET, DEFAULT,
                                       choose_precision=True, choose_recompute=True, runnable=PRECISIONS)
    # bf16-pure keeps 8 B per parameter (weights, gradients, two AdamW moments in bf16): 260 GB > 150 GB,
    # with or without checkpointing; bf16 autocast keeps 16 B.
    assert not prediction["fits"] and 8 * P30 > H200_TOTAL_MEMORY
    assert planned.precision == "bf16-pure"  # the option that comes closest stands for the configuration
    assert prediction["predicted_peak_bytes"] > 8 * P30
    found = alternatives(arch, planned, H200_TARGET, DEFAULT)
    changes = by_change(found)
    # Half of 8 B per parameter on each of 2 GPUs is 130 GB: FSDP or tensor parallel over 2 GPUs fits,
    # the fastest of them by the roofline is named; no layout of one GPU does.
    (sharded,) = [a for a in found if a.assessment.candidate.gpus > 1]
    assert sharded.assessment.candidate.gpus == 2 and sharded.assessment.candidate.strategy in ("fsdp", "tp")
    assert 8 * P30 / 2 < sharded.assessment.predicted_peak <= H200_TOTAL_MEMORY
    # QLoRA: 4-bit weights (0.5 B per parameter) and fp32 adapters fit on the one GPU.
    adapters = changes["as nf4 adapters (QLoRA) on this GPU"]
    assert adapters.candidate.precision == "nf4" and adapters.candidate.gpus == 1
    assert 0.5 * P30 < adapters.predicted_peak <= H200_TOTAL_MEMORY
    # Nothing on one GPU in a full-training precision, and no offload for training.
    assert not any(name.startswith(("in ", "with ", "at batch")) for name in changes)
    reason = refusal(arch, planned, prediction, H200_TARGET, found)
    need = f"{prediction['predicted_peak_bytes'] / GB:.1f} GB"
    assert reason.startswith(f"refused before launch: 30B train in bf16-pure at batch 1 x 512 tokens is predicted "
                             f"to need {need} on one GPU of 150.1 GB; it fits ")
    assert "on 2 GPUs with " in reason and f"at {sharded.assessment.predicted_peak / GB:.1f} GB each" in reason
    assert f"as nf4 adapters (QLoRA) on this GPU at {adapters.predicted_peak / GB:.1f} GB" in reason
    assert reason.count(", or ") == 1 and reason.endswith(".")


def test_inference_alternatives_precisions_smaller_batch_offload_and_more_gpus():
    # 7B bf16 weights are 13.5 GB; at 64 x (4096 + 128) tokens the KV cache alone, 524,288 B a token,
    # is 141.7 GB, more than the 80 GB GPU.
    arch, target = resolve("7B"), GpuTarget(H100, 1, 80e9, described=False)
    spec = run_spec("7B", "infer", "bf16-pure", 64, 4096)
    assert kv_bytes_per_token(LLAMA2_7B) * 64 * (4096 + 128) > 80e9
    _, prediction = predict_spec(arch, spec, target, DEFAULT, choose_precision=False, choose_recompute=False,
                                 runnable=PRECISIONS)
    assert not prediction["fits"]
    changes = by_change(alternatives(arch, spec, target, DEFAULT))
    for assessed in changes.values():
        assert assessed.fits and assessed.predicted_peak <= 80e9
    # Quantized weights leave the 16-bit KV cache as it is: still too big, so neither is offered.
    assert not any(name.startswith("in ") for name in changes)
    # The largest batch that fits: the next one up does not, and the KV cache bounds it from above.
    (smaller,) = [name for name in changes if name.startswith("at batch ")]
    batch = changes[smaller].candidate.batch_size
    assert smaller == f"at batch {batch}"
    assert batch * kv_bytes_per_token(LLAMA2_7B) * (4096 + 128) < 80e9 - 2 * P7
    bigger = assess(arch, "infer", replace(changes[smaller].candidate, batch_size=batch + 1), target, seq_len=4096,
                    new_tokens=128)
    assert not bigger.fits
    # Offloaded weights leave room for the cache only as far as the cache fits without them: 66.5 GB of
    # room is less than 141.7 GB, so offload is not offered either.
    assert not any("--offload" in name for name in changes)
    # More GPUs split the weights and the cache: the fewest that fit, tensor parallel, pipeline stages or
    # both (inference has no FSDP), each holding at least its share of both; on one fewer nothing fits.
    (sharded,) = [name for name in changes if name.startswith("on ")]
    layout = changes[sharded].candidate
    assert sharded.startswith(f"on {layout.gpus} GPUs with ")
    assert set(layout.strategy.split("+")) <= {"tp", "pipeline"}
    share = (2 * P7 + kv_bytes_per_token(LLAMA2_7B) * 64 * (4096 + 128)) / layout.gpus
    assert share <= changes[sharded].predicted_peak <= 80e9
    fewer = GpuTarget(H100, layout.gpus - 1, 80e9, described=False)
    assert layout.gpus >= 2 and not any(
        assess(arch, "infer", Candidate(layout.precision, fewer_layout, False, layout.batch_size), fewer,
               seq_len=4096, new_tokens=128).fits for fewer_layout in layouts_for(arch, "infer", fewer.count))


def test_offload_is_offered_when_the_weights_are_what_does_not_fit():
    # 65B in bf16 is 131 GB of weights: on one 80 GB GPU int8 (65 GB) fits, nf4 too, and --offload keeps
    # the layers offload_split finds room for.
    arch = resolve("65B")
    spec = run_spec("65B", "infer", "bf16-pure", 1, 128)
    changes = by_change(alternatives(arch, spec, TARGET_80, DEFAULT))
    split = offload_split(arch, "infer", "bf16-pure", 1, 128, new_tokens=128, budget=80e9, calibration=DEFAULT)
    offload = f"with --offload in bf16-pure ({split.resident_layers} of 80 layers on the GPU)"
    assert offload in changes and changes[offload].candidate.resident_layers == split.resident_layers
    assert {"in int8", "in nf4"} <= set(changes)
    assert 1.0 * arch.total_params < changes["in int8"].predicted_peak <= 80e9


def test_training_alternatives_checkpointing_and_a_smaller_batch():
    # 7B bf16-pure at 8 x 2048 tokens: checkpointing fits (test_predict_spec_turns_on_recompute_when_only_that_fits),
    # and so does a smaller batch without it.
    arch = resolve("7B")
    spec = run_spec("7B", "train", "bf16-pure", 8, 2048)
    changes = by_change(alternatives(arch, spec, TARGET_80, DEFAULT))
    (checkpointed,) = [name for name in changes if name.startswith("with activation checkpointing")]
    assert changes[checkpointed].candidate.activation_checkpointing  # of the fewest layers that fit
    assert checkpointed == f"with activation checkpointing of {changes[checkpointed].candidate.checkpointed_layers} " \
                           f"layers"
    (smaller,) = [name for name in changes if name.startswith("at batch ")]
    assert changes[smaller].candidate.batch_size < 8 and not changes[smaller].candidate.activation_checkpointing
    assert "in bf16" not in changes  # 16 B per parameter, 107.8 GB


def test_when_nothing_fits_the_reason_says_so():
    arch = resolve("120B")
    target = GpuTarget(None, 1, 24e9, described=True)
    spec = run_spec("120B", "train", "bf16-pure", 1, 512)
    _, prediction = predict_spec(arch, spec, target, DEFAULT, choose_precision=False, choose_recompute=True,
                                 runnable=PRECISIONS)
    found = alternatives(arch, spec, target, DEFAULT, max_gpus=2)
    assert not prediction["fits"] and found == []
    assert refusal(arch, spec, prediction, target, found).endswith(
        "no change of precision, checkpointing, batch, layout or GPU count makes it fit.")


def test_on_a_cpu_the_prediction_is_the_tensors_alone():
    arch, candidate = resolve("tiny"), Candidate("fp32", Layout(), False, 2)
    target = GpuTarget(None, 1, 1e12, described=False)
    assessed = assess(arch, "train", candidate, target, seq_len=64, new_tokens=1, calibration=None)
    assert assessed.overheads == ()
    assert assessed.predicted_peak == estimate_memory(arch, "train", "fp32", 2, 64).peak_bytes
    _, prediction = predict_spec(arch, run_spec("tiny", "train", "fp32", 2, 64), target, None, choose_precision=False,
                                 choose_recompute=False, runnable=PRECISIONS)
    assert prediction["calibration"] == TENSORS_ONLY


# ---- 12. calibration for the GPU at hand, and named GPUs' memory -----------------------------------

def store_raw(entries: dict) -> None:
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries))


def calibration(source: str, measured_at: str | None) -> Calibration:
    return Calibration(1e9, 0.9e9, 70e6, 35e6, 300e6, source, measured_at=measured_at)


def test_the_running_torch_versions_calibration_wins_even_over_a_newer_one():
    mine = calibration("mine", "2026-01-01T00:00:00Z")
    newer = calibration("newer", "2026-11-01T00:00:00Z")
    store_raw({f"{H100}|torch {torch.__version__}": asdict(mine), f"{H100}|torch 9.9.9": asdict(newer)})
    assert load_calibration(H100) == mine


def test_else_the_newest_stored_for_that_gpu_and_its_source_says_which():
    old = calibration("measured long ago", "2025-01-01T00:00:00Z")
    new = calibration("measured lately", "2026-11-01T00:00:00Z")
    undated = calibration("stored before dates", None)
    other_gpu = calibration("another GPU", "2026-11-20T00:00:00Z")
    store_raw({f"{H100}|torch 2.9.0": asdict(old), f"{H100}|torch 2.10.0": asdict(new),
               f"{H100}|torch 2.1.0": asdict(undated), "NVIDIA H200|torch 2.10.0": asdict(other_gpu)})
    chosen = load_calibration(H100)
    assert replace(chosen, source="measured lately") == new
    assert chosen.source == (f"measured lately (stored for torch 2.10.0, the newest for {H100}; none for torch "
                             f"{torch.__version__})")
    assert load_calibration("NVIDIA A100-SXM4-80GB") == DEFAULT


def test_plan_on_a_described_gpu_uses_a_calibration_of_another_torch(capsys):
    store_raw({f"{H100}|torch 2.9.0": asdict(Calibration(2.5e9, 1.5e9, 100e6, 50e6, 300e6, "measured on a bench",
                                                         measured_at="2026-11-01T00:00:00Z"))})
    code, out, err = cli(["plan", "--models", "7B", "--mode", "infer", "--gpu", "H100-80GB", "--json"], capsys)
    assert code == 0, err
    (result,) = json.loads(out)
    assert result["calibration"].startswith("measured on a bench (stored for torch 2.9.0")
    assert {t["name"]: t["bytes"] for t in result["chosen"]["overheads"]}["CUDA context"] == 1.5e9
    code, out, err = cli(["plan", "--models", "7B", "--mode", "infer", "--gpu", "H100-80GB"], capsys)
    assert "overheads: measured on a bench (stored for torch 2.9.0" in " ".join(out.split())


def test_the_first_run_on_a_gpu_measures_and_stores_a_calibration():
    measured = calibration("measured just now", "2026-11-23T00:00:00Z")
    calls = []

    def measure() -> Calibration:
        calls.append(1)
        return measured

    # Stored only for another torch version: the GPU at hand is measured with this one.
    store_raw({f"{H100}|torch 2.9.0": asdict(calibration("old torch", "2026-11-01T00:00:00Z"))})
    found, stored_in = ensure_calibration(H100, measure)
    assert (found, stored_in, len(calls)) == (measured, calibration_path(), 1)
    stored = set(json.loads(calibration_path().read_text()))
    assert stored == {f"{H100}|torch 2.9.0", f"{H100}|torch {torch.__version__}"}
    # The next run finds it and measures nothing.
    found, stored_in = ensure_calibration(H100, measure)
    assert (found, stored_in, len(calls)) == (measured, None, 1)
    assert load_calibration(H100) == measured


def test_run_target_on_a_cpu_plans_only_under_a_memory_limit(monkeypatch):
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    assert run_target("cpu") == (None, None)
    monkeypatch.setenv("FITBENCH_INJECT", "oom:int4, mem-limit:123456789")
    target, calibration_used = run_target("cpu")
    assert (target.count, target.memory, calibration_used) == (1, 123456789, None)
    assert "mem-limit" in target.memory_source


def test_named_gpus_plan_with_what_the_device_gives_a_process():
    # The committed H100 run: the memory torch reported there is the memory `--gpu H100-80GB` plans with.
    results = Path(__file__).parent.parent / "benchmarks/results/2026-11-22-h100-memory/results.jsonl"
    reported = {gpu["total_memory"] for line in results.read_text().splitlines() if line.strip()
                for gpu in json.loads(line)["environment"]["gpus"] if gpu["name"] == H100}
    assert reported == {H100_TOTAL_MEMORY}
    for alias in ("H100-80GB", "H100", "H100-SXM"):
        target = gpu_target(gpu=alias, gpu_memory=None, gpus=None)
        assert target.memory == H100_TOTAL_MEMORY and "total_memory" in target.memory_source
    # Every named GPU says where its memory comes from; a figure read off a device is in whole bytes
    # (whole MiB for printouts in MiB) and within a few percent of the datasheet's round GB: the driver
    # keeps some back, and the datasheets' GB are sometimes GiB.
    for alias, name in GPU_ALIASES.items():
        spec = gpu_spec(name)
        target = gpu_target(gpu=alias, gpu_memory=None, gpus=None)
        assert target.memory == spec.total_memory and target.memory_source == spec.total_memory_source
        if spec.total_memory_source.startswith("the datasheet"):
            assert spec.total_memory == spec.memory_gb * GB
        else:
            assert spec.total_memory == int(spec.total_memory)
            assert 0.97 < spec.total_memory / (spec.memory_gb * GB) < 1.08, alias
    # The gap the issue found: 7B inference plans for 85.0 GB on an H100, not 80.0 GB.
    assert gpu_target(gpu="H100-80GB", gpu_memory=None, gpus=None).memory / GB == \
        pytest.approx(85.0, abs=0.05)


# ---- layouts of several GPUs: tensor parallel x pipeline stages x data parallel ---------------------

def terms_of(assessed) -> dict[str, float]:
    memory = assessed.memory if hasattr(assessed, "memory") else assessed
    return {term.name: term.bytes for term in memory.terms}


def launchable(arch, mode: str, gpus: int, precision: str) -> list[Layout]:
    return [layout for layout in layouts_for(arch, mode, gpus)
            if layout.problem(arch, mode, precision, default_backend(arch)) is None]


def test_405b_bf16_inference_on_16_h100_is_tp8_x_pp2(capsys):
    arch = resolve("llama-3.1-405b")
    target = GpuTarget(H100, 16, H100_TOTAL_MEMORY, described=True)
    result = plan(arch, "infer", target, seq_len=128, new_tokens=128, batch_sizes=[1], precisions=["bf16-pure"])
    chosen = result.chosen
    assert chosen is not None and chosen.fits
    # 810 GB of weights: nothing of 8 GPUs or fewer fits; tensor parallelism stops at one node's 8 GPUs, so
    # the 16 need pipeline stages too, and the widest tensor-parallel degree reads each step's weights fastest
    assert all(a.candidate.gpus == 16 for a in result.feasible)
    assert chosen.candidate.layout == Layout(tp=8, pp=2) and "tp 8 x pipeline 2" in chosen.candidate.label
    assert 2 * arch.total_params / 16 < chosen.predicted_peak <= H100_TOTAL_MEMORY
    assert chosen.memory.stage is not None and chosen.memory.stage.count == 2
    # every other layout of 16 that fits is predicted slower
    assert all(a.speed.tokens_per_s < chosen.speed.tokens_per_s for a in result.feasible if a is not chosen)
    code, out, err = cli(["plan", "--models", "llama-3.1-405b", "--mode", "infer", "--gpu", "H100-80GB", "--gpus", "16",
                          "--precision", "bf16-pure", "--batch-size", "1", "--seq-len", "128", "--new-tokens", "128"],
                         capsys)
    assert code == 0, err
    assert "chosen: bf16-pure, tp 8 x pipeline 2" in out and f"on {chosen.memory.stage.label}" in " ".join(out.split())


def test_falcon_180b_bf16_inference_fewest_h100s_and_the_layout():
    arch = resolve("falcon-180b")
    found = fewest_gpus(arch, "infer", "bf16-pure", H100_TOTAL_MEMORY, seq_len=128, new_tokens=128, gpu_name=H100)
    assert found is not None and found.fits
    count, layout = found.candidate.gpus, found.candidate.layout
    assert layout.world_size == count
    # Falcon runs on transformers' model, which the run splits by pipeline stages, not tensor parallelism
    assert layout == Layout(pp=count)
    assert count >= math.ceil(2 * arch.total_params / H100_TOTAL_MEMORY)
    fewer = GpuTarget(H100, count - 1, H100_TOTAL_MEMORY, described=True)
    assert not any(assess(arch, "infer", Candidate("bf16-pure", other, False, 1), fewer, seq_len=128,
                          new_tokens=128).fits for other in launchable(arch, "infer", count - 1, "bf16-pure"))
    assert minimum_gpus(arch, "infer", "bf16-pure", H100_TOTAL_MEMORY, seq_len=128, new_tokens=128) == \
        (count, found.candidate.label)


@pytest.mark.parametrize("precision, strategies", [("fp8", ["tp"]), ("bf16-pure", ["tp"])])
def test_a_plan_of_layouts_the_run_refuses_says_why(precision, strategies, capsys):
    """Falcon-180B on H200s under tensor parallelism: transformers has no tensor-parallel plan for Falcon,
    so in fp8 and in bf16 the plan rejects those layouts with the run's reason (``Layout.problem``), not
    with their memory, and says so."""
    arch = resolve("falcon-180b")
    target = GpuTarget("NVIDIA H200", 8, H200_TOTAL_MEMORY, described=True)
    result = plan(arch, "infer", target, seq_len=512, new_tokens=32, batch_sizes=[1], precisions=[precision],
                  strategies=strategies)
    unlaunched = [a for a in result.rejected if a.candidate.layout.problem(arch, "infer", precision, "hf")]
    assert result.chosen is None and unlaunched
    for assessed in unlaunched:
        problem = assessed.candidate.layout.problem(arch, "infer", precision, "hf")
        assert assessed.reason == f"{assessed.candidate.label}: the run cannot launch {problem}"
        assert assessed.memory is None
    code, out, err = cli(["plan", "--models", "falcon-180b", "--mode", "infer", "--gpu", "H200", "--gpus", "8",
                          "--seq-len", "512", "--new-tokens", "32", "--precision", precision,
                          *(["--strategy", *strategies] if strategies else [])], capsys)
    assert code == 1, err  # nothing fits: a script sees it
    text = " ".join(out.split())  # the terminal wraps long lines
    first = unlaunched[0]
    problem = first.candidate.layout.problem(arch, "infer", precision, "hf")
    grouped = problem.replace(first.candidate.layout.label, "this layout")  # one line for every layout it refuses
    assert "nothing fits" in text and f"rejected: {first.candidate.label}" in text
    assert text.count(f"the run cannot launch {grouped}") == 1


def test_the_run_plans_the_precision_it_left_open_from_its_fallback_ladder():
    """Llama-2-70B's bf16 weights (138 GB) do not fit a 100 GB GPU, its int8 and fp8 ones do: the run's
    plan takes the next rung of the ladder the user gives, not the default ladder's int8."""
    from fitbench.config import SweepConfig, expand
    from fitbench.sweep import plan_jobs

    target = GpuTarget("NVIDIA H200", 1, 100e9, described=True)
    for fallback, expected in ((None, "int8"), (["bf16-pure", "fp8", "nf4"], "fp8")):
        config = SweepConfig(models=["llama-2-70b"], mode=["infer"], fallback=fallback)
        specs = expand(config, device="cuda:0", default_models=[])
        (job,) = plan_jobs(specs, config, target, DEFAULT)
        assert job.spec.precision == expected and job.refusal is None


def test_a_plan_with_no_layout_of_the_strategies_says_so_not_that_nothing_fits(capsys):
    """FSDP on one GPU is no layout at all: the plan says which strategies need more GPUs, where one
    with candidates that all fail says nothing fits."""
    code, out, err = cli(["plan", "--models", "tiny", "--gpus", "1", "--gpu", "H200", "--strategy", "fsdp"], capsys)
    text = " ".join(out.split())
    assert code == 1, err
    assert "nothing to plan" in text and "ddp and fsdp need two or more" in text and "nothing fits" not in text
    code, out, err = cli(["plan", "--models", "llama-2-70b", "--gpus", "1", "--gpu-memory", "20GB"], capsys)
    assert "nothing fits" in " ".join(out.split()) and "nothing to plan" not in out and code == 1


def test_70b_bf16_inference_on_two_h200_fits_with_tp2():
    target = GpuTarget("NVIDIA H200", 2, H200_TOTAL_MEMORY, described=True)
    result = plan(resolve("llama-2-70b"), "infer", target, seq_len=512, new_tokens=128, batch_sizes=[1],
                  precisions=["bf16-pure"])
    assert result.chosen.candidate.layout == Layout(tp=2)
    assert 2 * P70 / 2 < result.chosen.predicted_peak <= H200_TOTAL_MEMORY
    # one H200 holds the 138 GB of weights, so two replicas fit too, twice one GPU's forecast, but at 92%
    # of the memory, within the allocator-retry margin
    replicas = next(a for a in result.feasible if a.candidate.layout == Layout(replicas=2))
    assert not replicas.clear and replicas.forecast_tokens_per_s > result.chosen.forecast_tokens_per_s
    # two stages fit too, but decode one after another: the whole model's weights read per step
    by_layout = {a.candidate.layout: a for a in result.feasible}
    assert by_layout[Layout(pp=2)].speed.tokens_per_s < result.chosen.speed.tokens_per_s


def test_uneven_stages_of_126_layers_on_16():
    arch = resolve("llama-3.1-405b")
    pipeline = Parallelism("pipeline", 16)
    estimates = stage_estimates(arch, "infer", "bf16-pure", 1, 128, new_tokens=128, parallelism=pipeline)
    sizes = [len(e.stage.layers) for e in estimates]
    assert sum(sizes) == 126 and sizes[0] == sizes[-1] == 7 and set(sizes[1:-1]) == {8}
    p, V, h = arch.params_per_layer, arch.vocab_size, arch.hidden_size
    weights = [terms_of(e)["weights"] for e in estimates]
    assert weights[0] == 2 * (7 * p + V * h)  # and the embedding
    assert weights[1] == 2 * 8 * p
    assert weights[-1] == 2 * (7 * p + h + V * h)  # and the final norm and output projection
    caches = [terms_of(e)["KV cache"] for e in estimates]
    assert caches[0] == caches[-1] == caches[1] * 7 / 8
    assert caches[1] == 8 * 2 * arch.num_kv_heads * arch.head_dim * 2 * (128 + 128)
    assert [("output projection" in terms_of(e)) for e in estimates] == [False] * 15 + [True]
    # 8 layers (8 x 3.2e9 parameters) outweigh 7 and the embedding (V h = 2.1e9): a middle stage peaks
    whole = estimate_memory(arch, "infer", "bf16-pure", 1, 128, new_tokens=128, parallelism=pipeline)
    assert whole.peak_bytes == max(e.peak_bytes for e in estimates) and whole.stage.index not in (0, 15)
    assert "stage" in whole.as_dict() and whole.as_dict()["stage"].startswith(f"stage {whole.stage.index + 1} of 16")


def test_tensor_parallel_collectives_by_hand():
    # 100 GB/s; 5 us per all-reduce, 7 us per all-gather (and per send)
    arch, links = resolve("tiny"), BusBandwidth(100e9, 100e9, "test", 5e-6, 7e-6)
    L, h, V = arch.num_layers, arch.hidden_size, arch.vocab_size
    decode = estimate_step_time(arch, "infer", "bf16-pure", 4, 64, new_tokens=8, parallelism=Parallelism("tp", 2),
                                gpu_name=H100, links=links)
    # two ring all-reduces per layer and the embedding's, of 4 sequences x h x 2 B each:
    # 5 us + 2 (2 - 1) / 2 x bytes / 100 GB/s; then the logits, 4 x V x 2 B, gathered: 7 us + 1 / 2 x bytes / ...
    all_reduce = 5e-6 + 4 * h * 2 / 100e9
    gather = 7e-6 + 4 * V * 2 / 2 / 100e9
    assert decode.communication_s == pytest.approx((2 * L + 1) * all_reduce + gather, rel=1e-12)
    train = estimate_step_time(arch, "train", "bf16-pure", 4, 64, new_tokens=1, parallelism=Parallelism("tp", 4),
                               gpu_name=H100, links=links)
    # two in the forward and two in the backward per layer, each of 4 x 64 tokens x h x 2 B over 4 ranks
    assert train.communication_s == pytest.approx(L * 4 * (5e-6 + 2 * 3 / 4 * 4 * 64 * h * 2 / 100e9), rel=1e-12)


def test_each_collective_by_hand():
    links = BusBandwidth(200e9, 100e9, "test", 10e-6, 20e-6)
    mib = 2**20
    # 8 ranks: an all-reduce moves 2 x 7 / 8 of the message per rank, an all-gather 7 / 8
    assert links.all_reduce_s(64 * mib, 8) == pytest.approx(10e-6 + 1.75 * 64 * mib / 200e9, rel=1e-12)
    assert links.all_gather_s(64 * mib, 8) == pytest.approx(20e-6 + 0.875 * 64 * mib / 100e9, rel=1e-12)
    assert links.reduce_scatter_s(64 * mib, 8) == links.all_gather_s(64 * mib, 8)
    assert links.send_recv_s(mib) == pytest.approx(20e-6 + mib / 100e9, rel=1e-12)
    # three messages pay three latencies and the bytes of all three
    assert links.all_reduce_s(3 * mib, 2, messages=3) == pytest.approx(30e-6 + 3 * mib / 200e9, rel=1e-12)
    assert links.all_reduce_s(64 * mib, 1) == links.all_gather_s(64 * mib, 1) == 0.0


def test_pipeline_bubble_by_hand():
    assert bubble_fraction(4, 8) == 3 / 11 and bubble_fraction(1, 8) == 0 and bubble_fraction(2, 1) == 1 / 2
    arch, links = resolve("7B"), BusBandwidth(100e9, 100e9, "test", 5e-6, 7e-6)
    assert arch.num_layers % 4 == 0
    one = estimate_step_time(arch, "train", "bf16-pure", 8, 512, new_tokens=1, parallelism=Parallelism(),
                             gpu_name=H100, links=links)
    piped = estimate_step_time(arch, "train", "bf16-pure", 8, 512, new_tokens=1, gpu_name=H100, links=links,
                               parallelism=Parallelism(layout=Layout(pp=4), microbatches=8))
    # each stage a quarter of the work, stretched by the bubble: (m + p - 1) / m = 11 / 8; one microbatch
    # (a sequence) crossing the 3 boundaries forward and its gradient back is not hidden
    sends = 2 * 3 * (7e-6 + 512 * arch.hidden_size * 2 / 100e9)
    assert piped.seconds == pytest.approx(max(one.compute_s, one.memory_s) / 4 * 11 / 8 + sends, rel=1e-12)


def test_pipeline_training_holds_the_microbatches_in_flight():
    # GPipe: every stage runs all m forwards first, so each holds m microbatches' activations of its 8
    # layers, and m - 1 of them while the first microbatch's backward forms the gradients
    arch = resolve("7B")
    pipeline = Parallelism(layout=Layout(pp=4), microbatches=8)
    estimates = stage_estimates(arch, "train", "bf16-pure", 8, 512, parallelism=pipeline)
    per_layer = terms_of(estimate_memory(arch, "train", "bf16-pure", 1, 512))["activations"] / arch.num_layers
    for estimate in estimates:
        terms = terms_of(estimate)
        assert terms["activations"] == pytest.approx(8 * 8 * per_layer, rel=1e-12)
        assert terms["other microbatches' activations"] == pytest.approx(7 * 8 * per_layer, rel=1e-12)
    assert "loss chain" in terms_of(estimates[-1]) and "loss chain" not in terms_of(estimates[0])


EVERY_LAYOUT = (Layout(), Layout(tp=2), Layout(pp=2), Layout(tp=2, pp=2), Layout(tp=4, pp=3))


@pytest.mark.parametrize("mode", ["train", "forward-backward", "forward", "infer"])
def test_every_term_is_non_negative_in_every_layout(mode):
    training = mode in ("train", "forward-backward")
    layouts = EVERY_LAYOUT + ((Layout(dp_shard=2, tp=2), Layout(dp_replicate=2, tp=2)) if training else ())
    for arch in PRESETS:
        for precision in PRECISIONS:
            if training and entry(precision).training_problem:
                continue
            for layout in layouts:
                if layout.pp > arch.num_layers or arch.num_heads % layout.tp or (
                        layout.dp_shard > 1 and entry(precision).training == ADAPTERS):
                    continue
                for estimate in stage_estimates(arch, mode, precision, 2, 64, new_tokens=8,
                                                parallelism=Parallelism(layout=layout)):
                    assert estimate.peak_bytes > 0
                    negative = [t.name for t in estimate.terms if t.bytes < 0]
                    assert not negative, (arch.name, precision, layout.label, negative)


def test_requirements_answers_405b_with_a_layout(capsys):
    argv = ["plan", "--models", "llama-3.1-405b", "--mode", "infer", "--gpu", "H100-80GB", "--requirements"]
    code, out, err = cli([*argv, "--json"], capsys)
    assert code == 0, err
    rows = {row["precision"]: row for row in json.loads(out)}
    for row in rows.values():
        layout = Layout(**row["layout"])
        assert layout.world_size == row["min_gpus"] and (layout.label in row["how"] or layout.world_size == 1)
        assert row["peak_per_gpu_bytes"] <= H100_TOTAL_MEMORY
    bf16 = rows["bf16-pure"]
    # tensor parallelism stops at 8 GPUs, and 8 cannot hold 810 GB: stages as well
    assert 8 < bf16["min_gpus"] <= 16 and bf16["layout"]["pp"] > 1 and bf16["peak_stage"]
    code, out, err = cli(argv, capsys)
    assert code == 0, err
    assert "pipeline" in out and "more than 64" not in out


def test_the_planner_chooses_the_layout_of_a_run_left_open():
    # llama-2-70b on two GPUs of 100 GB, which one does not hold: tensor parallel 2, faster than two stages,
    # from a generation the sweep expanded in one process (or from another layout of the two)
    target = GpuTarget("NVIDIA H200", 2, 100e9, described=True)
    for layout, gpus in ((Layout(), 2), (Layout(pp=2), None)):
        spec = run_spec("llama-2-70b", "infer", "bf16-pure", 1, 512, layout=layout)
        planned, prediction = predict_spec(resolve("llama-2-70b"), spec, target, DEFAULT, choose_precision=False,
                                           choose_recompute=False, runnable=PRECISIONS, choose_strategy=True,
                                           gpus=gpus)
        assert planned.layout == Layout(tp=2) and prediction["fits"] and "layout" in prediction["chosen_by_planner"]
    # in training the fastest forecast: 7B bf16 on two H200s, DDP or FSDP
    target = GpuTarget("NVIDIA H200", 2, H200_TOTAL_MEMORY, described=True)
    spec = run_spec("7B", "train", "bf16", 1, 512, layout=Layout(dp_replicate=2))
    planned, _ = predict_spec(resolve("7B"), spec, target, DEFAULT, choose_precision=False, choose_recompute=False,
                              runnable=PRECISIONS, choose_strategy=True)
    assert planned.layout.strategy in ("ddp", "fsdp")
    # where one GPU does not hold the model (two of 60 GB), quantized weights are split by stages, and so
    # is Falcon on transformers' model, which has no tensor-parallel plan: accelerate's device map over the
    # two GPUs; where one does (an H200), two replicas, a whole copy and batch each, decode twice what two
    # stages do in turn
    falcon = run_spec("falcon-40b", "infer", "bf16-pure", 1, 512, layout=Layout(tp=2)).model_copy(
        update={"backend": "hf"})
    planned, _ = predict_spec(resolve("falcon-40b"), falcon, target, DEFAULT, choose_precision=False,
                              choose_recompute=False, runnable=PRECISIONS, choose_strategy=True)
    assert planned.layout == Layout(replicas=2)
    target = GpuTarget("NVIDIA H200", 2, 60e9, described=True)
    planned, _ = predict_spec(resolve("falcon-40b"), falcon, target, DEFAULT, choose_precision=False,
                              choose_recompute=False, runnable=PRECISIONS, choose_strategy=True)
    assert planned.layout == Layout(pp=2)
    for model, precision in (("llama-2-70b", "int8"),):
        spec = run_spec(model, "infer", precision, 1, 512, layout=Layout(tp=2)).model_copy(
            update={"backend": default_backend(resolve(model))})
        planned, prediction = predict_spec(resolve(model), spec, target, DEFAULT, choose_precision=False,
                                           choose_recompute=False, runnable=PRECISIONS, choose_strategy=True)
        assert planned.layout == Layout(pp=2), model
        # each stage's predicted peak, for each GPU's measured one; the largest is the prediction
        stages = prediction["stage_predicted_peak_bytes"]
        assert len(stages) == 2 and max(stages) == pytest.approx(prediction["predicted_peak_bytes"], rel=1e-12)
        assert prediction["peak_stage"].startswith(f"stage {stages.index(max(stages)) + 1} of 2")
    # asked for, a layout stays
    kept, _ = predict_spec(resolve("llama-2-70b"), spec.model_copy(update={"model": "llama-2-70b", "backend": "native",
                                                                           "precision": "bf16-pure"}),
                           target, DEFAULT, choose_precision=False, choose_recompute=False, runnable=PRECISIONS)
    assert kept.layout == Layout(tp=2)


# ---- streams' cached pools ------------------------------------------------------------------------

def test_cached_pools_count_in_the_peak_but_not_in_what_must_fit():
    """FSDP's copy-in and reduce-scatter streams keep their pools mapped (``Term.cached``): the peak NVML
    reads counts them, up to the GPU's capacity, where the allocator releases them and retries; a
    configuration fits when its tensors do."""
    arch, candidate = resolve("1B"), Candidate.of_strategy("bf16", "fsdp", 2, False, 8)
    memory = estimate_memory(arch, "train", "bf16", 8, 2048, parallelism=candidate.parallelism)
    cached = sum(t.bytes for t in memory.terms if t.cached and memory.at_peak(t))
    roomy = assess(arch, "train", candidate, GpuTarget(H100, 2, 1e12, True), seq_len=2048, new_tokens=0)
    overheads = sum(t.bytes for t in roomy.overheads)
    live = memory.total_at(roomy.peak_moment, cached=False) + overheads
    assert cached > 1e9 and roomy.fits and roomy.predicted_peak == live + cached
    # between the tensors and the tensors with the pools: fits, and the GPU fills to its capacity
    tight = assess(arch, "train", candidate, GpuTarget(H100, 2, live + cached / 2, True), seq_len=2048,
                   new_tokens=0)
    assert tight.fits and tight.predicted_peak == live + cached / 2
    # below the tensors: does not fit, and the reason names what the tensors need
    short = assess(arch, "train", candidate, GpuTarget(H100, 2, live - 1e9, True), seq_len=2048, new_tokens=0)
    assert not short.fits and f"needs {live / 1e9:.1f} GB per GPU" in short.reason


def test_fsdp_root_reduce_scatter_input_sets_the_late_fragmentation():
    """Late in an FSDP backward pass the root's reduce-scatter input, rd E in one block, maps pages of its own
    where it is larger than one layer's saved activations (the holes the freed activations leave)."""
    arch = resolve("llama-3.1-8b")
    candidate = Candidate.of_strategy("bf16", "fsdp", 2, True, 1)
    chosen = assess(arch, "train", candidate, GpuTarget(H100, 2, 1e12, True), seq_len=4096, new_tokens=0)
    memory = chosen.memory
    terms = {t.name: t.bytes for t in overhead_terms(arch, "train", candidate, memory, "end of the backward pass",
                                                     4096, DEFAULT)}
    root = arch.vocab_size * arch.hidden_size * 2 + arch.hidden_size  # embedding, output projection, final norm
    assert terms["allocator fragmentation"] == 4 * root  # fp32 shards under mixed precision: rd = 4 B
    single = {t.name: t.bytes for t in overhead_terms(arch, "train", Candidate("bf16", Layout(), True, 1), memory,
                                                      "end of the backward pass", 4096, DEFAULT)}
    assert single["allocator fragmentation"] < terms["allocator fragmentation"]


def test_the_hf_backends_pipeline_stages_hold_no_nccl_buffers():
    """The transformers backend's stages are one process driving a GPU each (accelerate's device map)."""
    arch, candidate = resolve("falcon-40b"), Candidate.of_strategy("bf16-pure", "pipeline", 2, False, 1)
    target = GpuTarget(H100, 2, 1e12, True)
    names = {backend: {t.name for t in assess(arch, "infer", candidate, target, seq_len=512, new_tokens=32,
                                              backend=backend).overheads} for backend in ("hf", "native")}
    assert "NCCL buffers" not in names["hf"] and "NCCL buffers" in names["native"]


@pytest.mark.parametrize("precision", ["int8-weight-only", "int4"])
def test_a_weight_only_format_slower_than_bf16_at_the_batch_asked_warns_in_the_row(precision):
    """torchao's int8 weight-only and tinygemm int4 kernels decode Llama-2-7B faster than bf16 at batch 1
    (1.37x and 1.42x) and slower at batch 8 (int8 weight-only 19x slower, int4 6.29 against 5.59 ms per
    token; benchmarks/results/2026-11-24-h200-engine-profiles): the prediction warns at 8, not at 1."""
    from fitbench.planning.calibration import DEFAULT
    from fitbench.planning.planner import GpuTarget, predict_spec
    from fitbench.precisions import PRECISIONS

    target = GpuTarget("NVIDIA H200", 1, 140e9, described=False)
    warned = {}
    for batch in (1, 8):
        spec = RunSpec(model="llama-2-7b", backend="native", mode="infer", precision=precision, batch_size=batch,
                       seq_len=512, new_tokens=128, device="cuda", warmup_steps=1, measure_steps=1)
        _, prediction = predict_spec(resolve("llama-2-7b"), spec, target, DEFAULT, choose_precision=False,
                                     choose_recompute=False, runnable=PRECISIONS)
        warned[batch] = prediction["warnings"]
    assert warned[1] == []
    [warning] = warned[8]
    assert f"{precision} is forecast slower than bf16-pure at batch 8" in warning and "--precision bf16-pure" in warning


def test_a_model_no_layout_splits_says_why_instead_of_a_gpu_count(capsys):
    """Training Falcon: transformers has no tensor-parallel plan for it and its pipeline stages run
    inference only, so no layout divides its weights, which --requirements says with the pipeline's
    reason; for inference its stages split it in any precision (quantized layers are made on their
    stage's device), and a Llama splits in any mode."""
    falcon = resolve("falcon-180b")
    reason = unsplittable(falcon, "train", "bf16", 8)
    assert reason is not None and "for inference" in reason
    for precision in ("bf16-pure", "nf4", "int8"):
        assert unsplittable(falcon, "infer", precision, 8) is None
    assert unsplittable(resolve("7B"), "infer", "nf4", 8) is None
    code, out, _ = cli(["plan", "--requirements", "--gpu", "H100-80GB", "--models", "falcon-180b", "--mode", "train",
                        "--precision", "bf16", "--json"], capsys)
    (row,) = json.loads(out)
    assert code == 0 and row["min_gpus"] is None and row["how"] == unsplittable(falcon, "train", "bf16", MOST_GPUS)
    code, out, _ = cli(["plan", "--requirements", "--gpu", "H100-80GB", "--models", "falcon-180b", "--mode", "infer",
                        "--precision", "nf4", "--json"], capsys)
    (row,) = json.loads(out)
    assert code == 0 and row["min_gpus"] is not None and "pipeline" in row["how"]


# ---- activation checkpointing of the fewest layers that fit ----------------------------------------

def test_plan_checkpoints_the_fewest_layers_that_fit_clear_of_the_margin():
    """13B training, bf16-pure, 8 x 2048 on 4 described H100s: without checkpointing FSDP x 4 does not fit,
    with every layer it is clear of the retry margin with room to spare, so the plan checkpoints the
    fewest layers clear of it: one fewer is not, and the forecast is faster than every layer's."""
    from fitbench.planning.planner import Assessment, fastest_first, fewest_checkpointed

    arch, target = resolve("13B"), gpu_target(gpu="H100-80GB", gpus=4)
    result = plan(arch, "train", target, seq_len=2048, new_tokens=1, batch_sizes=[8], precisions=["bf16-pure"])
    chosen = result.chosen
    count = chosen.candidate.checkpointed_layers
    assert chosen.candidate.layout == Layout(dp_shard=4) and chosen.candidate.activation_checkpointing
    assert count is not None and 1 <= count < arch.num_layers and chosen.clear
    assert f"recompute {count} layers" in chosen.candidate.label

    def assessed(**changes) -> Assessment:
        return assess(arch, "train", replace(chosen.candidate, **changes), target, seq_len=2048, new_tokens=1)

    assert not assessed(checkpointed_layers=count - 1).clear
    assert not assessed(activation_checkpointing=False, checkpointed_layers=None).fits
    every = assessed(checkpointed_layers=None)
    assert every.clear and every.predicted_peak < chosen.predicted_peak
    faster = {a.candidate.checkpointed_layers: a.forecast_tokens_per_s for a in result.feasible
              if a.candidate.layout == Layout(dp_shard=4)}
    assert faster[count] > fastest_first(arch, "train", [every], target, seq_len=2048, new_tokens=1,
                                         calibration=DEFAULT)[0].forecast_tokens_per_s
    # the search itself: as few as stay clear; without checkpointing clear already, every layer is kept
    assert fewest_checkpointed(arch, "train", every, target, seq_len=2048, new_tokens=1,
                               calibration=DEFAULT).candidate.checkpointed_layers == count
    small = assess(arch, "train", replace(every.candidate, batch_size=1), target, seq_len=512, new_tokens=1)
    without = assess(arch, "train", replace(small.candidate, activation_checkpointing=False), target, seq_len=512,
                     new_tokens=1)
    assert without.clear and fewest_checkpointed(arch, "train", small, target, seq_len=512, new_tokens=1,
                                                 calibration=DEFAULT, without=without) is small
    # the JSON carries the count, as benchmarks/auto_vs_best.sh reads it
    assert chosen.as_dict()["candidate"]["checkpointed_layers"] == count


def test_where_every_layer_recomputed_is_not_clear_of_the_margin_every_layer_is_kept():
    """30B training, bf16-pure under FSDP x 4 at 4 x 2048 on described H100s: with every layer recomputed
    it fits but not clear of the retry margin, and fewer layers that still fit would stand nearer the
    edge, where the allocator's retries cost more than the recomputation saves: every layer is kept."""
    from fitbench.planning.planner import fewest_checkpointed

    arch, target = resolve("30B"), gpu_target(gpu="H100-80GB", gpus=4)
    result = plan(arch, "train", target, seq_len=2048, new_tokens=1, batch_sizes=[4], precisions=["bf16-pure"],
                  strategies=["fsdp"])
    chosen = result.chosen
    assert chosen.candidate.layout == Layout(dp_shard=4) and chosen.candidate.activation_checkpointing
    assert chosen.candidate.checkpointed_layers is None and chosen.fits and not chosen.clear
    fewer = assess(arch, "train", replace(chosen.candidate, checkpointed_layers=arch.num_layers - 10), target,
                   seq_len=2048, new_tokens=1)
    assert fewer.fits and fewer.predicted_peak > chosen.predicted_peak
    assert fewest_checkpointed(arch, "train", chosen, target, seq_len=2048, new_tokens=1,
                               calibration=DEFAULT) is chosen


def test_run_planning_checkpoints_the_fewest_layers_unless_told():
    """`fitbench run` leaving checkpointing open gets the fewest layers that fit; --activation-checkpointing
    keeps every layer, --checkpointed-layers N its N."""
    target = gpu_target(gpu="H100-80GB", gpus=4)
    spec = RunSpec(model="13B", backend="native", mode="train", precision="bf16-pure", batch_size=8, seq_len=2048,
                   new_tokens=8, device="cuda:0", warmup_steps=1, measure_steps=1, layout=Layout(dp_shard=4))
    planned, prediction = predict_spec(resolve("13B"), spec, target, DEFAULT, choose_precision=False,
                                       choose_recompute=True, runnable=PRECISIONS)
    assert planned.activation_checkpointing and 1 <= planned.checkpointed_layers < 40
    assert prediction["fits"] and not prediction["within_retry_margin"]
    assert f"recompute {planned.checkpointed_layers} layers" in planned.label
    told = spec.model_copy(update={"activation_checkpointing": True})
    planned, _ = predict_spec(resolve("13B"), told, target, DEFAULT, choose_precision=False, choose_recompute=False,
                              runnable=PRECISIONS)
    assert planned.activation_checkpointing and planned.checkpointed_layers is None
    told = spec.model_copy(update={"activation_checkpointing": True, "checkpointed_layers": 30})
    planned, prediction = predict_spec(resolve("13B"), told, target, DEFAULT, choose_precision=False,
                                       choose_recompute=False, runnable=PRECISIONS)
    assert planned.checkpointed_layers == 30 and "recompute 30 layers" in planned.label


def test_a_refusal_offers_checkpointing_of_the_fewest_layers_that_fit():
    """13B at 8 x 2048 under FSDP x 4 without checkpointing does not fit: the first alternative is
    checkpointing of the fewest layers that fit, not of every layer; a spec that checkpoints too few
    layers is offered every layer."""
    arch, target = resolve("13B"), gpu_target(gpu="H100-80GB", gpus=4)
    spec = RunSpec(model="13B", backend="native", mode="train", precision="bf16-pure", batch_size=8, seq_len=2048,
                   new_tokens=8, device="cuda:0", warmup_steps=1, measure_steps=1, layout=Layout(dp_shard=4))
    found = alternatives(arch, spec, target, DEFAULT)
    first = found[0]
    layers = first.assessment.candidate.checkpointed_layers
    assert first.change == f"with activation checkpointing of {layers} layers" and 1 <= layers < 40
    assert first.assessment.fits
    few = spec.model_copy(update={"activation_checkpointing": True, "checkpointed_layers": 2})
    _, prediction = predict_spec(arch, few, target, DEFAULT, choose_precision=False, choose_recompute=False,
                                 runnable=PRECISIONS)
    assert not prediction["fits"]
    found = alternatives(arch, few, target, DEFAULT)
    assert found[0].change == "with activation checkpointing of every layer"
    assert "with activation checkpointing of 2 layers" in refusal(arch, few, prediction, target, found)


@pytest.mark.parametrize("memory_gb, gpus", [(85.0, 1), (85.0, 4), (143.7, 4), (24.0, 1), (24.0, 2), (8.0, 1)])
def test_default_gpu_models_are_the_largest_that_fit_the_job_gpus(memory_gb, gpus):
    from fitbench.models.presets import SIZE_LADDER
    from fitbench.sweep import default_gpu_models

    memory = int(memory_gb * 1e9)
    # a size fits when 16 bytes per parameter are at most 70% of the job's GPUs' memory together
    fitting = [name for name in SIZE_LADDER if 16 * resolve(name).total_params <= 0.7 * memory * gpus]
    expected = (fitting[-2:] if gpus == 1 else fitting[-1:]) or ["tiny"]
    assert default_gpu_models(memory, gpus) == expected


def test_default_job_on_four_80_gb_gpus_trains_the_largest_preset_the_four_hold():
    from fitbench.sweep import default_gpu_models

    # 0.7 x 4 x 85 GB = 238 GB: 15B (16 x 14.64e9 = 234.3 GB) fits the four, 20B (318.4 GB) does not;
    # on one of them (59.5 GB): 1B (16.6 GB) and 3B (51.4 GB), not 7B (107.8 GB)
    assert default_gpu_models(int(85e9), 4) == ["15B"]
    assert default_gpu_models(int(85e9), 1) == ["1B", "3B"]
    # DDP and replicas hold the whole model on each GPU: one GPU's models; sharding strategies the four's
    assert default_gpu_models(int(85e9), 4, "ddp") == default_gpu_models(int(85e9), 4, "replicas") == ["1B", "3B"]
    assert default_gpu_models(int(85e9), 4, "fsdp") == default_gpu_models(int(85e9), 4, "tp") == ["15B"]


def test_a_later_precision_forecast_twice_as_fast_is_named_in_the_row():
    """30B training over 4 H200s: bf16 (fp32 master weights), the ladder's first precision, fits only as
    TP x 4, host-bound eagerly; bf16-pure fits FSDP x 4, forecast several times faster. The planner keeps
    the user's first precision and the row names the faster one with the ratio of the two forecasts;
    with the precision given, or where the later one is not twice as fast (13B on 4 H100s), nothing."""
    from fitbench.planning.calibration import DEFAULT
    from fitbench.planning.planner import FASTER_PRECISION_RATIO, GpuTarget, predict_spec
    from fitbench.precisions import PRECISIONS

    def plan(model: str, memory: float, gpu: str, choose_precision: bool = True):
        spec = RunSpec(model=model, backend="native", mode="train", precision="bf16", batch_size=4, seq_len=512,
                       new_tokens=1, device="cuda", warmup_steps=1, measure_steps=1, layout=Layout(dp_shard=4))
        return predict_spec(resolve(model), spec, GpuTarget(gpu, 4, memory, described=False), DEFAULT,
                            choose_precision=choose_precision, choose_recompute=True, runnable=PRECISIONS,
                            choose_strategy=True, gpus=4)

    planned, prediction = plan("30B", 150.1e9, "NVIDIA H200")
    [warning] = [w for w in prediction["warnings"] if "is forecast" in w]
    assert planned.precision == "bf16" and warning.startswith("bf16-pure, ") and "--precision bf16-pure" in warning
    figures = re.search(r"\(([\d,]+) against ([\d,]+) tokens/s", warning).groups()
    faster, chosen = (float(figure.replace(",", "")) for figure in figures)
    assert faster >= FASTER_PRECISION_RATIO * chosen and f"{faster / chosen:.1f}x" in warning
    assert not [w for w in plan("30B", 150.1e9, "NVIDIA H200", choose_precision=False)[1]["warnings"]
                if "is forecast" in w]
    assert not [w for w in plan("13B", 85.0e9, "NVIDIA H100 80GB HBM3")[1]["warnings"] if "is forecast" in w]


def test_plan_predicts_the_backend_asked_for(capsys):
    """``--backend`` reaches the planner: each build's chosen peak is what ``assess`` predicts of that build,
    the plan says whose it is, and the two builds of Falcon differ (the hf one quantizes a layer at a time
    through transformers' modules: its own temporaries)."""
    from fitbench.api import plan_target
    from fitbench.planning.planner import Candidate

    argv = ["plan", "--models", "falcon-40b", "--mode", "infer", "--precision", "nf4", "--gpu", "H200", "--gpus", "1",
            "--strategy", "single", "--json"]
    target, arch = plan_target(gpu="H200", gpus=1), resolve("falcon-40b")
    peaks = {}
    for backend in ("native", "hf"):
        code, out, err = cli([*argv, "--backend", backend], capsys)
        assert code == 0, err
        (shown,) = json.loads(out)
        assert shown["backend"] == backend
        by_hand = assess(arch, "infer", Candidate("nf4", Layout(), False, 1), target, seq_len=512, new_tokens=128,
                         calibration=load_calibration(target.name), backend=backend)
        assert shown["chosen"]["predicted_peak_bytes"] == pytest.approx(by_hand.predicted_peak)
        peaks[backend] = by_hand.predicted_peak
    assert peaks["native"] != peaks["hf"]
    code, out, _ = cli([*argv[:-1], "--json"], capsys)
    assert json.loads(out)[0]["backend"] == default_backend(arch) == "hf"
    code, out, err = cli(["plan", "--requirements", "--models", "falcon-180b", "--mode", "infer", "--precision",
                          "int8", "--gpu", "H100-80GB", "--backend", "native", "--json"], capsys)
    assert code == 0, err
    need = fewest_gpus(resolve("falcon-180b"), "infer", "int8", plan_target(gpu="H100-80GB").memory, seq_len=512,
                       new_tokens=128, calibration=load_calibration(plan_target(gpu="H100-80GB").name),
                       gpu_name=plan_target(gpu="H100-80GB").name, backend="native")
    assert json.loads(out)[0]["how"] == need.candidate.label
