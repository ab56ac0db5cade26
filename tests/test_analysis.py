"""The analysis through Ollama, against servers written here that speak Ollama's ``/api/chat`` on
the loopback address only: one that answers (streamed or not, as the request asks), one too slow
(for the timeout of ``analyse``, of ``--ollama-timeout`` on report and run, and of ``ollama_timeout``
in a sweep's file), one that fails, one without the model; and none at all. Only a malformed URL or
timeout is bad input."""

import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pydantic import ValidationError

from conftest import cli
from fitbench.config import SweepConfig, load_yaml
from fitbench.report.analysis import DEFAULT_TIMEOUT_S, analyse, prompt, write_analysis
from fitbench.results.directories import read_sweep
from fitbench.util.errors import UserError

COMMITTED = "benchmarks/results/2026-11-27-h100x4-replicas/default"
ANSWER = ["The 1B and 3B models fit on one H100 each. ", "Decode is bandwidth-bound; ", "try a larger batch."]


def serve(behaviour: str):
    """A loopback server answering POST /api/chat as ``behaviour`` says; (server, requests received)."""
    received = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append((self.path, body))
            if behaviour == "slow":
                time.sleep(3)
            if behaviour == "failing":
                return self._send(500, {"error": "the runner crashed"})
            if behaviour == "missing":
                return self._send(404, {"error": f"model '{body['model']}' not found"})
            done = {"model": body["model"], "created_at": "2026-11-27T00:00:00Z", "done": True}
            if not body.get("stream", True):
                return self._send(200, {**done, "message": {"role": "assistant", "content": "".join(ANSWER)}})
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.end_headers()
            for part in ANSWER:
                line = {**done, "done": False, "message": {"role": "assistant", "content": part}}
                self.wfile.write(json.dumps(line).encode() + b"\n")
                self.wfile.flush()
            self.wfile.write(json.dumps({**done, "message": {"role": "assistant", "content": ""}}).encode() + b"\n")

        def _send(self, status, value):
            data = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.handle_error = lambda request, address: None  # a client that gave up on a slow answer closed its end
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, received


