"""Quantized weights (``fitbench.run.quantize``): the worker's quality and weight-size report, which
matmuls are replaced, the bf16 reference the error is measured against, and the refusals of what
this hardware or mode cannot run."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from fitbench.models.backends import HuggingFaceLM
from torch import nn

from fitbench.cli import hardware_refusals, main
from fitbench.config import RunSpec, SweepConfig, expand
from fitbench.errors import UserError
from fitbench.models.hf import build_hf
from fitbench.models.native import build_native, init_random_weights, meta_model
from fitbench.models.registry import resolve
from fitbench.plan.memory import estimate_memory
from fitbench.results.store import ResultStore
from fitbench.run import worker
from fitbench.run.loops import random_tokens
from fitbench.run.quantize import build_quantized_native, hardware_problem, quantize_built, quantize_linears

CPU = torch.device("cpu")
BATCH, SEQ, NEW = 1, 16, 4
CPU_PRECISIONS = ("int8", "nf4", "int8-dynamic")

# Relative error of the logits against the bf16 model. 8-bit weights resolve each row (or row block)
# to 1/127 of its largest magnitude, a per-matrix error near 1%, a few percent after tiny's four layers.
# 4-bit weights have 16 levels per block of 64, about ten times coarser per matrix, and the error
# compounds through the seven matmuls of every layer: on tiny it is about 0.25, so its bound is looser.
MAX_LOGITS_ERROR = {"int8": 0.1, "int8-dynamic": 0.1, "nf4": 0.5}
# The measured weight storage against the planner's weight term.
PLANNER_TOLERANCE = 0.03
SMALL_SHAPES = ["--batch-size", str(BATCH), "--seq-len", str(SEQ), "--new-tokens", str(NEW),
                "--warmup-steps", "1", "--measure-steps", "2", "--device", "cpu"]


def spec(**fields) -> RunSpec:
    values = dict(model="tiny", backend="native", mode="infer", precision="int8", batch_size=BATCH, seq_len=SEQ,
                  new_tokens=NEW, device="cpu", warmup_steps=1, measure_steps=2)
    return RunSpec(**{**values, **fields})


def run_worker(run: RunSpec, tmp_path: Path) -> tuple[int, dict]:
    """``python -m fitbench.run.worker SPEC RESULT``, in this process: exit code and result."""
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(run.model_dump_json())
    code = worker.main([str(spec_path), str(result_path)])
    return code, json.loads(result_path.read_text())


def logits_error(quantized: torch.Tensor, reference: torch.Tensor) -> float:
    """||q - ref|| / ||ref|| in float64, written out."""
    q, ref = quantized.double(), reference.double()
    return math.sqrt(((q - ref) ** 2).sum().item() / (ref ** 2).sum().item())


def matrices(arch) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's matmuls: q, k, v, o, gate, up, down."""
    h, f = arch.hidden_size, arch.ffn_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)]


def bf16_rest_bytes(arch) -> int:
    """Everything outside the layers' matmuls (embedding, tied output projection, norms) in bf16."""
    matmul = sum(rows * cols for rows, cols in matrices(arch)) * arch.num_layers
    return 2 * (arch.total_params - matmul)


def decoder_linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.startswith("model.layers.")]


# ---- through the worker --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["infer", "forward"])
@pytest.mark.parametrize("precision", CPU_PRECISIONS)
def test_worker_reports_quality_and_weight_storage(precision, mode, tmp_path):
    arch = resolve("tiny")
    code, result = run_worker(spec(precision=precision, mode=mode), tmp_path)
    assert result["status"] == "ok", result.get("error")
    assert code == worker.EXIT_OK

    quality = result["quality"]
    error = quality["logits_relative_error"]
    assert math.isfinite(error)
    assert 0 < error < MAX_LOGITS_ERROR[precision]
    assert quality["probe_tokens"] == min(SEQ, worker.PROBE_TOKENS)

    weights = result["weights"]
    bf16_bytes = 2 * arch.total_params
    assert weights["bf16_bytes"] == bf16_bytes
    assert weights["bytes"] < bf16_bytes
    assert weights["relative_to_bf16"] == pytest.approx(weights["bytes"] / bf16_bytes)
    # the quantized matrices are three quarters of tiny's parameters: 8 bits save over 30%, 4 bits over half
    assert weights["bytes"] < (0.7 if precision != "nf4" else 0.5) * bf16_bytes
    terms = {term.name: term.bytes for term in estimate_memory(arch, "infer", precision, BATCH, SEQ,
                                                               new_tokens=NEW).terms}
    assert weights["bytes"] == pytest.approx(terms["weights"], rel=PLANNER_TOLERANCE)
    if mode == "infer":
        assert result["throughput"]["weight_bytes"] == weights["bytes"]
        assert result["timing"]["token_latency"]["count"] == 2 * BATCH * (NEW - 1)
    else:
        assert result["timing"]["step"]["count"] == 2


