"""A checkpoint directory quantized as it loads, one layer at a time, on either backend.

For tiny Llama, Falcon (new decoder architecture, grouped key/value heads, no biases, as Falcon-40B
and -180B) and GPT-2 (a tied output projection, transposed ``Conv1D`` weights, biases)
configurations, transformers' model is made in fp32 from a seed, every parameter moved off its
initial value (norms and biases included, so that a misplaced one shows), and saved with
``save_pretrained`` (safetensors). The quantized build from that directory must give the logits of
the checkpoint loaded whole in bf16 and quantized afterwards, with its quality against that bf16
model recomputed by hand; must hold one layer in floating point at a time, having read the
checkpoint's tensors of that layer and the ones before it only; split by layers over two devices
(transformers' stages) or built as two native stages, must give the one-device logits; must read
``pytorch_model.bin``, several shards and a base model's names alike; and must refuse a checkpoint
that does not fit its model. Runs from the command line on such a directory give ok rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import cli
from fitbench.models.backends import load_model
from fitbench.models.checkpoint_names import layer_of
from fitbench.models.checkpoint_reader import CheckpointReader
from fitbench.models.registry import resolve
from fitbench.results.store import ResultStore
from fitbench.worker import quantize
from fitbench.worker.loops import random_tokens
from fitbench.worker.pipeline import stage_forward
from fitbench.worker.quantize import STAGE_PERPLEXITY, build_quantized_native, hf_layers, quantize_linears
from fitbench.worker.quantize.hf_layers import build_quantized_hf
from fitbench.worker.quantize.linears import to_plain_linears
from fitbench.spec import Layout, Stage
from test_quantize import agreement_by_hand, kl_by_hand, relative_error, run_worker, spec

CPU = torch.device("cpu")
VOCAB, HIDDEN, HEADS, LAYERS, FFN, SEQ = 256, 64, 8, 4, 160, 16
CONFIGS = {
    "llama": dict(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FFN, max_position_embeddings=64,
                  tie_word_embeddings=False),
    "falcon": dict(model_type="falcon", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, num_kv_heads=2, ffn_hidden_size=FFN, new_decoder_architecture=True,
                   parallel_attn=True, bias=False, alibi=False, max_position_embeddings=64),
    "gpt2": dict(model_type="gpt2", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
                 n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}


def write_checkpoint(family: str, directory):
    """transformers' model of ``family``, random (seeded) and perturbed, saved into ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(CONFIGS[family])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    return directory


def build(backend: str, directory, precision: str, probe: torch.Tensor, devices: tuple[str, ...] = ("cpu",)):
    """The model quantized as it is built from ``directory``, and its quality."""
    arch = resolve(str(directory))
    if backend == "native":
        return build_quantized_native(arch, CPU, precision, probe, checkpoint=directory)
    model, _, quality = build_quantized_hf(arch, list(devices), precision, probe, checkpoint=directory)
    return model, quality


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens) if not hasattr(model, "generation_config") else model(tokens, use_cache=False)
    return out if isinstance(out, torch.Tensor) else out.logits


