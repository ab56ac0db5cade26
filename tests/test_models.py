import dataclasses
import json
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fitbench.models.architecture import Architecture
from fitbench.models.backends import HuggingFaceLM, NativeLM, load_model
from fitbench.models.graphs import Replay
from fitbench.models.hf import build_hf, hf_config
from fitbench.models.native import (DecoderConfig, FusedLinear, build_native, checkpoint_tensors,
                                    rope_inverse_frequencies)
from fitbench.models.registry import resolve
from fitbench.precisions import entry, policy
from fitbench.worker import worker
from fitbench.worker.loops import make_step, random_tokens
from fitbench.worker.parallelize import parallelize
from fitbench.worker.ranks import Rank
from fitbench.spec import Assignment, Layout, RunSpec

MODES = ("train", "forward", "forward-backward", "infer")
BATCH, SEQ, NEW = 2, 16, 4


def spec(**fields) -> RunSpec:
    values = dict(model="tiny", backend="native", mode="train", precision="fp32", batch_size=BATCH, seq_len=SEQ,
                  new_tokens=NEW, device="cpu", warmup_steps=1, measure_steps=2)
    return RunSpec(**{**values, **fields})


def positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_stats(stats: dict, count: int) -> None:
    assert stats["count"] == count
    for key in ("mean", "median", "min", "max", "p95", "q1", "q3"):
        assert positive_finite(stats[key]), key
    assert stats["min"] <= stats["median"] <= stats["max"]


# ---- the worker's measurement, in this process ------------------------------------------------


def measure(run: RunSpec, tmp_path) -> dict:
    """The worker's whole job (``python -m fitbench.worker.worker SPEC RESULT``), run in this process."""
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(Assignment(spec=run).model_dump_json())
    code = worker.main([str(spec_path), str(result_path)])
    result = json.loads(result_path.read_text())
    assert result["status"] == "ok", result.get("error")
    assert code == worker.EXIT_OK
    return result


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_measures_on_tiny(mode, backend, tmp_path):
    result = measure(spec(mode=mode, backend=backend), tmp_path)
    arch = resolve("tiny")
    timing, throughput = result["timing"], result["throughput"]
    if mode == "infer":
        check_stats(timing["time_to_first_token"], 2)
        check_stats(timing["token_latency"], 2 * (NEW - 1))
        check_stats(timing["end_to_end"], 2)
        samples = timing["samples"]
        assert len(samples["token_latency"]) == 2 * (NEW - 1)
        # a generation lasts at least its prefill plus its decode steps
        for e2e, ttft in zip(samples["end_to_end"], samples["time_to_first_token"]):
            assert e2e >= ttft
        latency = timing["token_latency"]["median"]
        assert throughput["decode_tokens_per_s"] == pytest.approx(BATCH / latency)
        assert throughput["prefill_tokens_per_s"] == pytest.approx(BATCH * SEQ / timing["time_to_first_token"]["median"])
        # one copy of every weight in fp32, the tied output projection included once
        assert throughput["weight_bytes"] == 4 * arch.total_params
        # a step reads every weight (the tied table whole) and the rotary rows: the native model's cos
        # and sin tables one fp32 row each, transformers' head_dim / 2 fp32 inverse frequencies
        rotary = 2 * arch.head_dim * 4 if backend == "native" else arch.head_dim // 2 * 4
        assert throughput["decode_weight_bytes_per_step"] == 4 * arch.total_params + rotary
        # fp32 keys and values; eager native decoding reads positions 0..p (SEQ + NEW / 2 on average over
        # the steps at SEQ .. SEQ + NEW - 2), transformers' StaticCache all SEQ + NEW slots
        slots = SEQ + NEW / 2 if backend == "native" else SEQ + NEW
        kv_bytes = BATCH * 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4 * slots
        assert throughput["decode_kv_bytes_per_step"] == pytest.approx(kv_bytes, rel=1e-12)
        assert throughput["decode_weights_bandwidth_gbs"] == pytest.approx(
            throughput["decode_weight_bytes_per_step"] / latency / 1e9)
        assert throughput["decode_roofline_percent"] is None  # no datasheet bandwidth for a CPU
        reason = ("CUDA graphs need a GPU; this run is on cpu" if backend == "native"
                  else "the hf backend decodes eagerly, one transformers forward per token")
        assert result["decode"] == {"cuda_graphs": False, "reason": reason}
    else:
        assert result["decode"] is None
        check_stats(timing["step"], 2)
        assert len(timing["samples"]["step"]) == 2
        median = timing["step"]["median"]
        assert throughput["tokens_per_step"] == BATCH * SEQ
        assert throughput["tokens_per_s"] == pytest.approx(BATCH * SEQ / median)
        per_token = arch.forward_flops_per_token(SEQ) * (1 if mode == "forward" else 3)
        assert throughput["flops_per_token"] == per_token
        assert throughput["achieved_tflops"] == pytest.approx(BATCH * SEQ / median * per_token / 1e12)
        assert throughput["mfu"] is None  # no datasheet peak for a CPU
    assert result["memory"]["host_peak_rss"] > 0
    assert result["memory"]["gpus"] == []
    assert result["environment"]["torch"] == torch.__version__
    assert result["device_name"].startswith("cpu")


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_generation_in_16_bits(precision, backend, tmp_path):
    """Autocast keeps fp32 weights but 16-bit activations: the KV cache must take both."""
    result = measure(spec(mode="infer", precision=precision, backend=backend), tmp_path)
    check_stats(result["timing"]["token_latency"], 2 * (NEW - 1))


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_native_bf16_train_step(precision, tmp_path):
    result = measure(spec(precision=precision), tmp_path)
    check_stats(result["timing"]["step"], 2)
    assert result["throughput"]["tokens_per_s"] == pytest.approx(BATCH * SEQ / result["timing"]["step"]["median"])


