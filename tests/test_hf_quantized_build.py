"""transformers' models quantized as they are built (``fitbench.worker.quantize.hf_layers``): the bf16 model
never exists whole (the most bytes alive at once, counted operator by operator), its quality is measured
against the bf16 layers it was made from (recomputed by hand from copies of those layers taken just before
each was quantized), and a model split by layers over two devices is the one-device model."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from fitbench.models.registry import resolve
from fitbench.spec import Layout
from fitbench.worker.loops import random_tokens
from fitbench.worker.quantize import hf_layers
from fitbench.worker.quantize.hf_layers import build_quantized_hf
from test_quantize import (MAX_MATMUL_ERROR, agreement_by_hand, check_matmul_error, kl_by_hand,
                           relative_error)

CPU = torch.device("cpu")
SEQ = 16


def tiny(family: str, layers: int = 3, hidden: int = 128):
    """A small model of ``family``: Llama's block, Falcon's parallel one with grouped kv heads, GPT-2's."""
    base = {"llama": "tiny", "falcon": "falcon-40b", "gpt2": "gpt2"}[family]
    return dataclasses.replace(resolve(base), name=f"tiny-{family}", hidden_size=hidden, num_layers=layers,
                               num_heads=8, num_kv_heads=8 if family == "gpt2" else 2, ffn_size=4 * hidden,
                               vocab_size=1000, max_seq_len=128)


def logits(model: nn.Module, probe: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(probe, use_cache=False).logits


@pytest.mark.parametrize("precision", ["int8", "nf4", "int8-weight-only"])
@pytest.mark.parametrize("family", ["llama", "falcon", "gpt2"])
def test_quality_is_measured_against_the_bf16_layers_the_model_was_made_from(family, precision, monkeypatch):
    """Each layer is copied in bf16 the moment before its matmuls are quantized (the real quantizer runs
    on the original); those copies with the model's bf16 embeddings, norms and head are the reference,
    and every quality figure is recomputed against it by hand."""
    arch = tiny(family)
    bf16_layers: list[nn.Module] = []
    quantize = hf_layers.quantize_linears

    def copy_then_quantize(module, *args, **kwargs):
        twin = copy.deepcopy(module)
        for part in twin.modules():  # the copy without the build's and the recording's hooks
            part._forward_pre_hooks.clear()
            part._forward_hooks.clear()
        bf16_layers.append(twin)
        return quantize(module, *args, **kwargs)

    monkeypatch.setattr(hf_layers, "quantize_linears", copy_then_quantize)
    probe = random_tokens(arch.vocab_size, 1, SEQ, CPU, seed=2)
    torch.manual_seed(5)
    model, mapping, quality = build_quantized_hf(arch, ["cpu"], precision, probe)
    quantized = logits(model, probe)
    reference = copy.deepcopy(model)
    prefix, layers = hf_layers.decoder_layers(reference)
    assert len(bf16_layers) == arch.num_layers == len(layers)
    for index, layer in enumerate(bf16_layers):
        layers[index] = layer
    assert all(type(m) is nn.Linear for name, m in reference.named_modules() if name.startswith(f"{prefix}.")
               and isinstance(m, nn.Linear))
    expected = logits(reference, probe)
    assert quality.probe_tokens == SEQ
    assert quality.top1_agreement == agreement_by_hand(quantized, expected)
    assert quality.kl_divergence == pytest.approx(kl_by_hand(quantized, expected), rel=1e-3, abs=1e-8)
    calls = {}
    handles = [m.register_forward_hook(lambda m, a, o, name=name: calls.__setitem__(name, (a[0].clone(), o.clone())))
               for name, m in reference.named_modules() if name.startswith(f"{prefix}.") and isinstance(m, nn.Linear)]
    logits(reference, probe)
    for handle in handles:
        handle.remove()
    check_matmul_error(quality.matmul_error, calls, model, precision)
    assert quality.matmul_error.worst < MAX_MATMUL_ERROR[precision]


@pytest.mark.parametrize("family", ["llama", "falcon", "gpt2"])
def test_the_bf16_model_never_exists_whole(family, monkeypatch):
    """Whenever a layer is about to be quantized, the layers before it hold quantized matmuls only, the
    layers after it have no storage yet (the meta device), and it alone holds bf16 matmuls: the peak
    is the quantized layers, one bf16 layer and the quantizer's temporaries, as the planner counts."""
    arch = tiny(family, layers=4)
    seen: list[list[str]] = []
    found = {}
    quantize, layers_of = hf_layers.quantize_linears, hf_layers.decoder_layers

    def remember_layers(model):
        found["layers"] = layers_of(model)[1]
        return layers_of(model)

    def state(layer: nn.Module) -> str:
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        if all(m.weight.is_meta for m in linears):
            return "meta"
        if all(type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 for m in linears):
            return "bf16"
        return "quantized" if all(type(m) is not nn.Linear or m.weight.dtype != torch.bfloat16
                                  for m in linears) else "mixed"

    def check_then_quantize(module, *args, **kwargs):
        seen.append([state(layer) for layer in found["layers"]])
        return quantize(module, *args, **kwargs)

    monkeypatch.setattr(hf_layers, "decoder_layers", remember_layers)
    monkeypatch.setattr(hf_layers, "quantize_linears", check_then_quantize)
    probe = random_tokens(arch.vocab_size, 1, SEQ, CPU, seed=2)
    build_quantized_hf(arch, ["cpu"], "nf4", probe)
    L = arch.num_layers
    assert seen == [["quantized"] * i + ["bf16"] + ["meta"] * (L - 1 - i) for i in range(L)]
    assert [state(layer) for layer in found["layers"]] == ["quantized"] * L


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_model_split_over_two_devices_is_the_one_device_model(family):
    """The same seed on one device and by layers over two (here both the CPU, through accelerate's hooks as
    on GPUs): the same weights, quantized alike, give the same logits and quality; a tied output
    projection gets its own copy on the last device."""
    arch = tiny(family)
    probe = random_tokens(arch.vocab_size, 1, SEQ, CPU, seed=2)
    runs = {}
    for devices in (["cpu"], ["cpu", "cpu"]):
        torch.manual_seed(5)
        model, mapping, quality = build_quantized_hf(arch, devices, "int8", probe)
        runs[len(devices)] = (logits(model, probe), quality, model)
    (one, one_quality, one_model), (two, two_quality, two_model) = runs[1], runs[2]
    assert relative_error(two, one) < 1e-6
    assert two_quality.top1_agreement == one_quality.top1_agreement
    assert {type(m._hf_hook).__name__ for m in two_model.modules() if hasattr(m, "_hf_hook")} == {"AlignDevicesHook"}
    tied = [m.get_output_embeddings().weight is m.get_input_embeddings().weight for m in (one_model, two_model)]
    assert tied == [True, False]


def test_the_hf_backends_stages_take_quantized_layers():
    """transformers' stages are made layer by layer on their devices, so quantized stages compose; they
    still run inference and forward only."""
    for precision in ("nf4", "int8", "bf16-pure"):
        assert Layout(pp=2).problem(tiny("falcon"), "infer", precision, "hf") is None
    assert "--backend native" in Layout(pp=2).problem(tiny("falcon"), "train", "bf16", "hf")
