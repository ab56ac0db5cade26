"""What a row says about a generation: the time to first token (``fitbench.worker.loops.generate``), the
prefill FLOPs and the bytes a decode step reads (``fitbench.worker.metrics``, ``fitbench.worker.worker``,
``CausalLM.kv_bytes_read``), and the peak MFU divides by (the precision entry's ``peak_kind``).

Expected values are worked out here from the models' published shapes, never read back from the
code under test.
"""

import gc
import json
import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from fitbench.models.backends import HuggingFaceLM, NativeLM, load_model
from fitbench.models.graphs import Replay
from fitbench.models.hf import build_hf
from fitbench.models.native import build_native, meta_model
from fitbench.models.registry import resolve
from fitbench.planning import speed
from fitbench.planning.sharding import Parallelism
from fitbench.precisions import PRECISIONS, entry, policy
from fitbench.worker import worker
from fitbench.worker.build import Built
from fitbench.worker.modes.peaks import Peaks
from fitbench.worker.modes.generation import measure_generation
from fitbench.worker.weight_bytes import decode_weight_bytes, weight_storage_bytes
from fitbench.worker.loops import generate, random_tokens, read_generation
from fitbench.worker.metrics import inference_metrics
from fitbench.worker.quantize import quantize_linears
from fitbench.worker.timing import DeviceClock, run_stages
from fitbench.spec import Assignment, RunSpec
from fitbench.util.stats import SampleStats

CPU = torch.device("cpu")

# tiny: vocabulary 4096, hidden 256, 4 layers, 8 heads of 32, 4 kv heads, SwiGLU 768, tied, 1024 positions
V, H, L, HEADS, KV, Q, F, MAX_POSITIONS = 4096, 256, 4, 8, 4, 32, 768, 1024
TINY_LAYER = (H * HEADS * Q + 2 * H * KV * Q + HEADS * Q * H) + 3 * H * F + 2 * H  # attention, MLP, two RMSNorms
TINY_NORMS = L * 2 * H + H
TINY_PARAMS = L * TINY_LAYER + V * H + H  # one tied table, the final norm: 4,196,608
ROPE_ROWS = 2 * Q * 4  # one fp32 row of the cos table and one of the sin table
KV_PER_POSITION = 2 * L * KV * Q  # elements of keys and values, every layer, one sequence

# Llama-2-7B config.json: untied embeddings, 4096 positions
V7, H7, L7, HEADS7, Q7, F7 = 32000, 4096, 32, 32, 128, 11008
P7 = L7 * (4 * H7 * H7 + 3 * H7 * F7 + 2 * H7) + 2 * V7 * H7 + H7
H100 = "NVIDIA H100 80GB HBM3"
H100_BANDWIDTH = 3.35e12
H100_TFLOPS = {"bf16": 989.4e12, "int8": 1978.9e12, "fp8": 1978.9e12}


def test_tiny_shape_is_the_one_the_hand_values_assume():
    assert resolve("tiny").total_params == TINY_PARAMS == 4_196_608


# ---- 1. time to first token --------------------------------------------------------------------


class SlowPrefill(NativeLM):
    """The native model with host work before each prefill's launch, as a long launch path has:
    ``delays`` seconds, one per prefill, in turn."""

    def __init__(self, module, delays: list[float]):
        super().__init__(module, torch.float32)
        self.delays = list(delays)
        self.prefills = 0

    def prefill(self, tokens, max_len):
        time.sleep(self.delays[self.prefills % len(self.delays)])
        self.prefills += 1
        return super().prefill(tokens, max_len)


class RecordingClock(DeviceClock):
    """The CPU clock, noting each synchronize and mark in order."""

    def __init__(self):
        super().__init__(CPU)
        self.calls: list[str] = []

    def mark(self):
        self.calls.append("mark")
        return super().mark()

    def synchronize(self):
        self.calls.append("synchronize")
        super().synchronize()