def test_train_updates_weights_and_forward_backward_does_not():
    arch = resolve("tiny")
    device = torch.device("cpu")
    tokens = random_tokens(arch.vocab_size, 2, 9, device, seed=3)
    assert torch.equal(tokens, random_tokens(arch.vocab_size, 2, 9, device, seed=3))
    assert tokens.min() >= 0 and tokens.max() < arch.vocab_size

    for precision, dtype in (("fp32", torch.float32), ("bf16-pure", torch.bfloat16), ("bf16", torch.float32)):
        lm = load_model(arch, "native", device, policy(precision).weight_dtype)
        weight = lm.module.model.layers[0].mlp.gate_up_proj.weight
        assert weight.dtype == dtype
        before = weight.detach().clone()
        make_step("forward-backward", lm, policy(precision), tokens, device)()
        assert torch.equal(weight, before)
        assert weight.grad is not None and weight.grad.dtype == dtype and weight.grad.abs().sum() > 0
        make_step("train", lm, policy(precision), tokens, device)()
        assert not torch.equal(weight, before)
        assert torch.isfinite(weight).all()

    lm = load_model(arch, "native", device, torch.float32)
    make_step("forward", lm, policy("fp32"), tokens, device)()
    assert all(p.grad is None for p in lm.module.parameters())


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_tied_models_share_one_output_matrix(backend):
    arch = resolve("tiny")
    module = load_model(arch, backend, "cpu", torch.float32).module
    assert module.lm_head.weight is module.model.embed_tokens.weight
    assert sum(p.numel() for p in module.parameters()) == arch.total_params


def test_random_weights_are_initialized():
    arch = resolve("tiny")
    for backend in ("native", "hf"):
        module = load_model(arch, backend, "cpu", torch.float32).module
        embedding = module.model.embed_tokens.weight
        assert torch.isfinite(embedding).all()
        assert embedding.std().item() == pytest.approx(0.02, rel=0.1)
        assert torch.equal(module.model.norm.weight, torch.ones(arch.hidden_size))


# ---- numerical agreement of the two backends ----------------------------------------------------


def small_arch(model_type: str = "llama", *, qkv_bias: bool = False, tied: bool = False,
               rope_scaling: dict | None = None, max_seq_len: int = 64, kv_heads: int = 2) -> Architecture:
    return Architecture(
        name=f"small-{model_type}", family="llama", hf_model_type=model_type, vocab_size=128, hidden_size=64,
        num_layers=4, num_heads=4, num_kv_heads=kv_heads, ffn_size=160, max_seq_len=max_seq_len, tie_embeddings=tied,
        source="test", qkv_bias=qkv_bias, rope_scaling=rope_scaling, norm_eps=1e-5,
    )


# original context 64, head dim 16, theta 1e4: three of the eight frequencies are scaled, one interpolated
SHORT_LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}

VARIANTS = {
    "llama-gqa": small_arch(),
    "llama-mha": small_arch(kv_heads=4),
    "qwen2-bias": small_arch("qwen2", qkv_bias=True),
    "llama-tied": small_arch(tied=True),
    "llama3-rope": small_arch(rope_scaling=SHORT_LLAMA3, max_seq_len=256),
}


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform, norms and biases away from 1 and 0."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in module.named_parameters():
        noise = torch.randn(parameter.shape, generator=generator)
        if name.endswith("norm.weight") or "layernorm" in name:
            parameter.copy_(1 + 0.2 * noise)
        elif name.endswith("bias"):
            parameter.copy_(0.2 * noise)
        else:
            parameter.copy_(0.08 * noise)


def paired_models(arch: Architecture, seed: int = 0):
    hf = build_hf(arch, "cpu", torch.float32).eval()
    randomize(hf, seed)
    native = build_native(arch, "cpu", torch.float32).eval()
    result = native.load_state_dict(hf.state_dict(), strict=False)
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    for name, tensor in native.state_dict().items():
        assert torch.equal(tensor, hf.state_dict()[name]), name
    return native, hf


