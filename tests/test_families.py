"""The planner for every family: weights of every preset in every precision against the model's
own modules, no negative term anywhere, transformers' models held to their fake-tensor trace, and
the Falcon and GPT-2 cases worked by hand."""

import dataclasses
import functools
import math

import pytest
import torch

from fitbench.models.hf import build_hf, hf_config
from fitbench.models.native import meta_model
from fitbench.models.presets import PRESETS
from fitbench.models.registry import resolve
from fitbench.planning.activations import gpt2_gelu_upcast_bytes
from fitbench.planning.memory import estimate_memory
from fitbench.planning.sharding import Parallelism
from fitbench.planning.terms import Widths
from fitbench.precisions import TRAINING_MODES
from fitbench.planning.planner import Candidate, GpuTarget, assess
from fitbench.precisions import DEFAULT_LADDER, QUANTIZED_PRECISIONS, entry
from fitbench.worker.quantize import quantize_linears
from fitbench.worker.trace import trace_peak
from fitbench.worker.weight_bytes import weight_storage_bytes
from fitbench.spec import Layout

FLOAT_WIDTHS = {"fp32": 4, "bf16": 4, "bf16-pure": 2}  # bytes per stored weight
PRECISIONS = (*FLOAT_WIDTHS, *QUANTIZED_PRECISIONS)
CPU = torch.device("cpu")


@functools.lru_cache(maxsize=None)
def meta_module(name: str) -> torch.nn.Module:
    """The model the run builds for ``name``, on the meta device: native for llama, transformers otherwise."""
    arch = resolve(name)
    if arch.family == "llama":
        return meta_model(arch, torch.bfloat16)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.bfloat16)


def layers_of(module: torch.nn.Module) -> torch.nn.ModuleList:
    return module.model.layers if hasattr(module, "model") else module.transformer.h


def storage_rule(precision: str, rows: int, columns: int) -> float:
    """Bytes one quantized matrix keeps, by the library's own layout."""
    elements = rows * columns
    if precision in ("int8", "int8-dynamic", "int8-weight-only", "fp8", "fp8-weight-only"):
        # fp32 row scale (+ int8 zero point for torchao's int8 tensors)
        scale = 5 if precision in ("int8-dynamic", "int8-weight-only") else 4
        return elements + scale * rows
    if precision in ("nf4", "fp4"):
        # bitsandbytes: two 4-bit values per byte, one 8-bit absmax per 64 (double quantization),
        # one fp32 absmax per 256 blocks, and the 16-entry and 256-entry fp32 code books
        blocks = math.ceil(elements / 64)
        return elements / 2 + blocks + 4 * math.ceil(blocks / 256) + 4 * (16 + 256)
    if precision == "int4":
        return elements / 2 + 4 * elements / 128  # bf16 scale and zero point per group of 128
    if precision == "fp8-block":
        return elements + 4 * math.ceil(rows / 128) * math.ceil(columns / 128)
    if precision == "int8-dynamic-int4":
        return elements + 3 * elements / 32  # int4 held in int8; bf16 scale and int8 zero point per group of 32
    raise ValueError(precision)


def quantizable_shapes(module: torch.nn.Module) -> list[tuple[int, int]]:
    """(out, in) of every nn.Linear and Conv1D inside the decoder layers: what run.quantize converts."""
    shapes = []
    for layer in layers_of(module):
        for child in layer.modules():
            if isinstance(child, torch.nn.Linear):
                shapes.append((child.out_features, child.in_features))
            elif type(child).__name__ == "Conv1D":
                shapes.append((child.weight.shape[1], child.weight.shape[0]))
    return shapes


def storage_bytes(name: str, precision: str) -> float:
    """The model's weight storage under ``precision``, from its modules and the storage rules."""
    module = meta_module(name)
    parameters = {id(p): p for p in module.parameters()}.values()  # tied weights once
    everything = sum(p.numel() for p in parameters)
    if precision in FLOAT_WIDTHS:
        return FLOAT_WIDTHS[precision] * everything
    shapes = quantizable_shapes(module)
    quantized = sum(storage_rule(precision, rows, columns) for rows, columns in shapes)
    return quantized + 2 * (everything - sum(rows * columns for rows, columns in shapes))


