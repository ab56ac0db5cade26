"""The hf backend across GPUs: transformers' tensor-parallel plans in one real torchrun job of two CPU ranks
(tests/hf_tensor_parallel_job.py), whose logits, gradients and losses are compared with one process holding
the same weights; which plans exist and what they need (the refusals from the command line are in
tests/test_tensor_parallel.py with the native decoder's)."""

import json
import math

import pytest
import torch

import hf_tensor_parallel_job as job
from conftest import Shape
from fitbench.models.backends import load_model
from fitbench.precisions import policy
from fitbench.worker.cross_entropy import chunked_cross_entropy
from fitbench.worker.loops import make_step, random_tokens
from fitbench.spec import Layout
from test_parallel import rows_of_job
from test_tensor_parallel import RELATIVE, close  # the same sums in another order (measured: under 1e-6)

slow = pytest.mark.slow
CPU = torch.device("cpu")


# ---- what is refused before launch -------------------------------------------------------------------

def tensor_parallel_problem(precision: str, mode: str, backend: str, family: str | None = None) -> str | None:
    """What ``Layout`` says of tensor parallelism over two ranks on a model of ``family``."""
    return Layout(tp=2).problem(Shape(family=family), mode, precision, backend)


def heads_problem(heads: int, kv_heads: int, degree: int, backend: str) -> str | None:
    """What ``Layout`` says of tensor parallelism of ``degree`` on a model of these heads."""
    return Layout(tp=degree).problem(Shape(heads, kv_heads), "infer", "bf16", backend)


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
    assert heads_problem(8, 4, 2, "hf") is None
    problem = heads_problem(8, 1, 2, "hf")
    assert "1" in problem and "--backend native" in problem
    assert heads_problem(8, 1, 2, "native") is None
    assert "do not divide the model's 8" in heads_problem(8, 4, 3, "hf")


# ---- one torchrun job of two ranks against one process --------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return rows_of_job(job, tmp_path_factory.mktemp("hf-tensor-parallel"))


def reference():
    torch.manual_seed(job.SEED)
    return load_model(job.ARCH, "hf", CPU, policy(job.PRECISION).weight_dtype)


