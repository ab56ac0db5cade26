"""``fitbench serve-bench`` (``fitbench.serving``) against a server written here, on loopback, that
streams known delays and injects errors and dropped connections: every request is counted, and every
latency figure of a row is recomputed by hand from the row's own raw records."""

import json
import math
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fitbench.cli import main
from fitbench.models.vllm_options import layout_options, precision_options
from fitbench.precisions import PRECISIONS
from fitbench.report.serving_figure import latency_figure
from fitbench.results.directories import read_sweeps
from fitbench.results.store import ResultStore
from fitbench.serving.bench import Point, ServeBench, run_bench
from fitbench.serving.client import Outcome
from fitbench.serving.metrics import parse_slo, summary
from fitbench.serving.workload import Lengths, parse_lengths, requests
from fitbench.util.errors import UserError
from loopback_openai import LoopbackServer


def test_lengths_are_given_or_drawn_and_bad_ones_are_refused():
    assert parse_lengths("128", "prompt-tokens") == Lengths(128, 128)
    assert parse_lengths("uniform:64:256", "prompt-tokens") == Lengths(64, 256)
    for bad in ("0", "uniform:9:3", "normal:1:2", "-4"):
        with pytest.raises(UserError, match="prompt-tokens"):
            parse_lengths(bad, "prompt-tokens")
    drawn = requests(400, Lengths(10, 20), Lengths(5, 5), "ids", None, seed=3)
    assert {r.prompt_tokens for r in drawn} == set(range(10, 21))  # every length of the range, none outside
    assert all(len(r.prompt) == r.prompt_tokens and r.output_tokens == 5 for r in drawn)
    text = requests(3, Lengths(7, 7), Lengths(1, 1), "text", None, seed=0)
    assert all(len(r.prompt.split()) == 7 for r in text)


def test_poisson_arrivals_have_the_rate_asked_and_inf_sends_at_once():
    rate, count = 20.0, 4000
    sent = [r.send_at for r in requests(count, Lengths(1, 1), Lengths(1, 1), "ids", rate, seed=1)]
    gaps = np.diff(sent)
    assert abs(gaps.mean() - 1 / rate) < 0.05 / rate  # mean gap 1/rate: 4000 exponential gaps, sd 1.6%
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1  # exponential: its CV is 1
    assert sent == [r.send_at for r in requests(count, Lengths(1, 1), Lengths(1, 1), "ids", rate, seed=1)]
    assert {r.send_at for r in requests(5, Lengths(1, 1), Lengths(1, 1), "ids", math.inf, seed=1)} == {0.0}


def _outcome(index, sent, ttft, gaps, ended=None, error=None):
    first = sent + ttft
    chunks = [first + sum(gaps[:i]) for i in range(len(gaps) + 1)]
    return Outcome(index=index, sent=sent, prompt_tokens=10, output_tokens=0 if error else len(chunks),
                   ttft=None if error else ttft, e2e=None if error else chunks[-1] - sent,
                   chunk_times=[] if error else chunks, ended=ended if ended is not None else chunks[-1], error=error)


def test_a_points_figures_recomputed_by_hand():
    outcomes = [_outcome(0, 0.0, 0.1, [0.02, 0.02, 0.02]),  # 4 tokens, e2e 0.16, tpot 0.02
                _outcome(1, 0.5, 0.3, [0.05]),  # 2 tokens, e2e 0.35, tpot 0.05
                _outcome(2, 1.0, 0.2, [0.01, 0.03]),  # 3 tokens, e2e 0.24, tpot 0.02
                _outcome(3, 1.1, 0, [], ended=2.0, error="http: 500")]
    figures = summary(outcomes, parse_slo(["ttft:250ms", "tpot:0.03s"]))
    duration = 2.0 - 0.0  # first send to the last end, the failed request's included
    assert figures["duration_s"] == pytest.approx(duration)
    assert (figures["completed"], figures["failed"], figures["failures"]) == (3, 1, {"http": 1})
    assert figures["output_tokens_per_s"] == pytest.approx((4 + 2 + 3) / duration)
    assert figures["total_tokens_per_s"] == pytest.approx((4 + 2 + 3 + 3 * 10) / duration)
    assert figures["requests_per_s"] == pytest.approx(3 / duration)
    ttft = figures["latency"]["ttft"]  # sorted 0.1, 0.2, 0.3: p50 the middle; p90 = 0.2 + 0.8 (0.3 - 0.2)
    assert (ttft["p50"], ttft["p90"], ttft["p99"]) == pytest.approx((0.2, 0.28, 0.298))
    assert figures["latency"]["tpot"]["mean"] == pytest.approx((0.02 + 0.05 + 0.02) / 3)
    assert figures["latency"]["itl"]["count"] == 3 + 1 + 2
    assert figures["latency"]["e2e"]["max"] == pytest.approx(0.35)
    # the first meets both targets; the second misses ttft and tpot; the third meets both
    assert figures["good"] == 2 and figures["goodput_requests_per_s"] == pytest.approx(2 / duration)
    with pytest.raises(UserError, match="slo"):
        parse_slo(["ttfb:1s"])


