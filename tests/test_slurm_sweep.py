"""``fitbench run --launcher slurm`` on a real cluster (tests/slurm_cluster.py): a sweep as a job array
whose parent is killed and one of whose jobs is cancelled, then ``--resume``; a configuration over two
nodes. Skipped where SLURM is not installed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli
from fitbench.launch.slurm.jobs import cancel, statuses
from fitbench.results.store import ResultStore
from slurm_cluster import NODES

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TINY = ["--models", "tiny", "--mode", "forward", "--seq-len", "8", "--warmup-steps", "0", "--measure-steps", "1",
        "--device", "cpu", "--launcher", "slurm", "--time", "10", "--timeout", "300"]


@pytest.fixture(autouse=True)
def on_the_cluster(slurm_cluster, monkeypatch):
    for name, value in slurm_cluster.environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)


def wait_for(ready, what: str, within: float = 120):
    deadline = time.monotonic() + within
    while not (found := ready()):
        assert time.monotonic() < deadline, f"waiting for {what}"
        time.sleep(0.3)
    return found


def test_an_interrupted_array_ends_after_resume_with_every_configuration_once(tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["run", *TINY, "--batch-size", "1", "2", "3", "--max-concurrent", "2", "--out", str(out)]
    parent = subprocess.Popen([sys.executable, "-m", "fitbench", *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        submitted = wait_for(lambda: (out / "slurm.json").exists() and json.loads((out / "slurm.json").read_text()),
                             "the array's submission")["jobs"]
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert len(submitted) == 3
    last = sorted(submitted.values())[-1]  # held by --max-concurrent 2 while the first two run
    cancel([last])
    # a task cancelled before it started leaves no record; one that had started reads CANCELLED
    wait_for(lambda: last not in statuses([last]) or statuses([last])[last].finished, "the cancellation")

    code, printed, errors = cli(["run", "--resume", str(out)], capsys)
    assert code == 0, printed + errors
    rows = list(ResultStore(out).rows())
    assert sorted(row["key"] for row in rows) == sorted(submitted)
    assert {row["status"] for row in rows} == {"ok"}
    resubmitted = json.loads((out / "slurm.json").read_text())["jobs"]
    changed = [key for key in submitted if resubmitted[key] != submitted[key]]
    assert len(changed) == 1 and submitted[changed[0]] == last
    assert sorted(path.stem for path in (out / "rows").glob("*.json")) == sorted(submitted)


def test_a_configuration_over_two_nodes_is_one_row_with_every_ranks_node(tmp_path, capsys, monkeypatch):
    # planned here for 1 GB "GPUs", run on nodes of 2 GB ones (the memory limit), as the README's flow
    monkeypatch.setenv("FITBENCH_INJECT", "mem-limit:1e9")
    out = tmp_path / "nodes"
    code, printed, errors = cli(["run", *TINY, "--batch-size", "2", "--gpus", "2", "--strategy", "ddp",
                                 "--mode", "train", "--nodes", "2", "--out", str(out),
                                 "--sbatch-arg=--export=ALL,FITBENCH_INJECT=mem-limit:2e9"], capsys)
    rows = list(ResultStore(out).rows())
    assert code == 0, printed + errors + json.dumps(rows)[:3000]
    [row] = rows
    assert row["status"] == "ok" and row["ranks"] == 2 and row["spec"]["precision"] != "fp32"
    assert row["slurm"]["planned_for"] != row["slurm"]["node_gpu"]
    code, shown, errors = cli(["report", str(out)], capsys)
    assert code == 0 and "tiny" in shown, shown + errors
    # the job's ranks started from the srun and torchrun lines its script shows
    [script] = (out / "slurm").glob("*.sh")
    assert "export FITBENCH_SRUN='srun --nodes=2 --ntasks=2 --ntasks-per-node=1'" in script.read_text()
    assert "--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --max-restarts=0'" in script.read_text()
    assert sorted(rank["node"] for rank in row["placement"]) == sorted(NODES)
    assert all(rank["device"] and rank["host_peak_rss"] for rank in row["placement"])
    # every node sampled its GPUs beside its agent, and the row merges the nodes' summaries in SLURM's order; a
    # CPU job's nodes have none to sample, and say why (no NVML here, or no GPU named)
    monitor = row["gpu_monitor"]
    assert [node["node"] for node in monitor["nodes"]] == sorted(NODES) and monitor["gpus"] == []
    assert not monitor["available"] and all(node["reason"] for node in monitor["nodes"])
    for node in NODES:
        [summary] = (out / "artifacts").glob(f"**/nvml-{node}.json")
        assert json.loads(summary.read_text())["node"] == node


def test_a_partition_the_cluster_lacks_is_one_paragraph_before_anything_is_written(tmp_path, capsys):
    code, _, stderr = cli(["run", *TINY, "--partition", "nosuch", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "partition: the cluster has no partition 'nosuch'; it has debug" in stderr
    assert not (tmp_path / "out").exists()


def test_a_sweep_outlasts_a_paused_then_restarted_controller(tmp_path, slurm_cluster):
    out = tmp_path / "busy"
    parent = subprocess.Popen([sys.executable, "-m", "fitbench", "run", *TINY, "--batch-size", "1", "--out", str(out)],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (out / "slurm.json").exists(), "the submission")
        # the node has started the job (its log exists): no launch is in flight when the controller stops, as
        # one cut by a stop is lost with the state the controller could not save (a test cluster's race)
        wait_for(lambda: any((out / "logs").glob("slurm-*.out")), "the job's start on its node")
        # squeue waits on a paused controller, then fails: asked again
        slurm_cluster.pause_controller()
        time.sleep(25)
        slurm_cluster.resume_controller()
        # a controller that is down refuses the connection: asked again until it is back
        slurm_cluster.stop_controller()
        time.sleep(15)
        slurm_cluster.start_controller()
        try:
            printed, _ = parent.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            parent.kill()
            printed = parent.communicate()[0] + "\n(still following after 180 s)\n" + slurm_cluster.logs()
    finally:
        slurm_cluster.resume_controller()
        parent.kill()
    assert parent.returncode == 0 and "Traceback" not in printed, printed
    [row] = ResultStore(out).rows()
    assert row["status"] == "ok"


def test_a_node_that_plans_otherwise_runs_what_the_login_node_planned_and_says_so(tmp_path, capsys, monkeypatch):
    # a memory limit makes a CPU plan as a GPU of that size: the planner picks the precision left open; the
    # job's node gets another limit, on which it would plan otherwise
    monkeypatch.setenv("FITBENCH_INJECT", "mem-limit:1e9")
    out = tmp_path / "planned"
    code, printed, errors = cli(["run", *TINY, "--batch-size", "2", "--out", str(out),
                                 "--sbatch-arg=--export=ALL,FITBENCH_INJECT=mem-limit:2e9"], capsys)
    rows = list(ResultStore(out).rows())
    assert code == 0, printed + errors + json.dumps(rows)[:3000]
    [row] = rows
    [key] = json.loads((out / "slurm.json").read_text())["jobs"]
    assert row["status"] == "ok" and row["key"] == key and row["spec"]["precision"] != "fp32"
    [script] = (out / "slurm").glob("*.sh")
    assert f"{row['label']} ({key})" in script.read_text()
    assert "of 1.0 GB (FITBENCH_INJECT mem-limit)" in row["slurm"]["planned_for"]
    assert "of 2.0 GB (FITBENCH_INJECT mem-limit)" in row["slurm"]["node_gpu"]
    assert any(warning.startswith("planned on the login node for") for warning in row["warnings"])
    # the job's row is read like any other: report, compare, the API
    assert not (out / "results.jsonl").exists() and f"rows: {out / 'rows'}" in " ".join(printed.split())
    code, shown, errors = cli(["report", str(out)], capsys)
    assert code == 0 and row["label"].split()[0] in shown, shown + errors
    code, shown, errors = cli(["compare", str(out), str(out)], capsys)
    assert code == 0 and row["label"].split()[0] in shown, shown + errors
    from fitbench.api import load

    assert [loaded.key for loaded in load(out)] == [key]


def test_a_sweep_sbatch_refused_is_fixed_in_place_by_resume_with_the_corrected_option(tmp_path, capsys):
    out = tmp_path / "refused"
    code, _, stderr = cli(["run", *TINY, "--batch-size", "1", "--mem", "999999M", "--out", str(out)], capsys)
    assert code == 2 and "sbatch refused the job" in stderr, stderr
    code, printed, stderr = cli(["run", "--resume", str(out), "--mem", "500M"], capsys)
    assert code == 0, printed + stderr
    [row] = ResultStore(out).rows()
    assert row["status"] == "ok" and json.loads((out / "sweep.json").read_text())["config"]["mem"] == "500M"


def test_slurms_signal_before_the_time_limit_writes_a_timeout_row_with_the_attempts_done(tmp_path, slurm_cluster,
                                                                                           monkeypatch):
    monkeypatch.setenv("FITBENCH_INJECT", "hang:tiny")  # the worker sleeps, as a run past its time would
    out = tmp_path / "signalled"
    parent = subprocess.Popen([sys.executable, "-m", "fitbench", "run", *TINY, "--batch-size", "1", "--out", str(out),
                               "--sbatch-arg=--signal=B:USR1@90"], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: list((out / "logs").glob("*-1.log")), "the first attempt's log")
        [job_id] = json.loads((out / "slurm.json").read_text())["jobs"].values()
        # what --signal=B:USR1@90 has SLURM do 90 s before the limit: USR1 to the batch shell
        slurm_cluster.command("scancel", "--signal=USR1", "--batch", job_id)
        printed, _ = parent.communicate(timeout=120)
    finally:
        parent.kill()
    [row] = ResultStore(out).rows()
    assert row["status"] == "timeout" and "SLURM sent SIGUSR1" in row["error"], printed
    assert [attempt["status"] for attempt in row["attempts"]] == ["interrupted"]
    assert "#SBATCH --signal=B:USR1@90" in next((out / "slurm").glob("*.sh")).read_text()


def test_the_dry_run_script_edited_and_submitted_by_hand_is_followed_not_submitted_again(tmp_path, capsys,
                                                                                        slurm_cluster):
    out = tmp_path / "by-hand"
    code, printed, errors = cli(["run", *TINY, "--batch-size", "1", "2", "--out", str(out), "--dry-run"], capsys)
    assert code == 0, printed + errors
    [script] = (out / "slurm").glob("*.sh")
    edited = script.read_text().replace("set -euo pipefail\n", "set -euo pipefail\necho edited by hand\n", 1)
    script.write_text(edited)
    job_id = slurm_cluster.command("sbatch", "--parsable", str(script)).strip()
    code, printed, errors = cli(["run", "--resume", str(out)], capsys)
    assert code == 0, printed + errors
    rows = list(ResultStore(out).rows())
    assert [row["status"] for row in rows] == ["ok", "ok"]
    assert sorted(json.loads((out / "slurm.json").read_text())["jobs"].values()) == [f"{job_id}_0", f"{job_id}_1"]
    assert sorted(row["slurm"]["job_id"] for row in rows) == [f"{job_id}_0", f"{job_id}_1"]
    assert all("edited by hand" in (out / "logs" / f"slurm-{job_id}_{task}.out").read_text() for task in (0, 1))
