import copy
import dataclasses
import json
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from fitbench.models.checkpoint_names import native_state
from fitbench.models.hf import hf_config
from fitbench.models.native import DecoderConfig, NativeCausalLM
from fitbench.models.presets import CS336_SIZES, PRESETS, SIZE_LADDER
from fitbench.models.registry import architecture_from_hf_config, closest_names, preset_names, resolve
from fitbench.util.errors import UserError


def count(module: torch.nn.Module) -> int:
    """Unique parameters: a tied output projection counts once."""
    return sum(p.numel() for p in module.parameters())


def meta_hf_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("arch", PRESETS, ids=lambda arch: arch.name)
def test_exact_parameter_count_matches_the_instantiated_models(arch):
    hf = meta_hf_model(hf_config(arch))
    assert hf.config.model_type == arch.hf_model_type
    assert count(hf) == arch.total_params
    assert (hf.get_output_embeddings().weight is hf.get_input_embeddings().weight) == arch.tie_embeddings
    with torch.device("meta"):
        native = NativeCausalLM(DecoderConfig.from_architecture(arch))
    assert count(native) == arch.total_params
    # the native decoder carries transformers' Llama names; a Falcon or GPT-2 checkpoint's tensors map onto
    # them one for one (fitbench.models.checkpoint_names), with their shapes
    hf_tensors = native_state({"model_type": arch.hf_model_type, **arch.hf_config_dict()},
                              dict(hf.named_parameters()))
    assert dict((n, p.shape) for n, p in native.named_parameters()) == dict((n, p.shape) for n, p in hf_tensors.items())


@pytest.mark.parametrize("arch", PRESETS, ids=lambda arch: arch.name)
def test_transformers_config_maps_back_to_the_same_architecture(arch):
    before = copy.deepcopy(arch.rope_scaling)
    config = hf_config(arch).to_dict()
    assert arch.rope_scaling == before  # building the config leaves the preset alone
    back = architecture_from_hf_config(config, name=arch.name, source="round trip")
    for field in dataclasses.fields(arch):
        if field.name not in ("source", "follows", "extra_hf_config"):
            assert getattr(back, field.name) == getattr(arch, field.name), field.name
    assert back.total_params == arch.total_params


def size_of(name: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([MB])", name)
    assert match, name
    return float(match.group(1)) * {"M": 1e6, "B": 1e9}[match.group(2)]


@pytest.mark.parametrize("name", SIZE_LADDER)
def test_size_ladder_is_within_ten_percent_of_its_name(name):
    total = resolve(name).total_params
    assert abs(total - size_of(name)) <= 0.10 * size_of(name), f"{name}: {total:,}"


def test_size_ladder_is_ordered_and_registered():
    totals = [resolve(name).total_params for name in SIZE_LADDER]
    assert totals == sorted(totals)
    assert set(SIZE_LADDER) <= set(preset_names())


def test_cs336_models_match_the_assignment_table():
    # (d_model, d_ff, layers, heads) and the rounded size printed in the assignment
    table = {
        "small": (768, 3072, 12, 12),
        "medium": (1024, 4096, 24, 16),
        "large": (1280, 5120, 36, 20),
        "xl": (1600, 6400, 48, 25),
        "2.7B": (2560, 10240, 32, 32),
    }
    assert tuple(table) == CS336_SIZES
    for name, (d_model, d_ff, layers, heads) in table.items():
        arch = resolve(name)
        assert (arch.hidden_size, arch.ffn_size, arch.num_layers, arch.num_heads) == (d_model, d_ff, layers, heads)
        assert arch.num_kv_heads == heads
        assert arch.vocab_size == 10000
        assert not arch.tie_embeddings
        # embedding + output + layers (4 d^2 attention, 3 d d_ff SwiGLU, 2 d norms) + final norm
        by_hand = 2 * 10000 * d_model + layers * (4 * d_model**2 + 3 * d_model * d_ff + 2 * d_model) + d_model
        assert arch.total_params == by_hand
    assert round(resolve("small").total_params / 1e6) == 129
    assert round(resolve("medium").total_params / 1e6) == 423
    assert round(resolve("large").total_params / 1e6) == 969
    assert round(resolve("xl").total_params / 1e9, 2) == 2.00
    assert round(resolve("2.7B").total_params / 1e9, 2) == 3.41


def test_tiny_is_small():
    assert 1e6 < resolve("tiny").total_params < 10e6


def test_preset_names_are_unique():
    names = [arch.name for arch in PRESETS]
    assert len(names) == len(set(names))
    assert preset_names() == names


@pytest.mark.parametrize("name, suggestion", [("llama2-7b", "llama-2-7b"), ("7b", "7B"), ("Tiny", "tiny"),
                                              ("qwen2.5-7", "qwen2.5-7b"), ("mistral7b", "mistral-7b")])
def test_unknown_names_suggest_close_presets(name, suggestion):
    with pytest.raises(UserError) as error:
        resolve(name)
    message = str(error.value)
    assert message.startswith("models:")
    assert repr(name) in message
    assert "Did you mean" in message
    assert suggestion in message.split("Did you mean", 1)[1]
    assert suggestion in closest_names(name)


def test_unknown_name_without_a_close_preset():
    with pytest.raises(UserError) as error:
        resolve("zzzzqqqq")
    assert "Did you mean" not in str(error.value)
    assert "fitbench models" in str(error.value)
    assert UserError.exit_code == 2


def test_local_llama_directory(tmp_path):
    config = LlamaConfig(hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=512,
                         tie_word_embeddings=False, rope_theta=20000.0, rms_norm_eps=1e-6)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"

    arch = resolve(str(tmp_path))
    assert arch.family == "llama" and arch.hf_model_type == "llama"
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads) == (96, 3, 6, 2)
    assert (arch.ffn_size, arch.vocab_size, arch.max_seq_len) == (200, 300, 512)
    assert not arch.tie_embeddings and not arch.qkv_bias
    assert arch.rope_theta == 20000.0 and arch.norm_eps == 1e-6 and arch.rope_scaling is None
    head = 96 // 6
    by_hand = (2 * 300 * 96
               + 3 * (96 * 96 + 2 * 96 * 2 * head + 96 * 96 + 3 * 96 * 200 + 2 * 96)
               + 96)
    assert arch.total_params == by_hand
    assert count(meta_hf_model(AutoConfig.from_pretrained(tmp_path))) == by_hand