def test_each_generation_starts_from_an_idle_device_and_decodes_without_waiting():
    arch = resolve("tiny")
    lm = NativeLM(build_native(arch, CPU, torch.float32), torch.float32)
    clock = RecordingClock()
    run = generate(lm, random_tokens(arch.vocab_size, 2, 8, CPU, seed=1), 5, policy("fp32"), clock, CPU)
    for _ in range(2):
        clock.calls.clear()
        run()
        # a synchronize, then the first mark, the prefill's, and the four decode steps' with none between
        assert clock.calls == ["synchronize"] + ["mark"] * 6


def test_time_to_first_token_includes_the_prefills_host_work():
    arch, delay = resolve("tiny"), 0.2
    lm = SlowPrefill(build_native(arch, CPU, torch.float32), [delay])
    clock = DeviceClock(CPU)
    run = generate(lm, random_tokens(arch.vocab_size, 1, 8, CPU, seed=2), 4, policy("fp32"), clock, CPU)
    generations = [read_generation(marks, clock) for marks, _ in run_stages(run, clock, warmup=1, repeats=3)]
    for generation in generations:
        assert generation.time_to_first_token >= delay
    # the decode steps carry none of it (a median: a shared CPU may stall one step)
    assert SampleStats.of(t for g in generations for t in g.token_latencies).median < delay


def test_the_collector_runs_before_the_warmup_and_never_between_timed_calls():
    # a full collection between the stages made the first measured call slower than the rest
    clock, events = DeviceClock(CPU), []

    def note_collection(phase, info):
        if phase == "start":
            events.append("collect")

    def call():
        events.append("call")
        for _ in range(20_000):  # enough cyclic garbage that an enabled collector would run
            cycle = []
            cycle.append(cycle)

    gc.callbacks.append(note_collection)
    try:
        run_stages(call, clock, warmup=2, repeats=3)
        seen = list(events)  # before anything here allocates with the collector on again
    finally:
        gc.callbacks.remove(note_collection)
    assert seen[:6] == ["collect"] + ["call"] * 5
    assert gc.isenabled()


def test_a_barrier_meets_the_ranks_around_the_measured_calls_only():
    events = []
    clock = DeviceClock(CPU)
    run_stages(lambda: events.append("call"), clock, warmup=2, repeats=3, barrier=lambda: events.append("barrier"))
    assert events == ["call"] * 2 + ["barrier"] + ["call"] * 3 + ["barrier"]


def test_a_noisy_time_to_first_token_warns():
    arch = resolve("tiny")
    run_spec = RunSpec(model="tiny", backend="native", mode="infer", precision="fp32", batch_size=1, seq_len=8,
                       new_tokens=3, device="cpu", warmup_steps=1, measure_steps=4)
    built = Built(SlowPrefill(build_native(arch, CPU, torch.float32), [0.0, 0.05]))
    prompt = random_tokens(arch.vocab_size, 1, 8, CPU, seed=0)
    timing, _, noisy, _, _ = measure_generation(run_spec, arch, built, policy("fp32"), DeviceClock(CPU), CPU,
                                             Peaks(None, None, None), 4 * TINY_PARAMS, prompt, {})
    assert timing["time_to_first_token"]["cv_percent"] > 5
    assert "time to first token" in noisy


# ---- 2. prefill FLOPs ----------------------------------------------------------------------------


def test_prefill_flops_count_the_output_projection_once_per_sequence():
    # tiny, tied: N = every parameter (the table is the output projection's matmul too)
    T = 16
    attention = 4 * L * HEADS * Q * T
    assert resolve("tiny").prefill_flops(T) == T * (2 * (TINY_PARAMS - V * H) + attention) + 2 * V * H
    # Llama-2-7B, untied: N = every parameter but the input table
    T = 512
    n7 = P7 - V7 * H7
    expected = T * (2 * (n7 - V7 * H7) + 4 * L7 * HEADS7 * Q7 * T) + 2 * V7 * H7
    assert resolve("7B").prefill_flops(T) == expected
    # the old count, the output projection at every position, was 2% higher here
    assert T * (2 * n7 + 4 * L7 * HEADS7 * Q7 * T) / expected == pytest.approx(1.0198, abs=1e-4)