@pytest.mark.parametrize("name", [arch.name for arch in PRESETS])
def test_layer_description_matches_the_modules(name):
    arch = resolve(name)
    module = meta_module(name)
    layer = layers_of(module)[0]
    parts = dict(layer.named_modules())
    for matrix in arch.layer_matrices:
        weight = parts[matrix.name].weight
        shape = tuple(weight.shape) if type(parts[matrix.name]).__name__ != "Conv1D" else tuple(weight.shape[::-1])
        assert shape == (matrix.rows, matrix.columns), matrix.name
        assert (parts[matrix.name].bias is not None) == matrix.bias, matrix.name
    assert len(arch.layer_matrices) == len(quantizable_shapes(module)) // arch.num_layers
    for norm in arch.layer_norms:
        assert parts[norm.name].weight.shape == (norm.size,)
        assert (getattr(parts[norm.name], "bias", None) is not None) == norm.bias
    assert sum(p.numel() for p in layer.parameters()) == arch.params_per_layer
    assert sum(p.numel() for p in {id(p): p for p in module.parameters()}.values()) == arch.total_params


@pytest.mark.parametrize("precision", PRECISIONS)
def test_predicted_weights_match_the_storage_of_every_preset(precision):
    # one test per precision, not per preset too: each check is a millisecond, a test's own cost more
    for arch in PRESETS:
        predicted = {t.name: t.bytes for t in estimate_memory(arch, "infer", precision, 1, 16).terms}["weights"]
        assert predicted == pytest.approx(storage_bytes(arch.name, precision), rel=0.01), arch.name


def tiny_family(family: str):
    """A small model of ``family``, or of transformers' model type of that name (qwen2, mistral)."""
    base = {"llama": "tiny", "falcon": "falcon-40b", "gpt2": "gpt2", "qwen2": "qwen2.5-7b",
            "mistral": "mistral-7b"}[family]
    return dataclasses.replace(resolve(base), name=f"tiny-{family}", hidden_size=128, num_layers=2, num_heads=8,
                               num_kv_heads=8 if family == "gpt2" else 2, ffn_size=512, vocab_size=1000,
                               max_seq_len=128)


@pytest.mark.parametrize("precision", ["int8", "nf4", "fp4", "int8-dynamic"])
@pytest.mark.parametrize("family", ["llama", "falcon", "gpt2"])
def test_storage_rules_hold_on_a_real_model(family, precision):
    """A tiny model of each family, quantized on the CPU (bitsandbytes, and torchao's int8, the
    one of its formats with CPU kernels), which also runs a forward pass: its storage is what the
    rules above say, and what the planner predicts, less the 4-bit code books (1,088 B per matrix,
    a large share of a tiny model's bytes and none of a real one's)."""
    arch = tiny_family(family)
    model = build_hf(arch, CPU, torch.bfloat16)
    shapes = quantizable_shapes(model)
    plain = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) - sum(r * c for r, c in shapes)
    quantize_linears(model, precision, CPU)
    model(torch.zeros((1, 4), dtype=torch.long))  # LLM.int8 moves its row scales on the first forward
    expected = sum(storage_rule(precision, r, c) for r, c in shapes) + 2 * plain
    actual = weight_storage_bytes(model)
    assert actual == pytest.approx(expected, rel=1e-3)
    predicted = {t.name: t.bytes for t in estimate_memory(arch, "infer", precision, 1, 4).terms}["weights"]
    code_books = 4 * (16 + 256) * len(shapes) if precision in ("nf4", "fp4") else 0
    assert predicted + code_books == pytest.approx(actual, rel=1e-3)


