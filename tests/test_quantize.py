"""Quantized weights (``fitbench.worker.quantize``) and their quality against bf16 (``fitbench.worker.quality``):
the worker's quality and weight-size report, which matmuls are replaced, each quality figure
recomputed by hand (per-matmul error on the bf16 model's own activations, top-1 agreement, KL
divergence, a checkpoint's perplexity on the shipped text), and the refusals of what this hardware
or mode cannot run."""

import copy
import json
import math
import weakref
from pathlib import Path

import pytest
import torch

from tokenizers import Tokenizer
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import Shape
from fitbench.models.backends import load_model

from fitbench.cli import main
from fitbench.config import SweepConfig, expand
from fitbench.models.native import build_native, init_random_weights, meta_model
from fitbench.models.registry import resolve
from fitbench.planning.memory import estimate_memory
from fitbench.precisions import DEFAULT_LADDER, entry
from fitbench.results.store import ResultStore
from fitbench.worker import worker
from fitbench.worker.build import PROBE_TOKENS, RefusedError
from fitbench.worker.weight_bytes import weight_storage_bytes
from fitbench.worker.loops import random_tokens
from fitbench.worker.quality import (MatmulError, kl_divergence, matmul_errors, recorded_matmuls, reference_text,
                                  summarise, top1_agreement)
from fitbench.worker.quantize import build_quantized_native, quantize_linears
from fitbench.worker.quantize.hf_layers import build_quantized_hf
from fitbench.spec import Assignment, Layout, RunSpec
from fitbench.sweep import hardware_refusals
from fitbench.util.errors import UserError

CPU = torch.device("cpu")
BATCH, SEQ, NEW = 1, 16, 4
CPU_PRECISIONS = ("int8", "nf4", "int8-dynamic", "int8-weight-only", "fp8-weight-only")

# Relative error of one matmul's output against bf16. 8-bit weights round each element to a step of
# 1/127 of its row's largest magnitude (about 4 sigma for Gaussian rows of hundreds of elements): an
# rms error of 4 sigma / 127 / sqrt(12), about 1% of sigma, and so about 1% of the output. NF4 has 16
# levels per block of 64, about ten times coarser: near 10%. float8 e4m3 rounds each element to 3
# mantissa bits, a step of 1/8 to 1/16 of its own magnitude: an rms error near 2.5% of each element.
MAX_MATMUL_ERROR = {"int8": 0.02, "int8-dynamic": 0.03, "int8-weight-only": 0.02, "nf4": 0.15,
                    "fp8-weight-only": 0.04}
# The measured weight storage against the planner's weight term.
PLANNER_TOLERANCE = 0.03
SMALL_SHAPES = ["--batch-size", str(BATCH), "--seq-len", str(SEQ), "--new-tokens", str(NEW),
                "--warmup-steps", "1", "--measure-steps", "2", "--device", "cpu"]


def spec(**fields) -> RunSpec:
    values = dict(model="tiny", backend="native", mode="infer", precision="int8", batch_size=BATCH, seq_len=SEQ,
                  new_tokens=NEW, device="cpu", warmup_steps=1, measure_steps=2)
    return RunSpec(**{**values, **fields})


def run_worker(run: RunSpec, tmp_path: Path) -> tuple[int, dict]:
    """``python -m fitbench.worker.worker SPEC RESULT``, in this process: exit code and result."""
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(Assignment(spec=run).model_dump_json())
    code = worker.main([str(spec_path), str(result_path)])
    return code, json.loads(result_path.read_text())


def relative_error(quantized: torch.Tensor, reference: torch.Tensor) -> float:
    """||q - ref|| / ||ref|| in float64, written out."""
    q, ref = quantized.double(), reference.double()
    return math.sqrt(((q - ref) ** 2).sum().item() / (ref ** 2).sum().item())