@pytest.mark.parametrize("variant", VARIANTS)
def test_native_and_hf_logits_agree(variant):
    arch = VARIANTS[variant]
    native, hf = paired_models(arch)
    assert type(hf).__name__.lower().startswith(arch.hf_model_type)
    if arch.qkv_bias:
        assert native.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    tokens = torch.randint(0, arch.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = native(tokens)
        theirs = hf(tokens).logits
    assert ours.shape == theirs.shape == (2, 48, arch.vocab_size)
    assert theirs.std() > 0.1  # the comparison is between non-trivial logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def gradients_by_transformers_name(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient under transformers' names, a fused weight's split into its parts."""
    grads = {}
    for name, part in module.named_modules():
        for kind, parameter in part.named_parameters(recurse=False):
            if isinstance(part, FusedLinear):
                owner = name.rpartition(".")[0]
                grads |= {f"{owner}.{projection}.{kind}": grad
                          for projection, grad in part.slices(parameter.grad).items()}
            else:
                grads[f"{name}.{kind}"] = parameter.grad
    return grads


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "llama3-rope"])
def test_native_and_hf_gradients_agree(variant, fused):
    """In training the native modules run their own autograd Functions (``fitbench.models.layer_ops``):
    logits and every weight's gradient against transformers' model with the same weights."""
    arch = VARIANTS[variant]
    native, hf = paired_models(arch)
    if fused:
        native = fused_twin(native, arch)
    tokens = torch.randint(0, arch.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, 48, arch.vocab_size, generator=torch.Generator().manual_seed(2))
    ours, theirs = native(tokens), hf(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    (ours * grad).sum().backward()
    (theirs * grad).sum().backward()
    expected = {name: parameter.grad for name, parameter in hf.named_parameters()}
    actual = gradients_by_transformers_name(native)
    assert actual.keys() == expected.keys()
    for name, tensor in actual.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-4, rtol=1e-4, msg=name)


def test_rope_scaling_variant_differs_from_plain_rope():
    scaled = rope_inverse_frequencies(DecoderConfig.from_architecture(VARIANTS["llama3-rope"]), "cpu")
    plain = rope_inverse_frequencies(DecoderConfig.from_architecture(VARIANTS["llama-gqa"]), "cpu")
    assert not torch.allclose(scaled, plain)
    # wavelengths 2 pi 1e4^(i/8): below 64 / 4 kept, above 64 divided by the factor, between interpolated
    wavelengths = 2 * math.pi / plain
    kept, divided = wavelengths < 16, wavelengths > 64
    assert kept.sum() == 1 and divided.sum() == 5
    torch.testing.assert_close(scaled[kept], plain[kept])
    torch.testing.assert_close(scaled[divided], plain[divided] / 4.0)
    between = ~kept & ~divided
    assert ((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 4.0)).all()


def fused_twin(native: torch.nn.Module, arch: Architecture) -> torch.nn.Module:
    """The fused model holding ``native``'s weights, copied in by transformers' names."""
    fused = build_native(arch, "cpu", native.lm_head.weight.dtype, fused=True).eval()
    targets, source = checkpoint_tensors(fused), native.state_dict()
    assert set(targets) == set(source)
    with torch.no_grad():
        for name, tensor in targets.items():
            tensor.copy_(source[name])
    return fused


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "llama3-rope"])
def test_incremental_decoding_matches_the_full_forward(variant):
    arch = VARIANTS[variant]
    native, hf = paired_models(arch, seed=5)
    tokens = torch.randint(0, arch.vocab_size, (2, 13), generator=torch.Generator().manual_seed(2))
    prompt_len, steps = 10, 3
    for lm in (NativeLM(native, torch.float32), NativeLM(fused_twin(native, arch), torch.float32),
               HuggingFaceLM(hf, static_cache=True)):
        with torch.inference_mode():
            full = lm.logits(tokens)  # (B, T, V)
            first = lm.prefill(tokens[:, :prompt_len], max_len=prompt_len + steps + 2)
            torch.testing.assert_close(first, full[:, prompt_len - 1], atol=1e-4, rtol=1e-4)
            for step in range(steps):
                position = prompt_len + step
                logits = lm.decode(tokens[:, position:position + 1])
                assert logits.shape == (2, arch.vocab_size)
                torch.testing.assert_close(logits, full[:, position], atol=1e-4, rtol=1e-4)
            # a second generation starts from a fresh cache
            again = lm.prefill(tokens[:, :4], max_len=8)
            torch.testing.assert_close(again, full[:, 3], atol=1e-4, rtol=1e-4)


# ---- static-shape decoding and CUDA graphs -------------------------------------------------------


