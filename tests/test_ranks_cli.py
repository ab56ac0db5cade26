"""``fitbench run --gpus N``: each configuration as one torchrun job of N gloo ranks on the CPU.

One row per job from every rank (``fitbench.worker.aggregate``); a rank that fails alone names itself in
the row; a rank that hangs is named in the row of the timeout it causes; nothing the job started
outlives it.
"""

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import cli
from fitbench.config import SweepConfig, expand
from fitbench.worker.aggregate import combine
from fitbench.spec import Layout, LayoutError, RunSpec, pipeline_stages
from fitbench.util.errors import UserError

MARK = "FITBENCH_TEST_MARK"
SHAPE = ["--models", "tiny", "--device", "cpu", "--gpus", "2", "--mode", "train", "--batch-size", "2",
         "--seq-len", "16", "--warmup-steps", "1", "--measure-steps", "2"]


def marked(mark: str) -> set[int]:
    """Living processes that carry ``mark``, this one excluded."""
    needle = f"{MARK}={mark}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.add(int(entry))
        except OSError:
            continue
    return found


@dataclass
class Job:
    """``fitbench run`` of one torchrun job, and what was left of it the moment it exited."""

    out: Path
    returncode: int | None = None
    stderr: str = ""
    left: set[int] = field(default_factory=set)  # living processes with its mark
    scratch: list[Path] = field(default_factory=list)  # scratch directories in its TMPDIR

    @property
    def rows(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / "results.jsonl").read_text().splitlines()]


