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