@pytest.mark.parametrize("family", ["llama", "falcon", "gpt2"])
def test_adapters_go_on_every_layer_matrix(family):
    from fitbench.planning.weights import adapter_params
    from fitbench.precisions import ADAPTER_RANK
    from fitbench.worker.adapters import add_adapters

    arch = tiny_family(family)
    model = build_hf(arch, CPU, torch.bfloat16)
    quantize_linears(model, "nf4", CPU)
    trainable = add_adapters(model, CPU)
    assert trainable == adapter_params(arch) == ADAPTER_RANK * arch.num_layers * sum(
        m.rows + m.columns for m in arch.layer_matrices)


def planner_cases():
    for mode in ("train", "forward-backward", "forward", "infer"):
        for precision in PRECISIONS:
            if not (mode in TRAINING_MODES and entry(precision).training_problem):
                yield mode, precision


# one test per preset, its modes and precisions in a loop: each case is a few milliseconds, a test's
# own cost more
@pytest.mark.parametrize("name", [arch.name for arch in PRESETS])
def test_no_term_is_negative(name):
    arch = resolve(name)
    target = GpuTarget("NVIDIA H100 80GB HBM3", 8, 80e9, described=True)
    seq_len = min(2048, arch.max_seq_len)
    for mode, precision in planner_cases():
        for gpus, strategy in ((1, "single"), (2, "fsdp" if mode in TRAINING_MODES else "tp"), (4, "pipeline")):
            for recompute in ((False, True) if mode in TRAINING_MODES else (False,)):
                result = assess(arch, mode, Candidate.of_strategy(precision, strategy, gpus, recompute, 2), target,
                                seq_len=seq_len, new_tokens=128)
                if result.memory is None:
                    continue
                for term in (*result.memory.terms, *result.overheads):
                    assert term.bytes >= 0, (mode, precision, strategy, gpus, recompute, term)


def test_falcon_180b_nf4_by_hand():
    """Falcon-180B: 80 layers of h = 14848, 232 heads of 64, 8 kv heads, f = 4 h."""
    h, L, heads, kv, V = 14848, 80, 232, 8, 65024
    qkv, dense, up, down = (heads + 2 * kv) * 64 * h, h * h, 4 * h * h, 4 * h * h
    matrices = qkv + dense + up + down
    nf4 = sum(e / 2 + e / 64 * (1 + 4 / 256) for e in (qkv, dense, up, down))
    norms = 2 * 2 * h
    plain = V * h + L * norms + 2 * h  # tied embedding, layer norms and the final norm, bf16
    weights = {t.name: t.bytes for t in estimate_memory(resolve("falcon-180b"), "infer", "nf4", 1, 16).terms}["weights"]
    assert weights == pytest.approx(L * nf4 + 2 * plain, rel=1e-12)
    assert L * (matrices + norms) + V * h + 2 * h == resolve("falcon-180b").total_params
    assert 90e9 < weights < 110e9  # about 4.5 bits for each of 178.6e9 parameters


def test_falcon_180b_int8_fits_three_80_gb_gpus_by_layers_and_not_two():
    """The memory of LLM.int8 weights split by layers over two and three GPUs, as transformers' stages
    hold them (made and quantized layer by layer on their devices); tensor parallelism has no
    transformers plan for Falcon, so the planner rejects it for that (``Layout.problem``), not for memory."""
    arch = resolve("falcon-180b")

    def need(layout: Layout) -> float:
        return estimate_memory(arch, "infer", "int8", 1, 512, new_tokens=128,
                               parallelism=Parallelism(layout=layout)).peak_bytes

    assert need(Layout(pp=2)) > 80e9 > need(Layout(pp=3))
    rejected = assess(arch, "infer", Candidate("int8", Layout(tp=4), False, 1), GpuTarget(None, 4, 80e9, True),
                      seq_len=512, new_tokens=128)
    assert not rejected.fits and "the run cannot launch tp x 4" in rejected.reason
    staged = assess(arch, "infer", Candidate("int8", Layout(pp=3), False, 1), GpuTarget(None, 3, 80e9, True),
                    seq_len=512, new_tokens=128)
    assert staged.fits


