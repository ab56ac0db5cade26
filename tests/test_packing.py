"""Packing a module's state into one allocation (``fitbench.worker.packing``): every storage moves, the
modules compute the same, the old storages are freed, the block's size by hand, and the quantized
build packs each layer but the first into one block, its matmuls the largest first."""

import gc
import weakref

import pytest
import torch
from torch import nn

from fitbench.models.native import build_native
from fitbench.models.registry import resolve
from fitbench.worker.weight_bytes import weight_storage_bytes
from fitbench.worker.loops import random_tokens
from fitbench.worker.packing import Packer, aligned, packed_bytes, state_tensors
from fitbench.worker.quantize import build_quantized_native, quantize_linears

CPU = torch.device("cpu")
PRECISIONS = ("bf16", "int8", "nf4", "fp4", "int8-dynamic")


def tiny_model(precision: str):
    arch = resolve("tiny")
    model = build_native(arch, CPU, torch.bfloat16)
    if precision != "bf16":
        quantize_linears(model, precision, CPU)
    return arch, model


@pytest.mark.parametrize("precision", PRECISIONS)
def test_packing_moves_every_storage_and_changes_nothing_computed(precision):
    arch, model = tiny_model(precision)
    tokens = random_tokens(arch.vocab_size, 1, 8, CPU, seed=0)
    with torch.no_grad():
        before = model(tokens)  # bitsandbytes' int8 layers move their scales on the first forward
    weights = weight_storage_bytes(model)
    layers = model.model.layers
    old = [weakref.ref(tensor.untyped_storage()) for tensor in state_tensors(layers)]
    packer = Packer(CPU)
    packer.reserve(packed_bytes(layers[0], CPU))
    for layer in layers:
        packer.pack(layer)
    gc.collect()
    assert not [ref for ref in old if ref() is not None], "a storage of the layers was left behind"
    blocks = {tensor.untyped_storage().data_ptr() for tensor in state_tensors(layers)}
    assert len(blocks) == len(layers)  # the reserved block, then one per further layer
    with torch.no_grad():
        assert torch.equal(model(tokens), before)
    assert weight_storage_bytes(model) == weights


def test_the_block_size_by_hand():
    linear = nn.Linear(3, 5, bias=True, dtype=torch.bfloat16)
    # weight 5 x 3 x 2 B = 30 B and bias 5 x 2 B = 10 B, each rounded up to 512 B
    assert aligned(30) == aligned(10) == 512 and aligned(512) == 512 and aligned(513) == 1024
    assert packed_bytes(linear, CPU) == 1024
    shared = nn.Sequential(linear, nn.Linear(3, 5, bias=False, dtype=torch.bfloat16))
    shared[1].weight = linear.weight  # one storage counts once
    assert packed_bytes(shared, CPU) == 1024


def test_the_reserved_block_is_filled_then_a_new_one_is_taken():
    linears = [nn.Linear(16, 16, bias=False) for _ in range(3)]  # 1 KiB of fp32 each
    packer = Packer(CPU)
    packer.reserve(2048)
    assert [packer.pack(linear) for linear in linears] == [1024, 1024, 1024]
    first, second, third = (linear.weight.untyped_storage().data_ptr() for linear in linears)
    assert first == second != third
    assert linears[1].weight.storage_offset() == 1024 // 4
    assert packer.pack(linears[0]) == 0  # packed already


@pytest.mark.parametrize("precision", ["int8", "nf4"])
def test_the_quantized_build_packs_every_layer_into_one_block_the_largest_matrix_first(precision, monkeypatch):
    arch = resolve("tiny")
    order = []
    packing = Packer.pack

    def recording(self, module):
        if isinstance(module, nn.Linear) or hasattr(module, "in_features"):
            order.append(module.in_features * module.out_features)
        return packing(self, module)

    monkeypatch.setattr(Packer, "pack", recording)
    model, _ = build_quantized_native(arch, CPU, precision, random_tokens(arch.vocab_size, 1, 8, CPU, seed=0))
    # the first layer is packed whole; from the second on, each matmul as soon as it is quantized
    per_layer = len(order) // (arch.num_layers - 1)
    assert per_layer == 7 and order[:per_layer] == sorted(order[:per_layer], reverse=True)
    storages = {tensor.untyped_storage().data_ptr() for tensor in state_tensors(model.model.layers)}
    assert len(storages) == 1
    _, unpacked = tiny_model(precision)
    with torch.no_grad():
        unpacked(random_tokens(arch.vocab_size, 1, 8, CPU, seed=0))
    assert model.packer.open_block == (arch.num_layers * packed_bytes(unpacked.model.layers[0], CPU),) * 2
    # tiny ties its output projection to the embedding: one table, never a second one freed
    assert model.lm_head.weight is model.model.embed_tokens.weight
