"""``fitbench run --backend vllm``: what vLLM's engine cannot run refused before anything starts, the
engine's options and GPUs for a configuration, the plan from vLLM's memory model recomputed by hand,
and, in vLLM's environment (``FITBENCH_VLLM_PYTHON``; skipped without it), a sweep of the tiny preset
whose rows are ok, generate the tokens fitbench's own engine generates for the same configuration, and
whose KV blocks are the planner's.

The tolerance on the KV blocks is 0: the sweep gives the KV cache's bytes (``--kv-cache-bytes``, vLLM's
``kv_cache_memory_bytes``), so the blocks follow from a block's bytes alone. The share-of-memory path
(``--gpu-memory-utilization``) subtracts, on a CPU, the engine process's resident memory, which no
planner knows before it runs; it is not checked here."""

import json
import math
import os
import subprocess
import sys
import time

import pytest

from conftest import cli
from fitbench.launch.commands import LocalProcess, worker_command
from fitbench.models.registry import resolve
from fitbench.models.vllm_options import PYTHON_VARIABLE
from fitbench.planning.vllm_memory import profile_activations, rank_weights, vllm_prediction
from fitbench.results.store import ResultStore
from fitbench.spec import Layout, RunSpec
from fitbench.worker.vllm_backend import cpu_binding, engine_gpus, engine_options, tree_memory

needs_vllm = pytest.mark.skipif(not os.environ.get(PYTHON_VARIABLE),
                                reason=f"no vLLM environment: {PYTHON_VARIABLE} names none (.ci/run makes one)")
TINY_RUN = ["run", "--models", "tiny", "--mode", "infer", "--device", "cpu", "--seq-len", "16", "--new-tokens", "8",
            "--warmup-steps", "1", "--measure-steps", "2", "--precision", "fp32"]


def _spec(**fields) -> RunSpec:
    base = dict(model="tiny", backend="vllm", mode="infer", precision="bf16", batch_size=2, seq_len=16, new_tokens=8,
                device="cpu", warmup_steps=1, measure_steps=2)
    return RunSpec(**{**base, **fields})


@pytest.mark.parametrize("options, field, fix", [
    (["--backend", "vllm", "--mode", "train"], "mode:", "--mode infer"),
    (["--backend", "vllm", "--mode", "forward"], "mode:", "--mode infer"),
    (["--backend", "vllm", "--precision", "int8"], "precision:", "nf4"),  # infer, the vllm backend's default mode
    (["--backend", "vllm", "--precision", "int4"], "precision:", "checkpoint quantized with torchao"),
    (["--backend", "vllm", "--batch-size", "auto"], "batch-size:", "--batch-size N"),
    (["--backend", "vllm", "--offload"], "offload:", "Leave --offload out"),
    (["--backend", "vllm", "--gpus", "3", "--strategy", "tp"], "strategy:", "divides 8"),
    (["--backend", "vllm", "--gpus", "2", "--nodes", "2", "--launcher", "slurm"], "nodes:", "Ray"),
    (["--backend", "native", "--kv-cache-bytes", "1000"], "kv_cache_bytes:", "--backend vllm"),
])
def test_what_vllm_cannot_run_is_one_paragraph_naming_the_field_and_the_fix(tmp_path, capsys, options, field, fix):
    argv = ["run", "--models", "tiny", "--device", "cpu", "--out", str(tmp_path / "x"), *options]
    if "native" in options:
        argv += ["--mode", "infer"]  # the vllm backend's default mode; the others' are train and infer
    code, _, error = cli(argv, capsys)
    assert code == 2
    assert field in error and len(error.strip().splitlines()) == 1, error  # one paragraph
    assert fix in error and "Traceback" not in error
    assert not (tmp_path / "x" / "results.jsonl").exists()