# name -> (options, FITBENCH_INJECT)
JOBS = {
    "ddp": (["--strategy", "ddp"], None),
    "fsdp": (["--strategy", "fsdp"], None),
    "failed": (["--strategy", "ddp", "--no-fallback"], "rank-error:1"),
    "hung": (["--strategy", "ddp", "--timeout", "60"], "rank-hang:0,collective-timeout:8"),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Job]:
    """Every job of JOBS as a real ``fitbench run`` process, started at once (they share the cores, and
    the hanging one's wait for its timeout costs no time of its own), each with its own mark in the
    environment of every process it starts and its own TMPDIR, looked at the moment it exits."""
    root = str(Path(__file__).resolve().parents[1])
    started = {}
    try:
        for name, (options, inject) in JOBS.items():
            directory, mark = tmp_path_factory.mktemp(name), uuid.uuid4().hex
            (directory / "tmp").mkdir()
            env = {key: value for key, value in os.environ.items() if key != "FITBENCH_INJECT"}
            env.update({MARK: mark, "TMPDIR": str(directory / "tmp"),
                        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
                        **({"FITBENCH_INJECT": inject} if inject else {})})
            with (directory / "stderr").open("w") as stderr:
                process = subprocess.Popen([sys.executable, "-m", "fitbench", "run", *SHAPE, *options, "--out", "out"],
                                           cwd=directory, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
            started[name] = process, mark, Job(directory / "out")
        deadline = time.monotonic() + 300  # then what still runs is killed, and its test fails
        running = dict(started)
        while running and time.monotonic() < deadline:
            for name, (process, mark, job) in list(running.items()):
                if process.poll() is not None:
                    job.left, job.scratch = marked(mark), list((job.out.parent / "tmp").glob("fitbench-*"))
                    job.returncode, job.stderr = process.returncode, (job.out.parent / "stderr").read_text()
                    del running[name]
            time.sleep(0.05)
    finally:
        for process, _, job in started.values():
            if process.poll() is None:
                process.kill()
                job.returncode = process.wait()
    return {name: job for name, (_, _, job) in started.items()}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_job_of_two_ranks_is_one_row(jobs, strategy):
    job = jobs[strategy]
    assert job.returncode == 0, job.stderr
    [row] = job.rows
    assert row["status"] == "ok" and row["ranks"] == 2
    assert Layout.model_validate(row["layout"]) == Layout.of_strategy(strategy, 2)
    assert row["parallel"]["strategy"] == strategy
    assert f"{strategy} x 2" in row["label"]
    per_rank = row["throughput"]["tokens_per_s_per_rank"]
    assert len(per_rank) == 2 and row["throughput"]["tokens_per_s"] == pytest.approx(sum(per_rank))
    assert row["throughput"]["tokens_per_step"] == 2 * 2 * 16  # both ranks' batches
    assert row["timing"]["step"]["median"] == max(row["timing"]["rank_step_medians"])
    assert len(row["memory"]["host_peak_rss_per_rank"]) == 2
    assert not job.left and not job.scratch


@pytest.mark.slow
def test_a_rank_that_fails_names_itself_and_one_that_hangs_is_named(jobs):
    failed = jobs["failed"]
    assert failed.returncode == 1, failed.stderr
    [row] = failed.rows
    assert row["status"] == "error" and row["error"].startswith("rank 1: ")
    assert "rank 1 fails" in row["error"]
    # rank 0 was stopped with the job: still building, or already waiting for rank 1 in a collective
    assert "\nrank 0 did not finish" in row["error"] and row["rank_phases"][1]["status"] == "error"
    assert not failed.left and not failed.scratch

    hung = jobs["hung"]
    assert hung.returncode == 1, hung.stderr
    [row] = hung.rows
    assert row["status"] == "timeout"
    first, second = row["error"].splitlines()[:2]
    assert first.startswith("rank 0 hung outside any collective while rank 1 waited for it in one (rank 0: building "
                            "its model, entered "), first
    assert second.startswith("rank 1: waited in a collective (applying ddp") and "8 s timeout" in second
    assert [(rank["rank"], rank["in_collective"], rank["status"]) for rank in row["rank_phases"]] == \
        [(0, False, None), (1, True, "timeout")]
    assert row["wall_s"] < 60  # ended by the collective's 8 s timeout, not by the sweep's --timeout 60
    assert not hung.left and not hung.scratch


def test_the_sweep_gives_each_configuration_its_layout():
    config = SweepConfig(models=["tiny"], mode=["train", "forward"], precision=["fp32"], gpus=4, strategy="fsdp")
    specs = expand(config, device="cpu", default_models=["tiny"])
    assert [spec.layout for spec in specs] == [Layout(dp_shard=4)] * 2
    auto = expand(config.model_copy(update={"strategy": "auto"}), device="cpu", default_models=["tiny"])
    assert {spec.layout.strategy for spec in auto} == {"ddp"}  # DDP composes with fp32 and is tried first
    with pytest.raises(UserError, match="strategy: --strategy fsdp spreads each configuration over --gpus N ranks"):
        expand(config.model_copy(update={"gpus": 1}), device="cpu", default_models=["tiny"])  # it would change nothing
    # generation has no gradients: beside a training mode it runs in one process, alone it is refused
    infer = expand(SweepConfig(models=["tiny"], mode=["train", "infer"], precision=["fp32"], gpus=2, strategy="ddp"),
                   device="cpu", default_models=["tiny"])
    assert [spec.layout for spec in infer] == [Layout(dp_replicate=2), Layout()]
    with pytest.raises(UserError, match="strategy: --strategy ddp shares gradients .* generation would run in one"):
        expand(SweepConfig(models=["tiny"], mode=["infer"], gpus=2, strategy="ddp"), device="cpu",
               default_models=["tiny"])
    with pytest.raises(UserError, match="ddp x 2: int4 weights are torchao tensor subclasses"):
        expand(SweepConfig(models=["tiny"], mode=["forward"], precision=["int4"], gpus=2, strategy="ddp"),
               device="cpu", default_models=["tiny"])


def test_offload_over_several_ranks_is_fsdps_and_ddp_has_none(tmp_path, monkeypatch, capsys):
    """--offload on one device streams decoder layers (infer, forward); over several ranks it is FSDP's
    CPU offload, in every mode FSDP runs; DDP has none, and training on one device has neither."""
    monkeypatch.chdir(tmp_path)
    config = SweepConfig(models=["tiny"], mode=["train", "forward", "infer"], precision=["fp32"], gpus=2, offload=True)
    specs = expand(config, device="cpu", default_models=["tiny"])
    assert [(spec.mode, spec.layout, spec.fsdp_offload, spec.layer_offload) for spec in specs] == [
        ("train", Layout(dp_shard=2), True, False), ("forward", Layout(dp_shard=2), True, False),
        ("infer", Layout(), False, True)]  # generation runs in one process, its layers offloaded
    assert "offload fsdp x 2" in specs[0].label
    fields = dict(model="tiny", backend="native", mode="train", precision="fp32", batch_size=1, seq_len=16,
                  new_tokens=2, device="cpu", warmup_steps=1, measure_steps=1, offload=True)
    with pytest.raises(ValueError, match="--offload and --strategy ddp do not combine"):
        RunSpec(**fields, layout=Layout(dp_replicate=2))
    for argv, named in ((["--strategy", "ddp"], ["offload:", "--offload and --strategy ddp", "--strategy fsdp",
                                                 "drop --offload"]),
                        (["--gpus", "1"], ["offload:", "--mode infer or forward", "--gpus 2 or more",
                                           "--strategy fsdp"])):
        code, out, err = cli(["run", *SHAPE, *argv, "--offload"], capsys)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert all(name in err for name in named), err


def test_a_single_process_keeps_its_key_and_a_layout_changes_it():
    fields = dict(model="tiny", backend="native", mode="train", precision="fp32", batch_size=1, seq_len=16,
                  new_tokens=2, device="cpu", warmup_steps=1, measure_steps=1)
    single = RunSpec(**fields)
    assert RunSpec(**fields, layout=Layout()).key == single.key
    assert RunSpec(**fields, layout=Layout(dp_shard=2)).key != single.key
    assert RunSpec(**fields, layout=Layout(dp_shard=2)).key != RunSpec(**fields, layout=Layout(dp_replicate=2)).key


def test_layout_degrees_multiply_to_the_world_size():
    assert Layout.for_world(8, tp=2, dp_shard=-1) == Layout(dp_shard=4, tp=2)
    assert Layout(dp_replicate=2, dp_shard=2, tp=2, pp=2).world_size == 16
    assert Layout(dp_replicate=2, dp_shard=3).data_parallel == 6
    assert Layout(replicas=4).data_parallel == Layout(replicas=4).world_size == 4
    assert Layout.of_strategy("replicas", 2) == Layout(replicas=2) and Layout(replicas=2).label == "replicas x 2"
    assert Layout(dp_shard=2, tp=4).strategy == "fsdp+tp" and Layout().strategy == "single"
    with pytest.raises(LayoutError, match=r"dp_replicate=1 x dp_shard=2 x tp=2 x pp=1 x replicas=1 = 4, not the "
                                          r"world size 6"):
        Layout.for_world(6, dp_shard=2, tp=2)
    with pytest.raises(LayoutError, match="does not divide the world size 6"):
        Layout.for_world(6, tp=4, dp_shard=-1)
    with pytest.raises(LayoutError, match="at most one -1"):
        Layout.for_world(4, tp=-1, dp_shard=-1)
    with pytest.raises(LayoutError, match="unknown strategy"):
        Layout.of_strategy("zero3", 2)


def test_rows_combine_by_the_rule_of_each_figure():
    """Two data-parallel ranks: tokens and tokens/s add, the step is the slower rank's, MFU is the
    achieved FLOP/s over both GPUs' peak, memory lists both GPUs; a failed rank decides the status."""
    def payload(median, tokens_per_s, gpu_peak, status="ok"):
        return {"status": status, "error": None if status == "ok" else "out of memory",
                "timing": {"step": {"median": median}},
                "throughput": {"tokens_per_step": 100, "tokens_per_s": tokens_per_s, "flops_per_token": 10.0,
                               "achieved_tflops": tokens_per_s * 10 / 1e12, "mfu": tokens_per_s * 10 / 1e4 * 100,
                               "mfu_measured_peak": None},
                "memory": {"gpus": [{"index": 0, "max_reserved": gpu_peak}], "host_peak_rss": gpu_peak // 10}}

    layout = Layout(dp_replicate=2)
    row = combine([payload(0.5, 200.0, 1000), payload(0.4, 250.0, 1200)], layout)
    assert row["throughput"]["tokens_per_step"] == 200
    assert row["throughput"]["tokens_per_s"] == 450.0 and row["throughput"]["tokens_per_s_per_gpu"] == 225.0
    # achieved 450 x 10 FLOP/s against a peak of 1e4 FLOP/s per GPU, two GPUs: 22.5%
    assert row["throughput"]["mfu"] == pytest.approx(100 * 450 * 10 / (2 * 1e4))
    assert row["throughput"]["achieved_tflops"] == pytest.approx(450 * 10 / 1e12)
    assert row["timing"]["step"]["median"] == 0.5 and row["timing"]["slowest_rank"] == 0
    assert [gpu["rank"] for gpu in row["memory"]["gpus"]] == [0, 1]
    assert row["memory"]["host_peak_rss"] == 120
    failed = combine([payload(0.5, 200.0, 1000), payload(0.4, 250.0, 1200, status="oom")], layout)
    assert failed["status"] == "oom" and failed["error"] == "rank 1: out of memory"


def test_full_training_that_runs_out_of_memory_shards_before_it_changes_precision():
    """The ladder as the launcher walks it: a DDP job's out-of-memory is retried as FSDP over the same
    GPUs, then down the precisions in that layout."""
    from fitbench.launch.fallback import FallbackPolicy, run_with_fallback

    fields = dict(model="tiny", backend="native", mode="train", precision="fp32", batch_size=2, seq_len=16,
                  new_tokens=2, device="cpu", warmup_steps=1, measure_steps=1)
    ran = []

    def run(spec):
        ran.append((spec.layout.strategy, spec.precision))
        return {"status": "ok" if spec.precision == "bf16-pure" else "oom"}

    policy = FallbackPolicy(("fp32", "bf16-pure"), gpus_at_hand=2)
    row = run_with_fallback(RunSpec(**fields, layout=Layout(dp_replicate=2)), policy, run)
    assert ran == [("ddp", "fp32"), ("fsdp", "fp32"), ("fsdp", "bf16-pure")]
    assert row["status"] == "ok" and row["attempts"][1]["change"] == "ddp x 2 -> fsdp x 2"
    ran.clear()
    run_with_fallback(RunSpec(**fields), FallbackPolicy(("fp32", "bf16-pure")), run)
    assert ran[:2] == [("single", "fp32"), ("single", "bf16-pure")]  # one GPU at hand: no sharding rung


@pytest.mark.parametrize("n_layers, stages", [(5, 2), (126, 16), (32, 4), (7, 3), (3, 3), (80, 6), (1, 1)])
def test_pipeline_stages_cover_every_layer_once_and_differ_by_at_most_one(n_layers, stages):
    split = pipeline_stages(n_layers, stages)
    assert len(split) == stages and [layer for stage in split for layer in stage] == list(range(n_layers))
    sizes = [len(stage) for stage in split]
    assert max(sizes) - min(sizes) <= 1
    # the last stage (output projection and loss) is never larger than another
    assert sizes[-1] == min(sizes)
    if stages > 2 and n_layers % stages and n_layers % stages <= stages - 2:
        assert sizes[0] == sizes[-1] == min(sizes)  # middle stages take the extra layers first


def test_pipeline_stages_by_hand_and_too_many_stages():
    assert [len(s) for s in pipeline_stages(5, 2)] == [3, 2]
    assert [len(s) for s in pipeline_stages(126, 16)] == [7] + [8] * 14 + [7]
    assert [len(s) for s in pipeline_stages(7, 3)] == [2, 3, 2]
    assert [len(s) for s in pipeline_stages(8, 3)] == [3, 3, 2]
    with pytest.raises(LayoutError, match="4 decoder layers cannot make 5 pipeline stages"):
        pipeline_stages(4, 5)
