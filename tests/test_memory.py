"""The analytic memory model (``fitbench.planning.memory``) against hand arithmetic and against the
fake-tensor trace of the real loops (``fitbench.worker.trace``)."""

import dataclasses
import json

import pytest
import torch

from fitbench.models.native import DecoderConfig, NativeCausalLM
from fitbench.models.registry import resolve
from fitbench.planning.memory import estimate_memory, stage_estimates
from fitbench.planning.sharding import Parallelism
from fitbench.planning.terms import BUILD, END, FIRST, MLP, OUTLIERS, OUTPUT, RECOMPUTE, START, MemoryEstimate, Term
from fitbench.planning.outliers import outlier_probability
from fitbench.worker.trace import trace_peak

# The analytic peak must land within 3% of the traced one. The model claims to follow the loops
# tensor by tensor, so what it leaves out (token ids, scalars, small temporaries) is far below this;
# a larger miss means a tensor is missing from, or wrongly placed in, a peak moment.
TRACE_TOLERANCE = 0.03

# The trace runs at most this many generated tokens (prefill + two decode steps); the estimate is
# given the same number so that both size the KV cache alike.
NEW_TOKENS = 3

# ---- a small architecture, every count worked out by hand ----------------------------------------

H, L, HEADS, KV_HEADS, F, V, MAX_SEQ = 64, 2, 4, 2, 128, 100, 256
D = H // HEADS  # head dim: 16
K = KV_HEADS * D  # key/value width: 32 (grouped-query attention: 2 query heads per kv head)

ARCH = dataclasses.replace(
    resolve("tiny"), name="hand", hidden_size=H, num_layers=L, num_heads=HEADS, num_kv_heads=KV_HEADS,
    ffn_size=F, vocab_size=V, tie_embeddings=False, max_seq_len=MAX_SEQ,
)

# Per layer: q (H x H), k and v (H x K each), o (H x H), gate/up/down (H x F each), two norms (H each).
LAYER_MATMUL = H * H + 2 * H * K + H * H + 3 * H * F  # 36,864
LAYER_PARAMS = LAYER_MATMUL + 2 * H  # 36,992
PARAMS = V * H + L * LAYER_PARAMS + H + V * H  # embedding, layers, final norm, untied output: 86,848
EDGE_PARAMS = PARAMS - L * LAYER_PARAMS  # embedding, final norm, output projection: 12,864

# cos and sin, fp32, one row of head-dim per position of the context
ROTARY = 2 * MAX_SEQ * D * 4  # 32,768

# bytes per weight (w), activation (c) and residual-stream element (r); whether autocast is on
WIDTHS = {
    "fp32": dict(w=4, c=4, r=4, autocast=False),
    "bf16": dict(w=4, c=2, r=4, autocast=True),
    "bf16-pure": dict(w=2, c=2, r=2, autocast=False),
}
PRECISIONS = tuple(WIDTHS)


def terms_of(estimate: MemoryEstimate) -> dict[str, float]:
    return {term.name: term.bytes for term in estimate.terms}


def moments_of(estimate: MemoryEstimate) -> dict[str, float]:
    return {moment: estimate.total_at(moment) for moment in estimate.moments}


def hand_norm(n: int, precision: str, dtensor: bool = False) -> int:
    """What one RMSNorm saves for n tokens: its input (the residual stream's width) and 1/rms; the
    backward pass recomputes the normalized input, and the matmuls after it save its output. On a
    DTensor (tensor-parallel training) its plain expressions run instead: an fp32 input (the input
    itself in fp32, else its fp32 copy), 1/rms and the normalized input, in fp32 where the residual is."""
    if precision not in ("fp32", "bf16", "bf16-pure"):
        raise ValueError(precision)
    if dtensor:
        return 4 * n * H + (4 if precision in ("fp32", "bf16") else 2) * n * H + 4 * n
    return (4 if precision in ("fp32", "bf16") else 2) * n * H + 4 * n


def hand_saved_per_layer(n: int, precision: str, tp: int = 1) -> float:
    """One layer's saved activations for n tokens; tensor parallelism splits attention and the MLP."""
    if precision == "fp32":
        qkv_inputs = 4 * n * H  # the norm's output, shared by q, k and v
        # rotary q; k and v repeated to all 4 heads for the fp32 kernel; attention output; lse
        attention = 4 * n * H + 4 * n * H + 4 * n * H + 4 * n * H + 4 * n * HEADS
        mlp_inputs = 4 * n * H  # shared by gate and up
        swiglu = 3 * 4 * n * F  # gate and up (silu(gate) is recomputed), the product
    elif precision == "bf16":
        qkv_inputs = 2 * n * H  # the norm's output, already in bf16: no cast per projection
        attention = 2 * n * H + 2 * n * K + 2 * n * K + 2 * n * H + 4 * n * HEADS  # grouped k, v stay K wide
        mlp_inputs = 2 * n * H
        swiglu = 3 * 2 * n * F
    elif precision == "bf16-pure":
        qkv_inputs = 2 * n * H  # the norm's bf16 output, shared
        attention = 2 * n * H + 2 * n * K + 2 * n * K + 2 * n * H + 4 * n * HEADS
        mlp_inputs = 2 * n * H
        swiglu = 3 * 2 * n * F
    else:
        raise ValueError(precision)
    return 2 * hand_norm(n, precision, dtensor=tp > 1) + qkv_inputs + attention / tp + mlp_inputs + swiglu / tp


def hand_final(n: int, precision: str) -> int:
    """The final RMSNorm's saved tensors and the output projection's input (c n h)."""
    return hand_norm(n, precision) + WIDTHS[precision]["c"] * n * H


