"""The native Falcon and GPT-2 blocks under tensor parallelism: one torchrun job of two CPU ranks
(tests/native_families_tp_job.py) against one process holding the same weights.

One process's native model of each variant gives transformers' logits (tests/test_native_families.py);
here the tensor-parallel ranks give one process's, for the prefill and every decode step, eager and
through the static-shaped step a CUDA graph captures, with every bias and norm moved off its initial
value, so that a row-wise bias added on both ranks, a column-wise bias not cut with its rows, or a
position table missing on a rank shows; and a training forward pass's loss through DTensor."""

import math

import pytest
import torch

import native_families_tp_job as job
from fitbench.models.backends import NativeLM
from fitbench.models.graphs import Replay
from fitbench.models.native import build_native
from fitbench.worker.cross_entropy import cross_entropy
from fitbench.worker.loops import random_tokens
from test_parallel import rows_of_job

slow = pytest.mark.slow
CPU = torch.device("cpu")
# fp32 throughout; tensor parallelism changes only the order of sums (a row-wise matmul's halves, the
# embedding's lookups with zeros), each off by a few units of 2^-24 relative to the magnitudes summed
# (as tests/test_tensor_parallel.py measures); a bias added twice moves logits by about 1e-1.
RELATIVE = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return rows_of_job(job, tmp_path_factory.mktemp("native-families-tp"))


def one_process(arch, graphed: bool) -> NativeLM:
    torch.manual_seed(job.SEED)
    module = build_native(arch, CPU, torch.float32)
    job.perturb(module)
    return NativeLM(module, torch.float32, cuda_graphs=graphed, capture=(lambda step: Replay(step)) if graphed else None)


def close(measured: list[float], expected: list[float]) -> bool:
    scale = max(abs(value) for value in expected)
    return len(measured) == len(expected) and all(abs(m - e) <= RELATIVE * scale for m, e in zip(measured, expected))


@slow
@pytest.mark.parametrize("variant", list(job.VARIANTS))
@pytest.mark.parametrize("path", ["infer", "infer_graphed"])
def test_tensor_parallel_logits_equal_one_process(ranks, variant, path):
    arch = job.VARIANTS[variant]
    graphed = path == "infer_graphed"
    expected = job.logits(one_process(arch, graphed), arch, CPU)
    for row in ranks:
        measured = row[variant][path]
        assert len(measured["logits"]) == 1 + job.DECODE
        for step, (got, want) in enumerate(zip(measured["logits"], expected)):
            assert close(got, want), (variant, path, row["rank"], step)
        applied = measured["applied"]
        assert applied["query_heads_per_rank"] == arch.num_heads // 2
        # Falcon-7B's one kv head is kept whole on both ranks; the others' are cut
        assert applied["kv_heads"] == ("sharded" if arch.num_kv_heads % 2 == 0 else "replicated")
        assert measured["cache_kv_heads"] == max(arch.num_kv_heads // 2, 1)
        assert measured["decoding"]["cuda_graphs"] == graphed


def test_the_variants_are_the_blocks_they_name():
    """The job's architectures build the blocks the tests mean: biases everywhere, Falcon-7B's shared norm
    and one kv head, GPT-2's learned positions."""
    configs = {name: build_native(arch, "meta", torch.float32).config for name, arch in job.VARIANTS.items()}
    assert all(config.linear_bias and config.qkv_bias for config in configs.values())
    assert (configs["falcon-grouped"].shared_norm, configs["falcon-grouped"].n_kv_heads) == (False, 2)
    assert (configs["falcon-multi-query"].shared_norm, configs["falcon-multi-query"].n_kv_heads) == (True, 1)
    assert configs["gpt2"].positions == "learned" and configs["gpt2"].mlp == "gelu_tanh"


@slow
@pytest.mark.parametrize("variant", list(job.VARIANTS))
def test_tensor_parallel_training_loss_equals_one_process(ranks, variant):
    """Through DTensor (training's path): sequence parallel for Falcon, not for GPT-2, whose position rows
    are added to the whole sequence."""
    arch = job.VARIANTS[variant]
    lm = one_process(arch, graphed=False)
    tokens = random_tokens(arch.vocab_size, job.BATCH, job.SEQ_LEN + 1, CPU, job.SEED)
    expected = cross_entropy(lm.logits(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).item()
    for row in ranks:
        measured = row[variant]["train"]
        assert math.isclose(measured["loss"], expected, rel_tol=RELATIVE), (row["rank"], measured["loss"], expected)
        assert measured["sequence_parallel"] == (variant != "gpt2")