def test_worker_refuses_fp8_on_a_cpu(tmp_path):
    code, result = run_worker(spec(precision="fp8"), tmp_path)
    assert result["status"] == "refused"
    assert code == worker.EXIT_FAILED
    assert "8.9" in result["error"]
    assert "quality" not in result and "weights" not in result


def test_classify():
    assert worker.classify(worker.RefusedError("fp8 needs compute capability 8.9")) == "refused"
    assert worker.classify(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")) == "oom"
    assert worker.classify(ValueError("refused")) == "error"


# ---- weight storage ------------------------------------------------------------------------------


def test_weight_storage_of_plain_modules():
    arch = resolve("tiny")
    model = build_native(arch, CPU, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert worker.weight_storage_bytes(model) == 2 * arch.total_params
    assert worker.weight_storage_bytes(build_native(arch, CPU, torch.float32)) == 4 * arch.total_params

    embedding = nn.Embedding(10, 6, dtype=torch.bfloat16)
    head = nn.Linear(6, 10, bias=True, dtype=torch.bfloat16)
    head.weight = embedding.weight
    tied = nn.Sequential(embedding, nn.LayerNorm(6, dtype=torch.bfloat16), head)
    # 60 shared, 10 bias, 6 + 6 norm; buffers are not weights
    tied.register_buffer("table", torch.zeros(100))
    assert worker.weight_storage_bytes(tied) == 2 * (60 + 10 + 12)
    untied = nn.Sequential(nn.Embedding(10, 6, dtype=torch.bfloat16), nn.Linear(6, 10, bias=False,
                                                                                 dtype=torch.bfloat16))
    assert worker.weight_storage_bytes(untied) == 2 * 120
    # two parameter objects over one storage (ties made on the data, not the module) also count once
    untied[1].weight = nn.Parameter(untied[0].weight.data)
    assert worker.weight_storage_bytes(untied) == 2 * 60


def test_int8_storage_counts_row_scales():
    arch = resolve("tiny")
    model = build_native(arch, CPU, torch.bfloat16)
    quantize_linears(model, "int8", CPU)
    # one int8 per element and one fp32 absmax per output row
    expected = arch.num_layers * sum(rows * cols + 4 * rows for rows, cols in matrices(arch)) + bf16_rest_bytes(arch)
    assert worker.weight_storage_bytes(model) == expected


def test_int8_storage_counts_row_scales_after_a_forward():
    arch = resolve("tiny")
    model = build_native(arch, CPU, torch.bfloat16)
    quantize_linears(model, "int8", CPU)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    expected = arch.num_layers * sum(rows * cols + 4 * rows for rows, cols in matrices(arch)) + bf16_rest_bytes(arch)
    assert worker.weight_storage_bytes(model) == expected


def test_nf4_storage_counts_block_states():
    arch = resolve("tiny")
    model = build_native(arch, CPU, torch.bfloat16)
    quantize_linears(model, "nf4", CPU)

    def matrix(rows: int, cols: int) -> int:
        blocks = rows * cols // 64
        # packed nibbles, one 8-bit absmax per block of 64, one fp32 absmax per 256 blocks (double
        # quantization), the 16-entry NF4 and 256-entry dynamic fp32 code tables
        return rows * cols // 2 + blocks + 4 * math.ceil(blocks / 256) + 4 * 16 + 4 * 256

    expected = arch.num_layers * sum(matrix(rows, cols) for rows, cols in matrices(arch)) + bf16_rest_bytes(arch)
    assert worker.weight_storage_bytes(model) == expected


# ---- which matmuls are quantized -----------------------------------------------------------------


@pytest.mark.parametrize("precision", CPU_PRECISIONS)
def test_quantize_linears_replaces_decoder_matmuls_only(precision):
    import bitsandbytes as bnb
    from torchao.utils import TorchAOBaseTensor

    arch = resolve("tiny")
    model = build_native(arch, CPU, torch.bfloat16)
    names = decoder_linear_names(model)
    assert len(names) == 7 * arch.num_layers
    quantize_linears(model, precision, CPU)
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        if precision == "int8":
            assert isinstance(module, bnb.nn.Linear8bitLt), name
            assert module.weight.dtype == torch.int8, name
        elif precision == "nf4":
            assert isinstance(module, bnb.nn.Linear4bit), name
            assert module.weight.quant_state.quant_type == "nf4", name
        else:
            assert isinstance(module.weight, TorchAOBaseTensor), name
            assert type(module.weight).__module__.startswith("torchao"), name
            assert module.weight.qdata.dtype == torch.int8, name
    assert type(model.lm_head) is nn.Linear
    assert type(model.lm_head.weight) is nn.Parameter and model.lm_head.weight.dtype == torch.bfloat16
    assert type(model.model.embed_tokens.weight) is nn.Parameter
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.norm.weight.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, arch.vocab_size) and torch.isfinite(logits).all()


# ---- the bf16 reference ---------------------------------------------------------------------------


def bf16_twin(arch, seed: int) -> nn.Module:
    """A bf16 model whose weights are those ``build_quantized_native`` draws after ``manual_seed(seed)``:
    the embedding, final norm and (discarded, tied) output projection first, then layer by layer."""
    torch.manual_seed(seed)
    model = meta_model(arch, torch.bfloat16)
    model.to_empty(device=CPU)
    for part in (model.model.embed_tokens, model.model.norm, model.lm_head):
        init_random_weights(part)
    if arch.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope()
    for layer in model.model.layers:
        init_random_weights(layer)
    return model


@pytest.mark.parametrize("precision", CPU_PRECISIONS)
def test_native_build_reports_the_error_against_the_same_bf16_weights(precision):
    arch = resolve("tiny")
    probe = random_tokens(arch.vocab_size, 1, SEQ, CPU, seed=1)
    torch.manual_seed(7)
    built, quality = build_quantized_native(arch, CPU, precision, probe)
    reference = bf16_twin(arch, 7)
    assert torch.equal(built.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    twin = copy.deepcopy(reference)
    quantize_linears(twin, precision, CPU)
    with torch.no_grad():
        expected_logits = reference(probe)
        built_logits = built(probe)
        twin_logits = twin(probe)
    # the same bf16 weights quantize to the same model
    assert torch.equal(built_logits, twin_logits)
    assert quality.probe_tokens == SEQ
    assert quality.logits_relative_error == pytest.approx(logits_error(built_logits, expected_logits), rel=1e-5)
    assert 0 < quality.logits_relative_error < MAX_LOGITS_ERROR[precision]


@pytest.mark.parametrize("precision", CPU_PRECISIONS)
def test_quantize_built_reports_the_error_against_the_model_before(precision):
    arch = resolve("tiny")
    torch.manual_seed(3)
    model = build_hf(arch, CPU, torch.bfloat16).eval()
    probe = random_tokens(arch.vocab_size, 1, SEQ, CPU, seed=2)
    with torch.no_grad():
        reference = model(probe).logits.clone()
    quality = quantize_built(HuggingFaceLM(model, static_cache=True), precision, CPU, probe)
    with torch.no_grad():
        quantized = model(probe).logits
    assert quality.probe_tokens == SEQ
    assert quality.logits_relative_error == pytest.approx(logits_error(quantized, reference), rel=1e-5)
    assert 0 < quality.logits_relative_error < MAX_LOGITS_ERROR[precision]
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16


# ---- refusals -------------------------------------------------------------------------------------


def test_hardware_problem_messages():
    for precision in ("fp8", "fp8-block"):
        message = hardware_problem(precision, CPU, None)
        assert message and precision in message and "compute capability 8.9" in message and "CPU" in message
    message = hardware_problem("int4", CPU, None)
    assert message and "CUDA GPUs" in message
    for precision in CPU_PRECISIONS + ("fp4", "bf16", "fp32"):
        assert hardware_problem(precision, CPU, None) is None

    cuda = torch.device("cuda")
    for precision in ("fp8", "fp8-block"):
        message = hardware_problem(precision, cuda, (8, 0))
        assert message and "8.0" in message and "8.9" in message
        assert "8.6" in hardware_problem(precision, cuda, (8, 6))
        assert hardware_problem(precision, cuda, (8, 9)) is None
        assert hardware_problem(precision, cuda, (9, 0)) is None
        assert hardware_problem(precision, cuda, (10, 0)) is None
    assert hardware_problem("int4", cuda, (8, 0)) is None


def test_hardware_refusals_by_spec_key():
    config = SweepConfig(models=["tiny"], mode=["infer", "forward"], precision=["fp8", "int4", "int8", "fp8-block"])
    specs = expand(config, device="cpu", default_models=["tiny"])
    refusals = hardware_refusals(specs, "cpu")
    refused = {s.key for s in specs if s.precision != "int8"}
    assert set(refusals) == refused and len(refused) == 6
    assert all(reason.startswith("refused before launch: ") for reason in refusals.values())


def test_cli_records_refusals_without_launching(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    out = tmp_path / "out"
    code = main(["run", "--models", "tiny", "--mode", "infer", "--precision", "fp8", "int4", "int8", *SMALL_SHAPES,
                 "--out", str(out)])
    stderr = capsys.readouterr().err
    assert code == 0, stderr
    rows = {row["spec"]["precision"]: row for row in ResultStore(out).rows()}
    assert set(rows) == {"fp8", "int4", "int8"}
    for precision in ("fp8", "int4"):
        row = rows[precision]
        assert row["status"] == "refused"
        assert row["error"].startswith("refused before launch")
        assert "log" not in row
        assert not list((out / "logs").glob(f"{row['key']}*.log"))
    assert "8.9" in rows["fp8"]["error"] and "CUDA" in rows["int4"]["error"]
    ok = rows["int8"]
    assert ok["status"] == "ok", ok.get("error")
    assert Path(ok["log"]).is_file()
    assert 0 < ok["quality"]["logits_relative_error"] < MAX_LOGITS_ERROR["int8"]
    assert ok["weights"]["bytes"] < 2 * resolve("tiny").total_params
    assert sorted(path.name for path in (out / "logs").iterdir()) == [f"{ok['key']}-1.log"]


@pytest.mark.parametrize("mode", ["train", "forward-backward"])
def test_training_torchao_inference_weights_is_refused_by_the_config(mode):
    with pytest.raises(UserError, match="precision") as error:
        expand(SweepConfig(models=["tiny"], mode=[mode], precision=["int8-dynamic"]), device="cpu",
               default_models=["tiny"])
    assert "infer" in str(error.value) and "bf16" in str(error.value) and "nf4" in str(error.value)
    for allowed in ("infer", "forward"):
        (only,) = expand(SweepConfig(models=["tiny"], mode=[allowed], precision=["int8-dynamic"]), device="cpu",
                         default_models=["tiny"])
        assert only.precision == "int8-dynamic"


def test_cli_refuses_training_int4(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    code = main(["run", "--models", "tiny", "--mode", "train", "--precision", "int4", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == UserError.exit_code == 2
    message = captured.err.strip()
    assert message.startswith("fitbench: precision:")
    assert "\n" not in message  # one paragraph
    assert "int4" in message and "infer" in message and "forward" in message and "bf16" in message
    assert "Traceback" not in captured.err + captured.out
    assert not out.exists()
