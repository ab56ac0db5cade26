"""The native decoder's Falcon and GPT-2 blocks, given transformers' weights, give transformers' logits.

For a tiny configuration of each variant (Falcon's new decoder architecture with grouped key/value
heads, Falcon-7B's multi-query block with one LayerNorm, GPT-2), transformers' model is built in
fp32 from a seed, every parameter moved off its initial value (norms and biases included, so that a
misplaced one shows), saved with ``save_pretrained``, and loaded into the native model through
``load_checkpoint``. The native prefill and each decode step, eager (``NativeLM.decode``) and
static-shaped (``decode_step``, the step CUDA graphs capture), must give the logits of transformers'
forward pass over the whole sequence at the same positions.
"""

from __future__ import annotations

import json

import pytest
import torch

from fitbench.models.backends import NativeLM, load_checkpoint
from fitbench.models.checkpoint_names import native_state
from fitbench.models.native import DecoderConfig, build_decoder

VOCAB, HIDDEN, HEADS, LAYERS, FFN = 256, 64, 8, 2, 160

CONFIGS = {
    "falcon-grouped": dict(model_type="falcon", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_kv_heads=2, ffn_hidden_size=FFN,
                           new_decoder_architecture=True, parallel_attn=True, bias=True, alibi=False,
                           max_position_embeddings=64, rope_theta=50.0),
    "falcon-multi-query": dict(model_type="falcon", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                               num_attention_heads=HEADS, ffn_hidden_size=FFN, new_decoder_architecture=False,
                               multi_query=True, parallel_attn=True, bias=False, alibi=False,
                               max_position_embeddings=64),
    "gpt2": dict(model_type="gpt2", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
                 n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}
PROMPT, STEPS, BATCH = 5, 4, 2


def hf_checkpoint(variant: str, directory) -> tuple[torch.nn.Module, dict]:
    """transformers' model of ``variant``, random (seeded) and perturbed, saved into ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(CONFIGS[variant])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    return model, json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("variant", list(CONFIGS))
def test_native_logits_match_transformers(variant, fused, tmp_path):
    reference, config = hf_checkpoint(variant, tmp_path)
    native = build_decoder(DecoderConfig.from_hf_config(config), "cpu", torch.float32, fused=fused).eval()
    load_checkpoint(native, tmp_path, "cpu")
    assert sum(p.numel() for p in native.parameters()) == sum(p.numel() for p in reference.parameters())

    tokens = torch.randint(0, VOCAB, (BATCH, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(tokens).logits  # (B, T, V): position t's logits see tokens 0..t
        lm = NativeLM(native, cache_dtype=torch.float32)
        got = [lm.prefill(tokens[:, :PROMPT], max_len=PROMPT + STEPS)]
        got += [lm.decode(tokens[:, t:t + 1]) for t in range(PROMPT, PROMPT + STEPS - 1)]
        torch.testing.assert_close(torch.stack(got, 1), expected[:, PROMPT - 1:-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(native(tokens), expected, atol=1e-4, rtol=1e-4)

        cache = native.new_cache(BATCH, PROMPT + STEPS, torch.float32)
        native(tokens[:, :PROMPT], cache=cache, start=0, last_only=True)
        for t in range(PROMPT, PROMPT + STEPS):
            step = native.decode_step(tokens[:, t:t + 1], cache, torch.tensor([t]))
            torch.testing.assert_close(step, expected[:, t], atol=1e-4, rtol=1e-4)


def test_falcon_block_variants_are_read_from_the_config():
    grouped = DecoderConfig.from_hf_config({**CONFIGS["falcon-grouped"]})
    multi_query = DecoderConfig.from_hf_config({**CONFIGS["falcon-multi-query"]})
    assert (grouped.n_kv_heads, grouped.shared_norm, grouped.linear_bias) == (2, False, True)
    assert (multi_query.n_kv_heads, multi_query.shared_norm, multi_query.linear_bias) == (1, True, False)
    with pytest.raises(ValueError, match="ALiBi"):
        DecoderConfig.from_hf_config({**CONFIGS["falcon-grouped"], "alibi": True})


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_native_gradients_match_transformers(variant, tmp_path):
    """Training runs other code than inference (``layer_ops``' rotary Function under autograd): the
    logits of a training forward and every weight's gradient of a loss on them, mapped to the native
    names as a checkpoint is (``native_state``), are transformers'."""
    reference, config = hf_checkpoint(variant, tmp_path)
    native = build_decoder(DecoderConfig.from_hf_config(config), "cpu", torch.float32)
    load_checkpoint(native, tmp_path, "cpu")
    tokens = torch.randint(0, VOCAB, (BATCH, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))
    logits = {"hf": reference(tokens).logits, "native": native(tokens)}
    torch.testing.assert_close(logits["native"], logits["hf"], atol=1e-4, rtol=1e-4)
    for model, out in ((reference, logits["hf"]), (native, logits["native"])):
        out.square().mean().backward()
    expected = native_state(config, {name: p.grad for name, p in reference.named_parameters()})
    got = {name: p.grad for name, p in native.named_parameters()}
    assert set(got) == set(expected)
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-4, msg=name)


# ---- the presets' families through what a run builds ------------------------------------------------

def tiny_arch(family: str):
    """A tiny Architecture of ``family`` (falcon: the new decoder block with biases; gpt2), as a preset or a
    registered config.json gives one."""
    import dataclasses

    from fitbench.models.registry import resolve

    base = {"falcon": resolve("falcon-40b"), "gpt2": resolve("gpt2")}[family]
    return dataclasses.replace(base, name=f"tiny-{family}", hidden_size=HIDDEN, num_layers=3, num_heads=HEADS,
                               num_kv_heads=2 if family == "falcon" else HEADS, ffn_size=FFN, vocab_size=VOCAB,
                               max_seq_len=64)


@pytest.mark.parametrize("family", ["falcon", "gpt2"])
def test_an_architecture_builds_the_decoder_its_transformers_config_describes(family):
    """``from_architecture`` reads a Falcon or GPT-2 Architecture through its transformers config: the one
    mapping ``from_hf_config`` is, so the two cannot disagree; the model holds the Architecture's count."""
    from fitbench.models.native import meta_model

    arch = tiny_arch(family)
    config = DecoderConfig.from_architecture(arch)
    assert config == DecoderConfig.from_hf_config({"model_type": arch.hf_model_type, **arch.hf_config_dict()})
    assert (config.n_kv_heads, config.parallel_attention, config.positions) == \
        (arch.num_kv_heads, arch.parallel_attention, arch.position_embeddings)
    assert sum(p.numel() for p in meta_model(arch, torch.float32).parameters()) == arch.total_params


@pytest.mark.parametrize("family", ["falcon", "gpt2"])
def test_each_pipeline_stage_holds_its_own_modules_with_the_single_process_weights(family):
    """GPT-2's position table lives on the first stage with the token embedding, drawn as one process draws it."""
    from fitbench.models.native import build_native
    from fitbench.spec import Stage
    from fitbench.worker.stages import build_stage

    arch = tiny_arch(family)
    torch.manual_seed(3)
    expected = dict(build_native(arch, "cpu", torch.float32).named_parameters(remove_duplicate=False))
    held = set()
    for index in range(2):
        stage = Stage.of(arch.num_layers, index, 2)
        torch.manual_seed(3)
        parameters = dict(build_stage(arch, stage, "cpu", torch.float32).named_parameters(remove_duplicate=False))
        assert ("model.embed_positions.weight" in parameters) == (stage.first and family == "gpt2")
        for name, parameter in parameters.items():
            assert torch.equal(parameter, expected[name]), name
        held |= set(parameters)
    assert held == set(expected)


@pytest.mark.parametrize("precision", ["int8", "nf4", "int8-weight-only"])
@pytest.mark.parametrize("family", ["falcon", "gpt2"])
def test_the_layer_by_layer_quantized_build_is_the_bf16_model_quantized(family, precision):
    """``build_quantized_native`` over a Falcon or GPT-2 model (LayerNorm biases, biased matmuls, GELU MLP,
    learned positions): its logits are those of the same bf16 weights, drawn in its order, quantized
    whole afterwards; its quality is measured."""
    import copy

    from fitbench.models.native import init_random_weights, meta_model
    from fitbench.worker.quantize import build_quantized_native, quantize_linears

    arch = tiny_arch(family)
    probe = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(7)
    built, quality = build_quantized_native(arch, torch.device("cpu"), precision, probe)
    torch.manual_seed(7)
    twin = meta_model(arch, torch.bfloat16)
    twin.to_empty(device="cpu")
    edges = [twin.model.embed_tokens, *([twin.model.embed_positions] if family == "gpt2" else []), twin.model.norm]
    for part in edges:
        init_random_weights(part)
    twin.lm_head.weight = twin.model.embed_tokens.weight
    twin.reset_rope()
    for layer in twin.model.layers:
        init_random_weights(layer)
    twin = copy.deepcopy(twin)
    quantize_linears(twin, precision, torch.device("cpu"))
    with torch.no_grad():
        assert torch.equal(built(probe), twin(probe))
    assert quality.probe_tokens == probe.numel() and quality.kl_divergence >= 0


def test_fitbench_run_measures_a_gpt2_config_on_the_native_engine(tmp_path, capsys, monkeypatch):
    """`fitbench run --backend native` on a GPT-2 config.json: infer, forward and train rows, ok, on the
    native backend."""
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    model = tmp_path / "gpt2-tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIGS["gpt2"]))
    code, out, err = cli(["run", "--models", str(model), "--backend", "native", "--device", "cpu", "--mode", "infer",
                          "forward", "train", "--precision", "fp32", "--batch-size", "2", "--seq-len", "16",
                          "--new-tokens", "4", "--warmup-steps", "1", "--measure-steps", "1", "--out", "r"], capsys)
    assert code == 0, out + err
    rows = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert sorted(row["spec"]["mode"] for row in rows) == ["forward", "infer", "train"]
    for row in rows:
        assert row["status"] == "ok" and row["spec"]["backend"] == "native", row.get("error")


# Training follows the native blocks tensor by tensor (3%); inference as transformers' models are held (6%).
TRAIN_TOLERANCE, INFERENCE_TOLERANCE = 0.03, 0.06


def trace_cases():
    for family in ("falcon", "gpt2"):
        for mode in ("train", "forward", "infer"):
            for precision in ("fp32", "bf16", "bf16-pure"):
                for batch, seq_len in ((1, 64), (4, 256)):
                    yield pytest.param(family, mode, precision, batch, seq_len,
                                       id=f"{family}-{mode}-{precision}-{batch}x{seq_len}")


@pytest.mark.parametrize("family, mode, precision, batch, seq_len", list(trace_cases()))
def test_the_planners_native_terms_match_the_trace(family, mode, precision, batch, seq_len):
    """The planner's peak for the native Falcon and GPT-2 blocks against the fake-tensor trace of the model
    a run builds (its fused projections) through fitbench's loops (``fitbench.worker.trace``)."""
    import dataclasses

    from fitbench.planning.memory import estimate_memory
    from fitbench.precisions import TRAINING_MODES
    from fitbench.worker.trace import trace_peak

    arch = dataclasses.replace(tiny_arch(family), hidden_size=128, num_layers=2, num_heads=8,
                               num_kv_heads=2 if family == "falcon" else 8, ffn_size=512, vocab_size=1000,
                               max_seq_len=512)
    actual = trace_peak(arch, mode, precision, batch, seq_len, new_tokens=3, backend="native", fused=True).peak_bytes
    estimate = estimate_memory(arch, mode, precision, batch, seq_len, new_tokens=3, backend="native")
    error = (estimate.peak_bytes - actual) / actual
    tolerance = TRAIN_TOLERANCE if mode in TRAINING_MODES else INFERENCE_TOLERANCE
    assert abs(error) <= tolerance, f"analytic {estimate.peak_bytes:,.0f} B vs traced {actual:,} B ({error:+.2%})"
