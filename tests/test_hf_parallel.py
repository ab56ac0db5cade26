"""The hf backend across GPUs: transformers' tensor-parallel plans in one real torchrun job of two CPU ranks
(tests/hf_tensor_parallel_job.py), whose logits, gradients and losses are compared with one process holding
the same weights; what is refused before launch, and why."""

import json
import math
from pathlib import Path

import pytest
import torch

import hf_tensor_parallel_job as job
from fitbench.models.backends import load_model
from fitbench.precisions import policy, tensor_parallel_heads_problem, tensor_parallel_problem
from fitbench.run.loops import chunked_cross_entropy, make_step, random_tokens
from test_parallel import torchrun

slow = pytest.mark.slow
CPU = torch.device("cpu")


# ---- what is refused before launch -------------------------------------------------------------------

@pytest.mark.parametrize("family", ["falcon", "gpt2"])
def test_families_without_a_transformers_plan_are_refused_with_pipeline_stages_as_the_way_out(family):
    problem = tensor_parallel_problem("bf16", "infer", "hf", family)
    assert problem and family in problem and "--strategy pipeline" in problem
    assert problem.count(". ") == 0 and not problem.endswith(".")


def test_llama_family_models_run_under_transformers_plan_in_every_mode():
    for mode in ("infer", "forward", "forward-backward", "train"):
        assert tensor_parallel_problem("bf16", mode, "hf", "llama") is None
    assert "nf4 weights cannot be sharded" in tensor_parallel_problem("nf4", "infer", "hf", "llama")
    assert "unnamed family" in tensor_parallel_problem("bf16", "infer", "hf")  # the model's family decides


def test_the_plan_needs_kv_heads_that_divide_by_the_degree_where_the_native_decoder_replicates_them():
    assert tensor_parallel_heads_problem(8, 4, 2, "hf") is None
    problem = tensor_parallel_heads_problem(8, 1, 2, "hf")
    assert "1" in problem and "--backend native" in problem
    assert tensor_parallel_heads_problem(8, 1, 2, "native") is None
    assert "do not divide the model's 8" in tensor_parallel_heads_problem(8, 4, 3, "hf")


@pytest.mark.parametrize("options, says", [
    (["--models", "gpt2"], "no tensor-parallel plan for gpt2"),
    (["--models", "tiny", "--precision", "int8"], "int8 weights cannot be sharded"),
])
def test_what_the_hf_plans_cannot_run_is_refused_before_launch(options, says, tmp_path, capsys, monkeypatch):
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    argv = ["run", "--backend", "hf", "--device", "cpu", "--gpus", "2", "--strategy", "tp", "--mode", "infer",
            "--out", "r"]
    code, out, err = cli(argv + options, capsys)
    assert code == 2 and says in out + err and "Traceback" not in out + err, out + err
    assert not (tmp_path / "r" / "results.jsonl").exists()


# ---- one torchrun job of two ranks against one process --------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp_path = tmp_path_factory.mktemp("hf-tensor-parallel")
    done, _ = torchrun(tmp_path, str(tmp_path / "out.json"), script=Path(job.__file__),
                       world=job.LAYOUT.world_size, timeout=300)
    assert done.returncode == 0 and (tmp_path / "out.json").exists(), done.stdout[-3000:]
    rows = json.loads((tmp_path / "out.json").read_text())
    assert [row["rank"] for row in rows] == list(range(job.LAYOUT.world_size))
    return rows


def reference():
    torch.manual_seed(job.SEED)
    return load_model(job.ARCH, "hf", CPU, policy(job.PRECISION).weight_dtype)


# fp32 throughout: tensor parallelism changes only the order of sums (a row-wise matmul's halves summed by
# an all-reduce, the embedding's lookups summed with zeros), near 1e-6 of the largest value through 4
# layers (measured: under 1e-6). A rank keeping its own weights moves the logits by more than 1e-1.
RELATIVE = 1e-5


def close(measured: list[float], expected: list[float]) -> bool:
    scale = max(abs(value) for value in expected)
    return len(measured) == len(expected) and all(abs(m - e) <= RELATIVE * scale for m, e in zip(measured, expected))


@slow
def test_a_tensor_parallel_hf_forward_and_backward_pass_equals_one_process(ranks):
    lm = reference()
    tokens = random_tokens(job.ARCH.vocab_size, job.BATCH, job.SEQ_LEN + 1, CPU, job.SEED)
    loss = chunked_cross_entropy(lm.logits(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    parameters = dict(lm.module.named_parameters())
    for row in ranks:
        assert math.isclose(row["train"]["loss"], loss.item(), rel_tol=RELATIVE), row["rank"]
        for name in job.GRADIENTS:
            assert close(row["train"]["gradients"][name], job.sample(parameters[name].grad)), (row["rank"], name)


@slow
def test_tensor_parallel_hf_prefill_and_decode_logits_equal_one_process(ranks):
    lm = reference()
    prompt = random_tokens(job.ARCH.vocab_size, job.BATCH, job.PROMPT, CPU, job.SEED + 1)
    following = random_tokens(job.ARCH.vocab_size, job.BATCH, job.DECODE, CPU, job.SEED + 2)
    with torch.inference_mode():
        expected = [lm.prefill(prompt, job.PROMPT + job.DECODE)]
        expected += [lm.decode(following[:, i:i + 1]) for i in range(job.DECODE)]
    for row in ranks:
        assert len(row["infer"]["logits"]) == 1 + job.DECODE
        for step, (got, want) in enumerate(zip(row["infer"]["logits"], expected)):
            assert close(got, job.sample(want)), (row["rank"], step)
        assert row["infer"]["cache_kv_heads"] == job.ARCH.num_kv_heads // job.LAYOUT.tp  # each rank caches its own


@slow
def test_tensor_parallel_hf_training_steps_equal_one_process(ranks):
    lm = reference()
    tokens = random_tokens(job.ARCH.vocab_size, job.BATCH, job.SEQ_LEN + 1, CPU, job.SEED)
    step = make_step("train", lm, policy(job.PRECISION), tokens, CPU)
    expected = [step().item() for _ in range(job.STEPS)]
    assert expected[0] - expected[-1] > 100 * RELATIVE * expected[0]  # the step did move the weights
    for row in ranks:
        for got, want in zip(row["losses"], expected, strict=True):
            assert math.isclose(got, want, rel_tol=RELATIVE), (row["rank"], row["losses"], expected)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs two GPUs")


@two_gpus
@slow
def test_tensor_parallel_hf_generation_runs_on_two_gpus(tmp_path, capsys, monkeypatch):
    """`fitbench run --backend hf --gpus 2 --strategy tp` over NCCL: one row of the job, each GPU's memory."""
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    code, out, err = cli(["run", "--models", "tiny", "--backend", "hf", "--device", "cuda", "--gpus", "2",
                          "--strategy", "tp", "--mode", "infer", "--precision", "bf16-pure", "--batch-size", "2",
                          "--seq-len", "32", "--new-tokens", "8", "--warmup-steps", "1", "--measure-steps", "3",
                          "--out", "r"], capsys)
    assert code == 0, out + err
    [row] = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert row["status"] == "ok" and row["ranks"] == 2, row.get("error")
    assert row["parallel"]["plan"] == "transformers' base_model_tp_plan"
    assert sorted(gpu["rank"] for gpu in row["memory"]["gpus"]) == [0, 1]