def test_gpt2_weights_and_training_by_hand():
    """GPT-2 (124M): every layer's four Conv1D matrices with biases, two LayerNorms; tied embedding
    and a learned position table."""
    h, L, V, T = 768, 12, 50257, 1024
    layer = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 2 * 2 * h
    P = V * h + T * h + L * layer + 2 * h
    assert P == resolve("gpt2").total_params == 124_439_808
    train = {t.name: t.bytes for t in estimate_memory(resolve("gpt2"), "train", "bf16-pure", 2, 64).terms}
    assert train["weights"] == 2 * P and train["optimizer state"] == 4 * P
    assert train["rotary tables"] == 0
    int8 = {t.name: t.bytes for t in estimate_memory(resolve("gpt2"), "infer", "int8", 1, 16).terms}["weights"]
    matrices = L * 12 * h * h
    assert int8 == pytest.approx(L * (12 * h * h + 4 * (3 * h + h + 4 * h + h)) + 2 * (P - matrices), rel=1e-12)


# ---- transformers' models against their trace ---------------------------------------------------

# Training follows transformers' modules tensor by tensor, as the native model does (3%); the
# forward pass and prefill of transformers' models hold residual-sized tensors counted from the
# trace (``HF_WIDE_AT_MLP``), which leaves up to 6%.
TRAIN_TOLERANCE, INFERENCE_TOLERANCE = 0.03, 0.06


def hf_trace_cases():
    for family in ("llama", "falcon", "gpt2"):
        for mode in ("train", "forward-backward", "forward", "infer"):
            for precision in FLOAT_WIDTHS:
                for batch, seq_len in ((1, 64), (4, 256)):
                    yield pytest.param(family, mode, precision, batch, seq_len,
                                       id=f"{family}-{mode}-{precision}-{batch}x{seq_len}")
    # transformers' Qwen2 and Mistral models, whose caches autocast leaves of mixed widths as Llama's
    for family in ("qwen2", "mistral"):
        for mode in ("forward", "infer"):
            yield pytest.param(family, mode, "bf16", 4, 256, id=f"{family}-{mode}-bf16-4x256")


@pytest.mark.parametrize("family, mode, precision, batch, seq_len", list(hf_trace_cases()))
def test_hf_analytic_peak_matches_the_trace(family, mode, precision, batch, seq_len):
    arch = tiny_family(family)
    arch = dataclasses.replace(arch, max_seq_len=512)
    actual = trace_peak(arch, mode, precision, batch, seq_len, new_tokens=3, backend="hf").peak_bytes
    estimate = estimate_memory(arch, mode, precision, batch, seq_len, new_tokens=3, backend="hf")
    if estimate.peak_moment == "start of the backward pass":
        # the trace runs the CPU's autocast, which keeps GPT-2's pow in 16 bits; a GPU's runs it in fp32
        actual += arch.num_layers * gpt2_gelu_upcast_bytes(arch, batch * seq_len, Widths.of(precision))
    error = (estimate.peak_bytes - actual) / actual
    tolerance = TRAIN_TOLERANCE if mode in TRAINING_MODES else INFERENCE_TOLERANCE
    assert abs(error) <= tolerance, f"analytic {estimate.peak_bytes:,.0f} B vs traced {actual:,} B ({error:+.2%})"


def hf_spec(**fields):
    from fitbench.spec import RunSpec

    values = dict(model="gpt2", backend="hf", mode="train", precision="bf16", batch_size=1, seq_len=256,
                  new_tokens=16, device="cpu", warmup_steps=1, measure_steps=1)
    return RunSpec(**{**values, **fields})