def test_no_cuda_graphs_is_vllms_enforce_eager_not_an_inert_option(tmp_path, capsys):
    """On this CPU it is a warning (vLLM runs eagerly here anyway), and the configuration is planned: a batch
    its KV cache cannot hold is refused before launch, so nothing starts."""
    out = tmp_path / "eager"
    code, _, error = cli([*TINY_RUN, "--backend", "vllm", "--no-cuda-graphs", "--batch-size", "2", "--kv-cache-bytes",
                          "1000", "--out", str(out), "--quiet"], capsys)
    assert "--no-cuda-graphs" in error and "applies where the sweep runs on GPUs" in error
    [row] = list(ResultStore(out).typed_rows())
    assert row.status == "refused" and row.spec["cuda_graphs"] is False


def test_the_plan_is_vllms_memory_model_recomputed_by_hand():
    arch = resolve("tiny")
    kv = 3 * 2**20
    spec = _spec(precision="fp32", kv_cache_bytes=kv, batch_size=5)
    prediction = vllm_prediction(arch, spec, 64 * 2**30, "a test's")
    # a CPU block: 128 tokens x layers x (k, v) x kv heads x head_dim x 4 bytes (fp32)
    block = 128 * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 4
    figures = prediction["vllm"]
    assert figures["block_bytes"] == block and figures["blocks"] == kv // block
    assert figures["needed_blocks"] == 5 * math.ceil((16 + 8) / 128)
    assert prediction["fits"] == (kv // block >= 5)
    weights, activations = rank_weights(arch, 1, 1, 4), profile_activations(arch, 1, 4, 8192, 256)
    assert prediction["predicted_peak_bytes"] == weights + activations + kv  # no CUDA context on a CPU
    assert figures["max_concurrency"] == (kv // block) / 1
    # on GPUs without the cache's bytes: vLLM takes its share of each, 16-token blocks, tp 2 halves the kv heads
    gpu = vllm_prediction(arch, _spec(device="cuda:0", layout=Layout(tp=2), gpu_memory_utilization=0.5), 8e9, "x")
    assert gpu["predicted_peak_bytes"] == math.ceil(0.5 * 8e9)
    assert gpu["vllm"]["block_bytes"] == 16 * arch.num_layers * 2 * (arch.num_kv_heads // 2) * arch.head_dim * 2


def test_a_batch_the_kv_cache_cannot_hold_is_refused_before_launch(tmp_path, capsys):
    arch = resolve("tiny")
    block = 128 * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 4
    out = tmp_path / "refused"
    # one block holds one sequence of 24 tokens: a batch of 2 needs two
    code, _, _ = cli([*TINY_RUN, "--backend", "vllm", "--batch-size", "2", "--kv-cache-bytes", str(block),
                      "--out", str(out), "--quiet"], capsys)
    rows = list(ResultStore(out).typed_rows())
    assert [row.status for row in rows] == ["refused"]
    assert "needs 2 KV blocks" in rows[0].error and "hold 1" in rows[0].error and "--batch-size 1" in rows[0].error
    assert rows[0].prediction["vllm"]["blocks"] == 1
    assert not (out / "logs").exists() or not list((out / "logs").iterdir())  # nothing was launched


@pytest.mark.slow
def test_a_python_without_vllm_is_the_rows_error_naming_the_fix(tmp_path, capsys, monkeypatch):
    """The engine's script run by this test's Python, which has no vLLM: the worker records its failure,
    naming the missing module and how to install it, and the sweep goes on."""
    monkeypatch.setenv(PYTHON_VARIABLE, sys.executable)
    out = tmp_path / "novllm"
    code, _, _ = cli([*TINY_RUN, "--backend", "vllm", "--batch-size", "1", "--kv-cache-bytes", str(2**20),
                      "--measure-steps", "1", "--out", str(out), "--quiet"], capsys)
    assert code == 1
    [row] = list(ResultStore(out).typed_rows())
    assert row.status == "error"
    assert "No module named 'vllm'" in row.error and f"name its Python with {PYTHON_VARIABLE}" in row.error
    assert sys.executable in row.error


def test_the_engines_options_and_gpus_follow_the_precision_and_layout(tmp_path, monkeypatch):
    options = engine_options(_spec(precision="fp8", device="cuda:0", layout=Layout(tp=2, pp=2)), tmp_path)
    assert (options["dtype"], options["quantization"]) == ("bfloat16", "fp8")
    assert (options["tensor_parallel_size"], options["pipeline_parallel_size"]) == (2, 2)
    assert options["max_model_len"] == 24 and options["enforce_eager"] is False
    assert engine_options(_spec(device="cuda:0", cuda_graphs=False), tmp_path)["enforce_eager"] is True
    assert engine_options(_spec(), tmp_path)["enforce_eager"] is True  # a CPU: eager
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    replicas = _spec(device="cuda:1", layout=Layout(replicas=2))
    assert [engine_gpus(replicas, r) for r in range(2)] == ["1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert engine_gpus(_spec(device="cuda:0", layout=Layout(tp=2, pp=2)), 0) == "4,5,6,7"
    assert engine_gpus(_spec(device="cpu"), 0) is None
    # on a CPU, an engine's ranks share the CPUs; one rank, or a GPU, binds nothing of fitbench's
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert cpu_binding(_spec(layout=Layout(tp=2, pp=2)), [0, 1, 2, 3, 4, 5, 6, 7, 8]) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3|4,5|6,7"}
    assert cpu_binding(_spec(), [0, 1]) == {} and cpu_binding(_spec(layout=Layout(tp=2)), [0]) == {}
    assert cpu_binding(_spec(device="cuda:0", layout=Layout(tp=2)), [0, 1]) == {}
    # one process starts vLLM's engines, whatever the layout: they start their own ranks
    assert isinstance(worker_command(Layout(tp=2, pp=2), "vllm"), LocalProcess)


def test_an_engines_memory_is_its_process_trees(tmp_path):
    """A process holding 200 MiB that starts a child holding 200 MiB more: their memory together is at
    least the 400 MiB they wrote (each page touched), and nothing once they are gone."""
    hold = "import sys, time; block = bytearray(200 * 2**20); block[::4096] = b'x' * len(block[::4096]); "
    child = hold + "sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)"
    parent = hold + (f"import subprocess; c = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE); "
                     f"c.stdout.readline(); sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)")
    process = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert process.stdout.readline() == b"ready\n"
        assert tree_memory(process.pid) >= 400 * 2**20
    finally:
        os.killpg(process.pid, 9)
        process.wait()
    time.sleep(0.2)
    assert tree_memory(process.pid) == 0


def test_vllms_options_count_in_the_key_of_its_configurations_alone():
    native = dict(backend="native", precision="fp32")
    assert _spec(**native).key == _spec(**native, kv_cache_bytes=10**6, gpu_memory_utilization=0.5).key
    assert _spec().key != _spec(kv_cache_bytes=10**6).key != _spec(gpu_memory_utilization=0.5).key


def _tokens_per_sequence(row) -> float:
    """A native generation's tokens: the prefill's first, then one per decode step timed."""
    samples = row.timing["samples"]
    return 1 + len(samples["token_latency"]) / len(samples["end_to_end"])


@pytest.mark.slow
@needs_vllm
def test_a_vllm_sweep_writes_ok_rows_that_generate_what_the_native_engine_does(tmp_path, capsys):
    arch = resolve("tiny")
    kv = 40 * 2**20
    vllm_out, native_out = tmp_path / "vllm", tmp_path / "native"
    code, _, error = cli([*TINY_RUN, "--backend", "vllm", "--batch-size", "1", "3", "--kv-cache-bytes", str(kv),
                          "--out", str(vllm_out), "--quiet"], capsys)
    assert code == 0, error + "".join(path.read_text()[-3000:] for path in (vllm_out / "logs").glob("*.log"))
    code, _, error = cli([*TINY_RUN, "--backend", "native", "--batch-size", "1", "3", "--out", str(native_out),
                          "--quiet"], capsys)
    assert code == 0, error
    native = {row.spec["batch_size"]: row for row in ResultStore(native_out).typed_rows()}
    rows = list(ResultStore(vllm_out).typed_rows())
    assert sorted(row.spec["batch_size"] for row in rows) == [1, 3]
    block = 128 * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 4  # vLLM's CPU block, fp32
    for row in rows:
        batch = row.spec["batch_size"]
        assert row.status == "ok", row.error
        assert native[batch].status == "ok"
        per_sequence = _tokens_per_sequence(native[batch])
        assert per_sequence == 8
        assert row.vllm["tokens_per_sequence"] == [per_sequence] * batch
        assert row.vllm["generated_tokens"] == batch * per_sequence
        # the KV blocks vLLM reports are the planner's, tolerance 0 blocks
        predicted = row.prediction["vllm"]
        assert row.vllm["num_gpu_blocks"] == predicted["blocks"] == kv // block
        assert row.vllm["kv_cache_tokens"] == predicted["kv_tokens"]
        assert row.vllm["max_concurrency"] == pytest.approx(predicted["max_concurrency"])
        assert row.vllm["kv_cache_size_tokens"] == int(predicted["max_concurrency"] * 24)
        # the figures every backend's row has, recomputed from the samples
        samples = row.timing["samples"]
        assert len(samples["end_to_end"]) == len(samples["time_to_first_token"]) == 2
        for whole, first, step in zip(samples["end_to_end"], samples["time_to_first_token"], samples["token_latency"]):
            assert step == pytest.approx((whole - first) / 7)
        median_step = sorted(samples["token_latency"])[0] / 2 + sorted(samples["token_latency"])[1] / 2
        assert row.throughput["decode_tokens_per_s"] == pytest.approx(batch / median_step)
        assert row.memory["host_peak_rss"] > 0 and row.build_s > 0
        assert row.spec["backend"] == "vllm" and json.loads(json.dumps(row.vllm))["max_model_len"] == 24


@pytest.mark.slow
@needs_vllm
def test_replicas_are_engines_of_their_own_measured_side_by_side(tmp_path, capsys):
    out = tmp_path / "replicas"
    kv = 8 * 2**20
    code, _, error = cli([*TINY_RUN, "--backend", "vllm", "--batch-size", "2", "--kv-cache-bytes", str(kv),
                          "--gpus", "2", "--strategy", "replicas", "--out", str(out), "--quiet"], capsys)
    assert code == 0, error + "".join(path.read_text()[-3000:] for path in (out / "logs").glob("*.log"))
    [row] = list(ResultStore(out).typed_rows())
    assert row.status == "ok", row.error
    engines = row.vllm["engines"]
    assert len(engines) == 2 and row.vllm["generated_tokens"] == 2 * 2 * 8
    assert [replica["data_seed"] for replica in row.parallel["replicas"]] == [0, 1]
    assert all(replica["peak_memory_bytes"] > 0 for replica in row.parallel["replicas"])
    per_rank = row.throughput["decode_tokens_per_s_per_rank"]
    assert row.throughput["decode_tokens_per_s"] == pytest.approx(sum(per_rank))
    assert len(row.timing["samples"]["token_latency"]) == 2 * 2  # each engine's two rounds, concatenated


@pytest.mark.slow
@needs_vllm
def test_tensor_parallel_ranks_hold_the_kv_heads_the_planner_splits(tmp_path, capsys):
    """Two tensor-parallel ranks of vLLM's CPU engine: each holds half of tiny's kv heads, so the same
    bytes of KV cache per rank hold twice the blocks of one rank's, as the planner predicts
    (tolerance 0 blocks)."""
    arch = resolve("tiny")
    out, kv = tmp_path / "tp", 40 * 2**20
    code, _, error = cli([*TINY_RUN, "--backend", "vllm", "--batch-size", "2", "--kv-cache-bytes", str(kv),
                          "--gpus", "2", "--strategy", "tp", "--out", str(out), "--quiet"], capsys)
    assert code == 0, error + "".join(path.read_text()[-3000:] for path in (out / "logs").glob("*.log"))
    [row] = list(ResultStore(out).typed_rows())
    assert row.status == "ok", row.error
    block = 128 * arch.num_layers * 2 * (arch.num_kv_heads // 2) * arch.head_dim * 4
    assert row.vllm["num_gpu_blocks"] == row.prediction["vllm"]["blocks"] == kv // block
    assert row.vllm["tokens_per_sequence"] == [8, 8]
