"""``fitbench serve-bench --start-vllm`` against vLLM's real OpenAI server (its CPU build on a CPU), on
loopback: it starts the server for a preset, runs the points, stops it, and leaves nothing running.

vLLM pins its own torch and transformers, so it lives in an environment of its own, whose Python
``FITBENCH_VLLM_PYTHON`` names (``.ci/run`` makes one); without it these tests are skipped, saying so."""

import os
from pathlib import Path

import pytest

from fitbench.cli import main
from fitbench.results.store import ResultStore
from fitbench.serving.vllm_server import PYTHON_VARIABLE

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.environ.get(PYTHON_VARIABLE), reason=f"no vLLM environment: {PYTHON_VARIABLE} names none (.ci/run makes one)")]


def _running(text: str) -> list[str]:
    """The command lines of this machine's processes that hold ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and text in line:
            found.append(line)
    return found


def test_it_starts_vllm_for_a_preset_measures_and_stops_it(tmp_path):
    out = tmp_path / "serve"
    argv = ["serve-bench", "--start-vllm", "tiny", "--gpu-memory-utilization", "0.05", "--enforce-eager",
            "--rates", "inf", "--concurrency", "2", "--requests", "4", "--prompt-tokens", "16", "--output-tokens", "8",
            "--slo", "e2e:60s", "--out", str(out), "--quiet"]
    assert main(argv) == 0, (out / "logs" / "vllm-server.log").read_text()[-3000:]
    rows = list(ResultStore(out).typed_rows())
    assert [row.serving["point"] for row in rows] == ["rate inf", "concurrency 2"]
    for row in rows:
        assert row.status == "ok" and row.serving["completed"] == 4 and row.serving["failed"] == 0
        # ignore_eos: every request generates the 8 tokens asked, and vLLM counts the 16 prompt ids sent; a
        # server behind its engine may send several tokens in one chunk of the stream, never a chunk without one
        assert {(o["prompt_tokens"], o["output_tokens"]) for o in row.serving["outcomes"]} == {(16, 8)}
        assert all(1 <= len(o["chunk_times"]) <= 8 for o in row.serving["outcomes"])
        assert row.serving["good"] == 4
    server = rows[0].serving["server"]
    assert server["preset"] == "tiny" and server["base_url"].startswith("http://127.0.0.1:")
    directory = server["command"].split("--model ")[1].split()[0]
    assert not Path(directory).exists() and not _running(directory)  # nothing left running, nothing left behind


def test_a_server_that_cannot_start_is_one_paragraph_naming_its_log(tmp_path, capsys):
    # tiny's 8 attention heads do not split over 3 ranks: vLLM refuses the layout and exits
    argv = ["serve-bench", "--start-vllm", "tiny", "--tp", "3", "--gpu-memory-utilization", "0.05", "--enforce-eager",
            "--requests", "1", "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "vllm-server.log" in error and "exited" in error
