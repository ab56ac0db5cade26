"""Data parallelism inside a rank: torchrun's environment, the process group, DDP and FSDP2.

The slow tests start real torchrun jobs of two CPU ranks over gloo (tests/data_parallel_job.py)
and compare their losses with one process training on the same global batch.
"""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import data_parallel_job as job
from fitbench.models.backends import load_model
from fitbench.models.registry import resolve
from conftest import Shape
from fitbench.precisions import PRECISIONS, policy
from fitbench.worker.loops import make_step, random_tokens
from fitbench.worker.parallel import data_seed, mixed_precision
from fitbench.worker.ranks import Rank, RankEnvironmentError, gather_json, process_group
from fitbench.worker.build import RefusedError, build
from fitbench.spec import Assignment, Layout, RunSpec

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
MARK = "FITBENCH_TEST_MARK"
slow = pytest.mark.slow

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}


# ---- torchrun's environment -------------------------------------------------------------------------

def test_a_process_without_torchrun_is_a_job_of_one_on_its_own_device():
    rank = Rank.from_environment("cuda:2", environ={})
    assert (rank.rank, rank.local_rank, rank.world_size, rank.launched) == (0, 0, 1, False)
    assert rank.device == torch.device("cuda", 2) and rank.main


def test_a_torchrun_rank_drives_the_gpu_of_its_local_rank_not_its_rank():
    rank = Rank.from_environment("cuda:0", environ=TORCHRUN)
    assert (rank.rank, rank.local_rank, rank.world_size, rank.local_world_size) == (3, 1, 4, 2)
    assert rank.device == torch.device("cuda", 1) and rank.launched and not rank.main
    assert Rank.from_environment("cpu", environ=TORCHRUN).device == torch.device("cpu")