def _bench(server, points, count, slo=()):
    return ServeBench(base_url=server.base_url, model="loopback", points=points, requests=count,
                      prompt=Lengths(8, 8), output=Lengths(6, 6), slo=parse_slo(slo))


def test_every_failure_is_counted_and_every_figure_recomputes_from_the_raw_records(tmp_path):
    first_delay, token_delay = 0.05, 0.01
    with LoopbackServer(first_delay, token_delay, errors=frozenset({1, 6}), drops=frozenset({3, 4})) as server:
        store = ResultStore(tmp_path)
        rows = run_bench(_bench(server, (Point(concurrency=3),), 10, ["e2e:10s"]), store)
        assert len(server.bodies) == 10
    (row,) = rows
    serving, outcomes = row["serving"], row["serving"]["outcomes"]
    assert row["status"] == "ok" and len(outcomes) == 10  # nothing dropped from the row
    assert (serving["completed"], serving["failed"]) == (6, 4)
    assert serving["failures"] == {"dropped": 2, "http": 2}
    assert row["warnings"] == ["4 of 10 requests failed: 2 dropped, 2 http"]
    done = [o for o in outcomes if o["error"] is None]
    assert all(o["output_tokens"] == 6 and len(o["chunk_times"]) == 6 for o in done)
    ttft = np.array([o["ttft"] for o in done])
    assert (ttft >= first_delay).all()  # the server waited first_delay before the first token
    itl = np.array([b - a for o in done for a, b in zip(o["chunk_times"], o["chunk_times"][1:])])
    # a gap is the server's sleep as the client read it: one read late makes the next gap short
    assert np.median(itl) >= token_delay and len(itl) == 6 * 5
    duration = max(o["ended"] for o in outcomes) - min(o["sent"] for o in outcomes)
    assert serving["duration_s"] == pytest.approx(duration, abs=2e-6)
    for figure, values in (("ttft", ttft), ("itl", itl), ("e2e", np.array([o["e2e"] for o in done]))):
        for p in (50, 90, 99):
            assert row["timing"][figure][f"p{p}"] == pytest.approx(np.percentile(values, p), abs=2e-6)
    tpot = [(o["e2e"] - o["ttft"]) / (o["output_tokens"] - 1) for o in done]
    assert row["timing"]["tpot"]["mean"] == pytest.approx(np.mean(tpot), abs=2e-6)
    assert row["throughput"]["decode_tokens_per_s"] == pytest.approx(6 * 6 / duration, rel=1e-4)
    assert row["throughput"]["goodput_requests_per_s"] == pytest.approx(6 / duration, rel=1e-4)
    assert row["timing"]["samples"]["token_latency"] == pytest.approx(list(itl), abs=2e-6)
    assert [row["key"]] == [r.key for r in store.typed_rows()]  # written through the store, read back typed


def test_a_server_that_is_not_there_gives_a_row_of_connection_failures(tmp_path):
    with LoopbackServer() as server:
        url = server.base_url
    bench = ServeBench(base_url=url, model="gone", points=(Point(rate=math.inf),), requests=3, prompt=Lengths(2, 2),
                       output=Lengths(2, 2))
    (row,) = run_bench(bench, ResultStore(tmp_path))
    assert row["status"] == "error" and row["serving"]["failures"] == {"connection": 3}
    assert row["error"].startswith("no request completed; the first: connection:")