def hand_loss(n: int, precision: str) -> int:
    """The fused loss: the c-byte logits, overwritten by their gradient, and one chunk's fp32 exponentials
    (a chunk is 64 MiB of fp32 rows)."""
    rows = min(64 * 2**20 // (4 * V), n)
    return WIDTHS[precision]["c"] * n * V + 4 * rows * V


def hand_output_backward(n: int, precision: str) -> int:
    """What the output projection's backward holds beyond the loss: its matmul's two gradients (c n H,
    c V H) beside the logits' (c n V), or under autocast the weight's gradient cast to fp32 (4 V H) once
    the logits' gradient is freed; the loss's chunk is gone by then."""
    w, c = WIDTHS[precision]["w"], WIDTHS[precision]["c"]
    cast = w * V * H - c * n * V if WIDTHS[precision]["autocast"] else 0
    return max(0, c * n * V + max(c * n * H + c * V * H, cast) - hand_loss(n, precision))


def hand_first_layer(n: int, precision: str) -> float:
    """The first layer in its MLP's backward: its saved activations (and weight copies), the gradient
    flowing in (r n H) and SwiGLU's gradients beyond the down projection's freed input (2 c n F), less
    the layer's gradients not yet formed (all but the down projection's), at least nothing."""
    w, c, r = WIDTHS[precision]["w"], WIDTHS[precision]["c"], WIDTHS[precision]["r"]
    layer_casts = c * LAYER_MATMUL if WIDTHS[precision]["autocast"] else 0
    return max(0, hand_saved_per_layer(n, precision) + layer_casts + r * n * H + 2 * c * n * F
               - w * (LAYER_PARAMS - H * F))


def hand_training_moments(mode: str, precision: str, batch: int, seq_len: int,
                          checkpointing: bool = False) -> dict[str, int]:
    """The candidate peaks of a training step for ARCH on one GPU."""
    wd = WIDTHS[precision]
    w, c, r, autocast = wd["w"], wd["c"], wd["r"], wd["autocast"]
    n = batch * seq_len
    optimizer = 2 * w * PARAMS if mode == "train" else 0
    always = w * PARAMS + ROTARY + optimizer
    # every parameter's gradient but the untied input embedding's, which the very last backward
    # operator forms, after the first layer's activations are freed
    gradients = w * (PARAMS - V * H)
    embedding_gradient = w * V * H
    one_layer = hand_saved_per_layer(n, precision)
    layer_casts = c * LAYER_MATMUL if autocast else 0
    # SwiGLU's backward: the gradients of gate and up beside that of their product, the product freed
    widest = 2 * c * n * F
    # the logits and the loss's chunk, or the output projection's backward where it holds more
    loss = hand_loss(n, precision) + hand_output_backward(n, precision)
    # every weight's copy: saved by autograd, or with checkpointing held by autocast's cache to the loss
    casts = c * (L * LAYER_MATMUL + V * H) if autocast else 0
    moments = {}
    if checkpointing:
        inputs = L * r * n * H  # every layer's input
        moments[START] = always + inputs + casts + hand_final(n, precision) + loss
        # the last layer recomputed, beside the output projection's gradient and the gradient into the layer
        moments[RECOMPUTE] = always + inputs + one_layer + layer_casts + widest + w * V * H + r * n * H
    else:
        moments[START] = always + L * one_layer + casts + hand_final(n, precision) + loss
    moments[FIRST] = always + gradients + hand_first_layer(n, precision)
    moments[END] = always + gradients + embedding_gradient  # untied: no embedding-gradient sum
    return moments


def hand_inference_moments(mode: str, precision: str, batch: int, seq_len: int, new_tokens: int) -> dict[str, int]:
    wd = WIDTHS[precision]
    w, c, r, autocast = wd["w"], wd["c"], wd["r"], wd["autocast"]
    n = batch * seq_len
    cache = 2 * L * K * c * batch * (seq_len + new_tokens) if mode == "infer" else 0
    always = w * PARAMS + ROTARY + cache
    rows = batch if mode == "infer" else n  # generation projects the last position only
    output = r * n * H + c * rows * V + ((c * n * H + c * V * H) if autocast else 0)
    # inside the MLP: silu(gate), up and their product, beside the layer's input (still held by the
    # caller), the residual after attention and its normalized copy, and the int64 token ids
    mlp = 3 * r * n * H + 3 * c * n * F + 8 * n
    return {MLP: always + mlp, OUTPUT: always + output}


def assert_moments(estimate: MemoryEstimate, expected: dict[str, float]) -> None:
    assert estimate.moments == tuple(expected)
    assert moments_of(estimate) == pytest.approx(expected, rel=1e-12)
    assert estimate.peak_bytes == pytest.approx(max(expected.values()), rel=1e-12)
    assert estimate.peak_moment == max(expected, key=expected.get)


def test_hand_parameter_count_matches_the_built_model():
    with torch.device("meta"):
        module = NativeCausalLM(DecoderConfig.from_architecture(ARCH))
    assert PARAMS == 86_848
    assert sum(p.numel() for p in module.parameters()) == PARAMS
    assert ARCH.total_params == PARAMS
    assert ARCH.params_per_layer == LAYER_PARAMS


def test_rotary_tables_match_the_built_buffers():
    with torch.device("meta"):
        module = NativeCausalLM(DecoderConfig.from_architecture(ARCH))
    buffers = sum(b.numel() * 4 for b in (module.rope_cos, module.rope_sin))  # kept fp32
    assert buffers == ROTARY == 32_768


# ---- term by term --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["train", "forward-backward", "forward", "infer"])
@pytest.mark.parametrize("precision, per_weight", [("fp32", 4), ("bf16", 4), ("bf16-pure", 2)])
def test_weights_are_bytes_per_weight_times_parameters(mode, precision, per_weight):
    estimate = estimate_memory(ARCH, mode, precision, 2, 16, new_tokens=NEW_TOKENS)
    assert terms_of(estimate)["weights"] == per_weight * 86_848


@pytest.mark.parametrize("mode", ["train", "forward-backward", "forward", "infer"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_rotary_tables_are_always_alive(mode, precision):
    estimate = estimate_memory(ARCH, mode, precision, 2, 16, new_tokens=NEW_TOKENS)
    [rotary] = [t for t in estimate.terms if t.name == "rotary tables"]
    assert rotary.bytes == ROTARY
    assert rotary.moments is None and estimate.at_peak(rotary)


@pytest.mark.parametrize("precision, per_layer", [
    # int8: 36,864 one-byte elements + one fp32 scale per output row (512 rows)
    ("int8", 36_864 + 4 * 512),
    # nf4: half a byte per element + an 8-bit absmax per block of 64 + one fp32 scale per 256 blocks
    ("nf4", 36_864 // 2 + (36_864 // 64) * (1 + 4 / 256)),
    # torchao int4: half a byte per element + 4 B per group of 128
    ("int4", 36_864 // 2 + 4 * 36_864 // 128),
])
def test_quantized_weights(precision, per_layer):
    estimate = estimate_memory(ARCH, "infer", precision, 2, 16, new_tokens=NEW_TOKENS)
    # the layers' matrices quantized; norms, embedding and output projection in bf16
    plain = 2 * (PARAMS - L * LAYER_MATMUL)
    assert terms_of(estimate)["weights"] == pytest.approx(L * per_layer + plain, rel=1e-12)


@pytest.mark.parametrize("precision, per_element", [("int8", 2.2), ("nf4", 0.35), ("fp8", 10.6)])
def test_the_build_holds_one_bf16_layer_and_one_matrix_of_temporaries_and_no_cache(precision, per_element):
    estimate = estimate_memory(ARCH, "infer", precision, 2, 16, new_tokens=NEW_TOKENS)
    by_name = {t.name: t for t in estimate.terms}
    # one layer's parameters in bf16, and the quantizer's bytes per element of the largest matrix (H x F)
    assert by_name["quantizer temporaries"].bytes == pytest.approx(2 * LAYER_PARAMS + per_element * H * F)
    assert by_name["quantizer temporaries"].moments == frozenset({BUILD})
    # the KV cache and the step's temporaries come after the build
    assert BUILD not in by_name["KV cache"].moments and MLP in by_name["KV cache"].moments
    assert estimate.total_at(BUILD) == pytest.approx(
        by_name["weights"].bytes + by_name["rotary tables"].bytes + by_name["quantizer temporaries"].bytes)


def test_four_bit_prefill_holds_one_dequantized_matrix_at_the_mlp():
    by_name = {t.name: t for t in estimate_memory(ARCH, "infer", "nf4", 2, 16, new_tokens=NEW_TOKENS).terms}
    assert by_name["dequantized weight"].bytes == 2 * H * F
    assert by_name["dequantized weight"].moments == frozenset({MLP})


@pytest.mark.parametrize("precision, quantization, reserve", [
    # fp8 and int8-dynamic: three fp32 copies of the down projection's input and the 8-bit result
    # (13 B per element) less silu(gate) and up, freed by then (2 x 2 B); one more fp32 copy reserved
    ("fp8", 13 - 2 * 2, 4), ("int8-dynamic", 13 - 2 * 2, 4),
    # bitsandbytes' 4-bit weights quantize no activation; one more bf16 product reserved
    ("nf4", None, 2), ("fp4", None, 2),
    # LLM.int8: the up projection's int32 product reserved once more
    ("int8", None, 4), ("int4", None, None), ("bf16-pure", None, None)])
def test_quantized_prefill_terms_at_the_mlp_by_hand(precision, quantization, reserve):
    batch, seq_len = 2, 16
    n = batch * seq_len
    estimate = estimate_memory(ARCH, "infer", precision, batch, seq_len, new_tokens=NEW_TOKENS)
    by_name = terms_of(estimate)
    assert by_name.get("activation quantization") == (None if quantization is None else quantization * n * F)
    assert by_name.get("allocator reserve at the MLP") == (None if reserve is None else reserve * n * F)
    # LLM.int8: the up projection's int32 product and one more 16-bit copy, 6 B per element
    assert by_name.get("LLM.int8 product") == (6 * n * F if precision == "int8" else None)
    for name in ("activation quantization", "allocator reserve at the MLP", "LLM.int8 product"):
        assert all(t.moments == frozenset({MLP}) for t in estimate.terms if t.name == name)
    # a decode step of one token quantizes a row at a time: neither term
    one = terms_of(estimate_memory(ARCH, "infer", precision, 1, 1, new_tokens=NEW_TOKENS))
    assert not {"activation quantization", "allocator reserve at the MLP", "LLM.int8 product"} & set(one)


@pytest.mark.parametrize("batch, seq_len", [(1, 16), (4, 64)])
def test_int8_outlier_columns_by_hand(batch, seq_len):
    n = batch * seq_len
    p = outlier_probability(H, gated=True)
    k = F * (1 - (1 - p) ** n)  # columns of the down projection's input holding an outlier
    estimate = estimate_memory(ARCH, "infer", "int8", batch, seq_len, new_tokens=NEW_TOKENS)
    by_name = {t.name: t for t in estimate.terms}
    # bf16: r = c = 2; stream 3 r n h, input c n f, subA 2 n k, CB gather h k, fp32 pair 8 h k, 8 n h
    live = 3 * 2 * n * H + 2 * n * F + 2 * n * k + H * k + 8 * H * k + 8 * n * H
    assert by_name["LLM.int8 outlier columns"].bytes == pytest.approx(live, rel=1e-9)
    assert by_name["LLM.int8 allocator reserve"].bytes == pytest.approx(8 * H * k, rel=1e-9)
    assert estimate.total_at(OUTLIERS) == pytest.approx(
        by_name["weights"].bytes + by_name["rotary tables"].bytes + by_name["KV cache"].bytes + live + 8 * H * k)
    assert "LLM.int8 outlier columns" not in terms_of(estimate_memory(ARCH, "infer", "nf4", batch, seq_len,
                                                                      new_tokens=NEW_TOKENS))


@pytest.mark.parametrize("precision, grad_bytes, adam_bytes", [("fp32", 4, 8), ("bf16", 4, 8), ("bf16-pure", 2, 4)])
def test_training_gradients_and_optimizer_state(precision, grad_bytes, adam_bytes):
    train = estimate_memory(ARCH, "train", precision, 2, 16)
    # the untied input embedding's gradient (V x H) is its own term; the rest are "gradients"
    assert terms_of(train)["gradients"] == grad_bytes * (PARAMS - V * H)
    assert terms_of(train)["input embedding gradient"] == grad_bytes * V * H
    assert terms_of(train)["optimizer state"] == adam_bytes * PARAMS
    # gradients are set to None at the step's start; AdamW's moments live through it; the input
    # embedding's gradient comes from the last backward operator, so it exists only at the end
    by_name = {t.name: t for t in train.terms}
    assert by_name["gradients"].moments == frozenset({FIRST, END})
    assert by_name["input embedding gradient"].moments == frozenset({END})
    assert by_name["optimizer state"].moments is None

    backward = terms_of(estimate_memory(ARCH, "forward-backward", precision, 2, 16))
    assert backward["gradients"] == grad_bytes * (PARAMS - V * H)
    assert backward["input embedding gradient"] == grad_bytes * V * H
    assert backward.get("optimizer state", 0) == 0


@pytest.mark.parametrize("mode", ["forward", "infer"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_inference_modes_hold_no_gradients_or_optimizer_state(mode, precision):
    names = set(terms_of(estimate_memory(ARCH, mode, precision, 2, 16, new_tokens=NEW_TOKENS)))
    assert not names & {"gradients", "optimizer state", "activations", "loss chain", "autocast weight copies"}
    assert ("KV cache" in names) == (mode == "infer")


@pytest.mark.parametrize("precision, cache_bytes", [("fp32", 4), ("bf16", 2), ("bf16-pure", 2)])
@pytest.mark.parametrize("batch, seq_len, new_tokens", [(1, 16, 1), (3, 40, 9), (8, 128, 64)])
def test_kv_cache(precision, cache_bytes, batch, seq_len, new_tokens):
    estimate = estimate_memory(ARCH, "infer", precision, batch, seq_len, new_tokens=new_tokens)
    expected = 2 * L * KV_HEADS * D * cache_bytes * batch * (seq_len + new_tokens)
    assert terms_of(estimate)["KV cache"] == expected


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("batch, seq_len", [(1, 1), (2, 16), (4, 100)])
def test_saved_activations_per_layer(precision, batch, seq_len):
    """Without checkpointing the activations term is L layers of the docstring's per-layer list,
    and the first layer's share is what is left of it in the backward pass of the first layer, with
    its SwiGLU backward's gradients of gate and up (2 c n f, the product freed for its gradient)."""
    n = batch * seq_len
    estimate = estimate_memory(ARCH, "train", precision, batch, seq_len)
    terms = terms_of(estimate)
    assert terms["activations"] == L * hand_saved_per_layer(n, precision)
    assert terms["first layer in backward"] == pytest.approx(hand_first_layer(n, precision), rel=1e-12)


def test_saved_activations_per_layer_worked_example():
    # n = 10. fp32 (k and v repeated to all heads): 32 n h + 4 n H + 8 n + 12 n f;
    # bf16: 16 n h + 4 n k + 4 n H + 8 n + 6 n f; bf16-pure: 12 n h + 4 n k + 4 n H + 8 n + 6 n f
    assert hand_saved_per_layer(10, "fp32") == 20_480 + 160 + 80 + 15_360
    assert hand_saved_per_layer(10, "bf16") == 10_240 + 1_280 + 160 + 80 + 7_680
    assert hand_saved_per_layer(10, "bf16-pure") == 7_680 + 1_280 + 160 + 80 + 7_680


def test_fp32_repeats_keys_and_values_only_for_grouped_heads():
    """Without grouping (kv heads = heads) there is nothing to repeat: k and v are h wide either way."""
    n = 2 * 16
    ungrouped = dataclasses.replace(ARCH, num_kv_heads=HEADS)
    grouped = terms_of(estimate_memory(ARCH, "train", "fp32", 2, 16))["activations"]
    plain = terms_of(estimate_memory(ungrouped, "train", "fp32", 2, 16))["activations"]
    assert grouped == plain == L * hand_saved_per_layer(n, "fp32")
    # in 16 bits the grouped k and v stay K wide: 2 x 2 B x n x (H - K) less per layer
    grouped16 = terms_of(estimate_memory(ARCH, "train", "bf16", 2, 16))["activations"]
    plain16 = terms_of(estimate_memory(ungrouped, "train", "bf16", 2, 16))["activations"]
    assert plain16 - grouped16 == L * 2 * 2 * n * (H - K)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_step_terms(precision):
    wd = WIDTHS[precision]
    c = wd["c"]
    n = 3 * 20
    terms = terms_of(estimate_memory(ARCH, "train", precision, 3, 20))
    rows = min(max(1, 64 * 2**20 // (4 * V)), n)  # the loss's chunk: 64 MiB of fp32 rows
    assert terms["loss chain"] == c * n * V + 4 * rows * V
    # the output projection's backward: c n H + c V H beside the logits' gradient, against the loss's
    # 4 r V (60 rows of 100: 24,000 B); under autocast the weight's fp32 gradient, 4 V H, less c n V
    head = {"fp32": 4 * n * H + 4 * V * H, "bf16": max(2 * n * H + 2 * V * H, 4 * V * H - 2 * n * V),
            "bf16-pure": 2 * n * H + 2 * V * H}[precision]
    assert terms.get("output projection backward", 0) == max(0, head - 4 * rows * V)
    assert ("output projection backward" in terms) == (precision == "fp32")  # 40,960 B against 24,000 B
    assert "logits held by the loop" not in terms
    assert terms["final norm and output input"] == hand_final(n, precision)
    if wd["autocast"]:
        assert terms["autocast weight copies"] == c * (L * LAYER_MATMUL + V * H)
    else:
        assert "autocast weight copies" not in terms
    assert "tied embedding gradients" not in terms


def test_tied_embeddings_add_the_gradient_sum_at_the_end():
    tied = dataclasses.replace(ARCH, tie_embeddings=True)
    tied_params = PARAMS - V * H
    for precision in PRECISIONS:
        w = WIDTHS[precision]["w"]
        estimate = estimate_memory(tied, "forward-backward", precision, 1, 1)
        [term] = [t for t in estimate.terms if t.name == "tied embedding gradients"]
        assert term.bytes == 2 * w * V * H and term.moments == frozenset({END})
        assert terms_of(estimate)["weights"] == w * tied_params
        assert estimate.total_at(END) == w * tied_params + ROTARY + w * tied_params + 2 * w * V * H


@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpointed_activations_keep_layer_inputs(precision):
    n = 4 * 32
    wd = WIDTHS[precision]
    w, c, r = wd["w"], wd["c"], wd["r"]
    estimate = estimate_memory(ARCH, "train", precision, 4, 32, activation_checkpointing=True)
    terms = terms_of(estimate)
    assert terms["activations"] == L * r * n * H
    layer_casts = c * LAYER_MATMUL if wd["autocast"] else 0
    assert terms["recomputed last layer"] == hand_saved_per_layer(n, precision) + layer_casts + 2 * c * n * F + \
        w * V * H + r * n * H
    if wd["autocast"]:
        # recomputed layers save none, but autocast's cache holds every copy until the loss is formed
        assert terms["autocast weight copies"] == c * (L * LAYER_MATMUL + V * H)
    by_name = {t.name: t for t in estimate.terms}
    assert by_name["activations"].moments == frozenset({START, RECOMPUTE})
    assert by_name["recomputed last layer"].moments == frozenset({RECOMPUTE})


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("batch, seq_len", [(1, 1), (2, 16), (8, 64), (256, 256)])
def test_partial_checkpointing_moments_by_hand(precision, batch, seq_len):
    """--checkpointed-layers 1 of ARCH's 2 layers: the first layer keeps its input (r n H), the second its
    saved activations. At the start of the backward pass both are held; at the recompute of the first
    layer the second's activations are freed and its gradients (w x LAYER_PARAMS) formed beside the
    output projection's, the recomputed layer's activations, its SwiGLU's gradients and the gradient
    flowing in. The first layer's backward and the end are full checkpointing's."""
    wd = WIDTHS[precision]
    w, c, r, autocast = wd["w"], wd["c"], wd["r"], wd["autocast"]
    n = batch * seq_len
    always = w * PARAMS + ROTARY + 2 * w * PARAMS
    one_layer = hand_saved_per_layer(n, precision)
    layer_casts = c * LAYER_MATMUL if autocast else 0
    casts = c * (L * LAYER_MATMUL + V * H) if autocast else 0
    loss = hand_loss(n, precision) + hand_output_backward(n, precision)
    full = hand_training_moments("train", precision, batch, seq_len, checkpointing=True)
    expected = {
        START: always + one_layer + r * n * H + casts + hand_final(n, precision) + loss,
        RECOMPUTE: always + r * n * H + one_layer + layer_casts + 2 * c * n * F + w * V * H + w * LAYER_PARAMS
        + r * n * H,
        FIRST: full[FIRST],
        END: full[END],
    }
    estimate = estimate_memory(ARCH, "train", precision, batch, seq_len, activation_checkpointing=True,
                               checkpointed_layers=1)
    assert_moments(estimate, expected)
    # a count at or above the layers is every layer
    every = estimate_memory(ARCH, "train", precision, batch, seq_len, activation_checkpointing=True,
                            checkpointed_layers=L)
    assert moments_of(every) == pytest.approx(full, rel=1e-12)
    # the count means nothing without checkpointing
    assert moments_of(estimate_memory(ARCH, "train", precision, batch, seq_len, checkpointed_layers=1)) == \
        pytest.approx(hand_training_moments("train", precision, batch, seq_len), rel=1e-12)


def test_partial_checkpointing_peak_falls_from_none_to_every_layer():
    """Each layer more recomputed trades one layer's saved activations for its input: the peak falls
    with the count, from no checkpointing's to every layer's, where a layer's backward sets it."""
    arch = resolve("small")
    peaks = [estimate_memory(arch, "train", "bf16", 4, 512).peak_bytes]
    peaks += [estimate_memory(arch, "train", "bf16", 4, 512, activation_checkpointing=True,
                              checkpointed_layers=count).peak_bytes for count in range(1, arch.num_layers + 1)]
    every = estimate_memory(arch, "train", "bf16", 4, 512, activation_checkpointing=True).peak_bytes
    assert all(a >= b for a, b in zip(peaks, peaks[1:]))
    assert peaks[0] > peaks[1] and peaks[-1] == every < peaks[0]


@pytest.mark.parametrize("stages, checkpointed", [(2, 3), (4, 1)])
def test_partial_checkpointing_counts_per_pipeline_stage(stages, checkpointed):
    """Under a pipeline the count is per stage: each stage's first N layers keep only their input, so
    every stage's activations at the loss hold N inputs and (its layers - N) layers' saved tensors, for
    each microbatch in flight."""
    from fitbench.spec import Layout

    arch = resolve("small")
    parallelism = Parallelism(layout=Layout(pp=stages))
    batch, seq_len = 4, 128
    m = parallelism.microbatches_of(batch)
    n = -(-batch // m) * seq_len
    for estimate in stage_estimates(arch, "train", "bf16-pure", batch, seq_len, parallelism=parallelism,
                                    activation_checkpointing=True, checkpointed_layers=checkpointed):
        layers = len(estimate.stage.layers)
        one = estimate_memory(arch, "train", "bf16-pure", batch // m, seq_len).terms
        per_layer = dict((t.name, t.bytes) for t in one)["activations"] / arch.num_layers
        expected = m * (checkpointed * 2 * n * arch.hidden_size + (layers - checkpointed) * per_layer)
        assert terms_of(estimate)["activations"] == pytest.approx(expected, rel=1e-9)


# ---- moments and the peak ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["train", "forward-backward"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("batch, seq_len", [(1, 1), (2, 16), (8, 64), (256, 256)])
def test_training_moments_by_hand(mode, precision, checkpointing, batch, seq_len):
    expected = hand_training_moments(mode, precision, batch, seq_len, checkpointing)
    estimate = estimate_memory(ARCH, mode, precision, batch, seq_len, activation_checkpointing=checkpointing)
    assert_moments(estimate, expected)
    assert estimate.peak_bytes == pytest.approx(sum(t.bytes for t in estimate.terms if estimate.at_peak(t)),
                                                rel=1e-12)


@pytest.mark.parametrize("mode", ["forward", "infer"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("batch, seq_len", [(1, 1), (2, 16), (8, 128)])
def test_inference_moments_by_hand(mode, precision, batch, seq_len):
    expected = hand_inference_moments(mode, precision, batch, seq_len, NEW_TOKENS)
    estimate = estimate_memory(ARCH, mode, precision, batch, seq_len, new_tokens=NEW_TOKENS)
    assert_moments(estimate, expected)


@pytest.mark.parametrize("mode", ["train", "forward-backward"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_peak_moment_moves_with_the_batch(mode, precision):
    tiny = estimate_memory(ARCH, mode, precision, 1, 1)
    huge = estimate_memory(ARCH, mode, precision, 512, 256)
    assert tiny.peak_moment in (FIRST, END)
    assert huge.peak_moment == START
    # at one token the step is the model's state: weights, gradients (and AdamW state), the rotary
    # tables, within a layer's worth
    w = WIDTHS[precision]["w"]
    state = (2 if mode == "forward-backward" else 4) * w * PARAMS + ROTARY
    assert state <= tiny.peak_bytes < state + 4 * LAYER_PARAMS * w
    moments = hand_training_moments(mode, precision, 512, 256)
    assert huge.peak_bytes == moments[START] > max(moments[FIRST], moments[END])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpointed_peak_moment_moves_with_the_vocabulary(precision):
    """With checkpointing the start of the backward pass holds c n V + 4 r V of loss chain against one
    layer in its backward pass (the last one recomputed, or the first): the small vocabulary peaks in a
    layer's backward, a large one at the start."""
    small_vocab = estimate_memory(ARCH, "train", precision, 8, 64, activation_checkpointing=True)
    large_vocab = estimate_memory(dataclasses.replace(ARCH, vocab_size=4096), "train", precision, 8, 64,
                                  activation_checkpointing=True)
    assert small_vocab.peak_moment in (RECOMPUTE, FIRST)
    assert large_vocab.peak_moment == START


@pytest.mark.parametrize("precision", PRECISIONS)
def test_inference_peak_moment_moves_with_the_prompt(precision):
    """A single token peaks at the output projection (the largest matrix, logits); a long prompt
    peaks inside the MLP."""
    tiny = resolve("tiny")
    assert estimate_memory(tiny, "infer", precision, 1, 1, new_tokens=NEW_TOKENS).peak_moment == OUTPUT
    assert estimate_memory(tiny, "infer", precision, 4, 256, new_tokens=NEW_TOKENS).peak_moment == MLP


def test_estimate_picks_the_largest_moment():
    terms = (Term("always", 10.0, "x"), Term("a", 5.0, "x", frozenset({"a"})),
             Term("b", 7.0, "x", frozenset({"b"})), Term("ab", 1.0, "x", frozenset({"a", "b"})))
    estimate = MemoryEstimate(terms, ("a", "b"))
    assert (estimate.total_at("a"), estimate.total_at("b")) == (16.0, 18.0)
    assert estimate.peak_moment == "b" and estimate.peak_bytes == 18.0
    assert [estimate.at_peak(t) for t in terms] == [True, False, True, True]


# ---- offload -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["forward", "infer"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("batch, seq_len", [(1, 1), (2, 16), (8, 128)])
def test_offload_keeps_the_edges_and_the_resident_layers_with_one_layer_in_flight(mode, precision, batch, seq_len):
    w = WIDTHS[precision]["w"]
    plain = hand_inference_moments(mode, precision, batch, seq_len, NEW_TOKENS)
    for resident in range(L + 1):
        estimate = estimate_memory(ARCH, mode, precision, batch, seq_len, new_tokens=NEW_TOKENS,
                                   resident_layers=resident)
        terms = terms_of(estimate)
        assert terms["weights"] == w * (EDGE_PARAMS + resident * LAYER_PARAMS)
        # one offloaded layer copied in for its forward while any layer is offloaded, at every moment
        in_flight = w * LAYER_PARAMS if resident < L else 0
        assert terms.get("offloaded layer in flight", 0) == in_flight
        # the KV cache of every layer stays on the GPU, as do the temporaries
        if mode == "infer":
            assert terms["KV cache"] == 2 * L * K * WIDTHS[precision]["c"] * batch * (seq_len + NEW_TOKENS)
        offloaded = w * (L - resident) * LAYER_PARAMS
        assert_moments(estimate, {moment: total - offloaded + in_flight for moment, total in plain.items()})


def test_offload_worked_example():
    # bf16-pure, infer, batch 2 x 16 + 3 new tokens, one of the two layers on the GPU.
    estimate = estimate_memory(ARCH, "infer", "bf16-pure", 2, 16, new_tokens=NEW_TOKENS, resident_layers=1)
    weights = 2 * (12_864 + 36_992)  # edges and one layer: 99,712
    in_flight = 2 * 36_992  # 73,984
    cache = 2 * 2 * 32 * 2 * 2 * 19  # k and v, 2 layers, width 32, 2 B, batch 2, 19 positions: 9,728
    mlp = 3 * 2 * 32 * 64 + 3 * 2 * 32 * 128 + 8 * 32  # 12,288 + 24,576 + 256 = 37,120
    assert estimate.peak_moment == MLP
    assert estimate.peak_bytes == weights + ROTARY + in_flight + cache + mlp == 253_312


def test_offload_with_every_layer_resident_is_the_plain_model():
    for mode in ("forward", "infer"):
        plain = estimate_memory(ARCH, mode, "bf16-pure", 2, 16, new_tokens=NEW_TOKENS)
        resident = estimate_memory(ARCH, mode, "bf16-pure", 2, 16, new_tokens=NEW_TOKENS, resident_layers=L)
        assert moments_of(resident) == moments_of(plain)


@pytest.mark.parametrize("mode, precision, parallelism, resident", [
    ("train", "bf16-pure", Parallelism(), 1),
    ("forward-backward", "bf16", Parallelism(), 1),
    ("infer", "int8", Parallelism(), 1),
    ("infer", "bf16-pure", Parallelism("tp", 2), 1),
    ("infer", "bf16-pure", Parallelism(), -1),
    ("infer", "bf16-pure", Parallelism(), L + 1),
])
def test_offload_outside_its_scope_is_an_error(mode, precision, parallelism, resident):
    with pytest.raises(ValueError):
        estimate_memory(ARCH, mode, precision, 1, 16, new_tokens=NEW_TOKENS, parallelism=parallelism,
                        resident_layers=resident)


# ---- parallelism ---------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
def test_fsdp_shards_weights_gradients_and_optimizer_state(precision):
    single = terms_of(estimate_memory(ARCH, "train", precision, 2, 32))
    sharded = terms_of(estimate_memory(ARCH, "train", precision, 2, 32, parallelism=Parallelism("fsdp", 4)))
    w = WIDTHS[precision]["w"]
    for name, per_param in (("weights", w), ("optimizer state", 2 * w)):
        assert sharded[name] == single[name] / 4 == per_param * PARAMS / 4, name
    # on one GPU the input embedding's gradient is a term of its own; FSDP shards every gradient,
    # that one included, into the one gradients term
    whole_gradients = single["gradients"] + single["input embedding gradient"]
    assert single["gradients"] == w * (PARAMS - V * H)
    assert sharded["gradients"] == whole_gradients / 4 == w * PARAMS / 4
    assert "input embedding gradient" not in sharded
    # FSDP's mixed precision gathers 16-bit weights and runs the layers in 16 bits: bf16's activations
    # are bf16-pure's, and there are no autocast copies
    same_widths = "bf16-pure" if precision == "bf16" else precision
    assert sharded["activations"] == terms_of(estimate_memory(ARCH, "train", same_widths, 2, 32))["activations"]
    assert "autocast weight copies" not in sharded


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fsdp_units_in_flight_by_hand(precision, tied):
    arch = dataclasses.replace(ARCH, tie_embeddings=tied)
    estimate = estimate_memory(arch, "train", precision, 2, 32, parallelism=Parallelism("fsdp", 4))
    terms = terms_of(estimate)
    # gathered in 16 bits under mixed precision (c), reduced in the sharded parameters' dtype (w)
    c, rd = {"fp32": (4, 4), "bf16": (2, 4), "bf16-pure": (2, 2)}[precision]
    root = V * H + H + (0 if tied else V * H)  # embedding, final norm, output projection
    assert root == (EDGE_PARAMS if not tied else EDGE_PARAMS - V * H)
    gradients_at_root = root + (V * H if tied else 0)  # a tied matrix gets two contributions, then their sum
    expected = {
        "FSDP root gathered": (c * root, None),
        "FSDP layers gathered": (2 * c * LAYER_PARAMS, {START, RECOMPUTE, FIRST}),
        "FSDP layer gradients": (c * LAYER_PARAMS + rd * LAYER_PARAMS, {FIRST}),
        "FSDP root gradients": (c * (V * H + H), {RECOMPUTE, FIRST}),
        "FSDP root reduce-scatter": (max(c * gradients_at_root + rd * LAYER_PARAMS, rd * root), {END}),
    }
    by_name = {term.name: term for term in estimate.terms}
    for name, (size, moments) in expected.items():
        assert terms[name] == size > 0, name
        assert by_name[name].moments == (None if moments is None else frozenset(moments)), name
    assert "tied embedding gradients" not in terms and "unsharded FSDP units" not in terms
    # the streams' cached pools: the copy-in stream's at its largest (two layers' all-gather outputs, or
    # the root's output and its input, one of 4 shards) beyond the output in use; the reduce-scatter
    # stream's, the sharded gradients' pages, where the gradients are None
    # (or, where the root's output is the smaller, two layers' outputs beside the root's)
    pool = (2 * c * LAYER_PARAMS + c * root if root < LAYER_PARAMS
            else max(2 * c * LAYER_PARAMS, (1 + 1 / 4) * c * root))
    assert terms["FSDP all-gather pool"] == pool - c * LAYER_PARAMS and by_name["FSDP all-gather pool"].cached
    assert by_name["FSDP all-gather pool"].moments is None
    params = PARAMS - (V * H if tied else 0)
    assert terms["reduce-scatter pool"] == terms["gradients"] == WIDTHS[precision]["w"] * params / 4
    assert by_name["reduce-scatter pool"].cached and by_name["reduce-scatter pool"].moments == {START, RECOMPUTE}
    # the start of the backward pass: shards, every activation and the loss, the root and two layers gathered,
    # and the pools; what must fit leaves the pools out
    start = sum(terms.get(name, 0) for name in ("weights", "optimizer state", "rotary tables", "activations",
                                                "final norm and output input", "loss chain",
                                                "output projection backward"))
    live = start + c * root + 2 * c * LAYER_PARAMS
    assert estimate.total_at(START, cached=False) == live
    assert estimate.total_at(START) == live + pool - c * LAYER_PARAMS + terms["gradients"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fsdp_cpu_offload_keeps_shards_gradients_and_optimizer_state_in_host_memory(precision):
    on_gpu = estimate_memory(ARCH, "train", precision, 2, 32, parallelism=Parallelism("fsdp", 4))
    offloaded = estimate_memory(ARCH, "train", precision, 2, 32, parallelism=Parallelism("fsdp", 4, offload=True))
    before, after = terms_of(on_gpu), terms_of(offloaded)
    for name in ("weights", "gradients", "optimizer state"):
        assert before[name] > 0 and after[name] == 0, name
    w, c = WIDTHS[precision]["w"], WIDTHS[precision]["c"]
    # two units' shards pass through: copied in (w), cast for the all-gather (c), their gradients out (w);
    # the root (12,864 parameters) is the smaller unit here, so two layers' shards
    assert EDGE_PARAMS < LAYER_PARAMS
    assert after["FSDP offload staging"] == (2 * w + c) * 2 * LAYER_PARAMS / 4
    # what is gathered in flight and the activations stay as they were
    # (the sharded gradients leave the GPU after each reduce-scatter: no reduce-scatter pool keeps them)
    assert {name: size for name, size in after.items() if name not in ("weights", "gradients", "optimizer state",
                                                                      "FSDP offload staging")} == \
        {name: size for name, size in before.items() if name not in ("weights", "gradients", "optimizer state",
                                                                     "reduce-scatter pool")}
    assert offloaded.peak_bytes < on_gpu.peak_bytes
    for strategy, gpus in (("ddp", 4), ("fsdp", 1)):
        with pytest.raises(ValueError, match="CPU offload is FSDP's"):
            Parallelism(strategy, gpus, offload=True)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_ddp_gradient_buckets_by_hand(precision, tied):
    arch = dataclasses.replace(ARCH, tie_embeddings=tied)
    params = PARAMS - (V * H if tied else 0)
    single = estimate_memory(arch, "train", precision, 2, 32)
    ddp = estimate_memory(arch, "train", precision, 2, 32, parallelism=Parallelism("ddp", 4))
    one, each = terms_of(single), terms_of(ddp)
    w = WIDTHS[precision]["w"]
    # replicated: weights and optimizer state as on one GPU; the gradients live in DDP's buckets, which
    # exist at every moment (gradient_as_bucket_view)
    assert each["weights"] == one["weights"] == w * params
    assert each["optimizer state"] == one["optimizer state"] == 2 * w * params
    assert "gradients" not in each and each["gradient buckets"] == w * params
    assert {t.name: t.moments for t in ddp.terms}["gradient buckets"] is None
    assert each["activations"] == one["activations"]
    # and a second set of the buckets' bytes, measured on 2 x H200
    assert each["second gradient buckets"] == w * params
    assert ddp.total_at(START) == single.total_at(START) + 2 * w * params
    # the first layer's gradients that its MLP's backward has not formed yet take nothing on one GPU;
    # on DDP they are the buckets', already counted
    unformed = w * (LAYER_PARAMS - H * F)
    assert each["first layer in backward"] == one["first layer in backward"] + unformed
    if tied:
        # the output projection's contribution waits in autograd for the embedding's: one matrix more
        # at the first layer than the buckets (and their second set)
        assert each["tied gradient awaiting its sum"] == w * V * H
        assert ddp.total_at(FIRST) == single.total_at(FIRST) + w * V * H + w * params + unformed
        assert each["tied embedding gradients"] == one["tied embedding gradients"] == 2 * w * V * H
    else:
        # the input embedding's fresh gradient, before its copy into the bucket
        assert each["input embedding gradient"] == one["input embedding gradient"] == w * V * H
        assert ddp.total_at(FIRST) == single.total_at(FIRST) + w * V * H + w * params + unformed
        assert ddp.total_at(END) == single.total_at(END) + w * V * H + w * params


@pytest.mark.parametrize("precision", PRECISIONS)
def test_tensor_parallelism_halves_the_kv_cache(precision):
    single = terms_of(estimate_memory(ARCH, "infer", precision, 4, 64, new_tokens=16))
    split = terms_of(estimate_memory(ARCH, "infer", precision, 4, 64, new_tokens=16,
                                     parallelism=Parallelism("tp", 2)))
    c, r = WIDTHS[precision]["c"], WIDTHS[precision]["r"]
    n = 4 * 64
    assert split["KV cache"] == single["KV cache"] / 2 == 2 * L * K * c * 4 * (64 + 16) / 2
    # the MLP's intermediates split; the three residual-sized tensors and the token ids do not
    assert split["MLP temporaries"] == 3 * r * n * H + 3 * c * n * F / 2 + 8 * n


@pytest.mark.parametrize("precision", PRECISIONS)
def test_tensor_parallelism_splits_layers_and_the_vocabulary(precision):
    w = WIDTHS[precision]["w"]
    split = terms_of(estimate_memory(ARCH, "train", precision, 4, 64, parallelism=Parallelism("tp", 2)))
    # every layer matrix halves (2 kv heads split 2 ways), the norms do not; the embedding and the
    # output projection split over the vocabulary, the final norm does not
    local = L * (LAYER_MATMUL / 2 + 2 * H) + V * H / 2 + H + V * H / 2
    assert split["weights"] == w * local
    assert split["gradients"] == w * (local - V * H / 2)
    assert split["input embedding gradient"] == w * V * H / 2
    assert split["optimizer state"] == 2 * w * local
    assert split["activations"] == L * hand_saved_per_layer(4 * 64, precision, tp=2)


def test_tensor_parallelism_replicates_kv_heads_it_cannot_split():
    # 2 kv heads on 4 ranks: k, v and the KV cache whole on every rank; q, o and the MLP in quarters
    split = terms_of(estimate_memory(ARCH, "infer", "bf16-pure", 4, 64, new_tokens=16,
                                     parallelism=Parallelism("tp", 4)))
    single = terms_of(estimate_memory(ARCH, "infer", "bf16-pure", 4, 64, new_tokens=16))
    layer = (2 * H * H + 3 * H * F) / 4 + 2 * H * K + 2 * H
    assert split["weights"] == 2 * (L * layer + V * H / 4 + H + V * H / 4)
    assert split["KV cache"] == single["KV cache"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_pipeline_stages_hold_their_layers_and_their_edges(precision):
    # 2 layers on 2 stages, 2 microbatches of 2 sequences under GPipe: each stage holds both
    # microbatches' activations of its layer; the first the embedding, the last the final norm, the
    # output projection and the loss
    assert L == 2
    w = WIDTHS[precision]["w"]
    single = terms_of(estimate_memory(ARCH, "train", precision, 4, 64))
    pipeline = Parallelism("pipeline", 2)
    first, last = (terms_of(estimate_memory(ARCH, "train", precision, 4, 64, parallelism=pipeline, stage=i))
                   for i in (0, 1))
    assert first["activations"] == single["activations"] / 2 == 2 * hand_saved_per_layer(2 * 64, precision)
    assert last["activations"] == 2 * hand_saved_per_layer(2 * 64, precision)
    assert first["other microbatches' activations"] == last["other microbatches' activations"] == \
        hand_saved_per_layer(2 * 64, precision)
    assert first["weights"] == w * (LAYER_PARAMS + V * H)
    assert last["weights"] == w * (LAYER_PARAMS + H + V * H)
    assert "loss chain" not in first and "input embedding gradient" in first
    assert "loss chain" in last and "input embedding gradient" not in last
    whole = estimate_memory(ARCH, "train", precision, 4, 64, parallelism=pipeline)
    assert whole.stage is not None and whole.peak_bytes == max(
        estimate_memory(ARCH, "train", precision, 4, 64, parallelism=pipeline, stage=i).peak_bytes for i in (0, 1))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpipe_second_microbatch_by_hand(precision):
    # 2 layers on 2 stages, 2 microbatches of 2 x 64 tokens, checkpointed. At the second microbatch's
    # backward every gradient is the first's, the input embedding's included; the schedule keeps the
    # other microbatch's output (hidden states, or on the last stage its logits); the first stage keeps
    # a receive buffer per microbatch for its output's gradient; and the layer in backward forms a new
    # gradient of its largest matrix (H x F) beside the one it is added to.
    widths = WIDTHS[precision]
    w, c, r = widths["w"], widths["c"], widths["r"]
    n = 2 * 64
    pipeline = Parallelism("pipeline", 2)
    first, last = (estimate_memory(ARCH, "train", precision, 4, 64, parallelism=pipeline, stage=i,
                                   activation_checkpointing=True) for i in (0, 1))
    LATER = "backward of the second microbatch"
    assert LATER in first.moments and LATER in last.moments
    one, inputs = hand_saved_per_layer(n, precision), r * n * H
    casts = c * LAYER_MATMUL if widths["autocast"] else 0
    new_gradient = (c + (w if widths["autocast"] else 0)) * H * F
    mlp_backward = r * n * H + 2 * c * n * F
    layer = one + casts + mlp_backward + new_gradient
    local_first = LAYER_PARAMS + V * H
    outputs_first = r * n * H
    buffers = 2 * r * n * H
    assert terms_of(first)["outputs awaiting their backward"] == outputs_first
    assert terms_of(first)["gradient receive buffers"] == buffers
    assert terms_of(first)["second microbatch in backward"] == layer
    assert first.total_at(LATER) == (w * local_first + ROTARY + 2 * w * local_first + w * local_first
                                     + inputs + outputs_first + buffers + layer)
    local_last = LAYER_PARAMS + H + V * H
    head = c * (n * H + V * H)
    assert terms_of(last)["outputs awaiting their backward"] == c * n * V
    assert "gradient receive buffers" not in terms_of(last)
    assert terms_of(last)["second microbatch in backward"] == max(layer, head)
    assert last.total_at(LATER) == (4 * w * local_last + ROTARY + inputs + c * n * V + max(layer, head))
    # one microbatch: no GPipe terms, no such moment
    single = estimate_memory(ARCH, "train", precision, 1, 64, parallelism=pipeline, stage=0,
                             activation_checkpointing=True)
    assert LATER not in single.moments and "gradient receive buffers" not in terms_of(single)


def test_uneven_pipeline_stages():
    # 5 layers on 2 stages: 3 and 2 (spec.pipeline_stages gives the odd layer to the first here)
    arch = dataclasses.replace(ARCH, num_layers=5)
    estimates = stage_estimates(arch, "infer", "bf16-pure", 4, 64, new_tokens=16, parallelism=Parallelism("pipeline", 2))
    first, last = (terms_of(e) for e in estimates)
    cache = 2 * 2 * K * 4 * (64 + 16)  # k and v, 2 B, per layer
    assert (first["KV cache"], last["KV cache"]) == (3 * cache, 2 * cache)
    assert first["weights"] == 2 * (3 * LAYER_PARAMS + V * H)
    assert last["weights"] == 2 * (2 * LAYER_PARAMS + H + V * H)
    assert OUTPUT not in estimates[0].moments and OUTPUT in estimates[1].moments
    assert [len(e.stage.layers) for e in estimates] == [3, 2] and "embedding" in estimates[0].stage.label
    assert all(t.bytes >= 0 for e in estimates for t in e.terms)


def test_parallelism_degrees():
    assert (Parallelism().tensor, Parallelism().stages, Parallelism().shards) == (1, 1, 1)
    assert (Parallelism("fsdp", 4).tensor, Parallelism("fsdp", 4).stages, Parallelism("fsdp", 4).shards) == (1, 1, 4)
    assert (Parallelism("tp", 2).tensor, Parallelism("tp", 2).shards) == (2, 1)
    assert (Parallelism("pipeline", 2).stages, Parallelism("pipeline", 2).shards) == (2, 1)
    assert Parallelism("ddp", 8).shards == 1


# ---- serialisation -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["train", "forward-backward", "forward", "infer"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("parallelism", [Parallelism(), Parallelism("fsdp", 2), Parallelism("ddp", 2)],
                         ids=["single", "fsdp", "ddp"])
def test_as_dict_is_json_and_sums_to_the_peak(mode, precision, checkpointing, parallelism):
    estimate = estimate_memory(resolve("tiny"), mode, precision, 2, 64, new_tokens=NEW_TOKENS,
                               activation_checkpointing=checkpointing, parallelism=parallelism)
    data = json.loads(json.dumps(estimate.as_dict()))
    assert set(data) >= {"peak_bytes", "peak_moment", "moments", "terms"}
    assert data["peak_moment"] == estimate.peak_moment
    assert list(data["moments"]) == list(estimate.moments)
    assert [t["name"] for t in data["terms"]] == [t.name for t in estimate.terms]
    assert all(isinstance(t["formula"], str) and t["formula"] for t in data["terms"])
    assert all(t["bytes"] >= 0 for t in data["terms"])
    # the peak is the largest moment, and the terms alive at it sum to it
    assert data["peak_bytes"] == max(data["moments"].values()) == data["moments"][data["peak_moment"]]
    for moment, total in data["moments"].items():
        alive = sum(t.bytes for t in estimate.terms if t.moments is None or moment in t.moments)
        assert total == pytest.approx(alive, rel=1e-12), moment
    assert [t["at_peak"] for t in data["terms"]] == [
        t.moments is None or data["peak_moment"] in t.moments for t in estimate.terms]
    at_peak = sum(t["bytes"] for t in data["terms"] if t["at_peak"])
    assert at_peak == pytest.approx(data["peak_bytes"], rel=1e-12)
    assert data["peak_bytes"] > 0


# ---- against the trace ---------------------------------------------------------------------------

# A trace costs CPU per operator, whatever the shapes: small (12 layers) is traced at one shape, where
# its activations outweigh its weights, in the modes whose steps differ (forward-backward is a training
# step without the optimizer's state, traced for tiny); tiny at two shapes, where either outweighs.
SHAPES = {"tiny": [(1, 64), (4, 256)], "small": [(4, 512)]}
MODES = {"tiny": ("train", "forward-backward", "forward", "infer"), "small": ("train", "forward", "infer")}
# (model, mode, precision, batch, seq_len, checkpointing) of the traces test_trace_grows_with_the_batch
# and test_trace_checkpointing_lowers_the_peak compare
GROWTH = [("tiny", "train", precision, batch, 64, False) for precision in PRECISIONS for batch in (1, 2, 4)]
CHECKPOINTING = [("small", "train", "bf16", 4, 512, checkpointing) for checkpointing in (False, True)]


def trace_cases():
    for model, shapes in SHAPES.items():
        for mode in MODES[model]:
            for precision in PRECISIONS:
                for checkpointing in ((False, True) if mode in ("train", "forward-backward") else (False,)):
                    for batch, seq_len in shapes:
                        case_id = f"{model}-{mode}-{precision}-{'ckpt' if checkpointing else 'full'}-{batch}x{seq_len}"
                        yield pytest.param(model, mode, precision, batch, seq_len, checkpointing, id=case_id)


@pytest.fixture(scope="module")
def traced() -> dict[tuple, int]:
    """The traced peak of every configuration the tests below compare with (keyed as GROWTH), traced in
    this process: about half a minute of CPU in all. Every core is already busy with a test process, so
    traces in processes of their own would only add their imports of torch, and at a low priority
    would wait for the other test processes to end."""
    cases = {tuple(case.values) for case in trace_cases()} | set(GROWTH) | set(CHECKPOINTING)
    return {(model, mode, precision, batch, seq_len, checkpointing): trace_peak(
        resolve(model), mode, precision, batch, seq_len, new_tokens=NEW_TOKENS,
        activation_checkpointing=checkpointing).peak_bytes
        for model, mode, precision, batch, seq_len, checkpointing in sorted(cases)}


@pytest.mark.parametrize("model, mode, precision, batch, seq_len, checkpointing", list(trace_cases()))
def test_analytic_peak_matches_the_trace(traced, model, mode, precision, batch, seq_len, checkpointing):
    actual = traced[model, mode, precision, batch, seq_len, checkpointing]
    estimate = estimate_memory(resolve(model), mode, precision, batch, seq_len, new_tokens=NEW_TOKENS,
                               activation_checkpointing=checkpointing)
    error = (estimate.peak_bytes - actual) / actual
    moments = ", ".join(f"{m!r} {total:,.0f}" for m, total in moments_of(estimate).items())
    assert abs(error) <= TRACE_TOLERANCE, (
        f"analytic {estimate.peak_bytes:,.0f} B vs traced {actual:,} B ({error:+.2%}), "
        f"moment {estimate.peak_moment!r}; moments: {moments}")


@pytest.mark.parametrize("model, precision, batch, seq_len, checkpointed", [
    ("tiny", "bf16", 4, 256, 1), ("tiny", "fp32", 1, 64, 1), ("small", "bf16-pure", 4, 512, 5),
    ("small", "bf16", 4, 512, 11)])
def test_partial_checkpointing_matches_the_trace(model, precision, batch, seq_len, checkpointed):
    """The first N layers checkpointed in the real loop, traced on fake tensors, against the analytic peak."""
    arch = resolve(model)
    actual = trace_peak(arch, "train", precision, batch, seq_len, activation_checkpointing=True,
                        checkpointed_layers=checkpointed).peak_bytes
    estimate = estimate_memory(arch, "train", precision, batch, seq_len, activation_checkpointing=True,
                               checkpointed_layers=checkpointed)
    error = (estimate.peak_bytes - actual) / actual
    assert abs(error) <= TRACE_TOLERANCE, (estimate.peak_moment, moments_of(estimate), actual)


def test_trace_is_deterministic():
    arch = resolve("tiny")
    first = trace_peak(arch, "train", "bf16", 2, 64).peak_bytes
    second = trace_peak(arch, "train", "bf16", 2, 64).peak_bytes
    assert first == second > 0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_trace_grows_with_the_batch(traced, precision):
    arch = resolve("tiny")
    for batch in (1, 2):
        smaller = traced["tiny", "train", precision, batch, 64, False]
        larger = traced["tiny", "train", precision, 2 * batch, 64, False]
        assert larger > smaller, batch
    # the weights alone are a floor
    assert traced["tiny", "train", precision, 1, 64, False] > WIDTHS[precision]["w"] * arch.total_params


def test_trace_checkpointing_lowers_the_peak(traced):
    full, checkpointed = (traced[case] for case in CHECKPOINTING)
    assert checkpointed < full
    # a layer's backward keeps about twenty (B, T, C) bf16 tensors' worth (its norms' inputs, the
    # projections' inputs, attention's, gate and up of the MLP, four C wide each); checkpointing
    # keeps one fp32 input per layer, so it frees more than 15 per layer
    arch, (_, _, _, batch, seq_len, _) = resolve("small"), CHECKPOINTING[0]
    assert full - checkpointed > 15 * arch.num_layers * batch * seq_len * arch.hidden_size * 2


def test_tensor_parallel_logits_are_gathered_and_reordered_beside_the_ranks_slice():
    # forward, 4 x 64 rows: the rank's slice (V / 2), the gather's rank-major buffer and its copy in
    # vocabulary order (V each); one row of a decode needs no copy
    single = terms_of(estimate_memory(ARCH, "forward", "bf16-pure", 4, 64))
    split = terms_of(estimate_memory(ARCH, "forward", "bf16-pure", 4, 64, parallelism=Parallelism("tp", 2)))
    assert split["output projection"] - single["output projection"] == 2 * 4 * 64 * V * (2 + 1 / 2 - 1)
    one = terms_of(estimate_memory(ARCH, "infer", "bf16-pure", 1, 64, new_tokens=8))
    one_split = terms_of(estimate_memory(ARCH, "infer", "bf16-pure", 1, 64, new_tokens=8,
                                         parallelism=Parallelism("tp", 2)))
    assert one_split["output projection"] - one["output projection"] == 2 * 1 * V * (1 + 1 / 2 - 1)


def test_copy_in_pool_by_hand():
    """The copy-in stream's pool: two layers' all-gather outputs beside the root's where the root's is the
    smaller (its block never holds a layer's), else the larger of two layers' and the root's output and
    input. The 30B preset over 4 GPUs in bf16-pure, GiB: layer 0.997, root 0.793 -> 2.787 (2.79 mapped
    on 4 x H200 and 4 x H100); the 20B over 2: layer 0.727, root 0.732 -> 1.463 (1.46 mapped)."""
    from fitbench.planning.parallel_terms import copy_in_pool

    assert copy_in_pool(0.997, 0.793, 4)[0] == 2 * 0.997 + 0.793
    assert copy_in_pool(0.727, 0.732, 2)[0] == max(2 * 0.727, 1.5 * 0.732) == 2 * 0.727
    assert copy_in_pool(0.406, 1.957, 2)[0] == 1.5 * 1.957
