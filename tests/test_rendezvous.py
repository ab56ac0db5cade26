"""Several nodes without SLURM: two torchrun agents, each one node of a job of two, meet at a c10d
rendezvous on localhost with the options a SLURM job's agents get (``fitbench.launch.slurm.script``),
and their ranks all-reduce over gloo (tests/allreduce_job.py)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fitbench.launch.slurm.script import TORCHRUN, agent_options

JOB = Path(__file__).resolve().parent / "allreduce_job.py"


@pytest.mark.slow
def test_two_agents_of_two_nodes_rendezvous_on_localhost_and_all_reduce(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "out.json"
    command = [sys.executable, *TORCHRUN, *agent_options(nodes=2, ranks=1), f"--rdzv-endpoint=localhost:{port}",
               "--rdzv-id=two-nodes", str(JOB), str(out)]
    agents = [subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=180)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    result = json.loads(out.read_text())
    assert result["sum"] == 1 + 2 and result["world_size"] == 2
    assert sorted(rank["node_rank"] for rank in result["ranks"]) == [0, 1]
