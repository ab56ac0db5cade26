"""The rows of SLURM jobs that ended without their own (fitbench.launch.slurm.states), and how the
store merges the jobs' row files with results.jsonl (fitbench.results.store)."""

import pytest

from fitbench.launch.job import Job
from fitbench.launch.slurm.jobs import JobStatus
from fitbench.launch.slurm.states import gone, stopped_row
from fitbench.results.row import Row
from fitbench.results.store import ResultStore
from fitbench.spec import RunSpec

SPEC = RunSpec(model="tiny", backend="native", mode="forward", precision="fp32", batch_size=1, seq_len=8, new_tokens=4,
               device="cpu", warmup_steps=0, measure_steps=1)


@pytest.mark.parametrize("state, reason, status", [
    ("TIMEOUT", "TimeLimit", "timeout"), ("OUT_OF_MEMORY", "OutOfMemory", "oom"),
    ("CANCELLED", None, "cancelled"), ("PREEMPTED", None, "preempted"), ("NODE_FAIL", "NodeDown", "node_failed"),
    ("FAILED", "NonZeroExitCode", "crashed"), ("COMPLETED", None, "crashed"),
])
def test_a_job_slurm_ended_becomes_a_row_with_its_state_and_reason(state, reason, status, tmp_path):
    output = tmp_path / "slurm-7_1.out"
    output.write_text("starting\nslurmstepd: error: *** JOB 7 ON node CANCELLED ***\n")
    row = stopped_row(Job(SPEC, 60), JobStatus("7_1", state, state, reason), output, command="fitbench run",
                      finished_at="now")
    assert row["status"] == status and row["key"] == SPEC.key
    assert row["slurm"] == {"job_id": "7_1", "state": state, "reason": reason}
    assert "SLURM job 7_1" in row["error"] and state in row["error"] and "*** JOB 7" in row["error"]
    assert (reason or "") in row["error"]
    assert ("--resume" in row["error"]) == (status in ("cancelled", "preempted", "node_failed"))


def test_a_job_slurm_forgot_reads_cancelled(tmp_path):
    row = stopped_row(Job(SPEC, 60), gone("8"), tmp_path / "none.out", command="fitbench run", finished_at="now")
    assert row["status"] == "cancelled" and "no longer known to SLURM" in row["error"]


def test_a_jobs_row_file_replaces_the_line_that_said_it_was_stopped(tmp_path):
    store = ResultStore(tmp_path)
    stopped = stopped_row(Job(SPEC, 60), JobStatus("9", "CANCELLED", "CANCELLED", None), tmp_path / "x.out",
                          command="fitbench run", finished_at="now")
    store.append(stopped)
    assert store.finished_keys() == set()
    store.write_job_row(Row(key=SPEC.key, label=SPEC.label, spec=SPEC.model_dump(), status="ok").as_dict())
    assert [row["status"] for row in store.rows()] == ["ok"]
    assert store.finished_keys() == {SPEC.key}
