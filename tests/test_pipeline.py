"""Pipeline parallelism of the native model (fitbench.worker.pipeline).

The fast tests build stages in this process; the slow ones start one real torchrun job of three CPU
ranks over gloo (tests/pipeline_job.py) and compare what its stages computed with one process
running the whole model of the same seed, and one `fitbench run` of two ranks.
"""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import pipeline_job as job
from conftest import Shape
from fitbench.models.backends import NativeLM, load_model
from fitbench.models import native
from fitbench.models.native import build_native
from fitbench.models.registry import resolve
from fitbench.precisions import policy
from fitbench.worker.aggregate import combine
from fitbench.worker.loops import make_step, random_tokens
from fitbench.worker.stages import build_stage
from fitbench.worker.quantize import build_quantized_native
from fitbench.spec import Layout, Stage, microbatch_problem
from test_parallel import marked

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
STAGES = 3  # the job's: a stage between the first and the last, and the tied table's copies on ranks 0 and 2
MARK = "FITBENCH_TEST_MARK"
slow = pytest.mark.slow


# ---- a stage, in this process ---------------------------------------------------------------------------

@pytest.mark.parametrize("layers, tied, stages", [(5, True, 2), (5, True, 3), (4, False, 3)])
def test_each_stage_holds_its_own_modules_with_the_single_process_weights(layers, tied, stages):
    arch = dataclasses.replace(resolve("tiny"), num_layers=layers, tie_embeddings=tied)
    torch.manual_seed(5)
    whole = build_native(arch, "cpu", torch.float32)
    expected = dict(whole.named_parameters(remove_duplicate=False))
    held = set()
    for index in range(stages):
        stage = Stage.of(layers, index, stages)
        torch.manual_seed(5)
        model = build_stage(arch, stage, "cpu", torch.float32)
        parameters = dict(model.named_parameters(remove_duplicate=False))
        layer_names = {name.split(".")[2] for name in parameters if name.startswith("model.layers.")}
        assert layer_names == {str(i) for i in stage.layers}
        assert ("model.embed_tokens.weight" in parameters) == stage.first
        assert ("lm_head.weight" in parameters) == ("model.norm.weight" in parameters) == stage.last
        for name, parameter in parameters.items():
            assert not parameter.is_meta and torch.equal(parameter, expected[name]), name
        held |= set(parameters)
        assert torch.equal(model.rope_cos, whole.rope_cos)
    assert held == set(expected)  # every weight on some stage


def pipeline_problem(precision: str, mode: str, backend: str = "native") -> str | None:
    """What ``Layout`` says of two pipeline stages."""
    return Layout(pp=2).problem(Shape(), mode, precision, backend)


def test_a_batch_must_split_into_the_microbatches_and_the_hf_backend_trains_no_stages():
    assert microbatch_problem(8, 4) is None
    assert "--microbatches that divides 6" in microbatch_problem(6, 4)
    assert pipeline_problem("bf16", "infer") is None and pipeline_problem("bf16", "infer", "hf") is None
    problem = pipeline_problem("bf16", "train", "hf")
    assert "hf backend" in problem and "--backend native" in problem
    assert "bf16" in pipeline_problem("fp16", "train")
    assert "adapters" in pipeline_problem("nf4", "train") and pipeline_problem("nf4", "infer") is None


def test_a_pipelined_row_takes_the_last_stages_figures_counts_the_tokens_once_and_sums_the_weights():
    def payload(rank, median, loss):
        return {"status": "ok", "loss": loss, "timing": {"step": {"median": median}},
                "throughput": {"tokens_per_step": 64, "tokens_per_s": 64 / median, "flops_per_token": 10.0,
                               "achieved_tflops": 64 / median * 10 / 1e12, "mfu": None, "mfu_measured_peak": None},
                "weights": {"bytes": 1000 + rank, "bf16_bytes": 1000, "relative_to_bf16": (1000 + rank) / 1000},
                "parallel": {"strategy": "pipeline", "stage": {"stage": rank, "layers": [2 * rank, 2 * rank + 2]}},
                "memory": {"gpus": [], "host_peak_rss": 10 + rank}}

    row = combine([payload(0, 0.5, None), payload(1, 0.4, [2.5, 2.4])], Layout.of_strategy("pipeline", 2))
    assert row["loss"] == [2.5, 2.4]  # the last stage's
    assert row["timing"]["step"]["median"] == 0.5 and row["timing"]["slowest_rank"] == 0
    assert row["throughput"]["tokens_per_step"] == 64  # one pipeline: its tokens once
    assert row["throughput"]["tokens_per_s_per_gpu"] == pytest.approx(64 / 0.5 / 2)
    assert [stage["layers"] for stage in row["parallel"]["stages"]] == [[0, 2], [2, 4]]
    assert "stage" not in row["parallel"]
    assert row["weights"]["bytes"] == 2001 and row["weights"]["bytes_per_rank"] == [1000, 1001]
    assert row["weights"]["relative_to_bf16"] == pytest.approx(2.001)
    assert row["memory"]["host_peak_rss_per_rank"] == [10, 11]