def test_local_llama31_directory_keeps_its_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=100, max_position_embeddings=4096, rope_theta=500000.0,
                rope_scaling=dict(scaling)).save_pretrained(tmp_path)
    arch = resolve(str(tmp_path))
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling is not None
    assert {key: arch.rope_scaling[key] for key in scaling} == scaling


def test_local_qwen2_and_gpt2_directories(tmp_path):
    qwen = tmp_path / "qwen"
    Qwen2Config(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=150, max_position_embeddings=256,
                tie_word_embeddings=True).save_pretrained(qwen)
    arch = resolve(str(qwen))
    assert arch.hf_model_type == "qwen2" and arch.qkv_bias and arch.tie_embeddings
    assert arch.total_params == count(meta_hf_model(AutoConfig.from_pretrained(qwen)))

    gpt = tmp_path / "gpt"
    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=120, n_positions=96).save_pretrained(gpt)
    arch = resolve(str(gpt))
    assert arch.family == "gpt2" and arch.ffn_size == 4 * 64 and arch.max_seq_len == 96
    assert arch.total_params == count(meta_hf_model(AutoConfig.from_pretrained(gpt)))


def test_unsupported_model_type_is_a_user_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(UserError, match="bert"):
        resolve(str(tmp_path))


def test_non_embedding_params():
    llama = resolve("7B")
    assert llama.non_embedding_params == llama.total_params - llama.vocab_size * llama.hidden_size
    tied = resolve("1B")
    assert tied.non_embedding_params == tied.total_params - tied.vocab_size * tied.hidden_size
    gpt2 = resolve("gpt2")
    assert gpt2.non_embedding_params == (gpt2.total_params - gpt2.vocab_size * gpt2.hidden_size
                                         - gpt2.max_seq_len * gpt2.hidden_size)
    # GPT-2 small: 124,439,808 in all, 85,054,464 outside the two embedding tables
    assert gpt2.total_params == 124_439_808
    assert gpt2.non_embedding_params == 124_439_808 - 50257 * 768 - 1024 * 768


def test_tiny_flops_by_hand():
    tiny = resolve("tiny")
    assert (tiny.vocab_size, tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.num_kv_heads, tiny.ffn_size) \
        == (4096, 256, 4, 8, 4, 768)
    head = 256 // 8
    attention = 256 * 256 + 2 * 256 * (4 * head) + 256 * 256
    mlp = 3 * 256 * 768
    norms = 2 * 256
    non_embedding = 4 * (attention + mlp + norms) + 256
    embedding = 4096 * 256
    assert tiny.total_params == non_embedding + embedding  # tied: no separate output matrix
    assert tiny.non_embedding_params == non_embedding
    matmul = non_embedding + embedding  # the tied output projection is a matmul per token
    for context in (1, 16, 128, 1024):
        forward = 2 * matmul + 4 * 4 * 8 * head * context
        assert tiny.forward_flops_per_token(context) == forward
        assert tiny.train_flops_per_token(context) == 3 * forward
    assert tiny.forward_flops_per_token(16) == 8_458_752


@pytest.mark.parametrize("name", ["7B", "gpt2", "qwen2.5-7b", "falcon-40b"])
def test_train_flops_are_three_forwards(name):
    arch = resolve(name)
    for context in (128, 4096):
        assert arch.train_flops_per_token(context) == 3 * arch.forward_flops_per_token(context)
    # untied: the output projection is already outside the embedding table
    if not arch.tie_embeddings:
        assert arch.matmul_params == arch.non_embedding_params


def test_kv_cache_bytes_per_token():
    arch = resolve("llama-3.1-8b")
    # 2 (k, v) x 32 layers x 8 kv heads x 128 head dim x 2 bytes
    assert arch.kv_cache_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2


def test_inconsistent_shapes_are_rejected():
    tiny = resolve("tiny")
    with pytest.raises(ValueError):
        dataclasses.replace(tiny, num_heads=7)
    with pytest.raises(ValueError):
        dataclasses.replace(tiny, num_kv_heads=3)