def random_native(arch: Architecture, device="cpu", dtype=torch.float32, seed: int = 7):
    module = build_native(arch, device, dtype).eval()
    randomize(module, seed)
    return module


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mha", "qwen2-bias", "llama-tied", "llama3-rope"])
def test_static_decode_step_matches_eager_decoding(variant):
    arch = VARIANTS[variant]
    native = random_native(arch)
    tokens = torch.randint(0, arch.vocab_size, (2, 14), generator=torch.Generator().manual_seed(3))
    prompt_len, max_len, end = 9, 16, tokens.shape[1]
    generator = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        eager, static = native.new_cache(2, max_len, torch.float32), native.new_cache(2, max_len, torch.float32)
        native(tokens[:, :prompt_len], cache=eager)
        native(tokens[:, :prompt_len], cache=static)
        # What an earlier generation left after the prompt, large enough to show if the mask let it through.
        for buffer in (*static.layer_keys, *static.layer_values):
            buffer[:, :, prompt_len:] = 100 * torch.randn(buffer[:, :, prompt_len:].shape, generator=generator)
        stale = [buffer[:, :, end:].clone() for buffer in (*static.layer_keys, *static.layer_values)]
        position = torch.tensor([prompt_len])
        for step in range(prompt_len, end):
            expected = native(tokens[:, step:step + 1], cache=eager, start=step)[:, -1]
            logits = native.decode_step(tokens[:, step:step + 1], static, position)
            assert logits.shape == (2, arch.vocab_size)
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
            position += 1
    for written, expected in zip((*static.layer_keys, *static.layer_values), (*eager.layer_keys, *eager.layer_values)):
        torch.testing.assert_close(written[:, :, :end], expected[:, :, :end], atol=1e-6, rtol=1e-6)
    # one slot written per step, nothing after it
    assert all(torch.equal(buffer[:, :, end:], before)
               for buffer, before in zip((*static.layer_keys, *static.layer_values), stale))


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "llama-tied"])
def test_fused_projections_hold_the_unfused_weights_of_the_same_seed(variant):
    arch = VARIANTS[variant]
    torch.manual_seed(0)
    unfused = build_native(arch, "cpu", torch.float32)
    torch.manual_seed(0)
    fused = build_native(arch, "cpu", torch.float32, fused=True)
    attention, mlp = fused.model.layers[1].self_attn, fused.model.layers[1].mlp
    assert not hasattr(attention, "q_proj") and not hasattr(mlp, "up_proj")
    # drawn part by part: the same numbers as three and two draws, not one draw of the stacked shape
    assert checkpoint_tensors(fused).keys() == unfused.state_dict().keys()
    for name, tensor in checkpoint_tensors(fused).items():
        assert torch.equal(tensor, unfused.state_dict()[name]), name
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in unfused.parameters())
    if arch.qkv_bias:
        randomize(unfused, seed=3)
        fused = fused_twin(unfused, arch)
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch.testing.assert_close(fused(tokens), unfused(tokens), atol=1e-5, rtol=1e-5)
        for eager in (False, True):
            caches = [model.new_cache(2, 12, torch.float32) for model in (fused, unfused)]
            firsts = [model(tokens[:, :8], cache=cache)[:, -1] for model, cache in zip((fused, unfused), caches)]
            torch.testing.assert_close(*firsts, atol=1e-5, rtol=1e-5)
            for step in range(8, 12):
                if eager:
                    pair = [model(tokens[:, step:step + 1], cache=cache, start=step)[:, -1]
                            for model, cache in zip((fused, unfused), caches)]
                else:
                    position = torch.tensor([step])
                    pair = [model.decode_step(tokens[:, step:step + 1], cache, position)
                            for model, cache in zip((fused, unfused), caches)]
                torch.testing.assert_close(*pair, atol=1e-5, rtol=1e-5)


def test_fused_and_unfused_models_train_alike():
    arch = resolve("tiny")
    tokens = random_tokens(arch.vocab_size, 2, 17, torch.device("cpu"), seed=4)
    losses = {}
    for fused in (False, True):
        torch.manual_seed(0)
        lm = NativeLM(build_native(arch, "cpu", torch.float32, fused=fused), torch.float32)
        step = make_step("train", lm, policy("fp32"), tokens, torch.device("cpu"))
        losses[fused] = [step().item() for _ in range(3)]
    assert losses[True][2] < losses[True][0]  # the steps train
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def eager_capture(calls: list):
    """A capture that "replays" by running the step again: NativeLM's graph path, on any device."""
    def capture(step):
        calls.append(step)
        return Replay(step)
    return capture


def generation_logits(lm, tokens: torch.Tensor, prompt_len: int, max_len: int) -> list[torch.Tensor]:
    """Prefill ``prompt_len`` tokens, then decode the given ones up to the last slot of the cache."""
    with torch.inference_mode():
        logits = [lm.prefill(tokens[:, :prompt_len], max_len).clone()]
        for position in range(prompt_len, max_len):
            logits.append(lm.decode(tokens[:, position:position + 1]).clone())
    return logits


def assert_same_generations(ours: list, theirs: list, **tolerance) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **(tolerance or {"atol": 1e-5, "rtol": 1e-5}))


def test_graphed_decoding_captures_once_per_cache_and_matches_eager():
    arch = VARIANTS["llama-gqa"]
    native = random_native(arch)
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    calls = []
    graphed = NativeLM(native, torch.float32, cuda_graphs=True, capture=eager_capture(calls))
    eager = NativeLM(native, torch.float32)
    assert graphed.capture_pending and not eager.capture_pending
    assert eager.decoding == {"cuda_graphs": False, "reason": "turned off (--no-cuda-graphs)"}
    # the second generation reuses the first's cache, stale keys included; the third needs a smaller one
    for prompt_len, max_len in ((8, 12), (5, 12), (6, 10)):
        assert_same_generations(generation_logits(graphed, tokens, prompt_len, max_len),
                                generation_logits(eager, tokens, prompt_len, max_len))
    assert len(calls) == 2
    decoding = graphed.decoding
    assert decoding["cuda_graphs"] is True
    assert [capture["generation"] for capture in decoding["captures"]] == [1, 3]
    assert not graphed.capture_pending
    with torch.inference_mode(), pytest.raises(IndexError, match="holds 10 positions"):
        graphed.decode(tokens[:, :1])