# ---- one real job -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pipelined(tmp_path_factory) -> tuple[list[dict], list[torch.Tensor], Path]:
    """tests/pipeline_job.py as a torchrun job of STAGES CPU ranks: every rank's row, the last stage's
    logits of each generation, and the job's directory."""
    tmp_path = tmp_path_factory.mktemp("pipeline")
    mark = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), MARK: mark}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(STAGES),
               str(Path(job.__file__)), str(tmp_path)]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert not marked(mark), "a rank outlived its job"
    assert process.returncode == 0 and (tmp_path / "ranks.json").exists(), output[-3000:]
    return json.loads((tmp_path / "ranks.json").read_text()), torch.load(tmp_path / "logits.pt"), tmp_path


@pytest.fixture(scope="module")
def pipelined_quantized(pipelined) -> dict:
    """The job's quantized generations, by precision."""
    return torch.load(pipelined[2] / "quantized.pt")


def single_process():
    torch.manual_seed(job.SEED)
    return load_model(job.ARCH, "native", "cpu", policy(job.PRECISION).weight_dtype)


# The losses average the same N = BATCH x SEQ_LEN token losses in fp32 in another order (the mean of
# MICROBATCHES means), and the gradients are summed in another order: the bound of test_parallel.
TOLERANCE = 2 * (job.BATCH * job.SEQ_LEN - 1) * 2.0 ** -24


@slow
def test_stages_hold_uneven_layer_runs_and_never_the_whole_model(pipelined):
    ranks, _, _ = pipelined
    assert [row["stage"]["layers"] for row in ranks] == [[0, 2], [2, 4], [4, 5]]  # 5 layers: 2, 2 and 1
    assert [(row["stage"]["embedding"], row["stage"]["output_projection"]) for row in ranks] == \
        [(True, False), (False, False), (False, True)]
    whole = single_process().module
    layer = sum(p.numel() for p in whole.model.layers[0].parameters())
    table = whole.model.embed_tokens.weight.numel()
    norm = whole.model.norm.weight.numel()
    assert [row["params"] for row in ranks] == [table + 2 * layer, 2 * layer, layer + norm + table]  # tied: 2 copies
    assert all(row["meta_params"] == 0 for row in ranks)


@slow
def test_pipelined_training_losses_equal_one_process(pipelined):
    ranks, _, _ = pipelined
    assert ranks[0]["losses"] == ranks[1]["losses"] == []  # the loss exists on the last stage only
    lm = single_process()
    tokens = random_tokens(job.ARCH.vocab_size, job.BATCH, job.SEQ_LEN + 1, torch.device("cpu"), job.SEED)
    step = make_step("train", lm, policy(job.PRECISION), tokens, torch.device("cpu"))
    reference = [step().item() for _ in range(job.STEPS)]
    assert reference[0] - reference[-1] > 100 * TOLERANCE * reference[0]  # the steps did move the weights
    assert len(ranks[-1]["losses"]) == job.STEPS
    for loss, expected in zip(ranks[-1]["losses"], reference):
        assert math.isclose(loss, expected, rel_tol=TOLERANCE), (ranks[-1]["losses"], reference)