def test_hf_backend_rows_get_a_prediction():
    from fitbench.planning.calibration import DEFAULT
    from fitbench.planning.planner import predict_spec

    spec = hf_spec(model="falcon-40b", mode="infer", precision="nf4", seq_len=512, device="cuda")
    target = GpuTarget("NVIDIA H200", 1, 140e9, described=False)
    arch = resolve("falcon-40b")
    _, prediction = predict_spec(arch, spec, target, DEFAULT, choose_precision=False,
                                 choose_recompute=False, runnable=tuple(DEFAULT_LADDER["infer"]))
    terms = {t["name"]: t["bytes"] for t in prediction["terms"]}
    assert prediction["fits"] and terms["weights"] == pytest.approx(storage_bytes("falcon-40b", "nf4"), rel=0.01)
    # transformers' model is made and quantized layer by layer (fitbench.worker.quantize.hf_layers): the
    # build's peak is the 4-bit weights and one layer in bf16 with the quantizer's temporaries, far below
    # the bf16 model
    largest = max(m.rows * m.columns for m in arch.layer_matrices)
    one_layer = 2 * arch.params_per_layer + entry("nf4").build_temporary_bytes * largest
    assert terms["quantizer temporaries"] == pytest.approx(one_layer)
    # the peak is the build's or the prefill's, by how many heads the installed transformers caches
    assert terms["weights"] + one_layer <= prediction["predicted_peak_bytes"] < 2 * arch.total_params / 3


def test_hf_backend_auto_batch_follows_the_memory_model(monkeypatch):
    from fitbench.launch.job import predicted_max_batch

    spec = hf_spec()
    one = estimate_memory(resolve("gpt2"), "train", "bf16", 1, 256, backend="hf").peak_bytes
    five = estimate_memory(resolve("gpt2"), "train", "bf16", 5, 256, backend="hf").peak_bytes
    monkeypatch.setenv("FITBENCH_INJECT", f"mem-limit:{(one + five) / 2}")
    assert 1 < predicted_max_batch(spec, "cpu") < 5


def test_injected_memory_limit_applies_to_hf_rows(monkeypatch):
    """The launcher's assignment carries the hf row's predicted peak, which the worker compares."""
    from fitbench.launch.orders import assign
    from fitbench.worker.worker import raise_injected_out_of_memory

    assignment = assign(hf_spec(batch_size=8), None, None)
    peak = estimate_memory(resolve("gpt2"), "train", "bf16", 8, 256, backend="hf").peak_bytes
    assert assignment.predicted_peak_bytes == peak
    monkeypatch.setenv("FITBENCH_INJECT", f"mem-limit:{peak * 0.99}")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        raise_injected_out_of_memory(assignment)
    monkeypatch.setenv("FITBENCH_INJECT", f"mem-limit:{peak * 1.01}")
    raise_injected_out_of_memory(assignment)


@pytest.mark.parametrize("precision", ["bf16-pure", "bf16"])
@pytest.mark.parametrize("family", ["llama", "falcon", "gpt2", "qwen2", "mistral"])
def test_hf_kv_cache_term_is_the_cache_transformers_keeps(family, precision):
    """The cache a generation through the hf backend keeps (2 layers, batch 2, a 12-token prompt, 5 new
    tokens) against the probe's layout (``cache_layout``: one layer, batch 1, 3 tokens) and against the
    planner's term. bf16-pure keeps a ``StaticCache`` of prompt + new tokens; under autocast a
    ``DynamicCache`` of every position but the last token's. What the installed transformers caches per
    position (which heads, each tensor's width) is the probe's to read, so nothing here is one version's."""
    from fitbench.models.backends import load_model
    from fitbench.models.hf_cache import cache_layout
    from fitbench.precisions import policy
    from fitbench.worker.loops import generate
    from fitbench.worker.timing import DeviceClock

    arch = tiny_family(family)
    chosen = policy(precision)
    lm = load_model(arch, "hf", CPU, chosen.weight_dtype, compute_dtype=chosen.compute_dtype)
    batch, prompt, new = 2, 12, 5
    generate(lm, torch.zeros((batch, prompt), dtype=torch.long), new, chosen, DeviceClock(CPU), CPU)()
    layers = lm.cache.layers
    kept = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    layout = cache_layout(arch, str(chosen.weight_dtype).removeprefix("torch."),
                          str(chosen.compute_dtype).removeprefix("torch."))
    cached = prompt + new if layout.static else prompt + new - 1
    assert layout.static == (precision == "bf16-pure")
    assert layers[0].keys.shape[1] == (arch.num_heads if layout.query_heads else arch.num_kv_heads)
    assert (layers[0].keys.element_size(), layers[0].values.element_size()) == (layout.key_bytes, layout.value_bytes)
    assert kept == layout.bytes_per_token(arch) * batch * cached
    terms = {t.name: t.bytes for t in estimate_memory(arch, "infer", precision, batch, prompt, new_tokens=new,
                                                      backend="hf").terms}
    assert terms["KV cache"] * cached / (prompt + new) == kept