def test_a_failed_capture_falls_back_to_eager_decoding_and_says_why():
    arch = VARIANTS["llama-tied"]
    native = random_native(arch)
    tokens = torch.randint(0, arch.vocab_size, (1, 10), generator=torch.Generator().manual_seed(6))
    attempts = []

    def refuse(step):
        # as torch.cuda.graph fails: the step's own error, then ending the invalidated capture
        attempts.append(step)
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors ...")
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    lm = NativeLM(native, torch.float32, cuda_graphs=True, capture=refuse)
    eager = NativeLM(native, torch.float32)
    for prompt_len in (6, 4):
        assert_same_generations(generation_logits(lm, tokens, prompt_len, 10),
                                generation_logits(eager, tokens, prompt_len, 10), atol=0, rtol=0)
    assert len(attempts) == 1  # not retried for later generations
    assert lm.decoding == {"cuda_graphs": False, "reason": (
        "capture failed, decoding eagerly: RuntimeError: CUDA error: operation not permitted when stream is "
        "capturing; then RuntimeError: CUDA error: operation failed due to a previous error during capture")}


def test_weights_no_graph_can_hold_decode_eagerly_from_the_start_and_say_why():
    arch = VARIANTS["llama-tied"]
    native = random_native(arch)
    tokens = torch.randint(0, arch.vocab_size, (1, 10), generator=torch.Generator().manual_seed(7))
    calls = []
    lm = NativeLM(native, torch.float32, cuda_graphs=True, capture=eager_capture(calls),
                  graph_problem=entry("int8").graph_problem)
    assert not lm.capture_pending
    generation_logits(lm, tokens, 6, 10)
    assert calls == []  # never attempted: a failed capture leaves a side stream's workspace behind
    assert lm.decoding == {"cuda_graphs": False, "reason": entry("int8").graph_problem}
    assert "argwhere" in entry("int8").graph_problem and entry("nf4").graph_problem is None


def test_autocast_decoding_is_captured_and_matches_eager():
    arch = VARIANTS["llama-gqa"]
    native = random_native(arch)
    tokens = torch.randint(0, arch.vocab_size, (1, 8), generator=torch.Generator().manual_seed(7))
    calls = []
    graphed = NativeLM(native, torch.bfloat16, cuda_graphs=True, capture=eager_capture(calls))
    eager = NativeLM(native, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # the graph's step attends over every cache slot under a mask: the same math, summed in another order
        assert_same_generations(generation_logits(graphed, tokens, 5, 8), generation_logits(eager, tokens, 5, 8),
                                atol=1e-2, rtol=1.6e-2)
    assert len(calls) == 1 and graphed.decoding["cuda_graphs"] is True


class CastCounter(TorchDispatchMode):
    """Counts dtype conversions of tensors of one shape."""

    def __init__(self, shape: torch.Size):
        super().__init__()
        self.shape, self.casts = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.to, torch.ops.aten._to_copy) and args[0].shape == self.shape:
            self.casts += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("inference", [True, False])
def test_autocast_casts_weights_again_at_every_call_inside_inference_mode(inference):
    # The premise of counting 8 bytes per matmul parameter for an autocast decode step, and of capturing
    # it: without autograd state autocast keeps no cast weight, so each call casts the weight again.
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(2, 64)
    counter = CastCounter(linear.weight.shape)
    mode = torch.inference_mode() if inference else torch.enable_grad()
    with mode, torch.autocast("cpu", dtype=torch.bfloat16), counter:
        for _ in range(3):
            linear(x)
    assert counter.casts == (3 if inference else 1)


def test_compile_decodes_eagerly():
    arch = VARIANTS["llama-gqa"]
    native = random_native(arch)
    calls = []
    compiled = NativeLM(random_native(arch), torch.float32, cuda_graphs=True, capture=eager_capture(calls))
    single = Rank(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), launched=False)
    # compiles lazily, at the first call, which never comes here
    parallelize(compiled, Layout(), policy("fp32"), single, compile=True)
    assert not compiled.capture_pending
    assert compiled.decoding == {"cuda_graphs": False,
                                 "reason": "--compile: decoding runs through the compiled module, eagerly"}
    on_cpu = NativeLM(native, torch.float32, cuda_graphs=True)
    assert on_cpu.decoding == {"cuda_graphs": False, "reason": "CUDA graphs need a GPU; this run is on cpu"}