def test_the_command_writes_rows_report_and_compare_read_and_resume_skips(tmp_path, capsys):
    out = tmp_path / "a"
    with LoopbackServer(0.01, 0.002) as server:
        argv = ["serve-bench", "--base-url", server.base_url, "--rates", "40", "inf", "--concurrency", "2",
                "--requests", "4", "--prompt-tokens", "uniform:4:8", "--output-tokens", "3", "--out", str(out),
                "--quiet"]
        assert main(argv) == 0
        assert len(server.bodies) == 12 and all(body["model"] == "loopback" for body in server.bodies)
        assert main(["serve-bench", "--resume", str(out), "--quiet"]) == 0
        assert len(server.bodies) == 12  # every point had its row: nothing sent again
    rows = list(ResultStore(out).typed_rows())
    assert [row.serving["point"] for row in rows] == ["rate 40/s", "rate inf", "concurrency 2"]
    assert all(row.spec["mode"] == "serve" and row.status == "ok" for row in rows)
    assert main(["report", str(out), "--html", str(tmp_path / "report.html")]) == 0
    figure = latency_figure(read_sweeps(out))
    ttft_p50 = next(trace for trace in figure.data if trace.name.endswith("ttft p50"))
    ordered = sorted(rows, key=lambda row: row.throughput["decode_tokens_per_s"])
    assert list(ttft_p50.y) == pytest.approx([row.timing["ttft"]["p50"] * 1e3 for row in ordered])
    assert "Serving latency against load" in (tmp_path / "report.html").read_text()
    assert main(["compare", str(out), str(out), "--fail-on", "mean:5%"]) == 0


def test_bad_options_are_one_paragraph(tmp_path, capsys):
    assert main(["serve-bench", "--out", str(tmp_path / "x")]) == 2
    assert "base-url" in capsys.readouterr().err
    assert main(["serve-bench", "--base-url", "ftp://x", "--out", str(tmp_path / "y")]) == 2
    assert main(["serve-bench", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--slo", "ttft:x",
                 "--out", str(tmp_path / "z")]) == 2
    assert "slo" in capsys.readouterr().err
    assert main(["serve-bench", "--resume", str(tmp_path / "none")]) == 2
    assert main(["serve-bench", "--start-vllm", "tiny", "--precision", "int4", "--out", str(tmp_path / "w")]) == 2
    assert "precision: vLLM has no int4" in capsys.readouterr().err
    assert main(["serve-bench", "--start-vllm", "no-such-model", "--out", str(tmp_path / "v")]) == 2


def test_every_precision_is_vllms_or_refused_saying_why():
    for name in PRECISIONS:
        options = precision_options(name)
        if isinstance(options, str):
            assert options.startswith(f"vLLM has no {name}: ")
        else:
            assert options["dtype"] in ("bfloat16", "float16", "float32")
    # the weights vLLM holds are those of the precision's compute dtype
    assert precision_options("bf16") == precision_options("bf16-pure") == {"dtype": "bfloat16"}
    assert precision_options("nf4") == {"dtype": "bfloat16", "quantization": "bitsandbytes"}
    assert layout_options(tp=2, pp=2, replicas=3) == {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                                      "data_parallel_size": 3}
    assert "DDP and FSDP" in layout_options(dp_shard=2)


@pytest.mark.slow
def test_ctrl_c_keeps_the_finished_points_and_resume_runs_the_rest(tmp_path):
    out = tmp_path / "run"
    with LoopbackServer(0.01, 0.2) as server:  # 2 requests at once, 6 tokens of 0.2 s: a point lasts ~2 s
        command = [sys.executable, "-m", "fitbench", "serve-bench", "--base-url", server.base_url, "--concurrency",
                   "2", "1", "--requests", "4", "--output-tokens", "6", "--out", str(out), "--quiet"]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        results = out / "results.jsonl"
        deadline = time.monotonic() + 60
        while not (results.exists() and results.read_text().count("\n") == 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
        assert process.returncode == 130, output
        assert "serve-bench --resume" in output
        assert [json.loads(line)["serving"]["point"] for line in results.read_text().splitlines()] == [
            "concurrency 2"]
        sent = len(server.bodies)
        assert main(["serve-bench", "--resume", str(out), "--quiet"]) == 0
        assert len(server.bodies) == sent + 4  # the interrupted point, whole, and nothing else
    assert [row.serving["point"] for row in ResultStore(out).typed_rows()] == ["concurrency 2", "concurrency 1"]