@pytest.fixture
def rows(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    return read_sweep(COMMITTED).rows


@pytest.mark.parametrize("stream", [True, False])
def test_the_analysis_is_the_models_answer_streamed_or_not(rows, stream, tmp_path):
    server, received = serve("answering")
    try:
        analysis = analyse(rows, f"http://127.0.0.1:{server.server_port}", "gpt-oss-20b", timeout=10, stream=stream)
    finally:
        server.shutdown()
    assert analysis.text == "".join(ANSWER).strip() and analysis.warning is None
    path, body = received[0]
    assert path == "/api/chat" and body["model"] == "gpt-oss-20b" and body["stream"] is stream
    question = body["messages"][-1]["content"]
    assert question == prompt(rows)
    assert all(row.label in question for row in rows)  # every row, as one line each
    written = write_analysis(analysis, tmp_path, "gpt-oss-20b")
    assert written.read_text() == f"# Analysis by gpt-oss-20b\n\n{analysis.text}\n"


@pytest.mark.parametrize("behaviour, says", [("slow", "did not answer within 1 s"),
                                             ("failing", "refused the request (500: the runner crashed)"),
                                             ("missing", "ollama pull nope")])
def test_a_slow_failing_or_modelless_server_is_a_warning(rows, behaviour, says, tmp_path):
    server, _ = serve(behaviour)
    try:
        analysis = analyse(rows, f"http://127.0.0.1:{server.server_port}", "nope", timeout=1)
    finally:
        server.shutdown()
    assert analysis.text is None and says in analysis.warning
    assert write_analysis(analysis, tmp_path, "nope") is None and not list(tmp_path.iterdir())


def test_no_server_is_a_warning(rows):
    server, _ = serve("answering")
    port = server.server_port
    server.shutdown()
    server.server_close()  # the port is closed now: nothing listens there
    analysis = analyse(rows, f"http://127.0.0.1:{port}", "gpt-oss-20b", timeout=2)
    assert analysis.text is None and "cannot be reached" in analysis.warning


@pytest.mark.parametrize("url", ["localhost:11434", "ftp://127.0.0.1:11434", "http://", "http://127.0.0.1:99999",
                                 "http://bad host", ""])
def test_a_malformed_url_is_bad_input(rows, url):
    with pytest.raises(UserError, match="ollama-url: .*http://localhost:11434"):
        analyse(rows, url, "gpt-oss-20b")


def test_a_timeout_on_the_command_line_is_a_warning_and_the_report_is_written(rows, tmp_path, capsys):
    directory = tmp_path / "sweep"
    shutil.copytree(COMMITTED, directory)
    server, received = serve("slow")
    try:
        code, out, err = cli(["report", str(directory), "--html", str(tmp_path / "r.html"), "--ollama-url",
                              f"http://127.0.0.1:{server.server_port}", "--ollama-model", "m", "--ollama-timeout",
                              "1"], capsys)
    finally:
        server.shutdown()
    assert code == 0 and "did not answer within 1 s; the report is written without its analysis" in err
    assert len(received) == 1 and 'id="analysis"' not in (tmp_path / "r.html").read_text()
    assert not (directory / "analysis.md").exists()


def test_the_analysis_of_several_directories_goes_beside_the_page(rows, tmp_path, capsys):
    weak = Path("benchmarks/results/2026-11-27-h100x4-vs-one-gpu/weak/1")
    other = Path("benchmarks/results/2026-11-24-h200x2-data-parallel/weak-1")  # the same configuration
    server, received = serve("answering")
    try:
        code, out, err = cli(["report", str(weak), str(other), "--html", str(tmp_path / "r.html"), "--ollama-url",
                              f"http://127.0.0.1:{server.server_port}", "--ollama-model", "m", "--ollama-timeout",
                              "30"], capsys)
    finally:
        server.shutdown()
    assert code == 0, err
    assert (tmp_path / "analysis.md").read_text() == f"# Analysis by m\n\n{''.join(ANSWER).strip()}\n"
    question = received[0][1]["messages"][-1]["content"]
    assert "8x2048 [native] [1] | single (1) | ok" in question
    assert "8x2048 [native] [weak-1] | single (1) | ok" in question
    assert 'id="analysis"' in (tmp_path / "r.html").read_text()


@pytest.mark.parametrize("command", ["report", "run"])
def test_the_help_gives_the_analysis_default_timeout(command, capsys):
    code, out, err = cli([command, "--help"], capsys)
    assert code == 0 and f"--ollama-timeout SECONDS how long the server has for the whole analysis; past it, a " \
                         f"warning, and the report is written without it (default {DEFAULT_TIMEOUT_S:g})" in " ".join(
                             out.split())


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_a_timeout_that_is_no_duration_is_bad_input(value, capsys):
    code, out, err = cli(["report", COMMITTED, "--ollama-model", "m", "--ollama-timeout", value], capsys)
    assert code == 2 and err.count("\n") == 1 and "--ollama-timeout" in err and "seconds" in err


@pytest.mark.parametrize("text, accepted", [("ollama_timeout: 2.5", 2.5), ("ollama_timeout: 0", None),
                                            ("ollama_timeout: '10'", None), ("ollama_timeout: .inf", None), ("", None)])
def test_the_timeout_in_a_sweeps_file(text, accepted, tmp_path):
    (tmp_path / "sweep.yaml").write_text(f"models: [tiny]\n{text}\n")
    options = load_yaml(str(tmp_path / "sweep.yaml"))
    if accepted is None and text:
        with pytest.raises(ValidationError, match="ollama_timeout"):
            SweepConfig.model_validate(options)
    else:
        assert SweepConfig.model_validate(options).ollama_timeout == accepted


@pytest.mark.slow
def test_a_run_whose_analysis_times_out_still_writes_its_rows(rows, tmp_path, capsys):
    """The YAML file's timeout reaches the analysis after a real (tiny, CPU) sweep."""
    server, _ = serve("slow")
    config = tmp_path / "sweep.yaml"
    config.write_text(f"ollama_url: http://127.0.0.1:{server.server_port}\nollama_model: m\nollama_timeout: 1\n")
    try:
        code, out, err = cli(["run", "--config", str(config), "--models", "tiny", "--mode", "forward", "--device",
                              "cpu", "--batch-size", "1", "--seq-len", "8", "--warmup-steps", "0", "--measure-steps",
                              "1", "--out", str(tmp_path / "out")], capsys)
    finally:
        server.shutdown()
    assert code == 0, err
    assert "did not answer within 1 s" in err
    assert (tmp_path / "out" / "results.csv").exists() and not (tmp_path / "out" / "analysis.md").exists()


def test_the_prompt_names_the_gpus_their_memory_and_each_row_s_spread(rows):
    question = prompt(rows)
    gpus = rows[0].environment["gpus"]
    assert question.startswith(f"GPUs of the machine: {len(gpus)} x {gpus[0]['name']} ({gpus[0]['total_memory'] / 1e9:.1f} GB "
                               f"each)")
    assert "| CV | p90 / p99 |" in question
    row = next(row for row in rows if row.spec["mode"] == "infer" and row.status == "ok")
    line = next(text for text in question.splitlines() if text.startswith(row.label + " |"))
    assert f"{row.timing['token_latency']['cv_percent']:.1f}%" in line and "replicas x 4 (4)" in line


def test_ollama_host_is_honoured_and_the_analysis_is_html_named_by_its_model(rows, tmp_path, capsys, monkeypatch):
    """No --ollama-url: the server OLLAMA_HOST names (host:port, as Ollama's own client reads it) is asked;
    the answer goes beside the page, never into the results folder the report reads."""
    directory = tmp_path / "sweep"
    shutil.copytree(COMMITTED, directory)
    server, received = serve("answering")
    monkeypatch.setenv("OLLAMA_HOST", f"127.0.0.1:{server.server_port}")
    try:
        code, out, err = cli(["report", str(directory), "--html", str(tmp_path / "page" / "r.html"),
                              "--ollama-model", "m", "--ollama-timeout", "30"], capsys)
    finally:
        server.shutdown()
    assert code == 0, err
    assert len(received) == 1 and f"127.0.0.1:{server.server_port}" in out
    assert not (directory / "analysis.md").exists() and (tmp_path / "page" / "analysis.md").exists()
    page = (tmp_path / "page" / "r.html").read_text()
    assert "<h2>Analysis by m</h2>" in page and "<p>The 1B and 3B models fit" in page


@pytest.mark.parametrize("host, url", [("127.0.0.1:9", "http://127.0.0.1:9"), ("gpu-box", "http://gpu-box:11434"),
                                       ("https://ollama.example:443", "https://ollama.example:443"),
                                       ("", None)])
def test_ollama_host_is_read_as_ollama_reads_it(host, url, monkeypatch):
    from fitbench.cli.documents import DEFAULT_OLLAMA_URL, ollama_server

    monkeypatch.setenv("OLLAMA_HOST", host)
    assert ollama_server(None) == (url or DEFAULT_OLLAMA_URL)
    assert ollama_server("http://given:1") == "http://given:1"  # the option wins