def plain_float_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters that have storage and are plain floating-point tensors (a quantized
    weight is an integer tensor, or a torchao subclass)."""
    return sum(p.numel() * p.element_size() for p in module.parameters()
               if not p.is_meta and p.is_floating_point() and type(p.data) is torch.Tensor)


BACKENDS = [("hf", "llama"), ("hf", "falcon"), ("hf", "gpt2"),
            ("native", "llama"), ("native", "falcon"), ("native", "gpt2")]


@pytest.mark.parametrize("precision", ["int8-weight-only", "nf4"])
@pytest.mark.parametrize("backend,family", BACKENDS)
def test_a_checkpoint_quantized_as_it_loads_is_the_checkpoint_loaded_whole_then_quantized(backend, family, precision,
                                                                                          tmp_path):
    directory = write_checkpoint(family, tmp_path)
    probe = random_tokens(VOCAB, 1, SEQ, CPU, seed=2)
    built, quality = build(backend, directory, precision, probe)
    whole = load_model(resolve(str(directory)), backend, CPU, torch.bfloat16, model_path=str(directory),
                       fused=False).module
    to_plain_linears(whole)  # Falcon's own x @ W.T rounds otherwise than F.linear, which the build's layers run
    bf16 = logits_of(whole, probe)
    quantize_linears(whole, precision, CPU)
    expected = logits_of(whole, probe)
    got = logits_of(built, probe)
    assert relative_error(got, expected) < 1e-6
    assert relative_error(got, bf16) > 1e-4  # quantized: a test that would see the bf16 model instead
    assert quality.top1_agreement == agreement_by_hand(got, bf16)
    assert quality.kl_divergence == pytest.approx(kl_by_hand(got, bf16), rel=1e-3, abs=1e-8)
    assert quality.reference == "bf16, the checkpoint's weights, same input"
    if family == "gpt2":
        head, embedding = ((built.lm_head, built.model.embed_tokens) if backend == "native"
                           else (built.get_output_embeddings(), built.get_input_embeddings()))
        assert head.weight is embedding.weight


@pytest.mark.parametrize("backend,family", BACKENDS)
def test_one_layer_at_a_time_is_read_and_held_in_floating_point(backend, family, tmp_path, monkeypatch):
    """Whenever a layer's matmuls are about to be quantized, the decoder layers' plain floating-point
    parameters are that layer's and the norms and biases of the layers before it (their matrices
    quantized; the layers after it have no storage), and the tensors read from the checkpoint are
    those of the layers so far and of the modules outside the layers, each once. The one layer is the
    one the planner counts in bf16 at the build's moment."""
    directory = write_checkpoint(family, tmp_path)
    read: list[str] = []
    layers: list[nn.ModuleList] = []
    seen: list[tuple[int, list[int]]] = []  # per quantization: float bytes held, layers read
    read_tensor = CheckpointReader.tensor

    def recorded_read(self, name, dtype):
        read.append(name)
        return read_tensor(self, name, dtype)

    def check_then_quantize(module, *args, **kwargs):
        seen.append((sum(plain_float_bytes(layer) for layer in layers[0]),
                     sorted({layer_of(name) for name in read} - {None})))
        return quantize_linears(module, *args, **kwargs)

    monkeypatch.setattr(CheckpointReader, "tensor", recorded_read)
    if backend == "hf":
        layers_of = hf_layers.decoder_layers

        def remember_layers(model):
            prefix, found = layers_of(model)
            layers.append(found)
            return prefix, found
        monkeypatch.setattr(hf_layers, "decoder_layers", remember_layers)
        monkeypatch.setattr(hf_layers, "quantize_linears", check_then_quantize)
    else:
        meta_model = quantize.meta_model

        def remember_model(*args):
            model = meta_model(*args)
            layers.append(model.model.layers)
            return model
        monkeypatch.setattr(quantize, "meta_model", remember_model)
        monkeypatch.setattr(quantize, "quantize_linears", check_then_quantize)
    build(backend, directory, "int8-weight-only", random_tokens(VOCAB, 1, SEQ, CPU, seed=2))

    whole = load_model(resolve(str(directory)), backend, CPU, torch.bfloat16, model_path=str(directory),
                       fused=False).module
    _, reference_layers = (hf_layers.decoder_layers(whole) if backend == "hf" else (None, whole.model.layers))
    one = [2 * sum(p.numel() for p in layer.parameters()) for layer in reference_layers]
    kept = [2 * sum(p.numel() for p in layer.parameters() if p.dim() < 2) for layer in reference_layers]
    assert seen == [(one[i] + sum(kept[:i]), list(range(i + 1))) for i in range(LAYERS)]
    # the layer the planner's "quantizer temporaries" holds in bf16 (fitbench.planning.memory)
    assert one == [2 * resolve(str(directory)).params_per_layer] * LAYERS
    assert len(read) == len(set(read))
    assert {layer_of(name) for name in read} == {None, *range(LAYERS)}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_checkpoint_split_over_two_devices_is_the_one_device_model(family, tmp_path):
    """transformers' stages (here both the CPU, through accelerate's hooks as on GPUs) from one checkpoint:
    the one-device logits and quality; a tied output projection gets the embedding's values on the last
    device, as a copy of its own."""
    directory = write_checkpoint(family, tmp_path)
    probe = random_tokens(VOCAB, 1, SEQ, CPU, seed=2)
    one, one_quality = build("hf", directory, "int8-weight-only", probe)
    two, two_quality = build("hf", directory, "int8-weight-only", probe, devices=("cpu", "cpu"))
    assert relative_error(logits_of(two, probe), logits_of(one, probe)) < 1e-6
    assert two_quality.top1_agreement == one_quality.top1_agreement
    assert two_quality.kl_divergence == pytest.approx(one_quality.kl_divergence, rel=1e-6)
    head, embedding = two.get_output_embeddings().weight, two.get_input_embeddings().weight
    if family == "gpt2":
        assert head is not embedding and torch.equal(head, embedding)