@slow
def test_pipelined_forward_prefill_and_decode_equal_one_process(pipelined):
    ranks, logits, _ = pipelined
    lm = single_process()
    tokens = random_tokens(job.ARCH.vocab_size, job.BATCH, job.SEQ_LEN + 1, torch.device("cpu"), job.SEED)
    with torch.inference_mode():
        forward = lm.logits(tokens[:, :-1]).sum(dtype=torch.float32).item()
        assert ranks[0]["forward_sum"] is ranks[1]["forward_sum"] is None
        assert math.isclose(ranks[-1]["forward_sum"], forward, rel_tol=1e-5, abs_tol=1e-3)
        prompt = random_tokens(job.ARCH.vocab_size, 2, job.PROMPT, torch.device("cpu"), job.SEED + 1)
        expected_tokens, expected_logits = [], []
        out = lm.prefill(prompt, job.PROMPT + job.NEW_TOKENS)
        for i in range(job.NEW_TOKENS):
            expected_logits.append(out)
            token = out.argmax(dim=-1, keepdim=True)
            expected_tokens.append(token[:, 0].tolist())
            if i < job.NEW_TOKENS - 1:
                out = lm.decode(token)
    expected = torch.stack(expected_logits)  # (NEW_TOKENS, B, V)
    for generation in range(job.GENERATIONS):
        assert ranks[0]["tokens"][generation] == ranks[-1]["tokens"][generation] == expected_tokens
        assert ranks[1]["tokens"][generation] == []  # a stage between needs no token
        torch.testing.assert_close(logits[generation], expected, rtol=1e-5, atol=1e-5)
    # each stage's static step, one capture per rank serving both generations (the same cache)
    graphed = torch.load(pipelined[2] / "graphed_logits.pt")
    for generation in range(job.GENERATIONS):
        assert ranks[0]["graphed_tokens"][generation] == ranks[-1]["graphed_tokens"][generation] == expected_tokens
        torch.testing.assert_close(graphed[generation], expected, rtol=1e-5, atol=1e-5)
    for rank in ranks:
        assert rank["graphed_decoding"]["cuda_graphs"] is True and len(rank["graphed_decoding"]["captures"]) == 1
    # as the worker times it: the last stage's sums are of the first and last tokens' logits
    timed = ranks[-1]["timed"]
    for value, logits_of in zip(timed["sums"], (expected[0], expected[-1])):
        assert math.isclose(value, logits_of.sum(dtype=torch.float32).item(), rel_tol=1e-5, abs_tol=1e-3)
    assert len(timed["token_latencies"]) == job.NEW_TOKENS - 1 and timed["time_to_first_token"] > 0


@slow
def test_fitbench_run_with_the_pipeline_strategy_writes_one_row_per_configuration(tmp_path, capsys, monkeypatch):
    """`fitbench run --gpus 2 --strategy pipeline --mode train`: one ok row for the job of two ranks, with
    both stages in ``parallel``, the memory of both ranks and the last stage's training losses, those
    of one process on the same batch (a generation through the worker's timing: ``pipelined``)."""
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    batch, seq_len, steps = 4, 16, 3
    code, out, err = cli(["run", "--models", "tiny", "--device", "cpu", "--gpus", str(WORLD), "--strategy", "pipeline",
                          "--mode", "train", "--precision", "fp32", "--batch-size", str(batch), "--seq-len",
                          str(seq_len), "--microbatches", "4", "--warmup-steps", "1",
                          "--measure-steps", str(steps - 1), "--out", "r"], capsys)
    assert code == 0, out + err
    [train] = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert train["status"] == "ok" and train["ranks"] == WORLD and "pipeline x 2" in train["label"], train.get("error")
    assert [stage["layers"] for stage in train["parallel"]["stages"]] == [[0, 2], [2, 4]]
    assert len(train["memory"]["host_peak_rss_per_rank"]) == WORLD
    stage_bytes = train["weights"]["bytes_per_rank"]
    assert len(stage_bytes) == WORLD and train["weights"]["bytes"] == sum(stage_bytes)  # the model is its stages
    assert stage_bytes == [4 * stage["params"] for stage in train["parallel"]["stages"]]  # fp32
    assert (train["parallel"]["schedule"], train["parallel"]["microbatches"]) == ("GPipe", 4)
    torch.manual_seed(0)
    lm = load_model(resolve("tiny"), "native", "cpu", torch.float32)
    tokens = random_tokens(resolve("tiny").vocab_size, batch, seq_len + 1, torch.device("cpu"), 0)
    step = make_step("train", lm, policy("fp32"), tokens, torch.device("cpu"))
    expected = [step().item() for _ in range(steps)][1:]  # the first step is the row's warm-up
    tolerance = 2 * (batch * seq_len - 1) * 2.0 ** -24
    assert len(train["loss"]) == len(expected)
    for loss, step_loss in zip(train["loss"], expected):
        assert math.isclose(loss, step_loss, rel_tol=tolerance), (train["loss"], expected)