def agreement_by_hand(quantized: torch.Tensor, reference: torch.Tensor) -> float:
    q, ref = quantized.reshape(-1, quantized.shape[-1]), reference.reshape(-1, reference.shape[-1])
    same = [int(torch.argmax(q[i])) == int(torch.argmax(ref[i])) for i in range(len(ref))]
    return sum(same) / len(same)


def kl_by_hand(quantized: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean over positions of sum_v p (log p - log q), p and q the softmaxes, in float64."""
    q, ref = quantized.reshape(-1, quantized.shape[-1]).double(), reference.reshape(-1, reference.shape[-1]).double()
    total = 0.0
    for i in range(len(ref)):
        log_p = ref[i] - torch.log(torch.exp(ref[i] - ref[i].max()).sum()) - ref[i].max()
        log_q = q[i] - torch.log(torch.exp(q[i] - q[i].max()).sum()) - q[i].max()
        total += (torch.exp(log_p) * (log_p - log_q)).sum().item()
    return total / len(ref)


def perplexity_by_hand(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean of -log softmax(logits[i])[ids[i + 1]], in float64."""
    logits = logits[0].double()
    nll = [torch.logsumexp(logits[i], 0).item() - logits[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    return math.exp(sum(nll) / len(nll))


def bf16_matmul_calls(model: nn.Module, run) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Input and output of every decoder matmul of ``model`` while ``run()`` runs it."""
    calls, handles = {}, []
    for name in decoder_linear_names(model):
        def keep(module, args, output, name=name):
            calls[name] = (args[0].clone(), output.clone())
        handles.append(dict(model.named_modules())[name].register_forward_hook(keep))
    with torch.no_grad():
        run()
    for handle in handles:
        handle.remove()
    return calls


def check_matmul_error(reported: MatmulError, calls: dict, quantized: nn.Module, precision: str) -> None:
    """The reported mean and worst against each bf16 input run through the quantized matmul by hand."""
    modules = dict(quantized.named_modules())
    with torch.no_grad():
        errors = {name: relative_error(modules[name](x), y) for name, (x, y) in calls.items()}
    worst = max(errors, key=errors.get)
    assert reported.count == len(errors)
    assert reported.mean == pytest.approx(sum(errors.values()) / len(errors), rel=1e-4)
    assert reported.worst_matmul == worst
    assert reported.worst == pytest.approx(errors[worst], rel=1e-4)
    assert 0 < reported.mean <= reported.worst < MAX_MATMUL_ERROR[precision]


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
    matmul = quality["matmul_error"]
    assert matmul["count"] == 7 * arch.num_layers
    assert 0 < matmul["mean"] <= matmul["worst"] < MAX_MATMUL_ERROR[precision]
    assert matmul["worst_matmul"] in decoder_linear_names(build_native(arch, "meta", torch.bfloat16))
    assert 0 <= quality["top1_agreement"] <= 1 and 0 <= quality["kl_divergence"] < 1
    assert quality["probe_tokens"] == min(SEQ, PROBE_TOKENS)
    assert quality["perplexity"] is None  # random weights
    assert result["weights"]["source"] == "random"

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
    assert worker.classify(RefusedError("fp8 needs compute capability 8.9")) == "refused"
    assert worker.classify(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")) == "oom"
    assert worker.classify(ValueError("refused")) == "error"


# ---- weight storage ------------------------------------------------------------------------------


def test_weight_storage_of_plain_modules():
    arch = resolve("tiny")
    model = build_native(arch, CPU, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert weight_storage_bytes(model) == 2 * arch.total_params
    assert weight_storage_bytes(build_native(arch, CPU, torch.float32)) == 4 * arch.total_params

    embedding = nn.Embedding(10, 6, dtype=torch.bfloat16)
    head = nn.Linear(6, 10, bias=True, dtype=torch.bfloat16)
    head.weight = embedding.weight
    tied = nn.Sequential(embedding, nn.LayerNorm(6, dtype=torch.bfloat16), head)
    # 60 shared, 10 bias, 6 + 6 norm; buffers are not weights
    tied.register_buffer("table", torch.zeros(100))
    assert weight_storage_bytes(tied) == 2 * (60 + 10 + 12)
    untied = nn.Sequential(nn.Embedding(10, 6, dtype=torch.bfloat16), nn.Linear(6, 10, bias=False,
                                                                                 dtype=torch.bfloat16))
    assert weight_storage_bytes(untied) == 2 * 120
    # two parameter objects over one storage (ties made on the data, not the module) also count once
    untied[1].weight = nn.Parameter(untied[0].weight.data)
    assert weight_storage_bytes(untied) == 2 * 60


@pytest.mark.parametrize("after_forward", [False, True])
def test_int8_storage_counts_row_scales(after_forward):
    arch = resolve("tiny")
    model = build_native(arch, CPU, torch.bfloat16)
    quantize_linears(model, "int8", CPU)
    if after_forward:
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long))
    # one int8 per element and one fp32 absmax per output row
    expected = arch.num_layers * sum(rows * cols + 4 * rows for rows, cols in matrices(arch)) + bf16_rest_bytes(arch)
    assert weight_storage_bytes(model) == expected


# bytes per output row beside one byte per element: int8 weight-only's fp32 scale and int8 zero point,
# float8 weight-only's fp32 scale
@pytest.mark.parametrize("precision, row_bytes", [("int8-weight-only", 5), ("fp8-weight-only", 4)])
def test_weight_only_storage_counts_its_row_scales(precision, row_bytes):
    arch = resolve("tiny")
    model = build_native(arch, CPU, torch.bfloat16)
    quantize_linears(model, precision, CPU)
    expected = arch.num_layers * sum(rows * cols + row_bytes * rows for rows, cols in matrices(arch)) + \
        bf16_rest_bytes(arch)
    assert weight_storage_bytes(model) == expected
    terms = {term.name: term.bytes for term in estimate_memory(arch, "infer", precision, BATCH, SEQ,
                                                               new_tokens=NEW).terms}
    assert terms["weights"] == expected


def test_int8_weight_only_leaves_activations_unquantized():
    """Weight-only: the matmul is the bf16 input times the dequantized weight, no rounding of the input
    (int8-dynamic rounds it per token, and so differs)."""
    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(64, 48, bias=False, dtype=torch.bfloat16))
    weight_only, dynamic = copy.deepcopy(linear), copy.deepcopy(linear)
    quantize_linears(weight_only, "int8-weight-only", CPU)
    quantize_linears(dynamic, "int8-dynamic", CPU)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    q = weight_only[0].weight
    dequantized = (q.qdata.float() * q.scale.float()).to(torch.bfloat16)
    with torch.no_grad():
        expected = x @ dequantized.t()
        assert torch.allclose(weight_only(x).float(), expected.float(), rtol=1e-2, atol=1e-2)
        assert relative_error(weight_only(x), linear(x)) < relative_error(dynamic(x), linear(x))


def test_fp8_weight_only_multiplies_the_bf16_input_by_the_weight_cast_back():
    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(64, 48, bias=False, dtype=torch.bfloat16))
    weight_only = copy.deepcopy(linear)
    quantize_linears(weight_only, "fp8-weight-only", CPU)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    q = weight_only[0].weight
    assert q.qdata.dtype == torch.float8_e4m3fn and q.act_quant_kwargs is None
    assert q.scale.dtype == torch.float32 and tuple(q.scale.shape) == (48, 1)  # one per output row
    dequantized = (q.qdata.float() * q.scale).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(weight_only(x), x @ dequantized.t())
        assert 0 < relative_error(weight_only(x), linear(x)) < MAX_MATMUL_ERROR["fp8-weight-only"]


class CopiesMade(TorchDispatchMode):
    """What the operators run under it make: bytes of the tensors they create (``written``), of those read
    again by later operators (``read``), and the most of them alive at once (``peak``). A view or an
    output sharing an input's storage is no new tensor; each is counted by its storage."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, int] = {}  # storage address -> bytes
        self.written = self.read = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.read += sum(self.alive.get(t.untyped_storage().data_ptr(), 0) for t in inputs)
        out = func(*args, **(kwargs or {}))
        known = {t.untyped_storage().data_ptr() for t in inputs} | set(self.alive)
        for made in tree_leaves(out):
            if isinstance(made, torch.Tensor) and made.untyped_storage().data_ptr() not in known:
                address, size = made.untyped_storage().data_ptr(), made.untyped_storage().nbytes()
                self.alive[address] = size
                self.written += size
                self.peak = max(self.peak, sum(self.alive.values()))
                weakref.finalize(made, self.alive.pop, address, None)
        return out


@pytest.mark.parametrize("precision", ["int8-weight-only", "fp8-weight-only"])
def test_an_eager_weight_only_matmul_copies_its_weight_as_the_planner_counts(precision):
    """One token through the largest matrix of tiny: the dequantized copies' traffic is the speed forecast's
    eager format's (``DecodeFormat.dequantized``), and float8's copies alive at once the memory planner's term."""
    from fitbench.planning.forecast import decode_format

    arch = resolve("tiny")
    rows, columns = arch.ffn_size, arch.hidden_size  # the MLP's gate and up projections
    model = nn.Sequential(nn.Linear(columns, rows, bias=False, dtype=torch.bfloat16))
    quantize_linears(model, precision, CPU)
    x = torch.randn(1, columns, dtype=torch.bfloat16)
    with torch.no_grad(), CopiesMade() as copies:
        model(x)
    # beyond the copies, a few tensors of one row: the output, and int8's scales and its scaled output
    copied = decode_format(precision, "eager", 1).dequantized * rows * columns
    assert copied <= copies.written + copies.read < copied + 8 * 2 * rows
    if precision == "fp8-weight-only":
        terms = {term.name: term.bytes for term in estimate_memory(arch, "infer", precision, BATCH, SEQ,
                                                                   new_tokens=NEW).terms}
        assert copies.peak == pytest.approx(terms["dequantized weight"], rel=0.01)


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
    assert weight_storage_bytes(model) == expected


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
            float8 = precision.startswith("fp8")
            assert module.weight.qdata.dtype == (torch.float8_e4m3fn if float8 else torch.int8), name
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
    the embedding, final norm and (unless tied to the embedding) output projection first, then layer by
    layer."""
    torch.manual_seed(seed)
    model = meta_model(arch, torch.bfloat16)
    model.to_empty(device=CPU)
    for part in (model.model.embed_tokens, model.model.norm, *(() if arch.tie_embeddings else (model.lm_head,))):
        init_random_weights(part)
    if arch.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope()
    for layer in model.model.layers:
        init_random_weights(layer)
    return model


@pytest.mark.parametrize("precision", CPU_PRECISIONS)
def test_native_build_measures_quality_against_the_same_bf16_weights(precision):
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
    # each matmul on the input it has in the bf16 model, not the one the quantized layers before give it
    check_matmul_error(quality.matmul_error, bf16_matmul_calls(reference, lambda: reference(probe)), built, precision)
    assert quality.top1_agreement == agreement_by_hand(built_logits, expected_logits)
    assert quality.kl_divergence == pytest.approx(kl_by_hand(built_logits, expected_logits), rel=1e-3, abs=1e-8)
    assert quality.kl_divergence > 0
    assert quality.perplexity is None


def test_matmul_error_of_one_linear_by_hand():
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=True, dtype=torch.bfloat16)
    holder = nn.Sequential(copy.deepcopy(linear))
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    with recorded_matmuls({"0": holder[0]}) as record, torch.no_grad():
        holder(x)
    quantize_linears(holder, "int8", CPU)
    errors = matmul_errors(record, {"0": holder[0]}, CPU)
    with torch.no_grad():
        expected = relative_error(holder[0](x), linear(x))
    assert errors == {"0": pytest.approx(expected, rel=1e-5)}
    assert 0 < expected < MAX_MATMUL_ERROR["int8"]
    # a matmul whose bf16 output is zero has no relative error: NaN, and it is the worst
    summary = summarise({"a": 0.01, "b": math.nan, "c": 0.03})
    assert summary.worst_matmul == "b" and math.isnan(summary.worst) and math.isnan(summary.mean)
    assert summarise({"a": 0.01, "c": 0.03}) == MatmulError(0.02, 0.03, "c", 2)
    assert summarise({}) == MatmulError(None, None, None, 0)


def test_agreement_and_kl_on_small_logits():
    reference = torch.tensor([[[0.0, math.log(2), 0.0], [3.0, 1.0, 0.0]]])
    quantized = torch.tensor([[[0.0, 0.0, math.log(2)], [2.0, 1.0, 0.0]]])
    # position 0: p = (1/4, 1/2, 1/4), q = (1/4, 1/4, 1/2): KL = 1/2 ln 2 - 1/4 ln 2; argmaxes 1 and 2
    first = math.log(2) / 4
    # position 1: p = e^(3, 1, 0) / (e^3 + e + 1), q = e^(2, 1, 0) / (e^2 + e + 1); argmaxes both 0
    zp, zq = math.exp(3) + math.e + 1, math.exp(2) + math.e + 1
    p = [math.exp(3) / zp, math.e / zp, 1 / zp]
    q = [math.exp(2) / zq, math.e / zq, 1 / zq]
    second = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    assert kl_divergence(quantized, reference) == pytest.approx((first + second) / 2, rel=1e-6)
    assert top1_agreement(quantized, reference) == 0.5
    assert kl_divergence(reference, reference) == pytest.approx(0, abs=1e-7)


# ---- perplexity of a checkpoint on the shipped text -------------------------------------------------


def test_shipped_text_is_package_data():
    text = reference_text()
    assert text.startswith("Four score and seven years ago") and text.endswith("shall not perish from the earth.")
    assert "#" not in text  # the header saying where it comes from is not part of it
    assert len(text.split()) > 200


def quantized_from_checkpoint(backend: str, arch, precision: str, probe: torch.Tensor, directory: Path):
    """The model quantized as it is built from the checkpoint in ``directory``, a function giving its logits,
    and its quality."""
    if backend == "native":
        built, quality = build_quantized_native(arch, CPU, precision, probe, checkpoint=directory)
        return built, quality
    built, _, quality = build_quantized_hf(arch, ["cpu"], precision, probe, checkpoint=directory)
    return built, quality


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Either backend's logits (1, T, V) for ``tokens``."""
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("precision", ["int8", "nf4"])
def test_perplexity_of_a_checkpoint_by_hand(precision, backend, tmp_path, tiny_checkpoint):
    """The shipped text passes the bf16 layers while they are built from the checkpoint: its perplexity
    before and after, recomputed on the checkpoint loaded whole in bf16, then quantized whole."""
    directory = tiny_checkpoint(tmp_path / "checkpoint", seed=5)
    arch = resolve(str(directory))
    twin = load_model(arch, backend, CPU, torch.bfloat16, model_path=str(directory), fused=False).module
    probe = random_tokens(arch.vocab_size, 1, SEQ, CPU, seed=1)
    _, quality = quantized_from_checkpoint(backend, arch, precision, probe, directory)

    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(reference_text()).ids
    perplexity = quality.perplexity
    assert perplexity.tokens == len(ids) > 200 and "Gettysburg" in perplexity.text
    tokens = torch.tensor([ids])
    bf16 = perplexity_by_hand(logits_of(twin, tokens), ids)
    quantize_linears(twin, precision, CPU)
    quantized = perplexity_by_hand(logits_of(twin, tokens), ids)
    assert perplexity.bf16 == pytest.approx(bf16, rel=1e-4)
    assert perplexity.quantized == pytest.approx(quantized, rel=1e-4)
    assert perplexity.quantized != perplexity.bf16
    # random weights (std 0.02) predict almost uniformly: near the vocabulary's size
    assert 0.8 * arch.vocab_size < perplexity.bf16 < 1.25 * arch.vocab_size


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_checkpoint_without_a_tokenizer_says_so(backend, tmp_path, tiny_checkpoint):
    directory = tiny_checkpoint(tmp_path / "checkpoint", tokenizer=False)
    arch = resolve(str(directory))
    _, quality = quantized_from_checkpoint(backend, arch, "int8", random_tokens(arch.vocab_size, 1, SEQ, CPU, seed=1),
                                           directory)
    assert quality.perplexity.startswith(f"not measured: no tokenizer in {directory}: none of tokenizer.json")
    assert quality.matmul_error.count == 7 * arch.num_layers


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_worker_reports_a_checkpoint_and_its_perplexity(backend, tmp_path, tiny_checkpoint):
    directory = tiny_checkpoint(tmp_path / "checkpoint", seed=5)
    code, result = run_worker(spec(model=str(directory), backend=backend, precision="nf4"), tmp_path)
    assert result["status"] == "ok", result.get("error")
    assert result["weights"]["source"] == f"checkpoint {directory.resolve()}"
    perplexity = result["quality"]["perplexity"]
    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(reference_text()).ids
    assert perplexity["tokens"] == len(ids)
    assert perplexity["bf16"] != perplexity["quantized"]
    assert all(math.isfinite(perplexity[key]) for key in ("bf16", "quantized"))
    # without weights the directory is an architecture with random weights
    (directory / "model.safetensors").unlink()
    code, result = run_worker(spec(model=str(directory), backend=backend, precision="nf4"), tmp_path)
    assert result["weights"]["source"] == "random" and result["quality"]["perplexity"] is None


# ---- refusals -------------------------------------------------------------------------------------


def test_hardware_problem_messages():
    for precision in ("fp8", "fp8-block"):
        message = entry(precision).hardware_problem("cpu", None)
        assert message and precision in message and "compute capability 8.9" in message and "CPU" in message
    message = entry("int4").hardware_problem("cpu", None)
    assert message and "CUDA GPUs" in message
    for precision in CPU_PRECISIONS + ("fp4", "bf16", "fp32"):
        assert entry(precision).hardware_problem("cpu", None) is None

    for precision in ("fp8", "fp8-block"):
        message = entry(precision).hardware_problem("cuda", (8, 0))
        assert message and "8.0" in message and "8.9" in message
        assert "8.6" in entry(precision).hardware_problem("cuda", (8, 6))
        assert entry(precision).hardware_problem("cuda", (8, 9)) is None
        assert entry(precision).hardware_problem("cuda", (9, 0)) is None
        assert entry(precision).hardware_problem("cuda", (10, 0)) is None
    assert entry("int4").hardware_problem("cuda", (8, 0)) is None


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
    assert code == 1, stderr  # refused rows are configurations that did not finish ok
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
    assert 0 < ok["quality"]["matmul_error"]["mean"] < MAX_MATMUL_ERROR["int8"]
    assert ok["weights"]["bytes"] < 2 * resolve("tiny").total_params
    assert sorted(path.name for path in (out / "logs").iterdir()) == [f"{ok['key']}-1.log"]


@pytest.mark.parametrize("precision", ["int8-dynamic", "int8-weight-only", "fp8-weight-only"])
@pytest.mark.parametrize("mode", ["train", "forward-backward"])
def test_training_torchao_inference_weights_is_refused_by_the_config(mode, precision):
    with pytest.raises(UserError, match="precision") as error:
        expand(SweepConfig(models=["tiny"], mode=[mode], precision=[precision]), device="cpu",
               default_models=["tiny"])
    assert "infer" in str(error.value) and "bf16" in str(error.value) and "nf4" in str(error.value)
    for allowed in ("infer", "forward"):
        (only,) = expand(SweepConfig(models=["tiny"], mode=[allowed], precision=[precision]), device="cpu",
                         default_models=["tiny"])
        assert only.precision == precision


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


def test_int8_weight_only_is_an_inference_precision_beside_llm_int8():
    from fitbench.planning.sharding import Parallelism
    from fitbench.planning.speed import estimate_step_time
    assert entry("int8-weight-only").training_problem and "fp8" in entry("int8-weight-only").training_problem
    assert "torchao" in Layout(tp=2).problem(Shape(), "infer", "int8-weight-only", "native")
    assert "torchao" in Layout(dp_shard=2).problem(Shape(), "forward", "int8-weight-only", "native")
    assert Layout(pp=2).problem(Shape(), "infer", "int8-weight-only", "native") is None
    assert entry("int8-weight-only").graph_problem is None and entry("int8").graph_problem is not None
    assert entry("int8-weight-only").peak_kind("infer") == "bf16"
    assert entry("int8-weight-only").hardware_problem("cpu", None) is None

    # int8-dynamic's storage, read once in the roofline (an eager step's bf16 copy is the forecast's)
    arch, gpu = resolve("7B"), "NVIDIA H200"

    def decode(precision):
        return estimate_step_time(arch, "infer", precision, 1, 128, new_tokens=16, parallelism=Parallelism(),
                                  gpu_name=gpu)

    assert decode("int8-weight-only").memory_s == pytest.approx(decode("int8-dynamic").memory_s)
    assert decode("int8-weight-only").memory_s < decode("bf16-pure").memory_s


def test_fp8_weight_only_is_an_inference_precision_that_needs_no_float8_tensor_cores():
    from fitbench.planning.sharding import Parallelism
    from fitbench.planning.speed import estimate_step_time
    assert entry("fp8-weight-only").training_problem and "fp8" in entry("fp8-weight-only").training_problem
    assert "torchao" in Layout(tp=2).problem(Shape(), "infer", "fp8-weight-only", "native")
    assert "torchao" in Layout(dp_shard=2).problem(Shape(), "forward", "fp8-weight-only", "native")
    assert "torchao" in Layout(dp_replicate=2).problem(Shape(), "forward", "fp8-weight-only", "native")
    assert Layout(pp=2).problem(Shape(), "infer", "fp8-weight-only", "native") is None
    assert entry("fp8-weight-only").graph_problem is None
    assert entry("fp8-weight-only").peak_kind("infer") == "bf16"
    for device, capability in (("cpu", None), ("cuda", (8, 0)), ("cuda", (9, 0))):
        assert entry("fp8-weight-only").hardware_problem(device, capability) is None
    assert entry("fp8").hardware_problem("cuda", (8, 0)) is not None

    # fp8's storage, read once in the roofline (an eager step's fp32 and bf16 copies are the forecast's)
    arch, gpu = resolve("7B"), "NVIDIA H200"

    def decode(precision):
        return estimate_step_time(arch, "infer", precision, 1, 128, new_tokens=16, parallelism=Parallelism(),
                                  gpu_name=gpu)

    assert decode("fp8-weight-only").memory_s == pytest.approx(decode("fp8").memory_s)
    assert decode("fp8-weight-only").memory_s < decode("bf16-pure").memory_s


def test_every_quantized_entry_is_served_by_its_librarys_converter():
    """A quantized entry names its library; that library's converter (``fitbench.worker.quantize``) has its
    layer or config, and serves no name the registry lacks."""
    from fitbench.precisions import ENTRIES
    from fitbench.worker.quantize import CONVERTERS, bitsandbytes, torchao

    served = {"bitsandbytes": set(bitsandbytes.LAYERS), "torchao": set(torchao.CONFIGS)}
    assert set(served) == set(CONVERTERS)
    quantized = {name for name, precision in ENTRIES.items() if precision.quantized}
    for name in quantized:
        assert name in served[ENTRIES[name].library], name
    assert set().union(*served.values()) == quantized


def test_int4_weights_with_int8_dynamic_activations_convert_on_a_cpu_as_their_entry_says():
    """int8-dynamic-int4 (torchao's Int8DynamicActivationIntxWeightConfig, int4 weights): converted on a CPU,
    its storage is the entry's, its matmul near bf16's; one token through the largest matrix of tiny writes
    the three dequantized bf16 copies the eager decode format reads back (each written once and read once)
    and holds two at once, the memory planner's term."""
    from fitbench.planning.forecast import decode_format

    arch = resolve("tiny")
    rows, columns = arch.ffn_size, arch.hidden_size
    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(columns, rows, bias=False, dtype=torch.bfloat16))
    model = copy.deepcopy(linear)
    quantize_linears(model, "int8-dynamic-int4", CPU)
    q = model[0].weight
    assert q.qdata.dtype == torch.int8 and int(q.qdata.min()) >= -8 and int(q.qdata.max()) <= 7
    stored = sum(t.untyped_storage().nbytes() for t in (q.qdata, q.scale, q.zero_point))
    assert stored == entry("int8-dynamic-int4").storage.matrix_bytes(rows, columns)
    x = torch.randn(1, columns, dtype=torch.bfloat16)
    with torch.no_grad():
        assert 0 < relative_error(model(x), linear(x)) < 0.15  # 16 levels per group of 32, as nf4's 64
        with CopiesMade() as copies:
            model(x)
    elements = rows * columns
    copied = decode_format("int8-dynamic-int4", "eager", 1).dequantized * elements
    assert copied <= 2 * copies.written < copied + 64 * rows  # and a few tensors of one row: input copies, output
    terms = {term.name: term.bytes for term in estimate_memory(arch, "infer", "int8-dynamic-int4", BATCH, SEQ,
                                                               new_tokens=NEW).terms}
    assert copies.peak == pytest.approx(terms["dequantized weight"], rel=0.02)


def test_int4_weights_with_int8_dynamic_activations_plan_and_refuse_as_torchao_inference_tensors():
    """Planned on an H100 for inference, its 7B weights above int8-dynamic's (int4 held in int8); refused for training and every
    sharding layout (a torchao inference tensor), runnable on any device, decoded in a CUDA graph."""
    from fitbench.planning.sharding import Parallelism
    from fitbench.planning.speed import estimate_step_time
    facts = entry("int8-dynamic-int4")
    assert facts.library == "torchao" and facts.weight_only and facts.peak_kind("infer") == "bf16"
    assert facts.training_problem and "no backward pass" in facts.training_problem
    assert "torchao" in Layout(tp=2).problem(Shape(), "infer", "int8-dynamic-int4", "native")
    assert "torchao" in Layout(dp_replicate=2).problem(Shape(), "forward", "int8-dynamic-int4", "native")
    assert Layout().offload_problem("infer", "int8-dynamic-int4", "native", False)
    assert facts.graph_problem is None and "int8-dynamic-int4" not in DEFAULT_LADDER["infer"]
    for device, capability in (("cpu", None), ("cuda", (8, 0)), ("cuda", (9, 0))):
        assert facts.hardware_problem(device, capability) is None
    arch = resolve("7B")
    weights = {p: {t.name: t.bytes for t in estimate_memory(arch, "infer", p, 1, 512, new_tokens=32).terms}["weights"]
               for p in ("int8-dynamic-int4", "int8-dynamic", "int4", "bf16-pure")}
    # int4 values held in int8, with a scale and a zero point per group of 32: more than int8's per row
    assert weights["int4"] < weights["int8-dynamic"] < weights["int8-dynamic-int4"] < weights["bf16-pure"]
    step = estimate_step_time(arch, "infer", "int8-dynamic-int4", 1, 128, new_tokens=16, parallelism=Parallelism(),
                              gpu_name="NVIDIA H100 80GB HBM3")
    assert step.tokens_per_s > 0