def test_the_cache_layout_is_read_once_per_transformers_version(tmp_path, monkeypatch):
    """``cache_layout`` runs transformers once and keeps the answer under its versions; a kept answer is
    what the next planner reads (changed here, so that reading it back shows)."""
    import json

    import transformers

    from fitbench.models import hf_cache

    monkeypatch.setenv("FITBENCH_CACHE_DIR", str(tmp_path))
    hf_cache._layout.cache_clear()
    try:
        arch = tiny_family("falcon")
        measured = hf_cache.cache_layout(arch, "bfloat16", "bfloat16")
        assert measured == hf_cache.measure_layout("falcon", hf_cache.probe_kv_heads(arch), "bfloat16", "bfloat16")
        path = tmp_path / "hf-cache-layouts.json"
        (versions, kept), = json.loads(path.read_text()).items()
        assert f"transformers {transformers.__version__}" in versions
        (key, entry), = kept.items()
        path.write_text(json.dumps({versions: {key: {**entry, "key_bytes": 8}}}))
        hf_cache._layout.cache_clear()
        assert hf_cache.cache_layout(arch, "bfloat16", "bfloat16").key_bytes == 8
        path.write_text("{not json")  # a damaged file is measured again
        hf_cache._layout.cache_clear()
        assert hf_cache.cache_layout(arch, "bfloat16", "bfloat16") == measured
    finally:
        hf_cache._layout.cache_clear()


def test_the_caches_kept_for_older_versions_are_what_those_versions_keep():
    """``KEPT_UNDER`` holds the caches of the versions committed rows ran; where the installed transformers
    is one of them (CI's oldest environment), reading them again gives the table's."""
    import transformers

    from fitbench.models import hf_cache

    kept = hf_cache.KEPT_UNDER.get(transformers.__version__)
    if kept is None:
        pytest.skip(f"transformers {transformers.__version__} is not among KEPT_UNDER's versions")
    for key, layout in kept.items():
        model_type, kv_heads, weights, compute = key.split("|")
        measured = hf_cache.measure_layout(model_type, int(kv_heads), weights, compute)
        assert dataclasses.astuple(measured)[:5] == layout, key


def test_a_row_is_repredicted_with_the_cache_its_transformers_kept():
    """Within ``kept_under`` a version of ``KEPT_UNDER`` answers with that version's cache (Falcon-40B's
    every query head, 16 times its kv heads, up to 5.24) and the planner's KV term follows; outside it,
    and for a version not in the table, the installed one's."""
    from fitbench.models.hf_cache import KEPT_UNDER, cache_layout, kept_under

    arch = resolve("falcon-40b")

    def kv_term() -> float:
        terms = estimate_memory(arch, "infer", "bf16-pure", 8, 512, new_tokens=32, backend="hf").terms
        return {t.name: t.bytes for t in terms}["KV cache"]

    installed = cache_layout(arch, "bfloat16", "bfloat16")
    for version, layouts in KEPT_UNDER.items():
        key_bytes, value_bytes, query_heads, _, _ = layouts["falcon|2|bfloat16|bfloat16"]
        with kept_under(version):
            layout = cache_layout(arch, "bfloat16", "bfloat16")
            heads = arch.num_heads if query_heads else arch.num_kv_heads
            assert layout.source == f"transformers {version}" and layout.query_heads == query_heads
            assert kv_term() == (key_bytes + value_bytes) * heads * arch.head_dim * arch.num_layers * 8 * (512 + 32)
    with kept_under("0.0.1"):
        assert cache_layout(arch, "bfloat16", "bfloat16") == installed
    assert cache_layout(arch, "bfloat16", "bfloat16") == installed