def test_microbatches_and_the_pipeline_strategy_are_validated_before_anything_runs(tmp_path, capsys, monkeypatch):
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    base = ["run", "--models", "tiny", "--device", "cpu", "--gpus", "2", "--out", "r"]
    for extra, says in ((["--strategy", "pipeline", "--mode", "train", "--batch-size", "3"], "--microbatches"),
                        (["--strategy", "pipeline", "--microbatches", "0"], "microbatches"),
                        (["--strategy", "pipeline", "--mode", "train", "--batch-size", "auto"], "--batch-size N"),
                        (["--strategy", "ddp", "--microbatches", "2"], "--strategy pipeline"),
                        (["--strategy", "pipeline", "--mode", "train", "--precision", "fp16"], "bf16"),
                        (["--models", "gpt2", "--strategy", "pipeline", "--mode", "train"], "hf backend")):
        code, out, err = cli(base + extra, capsys)
        assert code == 2 and says in out + err and "Traceback" not in out + err, (extra, out + err)
        assert not (tmp_path / "r" / "results.jsonl").exists()


@slow
@pytest.mark.parametrize("precision", job.QUANTIZED)
def test_quantized_stages_generate_as_the_single_process_quantized_model(pipelined_quantized, precision):
    """Each stage's layers built and quantized on its own rank from the same seed: the same quantized
    model as one process builds, so the same logits, and the quality of the whole model, on the last stage."""
    torch.manual_seed(job.SEED)
    module, quality = build_quantized_native(job.ARCH, torch.device("cpu"), precision, job.probe())
    lm = NativeLM(module, cache_dtype=torch.bfloat16)
    prompt = random_tokens(job.ARCH.vocab_size, 2, job.PROMPT, torch.device("cpu"), job.SEED + 1)
    expected = []
    with torch.inference_mode():
        out = lm.prefill(prompt, job.PROMPT + job.NEW_TOKENS)
        for i in range(job.NEW_TOKENS):
            expected.append(out)
            if i < job.NEW_TOKENS - 1:
                out = lm.decode(out.argmax(dim=-1, keepdim=True))
    got = pipelined_quantized[precision]
    torch.testing.assert_close(got["logits"], torch.stack(expected), rtol=1e-3, atol=1e-3)
    expected_quality = quality.as_dict()
    assert got["quality"]["matmul_error"].pop("worst_matmul") == expected_quality["matmul_error"].pop("worst_matmul")
    assert got["quality"]["matmul_error"]["count"] == job.ARCH.num_layers * 7  # every layer's, from both stages
    assert got["quality"]["matmul_error"] == pytest.approx(expected_quality["matmul_error"], rel=1e-4)
    for name in ("top1_agreement", "kl_divergence", "probe_tokens"):
        assert got["quality"][name] == pytest.approx(expected_quality[name], rel=1e-4), name


@pytest.mark.parametrize("checkpointed, recomputed", [(None, [3, 4, 5]), (1, [3]), (2, [3, 4]), (7, [3, 4, 5])])
def test_a_stage_checkpoints_its_own_first_layers(checkpointed, recomputed, monkeypatch):
    """--checkpointed-layers counts per stage: the second of two stages of 6 layers (3-5) recomputes its
    first N, every one of them when N is None or at least its 3, and its gradients are those without."""
    import fitbench.worker.pipeline as pipeline

    arch = dataclasses.replace(resolve("tiny"), num_layers=6)
    stage = Stage.of(6, 1, 2)
    torch.manual_seed(5)
    model = build_stage(arch, stage, "cpu", torch.float32)
    hidden = torch.randn(2, 16, arch.hidden_size, generator=torch.Generator().manual_seed(3))
    ran = []

    def counted(layer, *args, **kwargs):
        ran.append(list(model.model.layers).index(layer))
        return torch.utils.checkpoint.checkpoint(layer, *args, **kwargs)

    monkeypatch.setattr(native, "checkpoint", counted)  # NativeCausalLM.run_layer, which a stage calls

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        pipeline.stage_forward(model, stage, hidden).float().square().mean().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    reference = gradients()
    model.activation_checkpointing, model.checkpointed_layers = True, checkpointed
    actual = gradients()
    assert ran == recomputed
    for name, tensor in actual.items():
        torch.testing.assert_close(tensor, reference[name], atol=0, rtol=0, msg=name)