@slow
def test_a_tensor_parallel_hf_forward_and_backward_pass_equals_one_process(ranks):
    lm = reference()
    tokens = random_tokens(job.ARCH.vocab_size, job.BATCH, job.SEQ_LEN + 1, CPU, job.SEED)
    loss = chunked_cross_entropy(lm.logits(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    parameters = dict(lm.module.named_parameters())
    for row in ranks:
        assert math.isclose(row["train"]["loss"], loss.item(), rel_tol=RELATIVE), row["rank"]
        assert row["train"]["loss_function"] == "FusedCrossEntropyBackward"  # gathered logits: plain tensors
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


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def generate_on_two_gpus(model: str, strategy: str, tmp_path, capsys, monkeypatch) -> dict:
    """`fitbench run --backend hf --gpus 2 --strategy STRATEGY` generating a few tokens: its one row."""
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    code, out, err = cli(["run", "--models", model, "--backend", "hf", "--device", "cuda", "--gpus", "2",
                          "--strategy", strategy, "--mode", "infer", "--precision", "bf16-pure", "--batch-size", "2",
                          "--seq-len", "32", "--new-tokens", "8", "--warmup-steps", "1", "--measure-steps", "3",
                          "--out", "r"], capsys)
    assert code == 0, out + err
    [row] = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    return row


@two_gpus
@slow
def test_tensor_parallel_hf_generation_runs_on_two_gpus(tmp_path, capsys, monkeypatch):
    """`fitbench run --backend hf --gpus 2 --strategy tp` over NCCL: one row of the job, each GPU's memory."""
    row = generate_on_two_gpus("tiny", "tp", tmp_path, capsys, monkeypatch)
    assert row["status"] == "ok" and row["ranks"] == 2, row.get("error")
    assert row["parallel"]["plan"] == "transformers' base_model_tp_plan"
    assert sorted(gpu["rank"] for gpu in row["memory"]["gpus"]) == [0, 1]


# ---- pipeline stages in one process (accelerate's device map) ----------------------------------------------

def meta_model(arch):
    from transformers import AutoModelForCausalLM

    from fitbench.models.hf import hf_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(arch))


@pytest.mark.parametrize("name, stages", [("tiny", 3), ("gpt2", 5), ("falcon-40b", 4)])
def test_the_device_map_puts_the_planners_stages_on_consecutive_devices(name, stages):
    from fitbench.models.registry import resolve
    from fitbench.worker.hf_pipeline import decoder_layers, stage_device_map
    from fitbench.spec import pipeline_stages

    arch = resolve(name)
    model = meta_model(arch)
    devices = [f"cuda:{i}" for i in range(stages)]
    mapping = stage_device_map(model, devices)
    prefix, layers = decoder_layers(model)
    for device, run in zip(devices, pipeline_stages(arch.num_layers, stages), strict=True):
        assert [i for i in range(len(layers)) if mapping[f"{prefix}.{i}"] == device] == list(run)
    embedding = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    assert (mapping[embedding], mapping[head]) == (devices[0], devices[-1])
    norm = [n for n in mapping if n.rpartition(".")[2] in ("norm", "ln_f")]
    assert [mapping[n] for n in norm] == [devices[-1]]
    # every parameter has a device: the map covers the model
    assert all(any(p == n or p.startswith(n + ".") for n in mapping) for p, _ in model.named_parameters())


@pytest.mark.parametrize("name", ["tiny", "gpt2"])
def test_a_model_over_stages_in_one_process_generates_the_plain_models_tokens(name):
    from dataclasses import replace

    from fitbench.models.backends import HuggingFaceLM
    from fitbench.models.hf import build_hf
    from fitbench.models.registry import resolve
    from fitbench.worker.hf_pipeline import StagedHuggingFaceLM, build_staged

    arch = resolve(name)
    if name == "gpt2":  # GPT-2's shape, small
        arch = replace(arch, num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_size=256)
    torch.manual_seed(0)
    plain = HuggingFaceLM(build_hf(arch, CPU, torch.float32), static_cache=True)
    torch.manual_seed(0)
    module, mapping = build_staged(arch, ["cpu", "cpu"], torch.float32)
    staged = StagedHuggingFaceLM(module, static_cache=True, devices=["cpu", "cpu"])
    assert {type(m._hf_hook).__name__ for m in module.modules() if hasattr(m, "_hf_hook")} == {"AlignDevicesHook"}
    prompt = random_tokens(arch.vocab_size, 2, 8, CPU, 1)

    def greedy(lm) -> list[list[int]]:
        with torch.inference_mode():
            token = lm.prefill(prompt, 8 + 6).argmax(-1, keepdim=True)
            tokens = [token]
            for _ in range(5):
                token = lm.decode(token).argmax(-1, keepdim=True)
                tokens.append(token)
        return torch.cat(tokens, 1).tolist()

    assert greedy(staged) == greedy(plain)
    assert staged.module.get_output_embeddings().weight is not staged.module.get_input_embeddings().weight
    assert staged.applied()["stage_layers"][-1][1] == arch.num_layers - 1


def test_the_hf_backends_stages_launch_as_one_process_and_the_natives_as_torchrun():
    from fitbench.launch.commands import LocalProcess, Torchrun, worker_command

    layout = Layout.of_strategy("pipeline", 2)
    assert worker_command(layout, "hf") == LocalProcess()
    assert worker_command(layout, "native") == Torchrun(2)
    assert worker_command(Layout(tp=2), "hf") == Torchrun(2)


def test_the_hf_backends_stages_run_inference_in_any_precision():
    def pipeline_problem(precision: str, mode: str) -> str | None:
        return Layout(pp=2).problem(Shape(), mode, precision, "hf")

    for mode in ("infer", "forward"):
        for precision in ("bf16-pure", "nf4", "int8"):
            assert pipeline_problem(precision, mode) is None
    assert "--backend native" in pipeline_problem("bf16", "train")


@slow
def test_hf_pipeline_generation_from_the_command_line_is_one_process_row(tmp_path, capsys, monkeypatch):
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    code, out, err = cli(["run", "--models", "tiny", "--backend", "hf", "--device", "cpu", "--gpus", "2",
                          "--strategy", "pipeline", "--mode", "infer", "--batch-size", "2", "--seq-len", "16",
                          "--new-tokens", "4", "--warmup-steps", "1", "--measure-steps", "2", "--out", "r"], capsys)
    assert code == 0, out + err
    [row] = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert row["status"] == "ok", row.get("error")
    assert row["spec"]["layout"]["pp"] == 2 and "pipeline x 2" in row["label"]
    assert (row["parallel"]["world_size"], row["parallel"]["stage_layers"]) == (1, [[0, 1], [2, 3]])
    assert row["weights"]["bytes"] > 4 * job.ARCH.total_params  # the last stage's copy of the tied table


@two_gpus
@slow
def test_hf_pipeline_generation_spreads_over_two_gpus(tmp_path, capsys, monkeypatch):
    """One process over two GPUs: each GPU's memory in the row, the layers split as planned."""
    row = generate_on_two_gpus("gpt2", "pipeline", tmp_path, capsys, monkeypatch)
    assert row["status"] == "ok", row.get("error")
    assert sorted(gpu["index"] for gpu in row["memory"]["gpus"]) == [0, 1]
    assert row["parallel"]["devices"] == ["cuda:0", "cuda:1"]
