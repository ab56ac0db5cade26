"""A job past its time limit on the real SLURM cluster (tests/slurm_cluster.py) reads TIMEOUT with
SLURM's reason, and squeue's answer for it survives a job SLURM does not know. The job is conftest's
``slurm_overdue_job``, submitted as the session starts: SLURM ends it 60 to 90 s later, and this file,
the last the session runs (conftest), finds it ended instead of waiting for it. Skipped where SLURM is
not installed."""

import time

import pytest

from fitbench.launch.slurm.jobs import statuses

pytestmark = pytest.mark.slow
POLL_S = 0.3
# the job ends within 90 s of the session's start; a shorter session waits here for the rest
WITHIN_S = 150


@pytest.fixture(autouse=True)
def on_the_cluster(slurm_cluster, monkeypatch):
    """SLURM's commands of this module talk to the test cluster."""
    for name, value in slurm_cluster.environment.items():
        monkeypatch.setenv(name, value)


def test_a_job_slurm_does_not_know_has_no_status_and_hides_none_asked_with_it(slurm_overdue_job):
    assert statuses(["99999999"]) == {}
    assert list(statuses([slurm_overdue_job, "99999999"])) == [slurm_overdue_job]


def test_a_job_past_its_time_limit_reads_timeout_with_slurms_reason(slurm_overdue_job):
    deadline = time.monotonic() + WITHIN_S
    while not (found := statuses([slurm_overdue_job])) or not found[slurm_overdue_job].finished:
        assert time.monotonic() < deadline, f"job {slurm_overdue_job} after {WITHIN_S} s: {found}"
        time.sleep(POLL_S)
    assert (found[slurm_overdue_job].state, found[slurm_overdue_job].reason) == ("TIMEOUT", "TimeLimit")