def test_inference_metrics_by_hand():
    batch, prompt = 2, 512
    ttft, latency = SampleStats.of([0.2, 0.1, 0.3]), SampleStats.of([0.02, 0.01, 0.03, 0.01])
    weights, kv = 13.0e9, 1.0e9
    metrics = inference_metrics(resolve("7B"), batch, prompt, 13.5e9, ttft, latency, weights, kv,
                                peak_flops=H100_TFLOPS["bf16"], measured_flops=None, peak_bandwidth=H100_BANDWIDTH)
    prefill = batch * (prompt * (2 * (P7 - 2 * V7 * H7) + 4 * L7 * HEADS7 * Q7 * prompt) + 2 * V7 * H7)
    assert metrics["prefill_flops"] == prefill
    assert metrics["prefill_tflops"] == pytest.approx(prefill / 0.2 / 1e12)
    assert metrics["prefill_mfu"] == pytest.approx(prefill / 0.2 / 989.4e12)
    assert metrics["prefill_mfu_measured_peak"] is None
    assert metrics["weight_bytes"] == 13.5e9
    assert metrics["decode_tokens_per_s"] == pytest.approx(2 / 0.015)  # median of four: 0.015
    assert metrics["decode_weight_bytes_per_step"] == weights
    assert metrics["decode_kv_bytes_per_step"] == kv
    assert metrics["decode_bytes_per_step"] == 14.0e9
    assert metrics["decode_weights_bandwidth_gbs"] == pytest.approx(13.0e9 / 0.015 / 1e9)
    assert metrics["decode_bandwidth_gbs"] == pytest.approx(14.0e9 / 0.015 / 1e9)
    assert metrics["decode_weights_roofline_percent"] == pytest.approx(100 * 13.0e9 / 0.015 / 3.35e12)
    assert metrics["decode_roofline_percent"] == pytest.approx(100 * 14.0e9 / 0.015 / 3.35e12)
    assert metrics["decode_roofline_tokens_per_s"] == pytest.approx(2 * 3.35e12 / 14.0e9)


# ---- 2. what a decode step reads of the weights ---------------------------------------------------


def test_autocast_recasts_every_weight_on_every_call_inside_inference_mode():
    """The fact the 8 bytes per weight rest on: no cast cache in ``inference_mode``, one under ``no_grad``."""
    from torch.profiler import profile

    linear, x = nn.Linear(32, 32, bias=False), torch.randn(2, 32)

    def weight_casts(context) -> int:
        with context, torch.autocast("cpu", dtype=torch.bfloat16), profile() as prof:
            for _ in range(3):
                linear(x)
        # every cast is an aten::_to_copy: the input's on each call, the weight's when not cached
        return sum(event.name == "aten::_to_copy" for event in prof.events()) - 3

    assert weight_casts(torch.inference_mode()) == 3
    assert weight_casts(torch.no_grad()) == 1


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_weight_bytes_of_tiny_tied_and_untied(batch):
    arch = resolve("tiny")
    tied = build_native(arch, CPU, torch.float32)
    stored = weight_storage_bytes(tied)
    assert stored == 4 * TINY_PARAMS
    # tied: the output projection reads the whole table; the rotary tables one row each
    assert decode_weight_bytes(tied, stored, batch, V, None) == 4 * TINY_PARAMS + ROPE_ROWS
    # autocast: every matmul weight (all but the norms, the tied table included) 4 + 2 + 2 bytes
    assert decode_weight_bytes(tied, stored, batch, V, torch.bfloat16) == \
        8 * (TINY_PARAMS - TINY_NORMS) + 4 * TINY_NORMS + ROPE_ROWS

    untied_arch = replace(arch, tie_embeddings=False)
    params = TINY_PARAMS + V * H  # a second table of V x h, the output projection
    for dtype, width in ((torch.float32, 4), (torch.bfloat16, 2)):
        untied = build_native(untied_arch, CPU, dtype)
        stored = weight_storage_bytes(untied)
        assert stored == width * params
        # the input table: one row per sequence
        assert decode_weight_bytes(untied, stored, batch, V, None) == \
            width * (params - V * H + batch * H) + ROPE_ROWS
    untied = build_native(untied_arch, CPU, torch.float32)
    matmuls = params - V * H - TINY_NORMS
    assert decode_weight_bytes(untied, 4 * params, batch, V, torch.float16) == \
        8 * matmuls + 4 * TINY_NORMS + 4 * batch * H + ROPE_ROWS


