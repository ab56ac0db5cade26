"""Rows whose numbers cannot be kept (``fitbench.worker.sanity``): real checkpoints full of NaN or of
zeros run through the worker, the loss of every measured training step, and the warning of a run
without warm-up."""

import json
import math
from pathlib import Path

import pytest

from fitbench.models.registry import resolve
from fitbench.worker import worker
from fitbench.worker.sanity import non_finite_figures, non_finite_steps
from fitbench.spec import Assignment, RunSpec

SHAPES = dict(batch_size=1, seq_len=16, new_tokens=4, device="cpu", warmup_steps=1, measure_steps=2)


@pytest.fixture(autouse=True)
def no_injection(monkeypatch):
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)


def run_worker(tmp_path: Path, **fields) -> tuple[int, dict]:
    """``python -m fitbench.worker.worker SPEC RESULT`` in this process: exit code and result."""
    spec = RunSpec(**{"model": "tiny", "backend": "native", "precision": "fp32", **SHAPES, **fields})
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(Assignment(spec=spec).model_dump_json())
    code = worker.main([str(spec_path), str(result_path)])
    return code, json.loads(result_path.read_text())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_checkpoint) -> dict[str, str]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {"nan": str(tiny_checkpoint(root / "nan", fill=math.nan)),
            "zeros": str(tiny_checkpoint(root / "zeros", fill=0.0))}


@pytest.mark.parametrize("mode, precision, reason", [
    ("train", "fp32", "loss not finite in 2 of 2 measured steps"),
    ("forward-backward", "bf16", "loss not finite in 2 of 2 measured steps"),
    ("forward", "bf16-pure", "logits not finite in 2 of 2 measured steps"),
    ("infer", "bf16-pure", "prefill logits not finite in 2 of 2 measured steps"),
    ("infer", "int8", "quality figure not finite: matmul_error.mean = nan"),
])
def test_a_nan_checkpoint_is_invalid(mode, precision, reason, checkpoints, tmp_path):
    code, row = run_worker(tmp_path, model=checkpoints["nan"], mode=mode, precision=precision)
    assert row["status"] == "invalid", row.get("error")
    assert code == worker.EXIT_FAILED
    assert reason in row["error"]
    assert row["weights"]["source"] == f"checkpoint {Path(checkpoints['nan']).resolve()}"
    assert row["timing"]  # what was measured stays in the row
    if mode in ("train", "forward-backward"):
        assert len(row["loss"]) == 2 and all(math.isnan(loss) for loss in row["loss"])
    if mode == "infer":
        assert "last decode step's logits not finite in 2 of 2 measured steps" in row["error"]
    if precision == "int8":
        for figure in ("matmul_error.worst", "kl_divergence", "perplexity.bf16", "perplexity.quantized"):
            assert f"quality figure not finite: {figure} = nan" in row["error"]


def test_a_zero_checkpoint_trains_to_the_uniform_loss(checkpoints, tmp_path):
    """All-zero weights give zero logits: every next token at 1/V, a loss of ln V, finite, and zero
    gradients, so AdamW leaves the weights at zero and every step's loss is ln V: a valid row."""
    code, row = run_worker(tmp_path, model=checkpoints["zeros"], mode="train", precision="fp32")
    assert row["status"] == "ok", row.get("error")
    vocab = resolve(checkpoints["zeros"]).vocab_size
    assert row["loss"] == [pytest.approx(math.log(vocab), rel=1e-6)] * 2


def test_a_zero_checkpoint_quantized_is_invalid(checkpoints, tmp_path):
    """Zero weights quantize to zero weights: every matmul's bf16 output is zero, so its relative
    error is 0 / 0; the logits agree (all zero, perplexity exactly V) but the figure is undefined."""
    code, row = run_worker(tmp_path, model=checkpoints["zeros"], mode="infer", precision="nf4")
    assert row["status"] == "invalid"
    assert "quality figure not finite: matmul_error.mean = nan" in row["error"]
    assert "logits" not in row["error"]
    quality = row["quality"]
    vocab = resolve(checkpoints["zeros"]).vocab_size
    assert quality["top1_agreement"] == 1.0 and quality["kl_divergence"] == 0.0
    assert quality["perplexity"]["bf16"] == pytest.approx(vocab, rel=1e-5)
    assert quality["perplexity"]["quantized"] == pytest.approx(vocab, rel=1e-5)


def test_training_rows_keep_each_measured_loss(tmp_path):
    code, row = run_worker(tmp_path, mode="train", measure_steps=3)
    assert (code, row["status"]) == (worker.EXIT_OK, "ok"), row.get("error")
    assert len(row["loss"]) == 3 and all(math.isfinite(loss) for loss in row["loss"])
    # random weights with std 0.02 predict almost uniformly: near ln V
    assert row["loss"][0] == pytest.approx(math.log(resolve("tiny").vocab_size), rel=0.05)
    code, row = run_worker(tmp_path, mode="forward")
    assert row["status"] == "ok" and "loss" not in row


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_no_warmup_warns(mode, tmp_path):
    code, row = run_worker(tmp_path, mode=mode, warmup_steps=0)
    assert row["status"] == "ok", row.get("error")
    assert any(warning.startswith("--warmup-steps 0: the first measured step includes one-time costs")
               for warning in row["warnings"])
    code, row = run_worker(tmp_path, mode=mode, warmup_steps=1)
    assert not any("--warmup-steps 0" in warning for warning in row["warnings"])


def test_non_finite_helpers():
    assert non_finite_steps("loss", [1.0, 2.0]) == []
    assert non_finite_steps("loss", [1.0, math.nan, math.inf]) == [
        "loss not finite in 2 of 3 measured steps: 2 (nan), 3 (inf)"]
    figures = {"a": 1.0, "b": {"c": math.nan, "d": None, "e": "text"}, "f": -math.inf, "g": 3}
    assert non_finite_figures(figures) == ["b.c = nan", "f = -inf"]
