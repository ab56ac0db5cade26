"""SLURM jobs on a real cluster (tests/slurm_cluster.py: munged, slurmctld and two slurmd of CPU
nodes on this host): a job of one configuration, a job array under a concurrency limit, a job
cancelled while it runs, and a job of two nodes whose torchrun agents meet at a c10d rendezvous and
all-reduce over gloo (a job past its time limit: tests/test_slurm_time_limit.py). Skipped where SLURM
is not installed."""

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from fitbench.launch.slurm.jobs import JobStatus, cancel, statuses, submit
from fitbench.launch.slurm.options import SlurmOptions
from fitbench.launch.slurm.script import ScriptJob, array_script, batch_script
from fitbench.util.errors import UserError
from slurm_cluster import NODES

pytestmark = pytest.mark.slow
ALLREDUCE_JOB = Path(__file__).resolve().parent / "allreduce_job.py"
MARK = "FITBENCH_TEST_MARK"
POLL_S = 0.3
SLEEP = ["-c", "import time; print('started', flush=True); time.sleep(300)"]


@pytest.fixture(scope="module", autouse=True)
def on_the_cluster(slurm_cluster):
    """SLURM's commands of this module talk to the test cluster."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in slurm_cluster.environment.items():
            patch.setenv(name, value)
        yield slurm_cluster


def submit_script(script: str, directory: Path) -> str:
    path = directory / f"job-{uuid.uuid4().hex[:8]}.sh"
    path.write_text(script)
    return submit(path, cwd=directory)


def wait_until(job_id: str, done, within: float = 120) -> dict[str, JobStatus]:
    """Poll the job (every task of an array) until ``done(statuses)``; the statuses then."""
    deadline = time.monotonic() + within
    while True:
        found = statuses([job_id])
        if found and done(found):
            return found
        assert time.monotonic() < deadline, f"job {job_id} after {within} s: {found}"
        time.sleep(POLL_S)


def finished(found: dict[str, JobStatus]) -> bool:
    return all(status.finished for status in found.values())


def marked(mark: str) -> set[int]:
    """Living processes that carry ``MARK=mark`` in their environment."""
    needle = f"{MARK}={mark}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.add(int(entry))
        except OSError:
            continue
    return found


def test_a_job_runs_its_program_and_writes_its_output(tmp_path):
    program = ["-c", "import os, sys; print('hello from', os.environ['SLURMD_NODENAME'], sys.argv[1:])", "it's"]
    job_id = submit_script(batch_script(SlurmOptions(time="5"), ScriptJob("hello", str(tmp_path / "%j.out")), program),
                           tmp_path)
    status = wait_until(job_id, finished)[job_id]
    assert (status.state, status.reason) == ("COMPLETED", None)
    output = (tmp_path / f"{job_id}.out").read_text()
    assert "hello from" in output and "[\"it's\"]" in output


def test_an_array_runs_every_task_at_most_limit_at_once(tmp_path):
    program = ["-c", "import sys, time; start = time.time(); time.sleep(1); print(sys.argv[1], start, time.time())"]
    tasks = [[*program, str(index)] for index in range(3)]
    job_id = submit_script(array_script(SlurmOptions(time="5"), ScriptJob("sweep", str(tmp_path / "%A_%a.out")),
                                        tasks, limit=1), tmp_path)
    held = wait_until(job_id, lambda found: any(status.reason == "JobArrayTaskLimit" for status in found.values())
                      or finished(found))
    found = wait_until(job_id, finished)
    assert sorted(found) == [f"{job_id}_{index}" for index in range(3)]
    assert {status.state for status in found.values()} == {"COMPLETED"}
    assert any(status.state == "PENDING" and status.reason == "JobArrayTaskLimit" for status in held.values()), held
    spans = []
    for index in range(3):
        task, start, end = (tmp_path / f"{job_id}_{index}.out").read_text().split()
        assert task == str(index)
        spans.append((float(start), float(end)))
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans


def test_a_job_cancelled_while_it_runs_reads_cancelled_and_leaves_nothing_running(tmp_path, monkeypatch):
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)  # sbatch hands the job this environment
    output = tmp_path / "sleeper.out"
    job_id = submit_script(batch_script(SlurmOptions(time="5"), ScriptJob("sleeper", str(output)), SLEEP), tmp_path)
    wait_until(job_id, lambda found: found[job_id].state == "RUNNING" and output.exists()
               and "started" in output.read_text())
    cancel([job_id])
    status = wait_until(job_id, finished)[job_id]
    assert status.state == "CANCELLED"
    deadline = time.monotonic() + 30
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    assert not marked(mark)


def test_two_nodes_start_one_torchrun_agent_each_and_their_ranks_all_reduce(tmp_path):
    out = tmp_path / "allreduce.json"
    options = SlurmOptions(nodes=2, time="5")
    job = ScriptJob("allreduce", str(tmp_path / "%j.out"), ranks_per_node=1)
    job_id = submit_script(batch_script(options, job, [str(ALLREDUCE_JOB), str(out)]), tmp_path)
    status = wait_until(job_id, finished, within=240)[job_id]
    assert status.state == "COMPLETED", (tmp_path / f"{job_id}.out").read_text()
    result = json.loads(out.read_text())
    assert result["sum"] == 1 + 2 and result["world_size"] == 2
    assert sorted(rank["slurm_node"] for rank in result["ranks"]) == sorted(NODES)
    assert sorted(rank["node_rank"] for rank in result["ranks"]) == [0, 1]


def test_a_partition_the_cluster_lacks_is_sbatchs_refusal_as_a_user_error(tmp_path):
    script = batch_script(SlurmOptions(partition="nosuch"), ScriptJob("lost", str(tmp_path / "%j.out")), SLEEP)
    with pytest.raises(UserError, match="^sbatch refused the job of .*nvalid partition"):
        submit_script(script, tmp_path)