@pytest.mark.parametrize("change, named", [
    ({"LOCAL_WORLD_SIZE": None}, "LOCAL_WORLD_SIZE"),
    ({"RANK": "three"}, "RANK='three'"),
    ({"RANK": "4"}, "RANK 4"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK 2"),
    ({"LOCAL_WORLD_SIZE": "5"}, "LOCAL_WORLD_SIZE (5) exceeds"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE (0)"),
])
def test_a_broken_torchrun_environment_names_the_variable(change, named):
    environ = {name: value for name, value in {**TORCHRUN, **change}.items() if value is not None}
    with pytest.raises(RankEnvironmentError, match=named.replace("(", r"\(").replace(")", r"\)")):
        Rank.from_environment("cuda", environ=environ)


def test_a_job_of_one_without_torchrun_gathers_its_own_row_with_no_process_group():
    rank = Rank.from_environment("cpu", environ={})
    with process_group(rank, timedelta(seconds=5)):
        assert not dist.is_initialized()
        assert gather_json(rank, {"tokens_per_s": 1.5}) == [{"tokens_per_s": 1.5}]
        with pytest.raises(TypeError):
            gather_json(rank, {"step": torch.tensor(1.0)})  # not JSON: fails where it was made


def test_the_process_group_is_destroyed_however_the_block_ends(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    rank = Rank.from_environment("cpu")
    with pytest.raises(RuntimeError, match="inside the job"), process_group(rank, timedelta(seconds=5)):
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert gather_json(rank, {"rank": rank.rank}) == [{"rank": 0}]
        raise RuntimeError("inside the job")
    assert not dist.is_initialized()


# ---- what composes ----------------------------------------------------------------------------------

def data_parallel_problem(strategy: str, precision: str, mode: str, backend: str = "native",
                          offload: bool = False) -> str | None:
    """What ``Layout`` says of ``strategy`` over two ranks."""
    return Layout.of_strategy(strategy, WORLD).problem(Shape(), mode, precision, backend, offload)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16", "bf16-pure"])
@pytest.mark.parametrize("mode", ["train", "forward-backward", "forward"])
def test_float_precisions_compose_with_both_strategies(strategy, precision, mode):
    assert data_parallel_problem(strategy, precision, mode) is None


@pytest.mark.parametrize("strategy, precision, mode, offload", [
    ("ddp", "fp8", "train", False), ("fsdp", "fp8", "train", False),  # float8 training: plain bf16 weights
    ("ddp", "nf4", "train", False), ("ddp", "int8", "forward-backward", False),  # adapters on a replicated base
    ("fsdp", "bf16", "train", True), ("fsdp", "fp32", "forward", True),
])
def test_fp8_training_adapters_under_ddp_and_fsdp_offload_compose(strategy, precision, mode, offload):
    assert data_parallel_problem(strategy, precision, mode, offload=offload) is None


@pytest.mark.parametrize("strategy, precision, mode, backend, offload, says", [
    ("fsdp", "nf4", "train", "native", False, "--strategy ddp"),
    ("fsdp", "int8", "forward", "native", False, "scales"),
    ("ddp", "int8-dynamic", "forward", "native", False, "broadcast"),
    ("fsdp", "int4", "forward", "native", False, "shard"),
    ("fsdp", "fp8", "forward", "native", False, "torchao"),
    ("ddp", "fp8-block", "forward", "native", False, "one GPU"),
    ("ddp", "bf16", "infer", "native", False, "independent copies"),
    ("fsdp", "bf16", "infer", "native", False, "--offload"),
    ("ddp", "bf16", "train", "hf", False, "--backend native"),
    ("ddp", "bf16", "train", "native", True, "--strategy fsdp --offload"),
])
def test_what_does_not_compose_says_why_in_one_sentence(strategy, precision, mode, backend, offload, says):
    problem = data_parallel_problem(strategy, precision, mode, backend, offload)
    assert problem and says in problem
    assert problem.count(". ") == 0 and not problem.endswith(".")  # one sentence, the caller ends it


def test_every_precision_has_an_answer():
    for precision in PRECISIONS:
        for mode in ("train", "forward"):
            for strategy in ("ddp", "fsdp"):
                data_parallel_problem(strategy, precision, mode)


def test_fsdp_gathers_16_bit_weights_and_reduces_in_fp32_only_under_autocast():
    assert (mixed_precision(policy("bf16")).param_dtype, mixed_precision(policy("bf16")).reduce_dtype) == \
        (torch.bfloat16, torch.float32)
    assert mixed_precision(policy("fp16")).param_dtype == torch.float16
    for name in ("fp32", "tf32", "bf16-pure", "fp8"):
        assert (mixed_precision(policy(name)).param_dtype, mixed_precision(policy(name)).reduce_dtype) == (None, None)


def test_the_worker_refuses_a_layout_that_does_not_compose_before_it_builds(tmp_path):
    spec = RunSpec(model="tiny", backend="native", mode="infer", precision="fp32", batch_size=1, seq_len=8,
                   new_tokens=1, device="cpu", warmup_steps=0, measure_steps=1, layout=Layout(dp_replicate=WORLD))
    with pytest.raises(RefusedError, match="ddp x 2: generation has no gradients"):
        build(Assignment(spec=spec), resolve("tiny"), policy("fp32"), torch.device("cpu"), tmp_path)
    assert not any(tmp_path.iterdir())


def test_rank_0_draws_the_single_process_batch_and_each_rank_its_own():
    assert data_seed(7, 0) == 7
    assert len({data_seed(7, rank) for rank in range(8)}) == 8


# ---- real jobs ----------------------------------------------------------------------------------------

def torchrun(tmp_path: Path, *args: str, timeout: float = 300, script: Path = Path(job.__file__),
             world: int = WORLD) -> tuple[subprocess.CompletedProcess, Path]:
    """``script`` (tests/data_parallel_job.py) as a torchrun job of ``world`` CPU ranks; its result and log directory.
    Every process of the job carries a mark, and none may be alive once torchrun has returned."""
    logs, mark = tmp_path / "logs", uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           MARK: mark}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               "--log-dir", str(logs), str(script), *args]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert not marked(mark), "a rank outlived its job"
    return subprocess.CompletedProcess(command, process.returncode, output), logs



def rows_of_job(module, tmp_path: Path) -> list[dict]:
    """The rows a job ``module`` (a tests/*_job.py script with its ``LAYOUT``) writes to out.json, one per
    rank in rank order, from one torchrun job of its world size; that the job ended well is asserted."""
    done, _ = torchrun(tmp_path, str(tmp_path / "out.json"), script=Path(module.__file__),
                       world=module.LAYOUT.world_size, timeout=300)
    assert done.returncode == 0 and (tmp_path / "out.json").exists(), done.stdout[-3000:]
    rows = json.loads((tmp_path / "out.json").read_text())
    assert [row["rank"] for row in rows] == list(range(module.LAYOUT.world_size))
    return rows

def marked(mark: str) -> list[int]:
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            continue
    return found


FAIL_RANK = 1


@pytest.fixture(scope="module")
def job_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    """One job: every configuration trained, then rank FAIL_RANK raising in one more; torchrun's
    outcome, the losses and the log directory."""
    tmp_path = tmp_path_factory.mktemp("data-parallel")
    done, logs = torchrun(tmp_path, str(tmp_path / "losses.json"), str(FAIL_RANK), timeout=300)
    assert (tmp_path / "losses.json").exists(), done.stdout[-3000:]
    return done, json.loads((tmp_path / "losses.json").read_text()), logs


@pytest.fixture(scope="module")
def trained(job_run) -> dict:
    return job_run[1]


@pytest.fixture(scope="module")
def single_process_losses() -> list[float]:
    """The job's model trained in one process on its global batch: every rank's batch, in rank order."""
    arch, precision, device = resolve("tiny"), policy(job.PRECISION), torch.device("cpu")
    torch.manual_seed(job.SEED)
    lm = load_model(arch, "native", device, precision.weight_dtype)
    tokens = torch.cat([random_tokens(arch.vocab_size, job.BATCH, job.SEQ_LEN + 1, device, data_seed(job.SEED, rank))
                        for rank in range(WORLD)])  # (WORLD B, T + 1)
    step = make_step("train", lm, precision, tokens, device)
    return [step().item() for _ in range(job.STEPS)]


# Both sides average the same N = WORLD x BATCH x SEQ_LEN token losses in fp32, in another order (one
# mean of N, or the mean of WORLD means of N / WORLD). Recursive summation of n terms errs by at most
# (n - 1) u sum |x_i|, u = 2^-24 (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed.,
# eq. 4.4), and the token losses are positive, so the two means differ by at most 2 (N - 1) u L. The
# weights of later steps differ by gradients summed in another order, a relative (N - 1) u, but AdamW's
# first steps move each weight by about lr * sign(g), which that changes only where g is as small as
# its own rounding error: far below the bound (measured: 5e-7 against 1.3e-4). Each rank stepping on
# its own gradient instead of the average moves step 2's loss by about 1e-2.
TOKENS = WORLD * job.BATCH * job.SEQ_LEN
TOLERANCE = 2 * (TOKENS - 1) * 2.0 ** -24


@slow
@pytest.mark.parametrize("configuration", [name for name, _, _ in job.CONFIGURATIONS])
def test_data_parallel_losses_equal_one_process_on_the_global_batch(trained, single_process_losses, configuration):
    reference = single_process_losses
    assert reference[0] - reference[-1] > 100 * TOLERANCE * reference[0]  # the steps did move the weights
    ranks = trained[configuration]
    assert [row["rank"] for row in ranks] == list(range(WORLD))
    for step, expected in enumerate(reference):
        mean = sum(row["losses"][step] for row in ranks) / WORLD  # every rank holds as many tokens
        assert math.isclose(mean, expected, rel_tol=TOLERANCE), (configuration, step, mean, expected)


@slow
def test_each_rank_reports_what_was_applied(trained):
    for name, strategy, options in job.CONFIGURATIONS:
        for row in trained[name]:
            applied = row["applied"]
            assert (applied["strategy"], applied["world_size"]) == (strategy, WORLD)
            assert applied["activation_checkpointing"] == options.get("activation_checkpointing", False)
            assert applied["checkpointed_layers"] == options.get("checkpointed_layers")
            if strategy == "fsdp":
                assert applied["fsdp_units"] == resolve("tiny").num_layers + 1
                assert applied["offload"] == options.get("offload", False)
                assert applied["param_dtype"] is None  # fp32: nothing to cast


@slow
def test_a_rank_that_raises_ends_the_job_and_its_error_file_names_it(job_run):
    done, _, logs = job_run
    assert done.returncode != 0
    errors = {int(path.parent.name): json.loads(path.read_text())["message"]  # by local rank
              for path in logs.glob("*/attempt_0/*/error.json")}
    failed = f"injected failure in rank {FAIL_RANK} at step 2"
    assert failed in errors[FAIL_RANK]["message"], done.stdout[-3000:]
    # the other rank waited in the step's gradient all-reduce: gloo saw its peer go (or torchrun
    # stopped it) well before the process group's timeout
    other = 1 - FAIL_RANK
    if other in errors:
        assert "injected" not in errors[other]["message"]
        waited = int(errors[other]["extraInfo"]["timestamp"]) - int(errors[FAIL_RANK]["extraInfo"]["timestamp"])
        assert waited < job.TIMEOUT.total_seconds(), errors[other]["message"]


@slow
def test_fsdp_cpu_offload_from_the_command_line_trains_as_fsdp_does(trained, tmp_path, capsys, monkeypatch):
    """`fitbench run --gpus 2 --strategy fsdp --offload`: the row says the shards lived in host memory, and
    on CPU ranks, where the offload moves nothing, rank 0's losses are those of FSDP without it over the
    same steps: the job's own ``fsdp`` configuration, of the same seed, batch, shape and precision."""
    from conftest import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    code, out, err = cli(["run", "--models", "tiny", "--device", "cpu", "--gpus", str(WORLD), "--strategy", "fsdp",
                          "--mode", "train", "--offload", "--precision", job.PRECISION, "--batch-size", str(job.BATCH),
                          "--seq-len", str(job.SEQ_LEN), "--seed", str(job.SEED), "--warmup-steps", "1",
                          "--measure-steps", str(job.STEPS - 1), "--out", "r"], capsys)
    assert code == 0, out + err
    [row] = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert row["status"] == "ok" and row["spec"]["offload"] and row["parallel"]["offload"]
    assert row["parallel"]["strategy"] == "fsdp" and "offload fsdp x 2" in row["label"]
    measured = trained["fsdp"][0]["losses"][1:]  # the first step is the row's warm-up
    assert len(row["loss"]) == len(measured)
    for loss, expected in zip(row["loss"], measured):
        assert math.isclose(loss, expected, rel_tol=TOLERANCE), (row["loss"], measured)
