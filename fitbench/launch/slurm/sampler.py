"""Each node's GPUs sampled in a job over several nodes, and the nodes' timelines merged into the row.

The parent's sampler (``fitbench.monitor.nvml.GpuMonitor``) sees only the GPUs of its own node. So in
a job over several nodes, the task ``srun`` starts on each node is this module wrapped around the
node's torchrun agent:

    python -m fitbench.launch.slurm.sampler DIR GPUS -- AGENT...

It samples the node's first ``GPUS`` GPUs (``job_gpus``: local rank k's GPU k-th; none for a job of
CPU ranks) into ``DIR/nvml-<node>.jsonl`` while the agent runs, then writes their summary to
``DIR/nvml-<node>.json`` and exits with the agent's status. ``<node>`` is SLURM's name of the node
(``SLURMD_NODENAME``), else the host's. A SIGTERM (srun ending the step at the attempt's timeout or
on a cancellation) goes on to the agent, and the summary is still written; a SIGKILL leaves the
timeline, flushed every round, without it.

``merge_nodes`` reads the nodes' summaries back for the row (``DIR`` is the attempt's directory, which
every node sees): one GPU list in rank order of the nodes, each GPU with its node, one entry per GPU
UUID; the job's energy is the sum of its GPUs' where every GPU has one; ``nodes`` keeps each node's
summary and timeline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from fitbench.monitor.nvml import GpuMonitor, job_gpus

PREFIX = "nvml-"


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def sample_while(directory: Path, gpus: int, command: list[str]) -> int:
    """Run ``command`` while sampling this node's first ``gpus`` GPUs; its exit status."""
    node = node_name()
    directory.mkdir(parents=True, exist_ok=True)
    monitor = GpuMonitor(job_gpus(gpus) if gpus else [], directory, name=f"{PREFIX}{node}.jsonl")
    with monitor:
        agent = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        signal.signal(signal.SIGTERM, lambda signum, frame: agent.send_signal(signal.SIGTERM))
        code = agent.wait()
    summary = directory / f"{PREFIX}{node}.json"
    tmp = summary.with_suffix(".tmp")
    tmp.write_text(json.dumps({"node": node, **monitor.summary()}))
    os.replace(tmp, summary)
    return code


def merge_nodes(directory: Path, nodes: list[str] | None = None) -> dict:
    """The job's GPU figures from every node's summary in ``directory`` (the module docstring), in the
    order of ``nodes`` where given (the job's node list, whose first holds ranks 0 to k - 1), else by
    name; a node named but without a summary says so."""
    found = {path.stem[len(PREFIX):]: path for path in directory.glob(f"{PREFIX}*.json")}
    order = nodes or sorted(found)
    summaries, gpus, seen = [], [], set()
    for node in order:
        try:
            summary = json.loads(found[node].read_text())
        except (KeyError, OSError, ValueError):
            summary = {"node": node, "available": False, "reason": "no summary from this node's sampler (its task "
                                                                    "ended before writing one)", "gpus": []}
        summaries.append(summary)
        for gpu in summary.get("gpus") or []:
            if gpu.get("uuid") and gpu["uuid"] in seen:
                continue
            seen.add(gpu.get("uuid"))
            gpus.append({**gpu, "gpu": len(gpus), "node": node})
    energies = [gpu.get("energy_j") for gpu in gpus]
    available = any(summary.get("available") for summary in summaries)
    energy = sum(energies) if available and energies and None not in energies else None
    reasons = sorted({f"{s['node']}: {s['reason']}" for s in summaries if s.get("reason")})
    return {
        "available": available,
        "reason": "; ".join(reasons) or None,
        "timeline": next((s.get("timeline") for s in summaries if s.get("timeline")), None),
        "energy_j": energy,
        "energy_per_token_j": None,
        "gpus": gpus,
        "nodes": summaries,
    }


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m fitbench.launch.slurm.sampler DIR GPUS -- COMMAND... (a node's task in a job of "
              "several nodes)", file=sys.stderr)
        return 2
    return sample_while(Path(argv[0]), int(argv[1]), argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