@pytest.fixture
def fresh_dynamo():
    """Dynamo keeps compiled code per Python function for the whole process, beside that of earlier
    tests' models, up to a limit: each test that compiles starts and ends with none."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def graph_counts(lm: NativeLM) -> dict[str, int]:
    return {name: region["graphs"] for name, region in lm.decoding["regions"].items()}


def test_compiled_decode_step_and_prefill_match_eager_decoding(fresh_dynamo):
    arch = dataclasses.replace(VARIANTS["llama-gqa"], num_layers=2)
    native = random_native(arch)
    calls = []
    compiled = NativeLM(native, torch.float32, cuda_graphs=True, capture=eager_capture(calls), compile_decode=True)
    eager = NativeLM(native, torch.float32)
    # the second generation, of the same shape, reuses the compiled prefill and step (each compile is
    # seconds of CPU; a second prompt shape would only add another)
    for seed in (9, 10):
        tokens = torch.randint(0, arch.vocab_size, (2, 10), generator=torch.Generator().manual_seed(seed))
        assert_same_generations(generation_logits(compiled, tokens, 6, 10),
                                generation_logits(eager, tokens, 6, 10), atol=1e-4, rtol=1e-4)
    decoding = compiled.decoding
    assert decoding["compiled"] is True, decoding
    assert decoding["compile_s"] > 0 and len(decoding["prefill_first_call_s"]) == 1
    # inductor compiled each region once for both layers, the head once for the prefill and the step
    assert graph_counts(compiled) == {"layer": 1, "layer_decode": 1, "head": 1, "embed": 1}
    assert decoding["compiled_graphs"] == 4
    assert all(region["compile_s"] > 0 for region in decoding["regions"].values())
    assert len(calls) == 1


def counting_compiler(graphs: list):
    """A compiler that keeps each graph Dynamo traced and runs it as it is: counting without inductor."""
    def compile_graph(graph: torch.fx.GraphModule, inputs: list):
        graphs.append(graph)
        return graph.forward
    return compile_graph


def test_one_compiled_layer_serves_every_layer_and_each_shape_compiles_once(fresh_dynamo):
    arch = VARIANTS["llama-gqa"]
    assert arch.num_layers == 4
    native = random_native(arch)
    graphs = []
    lm = NativeLM(native, torch.float32, cuda_graphs=True, capture=eager_capture([]), compile_decode=True,
                  compiler=counting_compiler(graphs))
    eager = NativeLM(native, torch.float32)
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(11))
    for prompt_len in (6, 6, 8):
        assert_same_generations(generation_logits(lm, tokens, prompt_len, 12),
                                generation_logits(eager, tokens, prompt_len, 12))
        if prompt_len == 6:
            # four layers, one trace each; the second generation of the same shapes traces nothing
            assert graph_counts(lm) == {"layer": 1, "layer_decode": 1, "head": 1, "embed": 1} and len(graphs) == 4
    # a new prompt length: the prefill's layer once more; the step (the same cache) and the head (the
    # last position) run what they have
    assert graph_counts(lm) == {"layer": 2, "layer_decode": 1, "head": 1, "embed": 1}
    assert lm.decoding["compiled_graphs"] == len(graphs) == 5
    assert len(lm.decoding["prefill_first_call_s"]) == 2
    # the layer is an argument: its weights and its cache are the graphs' inputs, not constants
    layer_decode = graphs[3]  # after the prefill's layer and head, and the step's embedding
    weights = {p.shape for p in native.model.layers[0].parameters()}
    inputs = [node.meta["example_value"] for node in layer_decode.graph.find_nodes(op="placeholder")]
    assert weights <= {tuple(value.shape) for value in inputs if isinstance(value, torch.Tensor)}
    assert not list(layer_decode.named_parameters()) and not list(layer_decode.named_buffers())


def test_a_graphed_prefill_is_captured_at_its_shapes_second_call_and_reads_each_new_prompt(fresh_dynamo):
    arch = VARIANTS["llama-gqa"]
    native = random_native(arch)
    calls, graphs = [], []
    lm = NativeLM(native, torch.float32, cuda_graphs=True, capture=eager_capture(calls), compile_decode=True,
                  compiler=counting_compiler(graphs))
    lm.graph_prefill = True
    eager = NativeLM(native, torch.float32)
    for seed, captures in ((1, 1), (2, 2), (3, 2)):  # compiled; then the prefill captured; then replayed
        tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
        assert_same_generations(generation_logits(lm, tokens, 6, 12), generation_logits(eager, tokens, 6, 12))
        assert len(calls) == captures  # the decode step's, once per cache, and the prefill's
    assert [capture.get("prefill") for capture in lm.decoding["captures"]] == [None, [2, 6, 12]]
    assert lm.decoding["prefill"] == "CUDA graph per prompt shape"
    # a new cache (another batch) drops the graphs that wrote the old one
    tokens = torch.randint(0, arch.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        assert_same_generations(generation_logits(lm, tokens, 6, 12), generation_logits(eager, tokens, 6, 12))
    assert list(lm.prefill_graphs) == [(1, 6, 12)]


def test_a_prefill_whose_capture_fails_runs_through_the_compiled_regions_and_says_why(fresh_dynamo):
    arch = VARIANTS["llama-gqa"]
    native = random_native(arch)
    calls, attempts = [], []

    def decode_only(step):  # the decode step's capture (the first) works; the prefill's fails
        attempts.append(step)
        if calls:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return eager_capture(calls)(step)

    lm = NativeLM(native, torch.float32, cuda_graphs=True, capture=decode_only, compile_decode=True,
                  compiler=counting_compiler([]))
    lm.graph_prefill = True
    eager = NativeLM(native, torch.float32)
    for seed in (1, 2, 3):
        tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
        assert_same_generations(generation_logits(lm, tokens, 6, 12), generation_logits(eager, tokens, 6, 12))
    assert lm.decoding["prefill"] == ("capture failed, prefilling through the compiled regions: RuntimeError: "
                                      "CUDA error: operation not permitted when stream is capturing")
    assert not lm.prefill_graphs and len(attempts) == 2  # the prefill's capture not tried again


def test_past_dynamos_recompile_limit_generation_runs_eagerly_and_says_so(fresh_dynamo):
    arch = VARIANTS["llama-tied"]
    native = random_native(arch)
    tokens = torch.randint(0, arch.vocab_size, (1, 12), generator=torch.Generator().manual_seed(12))
    calls = []
    lm = NativeLM(native, torch.float32, cuda_graphs=True, capture=eager_capture(calls), compile_decode=True,
                  compiler=counting_compiler([]))
    eager = NativeLM(native, torch.float32)
    with torch._dynamo.config.patch(recompile_limit=1):
        # the second prompt length needs a second version of the prefill's layer, one past the limit
        for prompt_len in (6, 8):
            assert_same_generations(generation_logits(lm, tokens, prompt_len, 12),
                                    generation_logits(eager, tokens, prompt_len, 12))
    decoding = lm.decoding
    assert decoding["compiled"] is False and "recompile limit" in decoding["compile_fallback"], decoding
    assert "regions" not in decoding
    assert len(calls) == 2  # the compiled step's graph dropped, the eager step captured in its place


def test_a_failed_compile_decodes_eagerly_and_says_why(monkeypatch):
    monkeypatch.setenv("FITBENCH_INJECT", "compile-error:decode")
    arch = VARIANTS["llama-gqa"]
    native = random_native(arch)
    tokens = torch.randint(0, arch.vocab_size, (1, 10), generator=torch.Generator().manual_seed(10))
    calls = []
    lm = NativeLM(native, torch.float32, cuda_graphs=True, capture=eager_capture(calls), compile_decode=True)
    assert_same_generations(generation_logits(lm, tokens, 6, 10),
                            generation_logits(NativeLM(native, torch.float32), tokens, 6, 10))
    assert lm.decoding["cuda_graphs"] is True and lm.decoding["compiled"] is False
    assert lm.decoding["compile_fallback"] == "RuntimeError: FITBENCH_INJECT: compiling fails"
    assert len(calls) == 1  # the eager step, still captured


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@cuda_only
def test_cuda_graph_replays_match_eager_decoding():
    arch = VARIANTS["llama-gqa"]
    native = random_native(arch, "cuda")
    tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(8)).cuda()
    graphed = NativeLM(native, torch.float32, cuda_graphs=True)
    eager = NativeLM(native, torch.float32)
    for prompt_len, max_len in ((8, 16), (5, 16), (6, 12)):
        assert_same_generations(generation_logits(graphed, tokens, prompt_len, max_len),
                                generation_logits(eager, tokens, prompt_len, max_len), atol=1e-4, rtol=1e-4)
    decoding = graphed.decoding
    assert decoding["cuda_graphs"] is True, decoding
    assert [capture["generation"] for capture in decoding["captures"]] == [1, 3]
    assert all(capture["pool_bytes"] > 0 for capture in decoding["captures"])


@cuda_only
@pytest.mark.parametrize("precision", ["bf16-pure", "int8", "nf4", "int4", "fp8", "fp8-block"])
def test_cuda_graph_decoding_in_every_inference_precision(precision):
    """Replays give what the same static step gives launched eagerly; a precision whose kernels cannot
    be captured decodes eagerly and says why."""
    from fitbench.worker.quantize import build_quantized_native

    device = torch.device("cuda")
    problem = entry(precision).hardware_problem(device.type, torch.cuda.get_device_capability(device))
    if problem:
        pytest.skip(problem)
    arch = resolve("tiny")
    tokens = random_tokens(arch.vocab_size, 2, 24, device, seed=9)
    if policy(precision).quantized:
        module, _ = build_quantized_native(arch, device, precision, tokens[:1, :16])
    else:
        module = build_native(arch, device, torch.bfloat16)
    graphed = NativeLM(module, torch.bfloat16, cuda_graphs=True)
    reference = NativeLM(module, torch.bfloat16, cuda_graphs=True, capture=eager_capture([]))
    for prompt_len in (16, 12):
        assert_same_generations(generation_logits(graphed, tokens, prompt_len, 24),
                                generation_logits(reference, tokens, prompt_len, 24), atol=2e-2, rtol=2e-2)
    decoding = graphed.decoding
    print(precision, decoding)
    if decoding["cuda_graphs"]:
        assert [capture["generation"] for capture in decoding["captures"]] == [1]
    else:
        assert decoding["reason"].startswith("capture failed"), decoding
    torch.cuda.empty_cache()  # fails an assertion if the allocator still believes a capture is underway
    torch.randn(4, device=device)  # fails if the random generator still believes a capture is underway


@cuda_only
@pytest.mark.parametrize("precision, warmup", [("bf16-pure", 0), ("bf16-pure", 1), ("int8", 1)])
def test_the_worker_captures_in_an_untimed_generation(precision, warmup, tmp_path):
    result = measure(spec(mode="infer", precision=precision, device="cuda", warmup_steps=warmup), tmp_path)
    decoding = result["decode"]
    if decoding["cuda_graphs"]:
        assert [capture["generation"] for capture in decoding["captures"]] == [1]
    else:  # LLM.int8's search for outlier columns synchronizes
        assert precision != "bf16-pure" and decoding["reason"].startswith("capture failed"), decoding
        assert any("without CUDA graphs" in warning for warning in result["warnings"])
    assert result["timing"]["token_latency"]["count"] == 2 * (NEW - 1)
    torch.cuda.empty_cache()  # fails an assertion if the allocator still believes a capture is underway


def test_llama31_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    arch = resolve("llama-3.1-8b")
    ours = rope_inverse_frequencies(DecoderConfig.from_architecture(arch), "cpu")
    theirs, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_config(arch), "cpu")
    assert attention_scaling == 1.0
    assert ours.shape == theirs.shape == (arch.head_dim // 2,)
    torch.testing.assert_close(ours, theirs.float(), atol=0, rtol=1e-6)
    # and it is really scaled: the longest wavelengths are 8x the unscaled ones
    plain = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim))
    torch.testing.assert_close(ours[-1], plain[-1] / 8.0)
    torch.testing.assert_close(ours[0], plain[0])


def test_native_rotary_tables_match_the_hf_model():
    arch = VARIANTS["llama3-rope"]
    native, hf = paired_models(arch)
    torch.testing.assert_close(rope_inverse_frequencies(native.config, "cpu"), hf.model.rotary_emb.inv_freq.float())
    positions = torch.arange(arch.max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, hf.model.rotary_emb.inv_freq.float())
    torch.testing.assert_close(native.rope_cos, torch.cat((angles, angles), -1).cos())
    torch.testing.assert_close(native.rope_sin, torch.cat((angles, angles), -1).sin())


# ---- checkpoints ----------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["tiny", "llama3-rope"])
def test_native_loads_a_transformers_checkpoint(tmp_path, source):
    arch = resolve("tiny") if source == "tiny" else VARIANTS[source]
    hf = build_hf(arch, "cpu", torch.float32).eval()
    randomize(hf, seed=11)
    hf.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))

    local = resolve(str(tmp_path))
    assert local.total_params == arch.total_params
    assert local.rope_scaling == arch.rope_scaling
    tokens = torch.randint(0, arch.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(tokens).logits
    native = load_model(local, "native", "cpu", torch.float32, model_path=str(tmp_path))
    assert isinstance(native, NativeLM)
    with torch.no_grad():
        torch.testing.assert_close(native.logits(tokens), expected, atol=1e-4, rtol=1e-4)
    reloaded = load_model(local, "hf", "cpu", torch.float32, model_path=str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(reloaded.logits(tokens), expected, atol=1e-4, rtol=1e-4)


def test_checkpoint_missing_tensors_is_an_error(tmp_path):
    from safetensors.torch import save_file

    from fitbench.models.backends import load_checkpoint

    arch = small_arch()
    hf = build_hf(arch, "cpu", torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if "layers.3." not in k}
    save_file(state, str(tmp_path / "model.safetensors"))
    native = build_native(arch, "cpu", torch.float32)
    with pytest.raises(ValueError, match="lacks"):
        load_checkpoint(native, tmp_path, "cpu")


# ---- activation checkpointing of some layers ------------------------------------------------------

def checkpointed_gradients(lm, tokens, monkeypatch) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Every weight's gradient of one forward and backward pass of ``lm`` on ``tokens``, and the
    positions of the layers that ran under ``checkpoint``."""
    import fitbench.models.native as native

    positions, layers = [], list(lm.module.model.layers)

    def counted(layer, *args, **kwargs):
        positions.append(layers.index(layer))
        return torch.utils.checkpoint.checkpoint(layer, *args, **kwargs)

    monkeypatch.setattr(native, "checkpoint", counted)
    lm.module.zero_grad(set_to_none=True)
    logits = lm.module(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return {name: p.grad.clone() for name, p in lm.module.named_parameters()}, positions


@pytest.mark.parametrize("count", [1, 3, 4, 9])
def test_checkpointing_some_layers_gives_the_gradients_of_none(count, monkeypatch):
    """--checkpointed-layers N recomputes the first N layers (all of them when N is at least the layer
    count) and changes no gradient: recomputation runs the same kernels on the same inputs."""
    arch = resolve("tiny")
    torch.manual_seed(0)
    lm = load_model(arch, "native", "cpu", torch.float32)
    tokens = random_tokens(arch.vocab_size, 2, 33, torch.device("cpu"), 1)
    reference, none = checkpointed_gradients(lm, tokens, monkeypatch)
    assert none == []
    lm.enable_activation_checkpointing(count)
    actual, positions = checkpointed_gradients(lm, tokens, monkeypatch)
    assert positions == list(range(min(count, arch.num_layers)))
    assert actual.keys() == reference.keys()
    for name, tensor in actual.items():
        torch.testing.assert_close(tensor, reference[name], atol=0, rtol=0, msg=name)
    lm.enable_activation_checkpointing()  # every layer
    _, positions = checkpointed_gradients(lm, tokens, monkeypatch)
    assert positions == list(range(arch.num_layers))
