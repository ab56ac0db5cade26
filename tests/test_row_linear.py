import pytest
import torch
import torch.nn.functional as F

from fitbench.models import row_linear
from fitbench.models.backends import NativeLM
from fitbench.models.row_linear import Linear, reduces_as_row, row_product
from test_models import VARIANTS, assert_same_generations, eager_capture, fresh_dynamo, generation_logits  # noqa: F401
from test_models import random_native


def test_the_row_product_is_the_matmul_summed_in_fp32():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 64, generator=generator).bfloat16()
    weight = torch.randn(24, 64, generator=generator).bfloat16()
    bias = torch.randn(24, generator=generator).bfloat16()
    # by hand: each output column the fp32 sum of the products of the row with that column's weights
    by_hand = torch.tensor([sum(float(x[0, 0, k]) * float(weight[n, k]) for k in range(64)) + float(bias[n])
                            for n in range(24)])
    out = row_product(x, weight, bias)
    assert out.shape == (1, 1, 24) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().flatten(), by_hand, atol=0, rtol=1 / 128)  # one bf16 rounding
    torch.testing.assert_close(out, F.linear(x, weight, bias))


def traced_ops(module: torch.nn.Module, x: torch.Tensor) -> set[str]:
    """The call_function targets of the graph Dynamo traces of ``module(x)``."""
    graphs = []

    def keep(graph, inputs):
        graphs.append(graph)
        return graph.forward

    torch.compile(module, backend=keep, dynamic=False)(x)
    return {getattr(node.target, "__name__", str(node.target)) for graph in graphs for node in graph.graph.nodes
            if node.op in ("call_function", "call_method")}


def test_only_compiled_code_of_one_row_and_a_wide_plain_16_bit_weight_reduces(monkeypatch, fresh_dynamo):
    monkeypatch.setattr(row_linear, "ROW_REDUCTION_DEVICES", ("cpu",))
    monkeypatch.setattr(row_linear, "ROW_REDUCTION_MIN_FEATURES", 32)
    wide = Linear(32, 8, bias=False).bfloat16()
    one_row = torch.randn(1, 1, 32).bfloat16()
    assert "linear" not in traced_ops(wide, one_row) and "sum" in traced_ops(wide, one_row)
    torch.compiler.reset()
    assert "linear" in traced_ops(wide, torch.randn(2, 1, 32).bfloat16())  # two rows
    torch.compiler.reset()
    assert "linear" in traced_ops(Linear(16, 8, bias=False).bfloat16(), torch.randn(1, 1, 16).bfloat16())  # narrow
    torch.compiler.reset()
    assert "linear" in traced_ops(Linear(32, 8, bias=False), torch.randn(1, 1, 32))  # fp32
    assert not reduces_as_row(one_row, wide.weight)  # eager code: the product would be materialized
    monkeypatch.setattr(row_linear, "ROW_REDUCTION_DEVICES", ("cuda",))
    torch.compiler.reset()
    assert "linear" in traced_ops(wide, one_row)  # a device the reduction is not for


def test_a_compiled_bf16_generation_at_batch_1_through_the_reduction_matches_eager(monkeypatch, fresh_dynamo):
    """Through inductor's reduction in every projection wider than 16 features (on the CPU here), the
    compiled decode follows the eager one to bf16's rounding."""
    monkeypatch.setattr(row_linear, "ROW_REDUCTION_DEVICES", ("cpu",))
    monkeypatch.setattr(row_linear, "ROW_REDUCTION_MIN_FEATURES", 16)
    arch = VARIANTS["llama-gqa"]
    native = random_native(arch).bfloat16()
    tokens = torch.randint(0, arch.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    compiled = NativeLM(native, torch.bfloat16, cuda_graphs=True, capture=eager_capture([]), compile_decode=True)
    eager = NativeLM(native, torch.bfloat16)
    assert_same_generations(generation_logits(compiled, tokens, 6, 10), generation_logits(eager, tokens, 6, 10),
                            atol=0.05, rtol=0.05)
    assert compiled.decoding["compiled"] is True


@pytest.mark.parametrize("name", ["q_proj", "o_proj", "down_proj"])
def test_every_projection_of_the_native_decoder_is_a_row_linear(name):
    native = random_native(VARIANTS["llama-gqa"])
    assert isinstance(dict(native.named_modules())[f"model.layers.0.{'mlp' if name == 'down_proj' else 'self_attn'}."
                                                    f"{name}"], Linear)
    assert isinstance(native.lm_head, Linear)