@pytest.mark.parametrize("backend, layout", [
    ("hf", []), ("native", []),
    pytest.param("native", ["--strategy", "pipeline", "--gpus", "2"], marks=pytest.mark.slow, id="native-stages")])
def test_a_quantized_run_of_a_checkpoint_from_the_command_line(backend, layout, tmp_path, capsys):
    directory = write_checkpoint("gpt2", tmp_path / "gpt2")
    out = tmp_path / "out"
    code, stdout, stderr = cli(["run", "--models", str(directory), "--mode", "infer", "--precision", "int8-weight-only",
                                "--device", "cpu", "--backend", backend, *layout, "--batch-size", "1", "--seq-len", "16",
                                "--new-tokens", "4", "--warmup-steps", "1", "--measure-steps", "2",
                                "--out", str(out)], capsys)
    assert code == 0, stderr
    [row] = list(ResultStore(out).rows())
    assert row["status"] == "ok", row.get("error")
    assert row["weights"]["source"] == f"checkpoint {directory.resolve()}"
    assert row["quality"]["reference"] == "bf16, the checkpoint's weights, same input"
    assert row["quality"]["matmul_error"]["count"] == {"hf": 4, "native": 6}[backend] * LAYERS
    if layout:
        assert row["parallel"]["initial_weights"] == "read per stage from the checkpoint"


def test_the_hf_backends_quantized_stages_load_the_checkpoint(tmp_path):
    """A worker of two hf pipeline stages (one process over two devices, here both the CPU) quantizes the
    checkpoint, not random weights: the one-device run's quality, and its row says so."""
    directory = write_checkpoint("gpt2", tmp_path / "gpt2")
    results = {}
    for layout in (Layout(), Layout(pp=2)):
        scratch = tmp_path / f"stages-{layout.pp}"
        scratch.mkdir()
        code, results[layout.pp] = run_worker(spec(model=str(directory), backend="hf", precision="int8-weight-only",
                                                   layout=layout), scratch)
        assert code == 0 and results[layout.pp]["status"] == "ok", results[layout.pp].get("error")
    assert results[2]["parallel"]["stages"] == 2
    assert results[2]["parallel"]["initial_weights"] == "read from the checkpoint, each stage's on its device"
    assert results[2]["quality"]["reference"] == "bf16, the checkpoint's weights, same input"
    two, one = results[2]["quality"]["matmul_error"], results[1]["quality"]["matmul_error"]
    assert (two["count"], two["worst_matmul"]) == (one["count"], one["worst_matmul"])
    assert (two["mean"], two["worst"]) == pytest.approx((one["mean"], one["worst"]), rel=1e-6)
    assert results[2]["quality"]["kl_divergence"] == pytest.approx(results[1]["quality"]["kl_divergence"], rel=1e-6)


