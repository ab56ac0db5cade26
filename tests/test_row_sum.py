"""The row-wise matmul summed through symmetric memory (``fitbench.run.row_sum``): which products take
it, and what compiled code sees of it. The sum itself needs GPUs that map each other's memory; on CPU
ranks the fallback is what the tensor-parallel tests run."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fitbench.run import row_sum


def test_a_products_bytes_are_its_rows_times_the_weights_rows_times_the_element_size():
    x = torch.zeros(2, 3, 16, dtype=torch.bfloat16)
    assert row_sum.product_bytes(x, torch.zeros(40, 16, dtype=torch.bfloat16)) == 2 * 3 * 40 * 2
    assert row_sum.product_bytes(x.float(), torch.zeros(40, 16)) == 2 * 3 * 40 * 4


def test_a_product_takes_symmetric_memory_only_where_its_group_has_a_buffer_it_fits(monkeypatch):
    monkeypatch.setattr(row_sum, "_BUFFERS", {"tp": torch.empty(480, dtype=torch.uint8)})
    x = torch.zeros(2, 3, 16, dtype=torch.bfloat16)
    assert row_sum.fits(x, torch.zeros(40, 16, dtype=torch.bfloat16), "tp")  # 480 bytes: the whole buffer
    assert not row_sum.fits(x, torch.zeros(41, 16, dtype=torch.bfloat16), "tp")  # 492
    assert not row_sum.fits(x, torch.zeros(40, 16, dtype=torch.bfloat16), "another group")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_code_sees_one_product_of_the_inputs_rows_by_the_weights(dtype):
    with FakeTensorMode():
        out = torch.ops.fitbench.matmul_two_shot_sum(torch.empty(2, 1, 16, dtype=dtype),
                                                    torch.empty(40, 16, dtype=dtype), "tp")
    assert out.shape == (2, 1, 40) and out.dtype == dtype


def test_without_a_buffer_a_shard_multiplies_and_sums_over_its_group(tmp_path):
    """One CPU rank of gloo: the fallback's product, its all-reduce over a group of one the identity."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        linear = torch.nn.Linear(16, 40, bias=False)
        row_sum.RowShardLinear.convert(linear, dist.group.WORLD)
        x = torch.randn(2, 1, 16)
        assert torch.equal(linear(x), x @ linear.weight.t())
    finally:
        dist.destroy_process_group()