def test_decode_weight_bytes_of_an_int8_model_count_its_storage():
    arch = resolve("tiny")
    model = build_native(arch, CPU, torch.bfloat16)
    quantize_linears(model, "int8", CPU)
    # (out, in) of q, k, v, o, gate, up, down: int8 elements and one fp32 scale per output row
    layer = [(HEADS * Q, H), (KV * Q, H), (KV * Q, H), (H, HEADS * Q), (F, H), (F, H), (H, F)]
    int8 = L * sum(rows * cols + 4 * rows for rows, cols in layer)
    rest = 2 * (TINY_NORMS + V * H)  # bf16 norms and the tied table, read whole by the output projection
    assert decode_weight_bytes(model, weight_storage_bytes(model), 2, V, None) == int8 + rest + ROPE_ROWS


def test_decode_weight_bytes_of_transformers_models():
    # transformers' Llama: its rotary step reads the 16 fp32 inverse frequencies, not a table
    arch = resolve("tiny")
    llama = build_hf(arch, CPU, torch.float32)
    assert decode_weight_bytes(llama, 4 * TINY_PARAMS, 2, V, None) == 4 * TINY_PARAMS + 4 * Q // 2

    # GPT-2 of a small shape: the position table read one row (every sequence at one position),
    # Conv1D weights and biases re-cast under autocast
    small = replace(resolve("gpt2"), vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                    ffn_size=256, max_seq_len=32)
    h, f, positions = 64, 256, 32
    layer_matmuls = (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    norms = 2 * (2 * 2 * h) + 2 * h
    params = 2 * layer_matmuls + norms + 128 * h + positions * h
    gpt2 = build_hf(small, CPU, torch.float32)
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert weight_storage_bytes(gpt2) == 4 * params
    assert decode_weight_bytes(gpt2, 4 * params, 3, 128, None) == 4 * (params - positions * h + h)
    matmuls = 2 * layer_matmuls + 128 * h  # the tied table is the output projection's weight
    assert decode_weight_bytes(gpt2, 4 * params, 3, 128, torch.bfloat16) == \
        8 * matmuls + 4 * norms + 4 * h


@pytest.mark.parametrize("model, precision", [("7B", "bf16-pure"), ("7B", "bf16"), ("llama-3.1-8b", "bf16-pure"),
                                              ("1B", "bf16"), ("qwen2.5-7b", "bf16")])
def test_decode_weight_bytes_of_large_presets_on_the_meta_device(model, precision):
    """The module count on the real shapes, and the planner's count from the architecture, agree."""
    arch, batch = resolve(model), 4
    module = meta_model(arch, policy(precision).weight_dtype)
    width = 4 if precision == "bf16" else 2
    stored = width * sum(p.numel() for p in module.parameters())  # parameters() gives a tied one once
    touched = decode_weight_bytes(module, stored, batch, arch.vocab_size, policy(precision).autocast_dtype)
    rope_rows = 2 * arch.head_dim * 4
    assert touched - rope_rows == pytest.approx(speed._decode_weight_bytes(arch, precision, batch), rel=1e-12)
    if model == "7B" and precision == "bf16-pure":
        assert touched == 2 * (P7 - V7 * H7 + batch * H7) + 2 * Q7 * 4


# ---- 2. what a decode step reads of the KV cache --------------------------------------------------


def decode_all(lm, tokens: torch.Tensor, prompt_len: int, max_len: int) -> None:
    with torch.inference_mode():
        lm.prefill(tokens[:, :prompt_len], max_len)
        for position in range(prompt_len, max_len):
            lm.decode(tokens[:, position:position + 1])


def test_kv_bytes_read_by_each_way_of_decoding():
    arch, batch, prompt, max_len = resolve("tiny"), 2, 5, 9
    tokens = random_tokens(arch.vocab_size, batch, max_len, CPU, seed=3)
    module = build_native(arch, CPU, torch.float32)
    per_position = batch * KV_PER_POSITION * 4  # fp32

    eager = NativeLM(module, torch.float32)
    decode_all(eager, tokens, prompt, max_len)
    assert [eager.kv_bytes_read(p) for p in range(prompt, max_len)] == [(p + 1) * per_position
                                                                       for p in range(prompt, max_len)]
    # the graph's step (here "replayed" by running it again) attends over every slot
    graphed = NativeLM(module, torch.float32, cuda_graphs=True, capture=Replay)
    decode_all(graphed, tokens, prompt, max_len)
    assert graphed.decoding["cuda_graphs"] is True
    assert all(graphed.kv_bytes_read(p) == max_len * per_position for p in range(prompt, max_len))

    # transformers: the StaticCache read whole, in bf16
    static = load_model(arch, "hf", CPU, torch.bfloat16)
    assert isinstance(static, HuggingFaceLM) and static.static_cache
    decode_all(static, tokens, prompt, max_len)
    assert static.kv_bytes_read(prompt) == max_len * batch * KV_PER_POSITION * 2
    # under autocast the DynamicCache: fp32 keys (the rotary tables are fp32), values as the installed
    # transformers keeps bf16 values beside them; grown by concatenation: the p earlier positions copied,
    # then p + 1 read by attention
    dynamic = load_model(arch, "hf", CPU, torch.float32, compute_dtype=torch.bfloat16)
    assert not dynamic.static_cache
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decode_all(dynamic, tokens, prompt, max_len)
    mixed = batch * KV_PER_POSITION // 2 * (4 + dynamic_cache_value_bytes())
    assert [dynamic.kv_bytes_read(p) for p in range(prompt, max_len)] == [(2 * p + 1) * mixed
                                                                         for p in range(prompt, max_len)]


def dynamic_cache_value_bytes() -> int:
    """Bytes per element of the bf16 values that transformers' ``DynamicCache`` keeps beside fp32 keys:
    4 where it promotes them to the keys' dtype (5.17), 2 where it keeps their own (5.24)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4, dtype=torch.bfloat16), layer_idx=0)
    return cache.layers[0].values.element_size()


# ---- 2. through the worker -----------------------------------------------------------------------


def run_worker(run: RunSpec, tmp_path) -> dict:
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(Assignment(spec=run).model_dump_json())
    assert worker.main([str(spec_path), str(result_path)]) == worker.EXIT_OK
    return json.loads(result_path.read_text())


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_the_worker_reports_what_a_bf16_autocast_step_reads(backend, tmp_path):
    batch, prompt, new = 2, 12, 4
    result = run_worker(RunSpec(model="tiny", backend=backend, mode="infer", precision="bf16", batch_size=batch,
                                seq_len=prompt, new_tokens=new, device="cpu", warmup_steps=1, measure_steps=2),
                        tmp_path)
    throughput = result["throughput"]
    rotary = ROPE_ROWS if backend == "native" else 4 * Q // 2
    assert throughput["decode_weight_bytes_per_step"] == 8 * (TINY_PARAMS - TINY_NORMS) + 4 * TINY_NORMS + rotary
    positions = range(prompt, prompt + new - 1)  # the positions the decode steps write
    if backend == "native":  # eager (autocast keeps the graph off), bf16 cache, positions 0..p
        kv = sum(batch * KV_PER_POSITION * 2 * (p + 1) for p in positions) / len(positions)
    else:  # the DynamicCache of fp32 keys and its values, copied and read
        per_position = batch * KV_PER_POSITION // 2 * (4 + dynamic_cache_value_bytes())
        kv = sum(per_position * (2 * p + 1) for p in positions) / len(positions)
    assert throughput["decode_kv_bytes_per_step"] == pytest.approx(kv, rel=1e-12)
    latency = result["timing"]["token_latency"]["median"]
    assert throughput["decode_bandwidth_gbs"] == pytest.approx(
        (throughput["decode_weight_bytes_per_step"] + kv) / latency / 1e9)
    assert throughput["prefill_flops"] == batch * (prompt * (2 * (TINY_PARAMS - V * H) + 4 * L * HEADS * Q * prompt)
                                                   + 2 * V * H)
    assert result["peak_kind"] == "bf16"


def test_the_worker_divides_int8_by_the_int8_peak(tmp_path):
    result = run_worker(RunSpec(model="tiny", backend="native", mode="infer", precision="int8", batch_size=1,
                                seq_len=8, new_tokens=3, device="cpu", warmup_steps=1, measure_steps=2), tmp_path)
    assert result["peak_kind"] == "int8"
    # no autocast; the tied table is the output projection's: every stored byte, and the rotary rows
    assert result["throughput"]["decode_weight_bytes_per_step"] == result["weights"]["bytes"] + ROPE_ROWS


# ---- 4. the peak MFU divides by -----------------------------------------------------------------

INFERENCE_KIND = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16", "bf16-pure": "bf16",
                  "int8": "int8", "int8-dynamic": "int8", "fp8": "fp8", "fp8-block": "fp8",
                  "int4": "bf16", "int8-weight-only": "bf16", "fp8-weight-only": "bf16", "nf4": "bf16", "fp4": "bf16",
                  "int8-dynamic-int4": "bf16"}
TRAINING_KIND = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16", "bf16-pure": "bf16",
                 "fp8": "fp8", "int8": "bf16", "nf4": "bf16", "fp4": "bf16"}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_peak_kind_of_every_precision_and_mode(precision):
    for mode in ("forward", "infer"):
        assert entry(precision).peak_kind(mode) == INFERENCE_KIND[precision]
    for mode in ("train", "forward-backward"):
        if precision in TRAINING_KIND:
            assert entry(precision).peak_kind(mode) == TRAINING_KIND[precision]
        else:
            with pytest.raises(ValueError, match="no backward pass"):
                entry(precision).peak_kind(mode)


def test_the_planner_divides_by_the_same_peak():
    arch, batch = resolve("7B"), 8
    n7 = P7 - V7 * H7
    for precision, kind in (("int8", "int8"), ("int8-dynamic", "int8"), ("fp8", "fp8"), ("nf4", "bf16"),
                            ("int4", "bf16")):
        step = speed.estimate_step_time(arch, "infer", precision, batch, 128, new_tokens=16,
                                        parallelism=Parallelism(), gpu_name=H100)
        assert step.compute_s == pytest.approx(2 * batch * n7 / H100_TFLOPS[kind], rel=1e-12)
    tokens = batch * 128
    fp8 = speed.estimate_step_time(arch, "train", "fp8", batch, 128, new_tokens=1, parallelism=Parallelism(),
                                   gpu_name=H100)
    assert fp8.compute_s == pytest.approx(tokens * 3 * (2 * n7 + 4 * L7 * HEADS7 * Q7 * 128) / H100_TFLOPS["fp8"],
                                          rel=1e-12)
    assert not hasattr(speed, "PRECISION_KIND")