@pytest.mark.parametrize("layout", ["bin", "shards"])
@pytest.mark.parametrize("backend", ["hf", "native"])
def test_bin_and_sharded_checkpoints_are_read_as_one_safetensors_file_is(backend, layout, tmp_path):
    """A checkpoint in ``pytorch_model.bin`` (the same tensors, ``torch.save``d), or in several safetensors
    shards (``save_pretrained``'s ``max_shard_size``), builds the model its one safetensors file does."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    directory = write_checkpoint("falcon", tmp_path / "safetensors")
    other = tmp_path / layout
    if layout == "bin":
        other.mkdir()
        (other / "config.json").write_text((directory / "config.json").read_text())
        torch.save(load_file(str(directory / "model.safetensors")), other / "pytorch_model.bin")
    else:
        AutoModelForCausalLM.from_pretrained(directory).save_pretrained(other, max_shard_size="40KB")
        assert len(list(other.glob("*.safetensors"))) > 2
    probe = random_tokens(VOCAB, 1, SEQ, CPU, seed=2)
    expected = logits_of(build(backend, directory, "int8-weight-only", probe)[0], probe)
    assert torch.equal(logits_of(build(backend, other, "int8-weight-only", probe)[0], probe), expected)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_a_checkpoint_lacking_a_layers_tensor_is_refused(backend, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = write_checkpoint("llama", tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint in .* (has no tensor|lacks 1 tensors).*up_proj.*save_pretrained"):
        build(backend, directory, "int8-weight-only", random_tokens(VOCAB, 1, SEQ, CPU, seed=2))


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_a_checkpoint_of_the_base_model_names_its_tensors_without_its_prefix(backend, tmp_path):
    """GPT-2's base model saved alone (``wte.weight``, ``h.0.attn.c_attn.weight``: no ``transformer.``, no
    output projection, which is tied) builds the model the whole model's checkpoint does."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    directory = write_checkpoint("gpt2", tmp_path / "whole")
    base = tmp_path / "base"
    AutoModelForCausalLM.from_pretrained(directory).transformer.save_pretrained(base)
    with safe_open(str(base / "model.safetensors"), framework="pt") as saved:
        assert "wte.weight" in saved.keys() and not any(key.startswith("transformer.") for key in saved.keys())
    probe = random_tokens(VOCAB, 1, SEQ, CPU, seed=2)
    expected = logits_of(build(backend, directory, "int8-weight-only", probe)[0], probe)
    assert torch.equal(logits_of(build(backend, base, "int8-weight-only", probe)[0], probe), expected)


@pytest.mark.parametrize("family", ["falcon", "gpt2"])
def test_native_quantized_stages_of_a_checkpoint_are_the_one_process_model(family, tmp_path):
    """Two native pipeline stages, built in turn here with what one hands the next passed by hand (the
    ranks send it over torch.distributed), each read its own modules from the checkpoint: together the
    one-process model's logits and quality; the first stage's later layers have no storage."""
    directory = write_checkpoint(family, tmp_path)
    arch = resolve(str(directory))
    probe = random_tokens(VOCAB, 1, SEQ, CPU, seed=2)
    whole, quality = build("native", directory, "int8-weight-only", probe)
    carried = []
    first, last = Stage.every(LAYERS, 2)
    first_model, none = build_quantized_native(arch, CPU, "int8-weight-only", probe, first.layers,
                                               send=carried.append, checkpoint=directory)
    last_model, staged = build_quantized_native(arch, CPU, "int8-weight-only", probe, last.layers,
                                                receive=carried.pop, checkpoint=directory)
    assert none is None and not carried
    assert all(p.is_meta for i in last.layers for p in first_model.model.layers[i].parameters())
    assert all(p.is_meta for i in first.layers for p in last_model.model.layers[i].parameters())
    with torch.no_grad():
        expected = stage_forward(whole, Stage.of(LAYERS, 0, 1), probe)
        got = stage_forward(last_model, last, stage_forward(first_model, first, probe))
    assert torch.equal(got, expected)
    assert staged.matmul_error == quality.matmul_error
    assert (staged.top1_agreement, staged.kl_divergence) == (quality.top1_agreement, quality.kl_divergence)
    assert staged.perplexity == STAGE_PERPLEXITY


