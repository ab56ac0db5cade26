"""Training with quantized weights: adapters on a frozen int8 / 4-bit base (``fitbench.worker.adapters``),
float8 training's refusal off a GPU, what the memory model and the planner say of both, and the
refusal of torchao inference tensors in training."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from fitbench.config import SweepConfig, expand, fallback_ladder
from fitbench.launch.fallback import FallbackPolicy, next_attempt
from fitbench.models.registry import resolve
from fitbench.planning.memory import estimate_memory
from fitbench.planning.memory_constants import INT8_OUTLIER_COLUMNS
from fitbench.planning.weights import adapter_params
from fitbench.planning.planner import Candidate, GpuTarget, assess
from fitbench.precisions import ADAPTER_RANK
from fitbench.worker import worker
from fitbench.worker.adapters import LowRankAdapted, add_adapters
from fitbench.worker.loops import random_tokens
from fitbench.worker.quantize import build_quantized_native
from fitbench.spec import Layout, RunSpec
from fitbench.util.errors import UserError
from test_quantize import run_worker

CPU = torch.device("cpu")
ADAPTER_BASES = ("int8", "nf4", "fp4")
H100 = "NVIDIA H100 80GB HBM3"


def spec(**fields) -> RunSpec:
    values = dict(model="tiny", backend="native", mode="train", precision="nf4", batch_size=2, seq_len=16,
                  new_tokens=4, device="cpu", warmup_steps=1, measure_steps=2)
    return RunSpec(**{**values, **fields})


def hand_adapter_params(arch) -> int:
    """r x (in + out) for q, k, v, o, gate, up, down in every layer, written out."""
    h, f = arch.hidden_size, arch.ffn_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h)
    return ADAPTER_RANK * per_layer * arch.num_layers


def quantized_tiny(precision: str):
    """tiny quantized from weights of one seed, whatever ran before in this process."""
    torch.manual_seed(0)
    arch = resolve("tiny")
    probe = random_tokens(arch.vocab_size, 1, 8, CPU, 1)
    model, _ = build_quantized_native(arch, CPU, precision, probe)
    return arch, model


@pytest.mark.parametrize("precision", ADAPTER_BASES)
def test_adapters_train_only_themselves_and_start_as_the_base(precision):
    arch, model = quantized_tiny(precision)
    tokens = random_tokens(arch.vocab_size, 2, 17, CPU, 0)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        before = model(inputs).float()
    frozen = {name: p.detach().clone() for name, p in model.named_parameters()}

    trainable = add_adapters(model, CPU)
    assert trainable == adapter_params(arch) == hand_adapter_params(arch)
    adapted = [m for m in model.modules() if isinstance(m, LowRankAdapted)]
    assert len(adapted) == 7 * arch.num_layers
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable
    with torch.no_grad():
        assert torch.equal(model(inputs).float(), before)  # up starts at zero

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        for module in adapted:
            assert module.up.grad is not None and module.down.grad is not None
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]  # the same batch three times: the adapters fit it
    # The base, embeddings, norms and output projection did not move; a wrapped matmul's own
    # parameters sit one level down, under ``base``.
    after = dict(model.named_parameters())
    for name, value in frozen.items():
        assert torch.equal(after[re.sub(r"(layers\.\d+\.\w+\.\w+_proj)\.", r"\1.base.", name)].detach(), value), name
    assert any(not torch.equal(m.up.detach(), torch.zeros_like(m.up)) for m in adapted)


@pytest.mark.parametrize("precision", ["int8", "nf4"])
def test_worker_trains_adapters_and_says_so(precision, tmp_path):
    arch = resolve("tiny")
    code, row = run_worker(spec(precision=precision), tmp_path)
    assert (code, row["status"]) == (0, "ok"), row.get("error")
    assert row["training"]["trainable_params"] == hand_adapter_params(arch)
    assert "adapters" in row["training"]["method"] and precision in row["training"]["method"]
    # FLOPs per token: 6 N + 12 L H Q T less the base's weight gradients (2 N), plus 6 x the adapters.
    N, L, H, Q = arch.matmul_params, arch.num_layers, arch.num_heads, arch.head_dim
    assert row["throughput"]["flops_per_token"] == 4 * N + 12 * L * H * Q * 16 + 6 * hand_adapter_params(arch)
    # the base is quantized, its error measured as in infer; the loss of every measured step is kept
    assert row["quality"]["matmul_error"]["mean"] > 0 and row["quality"]["kl_divergence"] > 0
    assert len(row["loss"]) == spec(precision=precision).measure_steps
    assert all(math.isfinite(loss) for loss in row["loss"])


def test_adapter_training_memory_terms_by_hand():
    arch = resolve("7B")
    A = hand_adapter_params(arch)
    memory = estimate_memory(arch, "train", "nf4", 4, 512)
    terms = {t.name: t.bytes for t in memory.terms}
    assert terms["adapters"] == 4 * A
    assert terms["gradients"] == 4 * A
    assert terms["optimizer state"] == 8 * A
    # Frozen embeddings: no embedding gradient at the end of the backward pass; no autocast copies.
    assert "input embedding gradient" not in terms and "autocast weight copies" not in terms
    # Activations are saved as in bf16-pure training (the native norms keep their input and 1/rms
    # whether their weights train or not), with the adapters' r-wide intermediates.
    n, L = 4 * 512, arch.num_layers
    bf16 = {t.name: t.bytes for t in estimate_memory(arch, "train", "bf16-pure", 4, 512).terms}
    assert terms["activations"] == bf16["activations"]
    assert terms["final norm and output input"] == bf16["final norm and output input"]
    hf = {t.name: t.bytes for t in estimate_memory(arch, "train", "nf4", 4, 512, backend="hf").terms}
    hf_bf16 = {t.name: t.bytes for t in estimate_memory(arch, "train", "bf16-pure", 4, 512, backend="hf").terms}
    # transformers' norms: less their normalized outputs (2 B x n h each), which only their weights' gradients need
    h = arch.hidden_size
    assert hf["activations"] == hf_bf16["activations"] - L * 2 * (2 * n * h)
    assert terms["adapter activations"] == 2 * n * ADAPTER_RANK * 7 * L
    assert "LLM.int8 outlier columns" not in terms
    assert terms["dequantized weight in backward"] == 2 * arch.hidden_size * arch.ffn_size
    # Far below full training: the 7B base in 4 bits instead of 16 B per parameter.
    assert memory.peak_bytes < 0.4 * estimate_memory(arch, "train", "bf16", 4, 512).peak_bytes
    assert estimate_memory(arch, "forward-backward", "nf4", 4, 512).peak_bytes < memory.peak_bytes


def test_int8_adapters_keep_outlier_columns():
    arch = resolve("7B")
    n, h, f, L = 4 * 512, arch.hidden_size, arch.ffn_size, arch.num_layers
    int8 = {t.name: t.bytes for t in estimate_memory(arch, "train", "int8", 4, 512).terms}
    # fp16 outlier columns of each matmul's input: six read h columns, the down projection f.
    assert int8["LLM.int8 outlier columns"] == pytest.approx(2 * n * INT8_OUTLIER_COLUMNS * (6 * h + f) * L)
    recompute = {t.name: t.bytes for t in estimate_memory(arch, "train", "int8", 4, 512,
                                                          activation_checkpointing=True).terms}
    assert recompute["LLM.int8 outlier columns"] == 0 == recompute["adapter activations"]


def test_float8_training_memory_is_bf16_pure_with_its_casts():
    arch = resolve("7B")
    fp8 = {t.name: t.bytes for t in estimate_memory(arch, "train", "fp8", 4, 512).terms}
    pure = {t.name: t.bytes for t in estimate_memory(arch, "train", "bf16-pure", 4, 512).terms}
    h, f, n = arch.hidden_size, arch.ffn_size, 4 * 512
    assert fp8.pop("float8 casts") == 2 * h * f + 2 * n * f
    assert fp8 == pure


@pytest.mark.parametrize("precision", ["int8-dynamic", "int4", "fp8-block"])
def test_torchao_inference_tensors_are_refused_for_training(precision):
    with pytest.raises(UserError, match="no backward pass") as error:
        expand(SweepConfig(models=["tiny"], mode=["train"], precision=[precision]), device="cpu",
               default_models=["tiny"])
    assert str(error.value).startswith("precision:") and "nf4" in str(error.value)
    candidate = Candidate(precision, Layout(), False, 1)
    assessed = assess(resolve("7B"), "train", candidate, GpuTarget(H100, 1, 80e9, described=True), seq_len=512,
                      new_tokens=1)
    assert not assessed.fits and "no backward pass" in assessed.reason


@pytest.mark.parametrize("precision", ["nf4", "int8", "fp8"])
def test_quantized_training_is_planned(precision):
    # Llama-2-70B does not train in bf16 or fp8 (bf16 weights) on one 80 GB GPU; adapters on an 8-bit
    # or 4-bit base do (QLoRA's claim, Dettmers et al. 2023: 65B on one 48 GB GPU in 4 bits).
    target = GpuTarget(H100, 1, 80e9, described=True)
    arch = resolve("llama-2-70b")
    assessed = assess(arch, "train", Candidate(precision, Layout(), True, 1), target, seq_len=512, new_tokens=1)
    assert assessed.reason is None or "needs" in assessed.reason
    assert assessed.fits == (precision != "fp8")
    assert not assess(arch, "train", Candidate("bf16", Layout(), True, 1), target, seq_len=512, new_tokens=1).fits


def test_training_fallback_never_lands_on_adapters():
    # Adapters train another workload; a full-training ladder that names nf4 skips it.
    assert fallback_ladder(SweepConfig(fallback=["bf16", "nf4", "fp8"]), "train") == ["bf16", "fp8"]
    following, change = next_attempt(spec(precision="bf16", batch_size=1), FallbackPolicy(("bf16", "nf4", "fp8")))
    assert (following.precision, change) == ("fp8", "precision bf16 -> fp8")
    # Asked for directly, adapters on a 4-bit base train.
    (only,) = expand(SweepConfig(models=["tiny"], mode=["train"], precision=["nf4"]), device="cpu",
                     default_models=["tiny"])
    assert only.precision == "nf4"


def test_float8_training_is_refused_on_a_cpu(tmp_path):
    code, row = run_worker(spec(precision="fp8"), tmp_path)
    assert (code, row["status"]) == (worker.EXIT_FAILED, "refused")
    assert "8.9" in row["error"] and "CPU" in row["error"]


def test_adapter_training_roofline_counts_no_weight_gradients():
    from fitbench.planning.sharding import Parallelism
    from fitbench.planning.speed import estimate_step_time

    arch = resolve("7B")

    def compute_s(precision: str) -> float:
        return estimate_step_time(arch, "train", precision, 4, 512, new_tokens=1, parallelism=Parallelism(),
                                  gpu_name=H100).compute_s

    # Same peak (bf16 tensor cores): the ratio is the FLOPs per token, 4N + 12LHQT + 6A over 6N + 12LHQT.
    assert compute_s("nf4") / compute_s("bf16-pure") == pytest.approx(
        arch.adapter_train_flops_per_token(512, adapter_params(arch)) / arch.train_flops_per_token(512), rel=1e-12)