def test_a_falcon_checkpoint_with_biases_is_refused_by_the_native_model_and_built_by_transformers(tmp_path,
                                                                                                    monkeypatch):
    """fitbench's Falcon has no matmul biases (Falcon-40B's and -180B's config: bias false): a checkpoint
    holding them is refused on the native backend rather than built without them; transformers' model
    of its config.json holds them, and gives the logits of the checkpoint loaded whole then quantized."""
    monkeypatch.setitem(CONFIGS, "falcon", {**CONFIGS["falcon"], "bias": True})
    directory = write_checkpoint("falcon", tmp_path)
    probe = random_tokens(VOCAB, 1, SEQ, CPU, seed=2)
    with pytest.raises(ValueError, match=r"layer 0 .*bias.*--backend hf"):
        build("native", directory, "int8-weight-only", probe)
    built, _ = build("hf", directory, "int8-weight-only", probe)
    assert any(name.endswith("dense.bias") for name, _ in built.named_parameters())
    whole = load_model(resolve(str(directory)), "hf", CPU, torch.bfloat16, model_path=str(directory)).module
    quantize_linears(whole, "int8-weight-only", CPU)
    assert relative_error(logits_of(built, probe), logits_of(whole, probe)) < 1e-6


def test_a_falcon_checkpoint_with_biases_is_refused_by_the_native_floating_point_load(tmp_path, monkeypatch):
    """The native model loaded whole in floating point refuses, as its quantized build does, a layer's tensor
    it has no place for, rather than running without it."""
    monkeypatch.setitem(CONFIGS, "falcon", {**CONFIGS["falcon"], "bias": True})
    directory = write_checkpoint("falcon", tmp_path)
    with pytest.raises(ValueError, match=r"no place for.*--backend hf"):
        load_model(resolve(str(directory)), "native", CPU, torch.float32, model_path=str(directory))


def test_a_llama_checkpoint_carrying_rotary_frequencies_loads_as_one_without_them(tmp_path):
    """Older Llama checkpoints save each layer's ``rotary_emb.inv_freq``, which holds no weights: both the
    whole load and the quantized build read the checkpoint as they read it without them."""
    from safetensors.torch import load_file, save_file

    directory = write_checkpoint("llama", tmp_path / "plain")
    (shard,) = directory.glob("*.safetensors")
    state = load_file(str(shard))
    head_dim = CONFIGS["llama"]["hidden_size"] // CONFIGS["llama"]["num_attention_heads"]
    state |= {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(head_dim // 2)
              for i in range(CONFIGS["llama"]["num_hidden_layers"])}
    carrying = tmp_path / "carrying"
    carrying.mkdir()
    save_file(state, str(carrying / shard.name), metadata={"format": "pt"})
    (carrying / "config.json").write_text((directory / "config.json").read_text())
    probe = random_tokens(VOCAB, 1, SEQ, CPU, seed=2)
    plain, _ = build("native", directory, "int8-weight-only", probe)
    carried, _ = build("native", carrying, "int8-weight-only", probe)
    assert torch.equal(logits_of(carried, probe), logits_of(plain, probe))
    whole = [load_model(resolve(str(d)), "native", CPU, torch.float32, model_path=str(d)).module
             for d in (directory, carrying)]
    assert torch.equal(logits_of(whole[1], probe), logits_of(whole[0], probe))
