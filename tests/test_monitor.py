"""The per-GPU NVML monitor: what it says without NVML, its arithmetic on samples given by hand, its
timeline file (a killed writer included), and, where NVML and a CUDA GPU exist, a real job."""

import dataclasses
import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fitbench.monitor.nvml import (
    FORMAT,
    GpuMonitor,
    Sample,
    TimelineWriter,
    job_gpus,
    open_timeline,
    read_timeline,
    summarize,
    summarize_gpu,
    visible_devices,
)

REPO = Path(__file__).resolve().parents[1]


def _nvml_starts() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


NVML = _nvml_starts()


def _sampler_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "fitbench-nvml"]


# ---------------------------------------------------------------------------------------------
# Without NVML, or without the GPU asked for


@pytest.mark.skipif(NVML, reason="NVML starts on this machine")
def test_without_nvml_the_summary_says_why_and_nothing_is_left(tmp_path):
    with GpuMonitor(["0", "1"], tmp_path) as monitor:
        assert not _sampler_threads()
    summary = monitor.summary(tokens=1000)
    assert summary["available"] is False
    assert summary["reason"].startswith("NVML unavailable: ")
    assert len(summary["reason"]) > len("NVML unavailable: ")
    assert summary["gpus"] == [] and summary["energy_j"] is None and summary["energy_per_token_j"] is None
    assert summary["timeline"] is None
    assert json.loads(json.dumps(summary)) == summary  # goes into a row as it is
    assert list(tmp_path.iterdir()) == []
    assert not _sampler_threads()


def test_a_gpu_nobody_has_is_named_not_raised(tmp_path):
    """Runs everywhere: without NVML the reason is NVML's, with it the UUID that matches nothing."""
    monitor = GpuMonitor(["GPU-00000000-no-such-gpu"], tmp_path)
    monitor.start()
    monitor.stop()
    summary = monitor.summary()
    assert summary["available"] is False
    if NVML:
        assert "no GPU's UUID starts with 'GPU-00000000-no-such-gpu'" in summary["reason"]
        assert summary["gpus"][0]["available"] is False and summary["gpus"][0]["energy_j"] is None
    assert not _sampler_threads()
    with pytest.raises(RuntimeError, match="runs once"):
        monitor.start()


def test_visible_devices_as_cuda_reads_them():
    assert visible_devices(None) is None
    assert visible_devices("") == []
    assert visible_devices("0,2,-1,1") == ["0", "2"]  # CUDA hides everything from an invalid entry on
    assert visible_devices("GPU-8932f937, MIG-a1b2,3") == ["GPU-8932f937", "MIG-a1b2", "3"]
    assert job_gpus(2, {}) == ["0", "1"]
    assert job_gpus(2, {"CUDA_VISIBLE_DEVICES": "3,1,0"}) == ["3", "1"]
    assert job_gpus(4, {"CUDA_VISIBLE_DEVICES": "5"}) == ["5"]
    # a one-GPU job on cuda:1 is watched on the second visible GPU, not the first
    assert job_gpus(1, {}, first=1) == ["1"]
    assert job_gpus(1, {"CUDA_VISIBLE_DEVICES": "3,1,0"}, first=1) == ["1"]
    assert job_gpus(2, {"CUDA_VISIBLE_DEVICES": "3,1"}, first=1) == ["1"]


# ---------------------------------------------------------------------------------------------
# The arithmetic, on samples given by hand


def _three_samples(gpu: int = 0) -> list[Sample]:
    # uneven gaps (0.1 s, then 0.2 s), as a late round leaves them
    return [
        Sample(t=10.0, gpu=gpu, memory_used_bytes=1_000, utilization_percent=0.0, power_w=100.0,
               temperature_c=40, sm_clock_mhz=1000, energy_j=5000.0),
        Sample(t=10.1, gpu=gpu, memory_used_bytes=3_000, utilization_percent=50.0, power_w=200.0,
               temperature_c=45, sm_clock_mhz=1800, energy_j=5015.0),
        Sample(t=10.3, gpu=gpu, memory_used_bytes=2_000, utilization_percent=100.0, power_w=300.0,
               temperature_c=44, sm_clock_mhz=1800, energy_j=5070.0),
    ]


def test_peaks_means_and_energy_from_the_counter():
    figures = summarize_gpu(reversed(_three_samples()), tokens=1000)  # order must not matter
    assert figures["samples"] == 3
    assert figures["duration_s"] == pytest.approx(0.3)
    assert figures["interval_s"]["mean"] == pytest.approx(0.15)
    assert figures["interval_s"]["max"] == pytest.approx(0.2)
    assert figures["peak_memory_used_bytes"] == 3_000
    assert figures["peak_power_w"] == 300.0
    assert figures["peak_temperature_c"] == 45
    # time-weighted: trapezoids (0+50)/2 * 0.1 + (50+100)/2 * 0.2 = 2.5 + 15 = 17.5 %·s over 0.3 s
    assert figures["mean_utilization_percent"] == pytest.approx(17.5 / 0.3)
    # power: (100+200)/2 * 0.1 + (200+300)/2 * 0.2 = 15 + 50 = 65 J over 0.3 s
    assert figures["mean_power_w"] == pytest.approx(65 / 0.3)
    assert figures["mean_sm_clock_mhz"] == pytest.approx(((1000 + 1800) / 2 * 0.1 + 1800 * 0.2) / 0.3)
    assert figures["mean_memory_utilization_percent"] is None  # never given
    # the counter rose 5070 - 5000 = 70 J; it wins over the trapezoid's 65 J
    assert figures["energy_method"] == "nvml_energy_counter"
    assert figures["energy_j"] == pytest.approx(70.0)
    assert figures["energy_per_token_j"] == pytest.approx(70.0 / 1000)


def test_without_a_counter_energy_is_the_trapezoid_of_power():
    samples = [Sample(t=s.t, gpu=0, power_w=s.power_w) for s in _three_samples()]
    figures = summarize_gpu(samples, tokens=500)
    assert figures["energy_method"] == "trapezoid_power"
    assert figures["energy_j"] == pytest.approx(15 + 50)
    assert figures["energy_per_token_j"] == pytest.approx(65 / 500)


def test_a_counter_that_goes_back_is_not_trusted():
    samples = _three_samples()
    samples[2] = dataclasses.replace(samples[2], energy_j=3.0)
    figures = summarize_gpu(samples)
    assert figures["energy_method"] == "trapezoid_power"
    assert figures["energy_j"] == pytest.approx(65.0)


def test_a_null_sample_is_left_out_not_read_as_zero():
    samples = [
        Sample(t=0.0, gpu=0, power_w=100.0, utilization_percent=20.0),
        Sample(t=0.1, gpu=0, power_w=None, utilization_percent=None),  # a query that failed once
        Sample(t=0.3, gpu=0, power_w=300.0, utilization_percent=80.0),
    ]
    figures = summarize_gpu(samples)
    assert figures["energy_j"] == pytest.approx((100 + 300) / 2 * 0.3)  # 60 J, one trapezoid
    assert figures["mean_power_w"] == pytest.approx(200.0)
    assert figures["mean_utilization_percent"] == pytest.approx(50.0)
    assert figures["peak_memory_used_bytes"] is None and figures["peak_temperature_c"] is None
    nothing = summarize_gpu([Sample(t=0.0, gpu=0), Sample(t=0.1, gpu=0)], tokens=10)
    assert nothing["energy_j"] is None and nothing["energy_method"] is None and nothing["energy_per_token_j"] is None


def test_a_window_cuts_the_integrals_at_its_edges():
    window = (10.05, 10.2)
    figures = summarize_gpu(_three_samples(), tokens=100, window=window)
    # counter read linearly at the edges: 5000 + 15 * 0.5 = 5007.5 and 5015 + 55 * 0.5 = 5042.5
    assert figures["energy_j"] == pytest.approx(5042.5 - 5007.5)
    assert figures["energy_per_token_j"] == pytest.approx(35.0 / 100)
    assert figures["samples"] == 1  # only t = 10.1 lies inside
    assert figures["peak_power_w"] == 200.0
    assert figures["duration_s"] == pytest.approx(0.15)
    # power at the edges 150 W and 250 W: (150+200)/2 * 0.05 + (200+250)/2 * 0.1 = 8.75 + 22.5
    assert figures["mean_power_w"] == pytest.approx((8.75 + 22.5) / 0.15)
    no_counter = [Sample(t=s.t, gpu=0, power_w=s.power_w) for s in _three_samples()]
    assert summarize_gpu(no_counter, window=window)["energy_j"] == pytest.approx(8.75 + 22.5)
    outside = summarize_gpu(_three_samples(), window=(20.0, 21.0))
    assert outside["samples"] == 0 and outside["energy_j"] is None and outside["mean_power_w"] is None


def test_the_job_sums_its_gpus():
    second = [Sample(t=s.t, gpu=1, power_w=s.power_w) for s in _three_samples()]  # no counter: 65 J
    job = summarize(_three_samples(0) + second, gpus=[0, 1], tokens=1000)
    assert job["gpus"][0]["energy_j"] == pytest.approx(70.0)
    assert job["gpus"][1]["energy_j"] == pytest.approx(65.0)
    assert job["energy_j"] == pytest.approx(135.0)
    assert job["energy_per_token_j"] == pytest.approx(0.135)
    assert job["gpus"][0]["energy_per_token_j"] + job["gpus"][1]["energy_per_token_j"] == pytest.approx(0.135)
    # a GPU with no energy figure leaves the job's total unknown rather than too small
    unknown = summarize(_three_samples(0), gpus=[0, 1], tokens=1000)
    assert unknown["gpus"][1]["samples"] == 0
    assert unknown["energy_j"] is None and unknown["energy_per_token_j"] is None
    with pytest.raises(ValueError, match="tokens must be positive"):
        summarize(_three_samples(), gpus=[0], tokens=0)
    with pytest.raises(ValueError, match="before it starts"):
        summarize(_three_samples(), gpus=[0], window=(2.0, 1.0))


# ---------------------------------------------------------------------------------------------
# The timeline file


def test_timeline_round_trip_and_a_line_cut_short(tmp_path):
    path = tmp_path / "artifacts" / "nvml.jsonl"
    samples = _three_samples(0) + [Sample(t=10.05, gpu=1, utilization_percent=7.0)]
    writer = TimelineWriter(path)
    writer.header({"gpus": [{"gpu": 0, "uuid": "GPU-a"}, {"gpu": 1, "uuid": "GPU-b"}]})
    writer.samples(samples[:2])
    writer.samples(samples[2:])
    writer.close()
    timeline = read_timeline(path)
    assert timeline.header["format"] == FORMAT and timeline.header["gpus"][1]["uuid"] == "GPU-b"
    assert timeline.samples == tuple(samples)
    assert timeline.damaged_lines == 0
    assert summarize(timeline.samples, gpus=[0]) == summarize(samples, gpus=[0])

    # a run killed mid-write leaves a prefix of its last line; every cut point is a damaged line
    data = path.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    for cut in range(last + 1, len(data) - 1):
        path.write_bytes(data[:cut])
        timeline = read_timeline(path)
        assert timeline.samples == tuple(samples[:-1]), cut
        assert timeline.damaged_lines == 1, cut
    path.write_bytes(data[:-1])  # only the newline lost: the line is whole
    assert read_timeline(path).samples == tuple(samples)

    # appending after a cut (a second monitor on the same file) starts on a line of its own
    path.write_bytes(data[: last + 5])
    writer = TimelineWriter(path)
    writer.samples([samples[0]])
    writer.close()
    timeline = read_timeline(path)
    assert timeline.samples == tuple(samples[:-1]) + (samples[0],)
    assert timeline.damaged_lines == 1


def test_a_gzipped_timeline_reads_as_the_plain_one(tmp_path):
    """Committed timelines are gzipped: the same samples come back from ``nvml.jsonl.gz``, named
    as such or by the plain name a row's ``timeline`` records."""
    plain = tmp_path / "plain" / "nvml.jsonl"
    samples = _three_samples(0) + _three_samples(1)
    writer = TimelineWriter(plain)
    writer.header({"gpus": [{"gpu": 0, "uuid": "GPU-a"}, {"gpu": 1, "uuid": "GPU-b"}]})
    writer.samples(samples)
    writer.close()
    packed = tmp_path / "packed" / "nvml.jsonl.gz"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert packed.stat().st_size < plain.stat().st_size
    expected = read_timeline(plain)
    assert expected.samples == tuple(samples) and expected.damaged_lines == 0
    for path in (packed, packed.with_name("nvml.jsonl")):
        assert read_timeline(path) == expected, path
    with open_timeline(packed.with_name("nvml.jsonl")) as lines:
        assert lines.read() == plain.read_text()

    # where both exist, the plain name is the plain file (a sweep's own, still being written)
    (packed.parent / "nvml.jsonl").write_text(plain.read_text().splitlines(keepends=True)[0])
    assert read_timeline(packed.with_name("nvml.jsonl")).samples == ()
    with pytest.raises(FileNotFoundError, match="missing"):
        read_timeline(tmp_path / "missing" / "nvml.jsonl")

    # a compressed file cut short gives a prefix of its samples and one damaged line
    data = packed.read_bytes()
    packed.write_bytes(data[: len(data) - 12])
    cut = read_timeline(packed)
    assert cut.samples == tuple(samples[: len(cut.samples)]) and cut.damaged_lines == 1


def test_every_committed_timeline_reads_whole():
    """The timelines under ``benchmarks/results/`` are gzipped and read without a damaged line."""
    results = REPO / "benchmarks" / "results"
    compressed = sorted(results.rglob("nvml*.jsonl.gz"))
    assert compressed, "no committed timeline found"
    assert not sorted(results.rglob("nvml*.jsonl")), "commit timelines gzipped (gzip -9 nvml.jsonl)"
    for path in compressed:
        timeline = read_timeline(path)
        assert timeline.header["format"] == FORMAT and timeline.samples and not timeline.damaged_lines, path


def test_a_killed_writer_loses_no_flushed_round(tmp_path):
    """A real process writes rounds and says after each how many it flushed; SIGKILL mid-stream."""
    path = tmp_path / "nvml.jsonl"
    child = (
        "import sys, itertools\n"
        "from fitbench.monitor.nvml import Sample, TimelineWriter\n"
        "writer = TimelineWriter(sys.argv[1])\n"
        "writer.header({'gpus': []})\n"
        "for k in itertools.count():\n"
        "    writer.samples([Sample(t=float(k), gpu=g, power_w=100.0 + k) for g in range(2)])\n"
        "    print(k + 1, flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-c", child, str(path)], stdout=subprocess.PIPE, env=env)
    try:
        flushed = 0
        while flushed < 200:
            flushed = int(process.stdout.readline())
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(timeout=30)
        process.stdout.close()
    assert process.returncode == -signal.SIGKILL
    timeline = read_timeline(path)
    assert timeline.header is not None
    assert len(timeline.samples) >= 2 * flushed
    assert timeline.damaged_lines <= 1
    rounds = sorted({s.t for s in timeline.samples})
    assert rounds[: flushed] == [float(k) for k in range(flushed)]


# ---------------------------------------------------------------------------------------------
# The sampling thread on a real GPU (skipped where there is none).


@pytest.mark.skipif(not NVML, reason="needs NVML and a GPU")
def test_monitors_a_real_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gpus = job_gpus(1)
    before = len(threading.enumerate())
    with GpuMonitor(gpus, tmp_path, interval_s=0.1) as monitor:
        assert len(_sampler_threads()) == 1
        begin = time.monotonic()
        a = torch.randn(8192, 8192, device="cuda")  # 256 MiB
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
        end = time.monotonic()
    assert not _sampler_threads() and len(threading.enumerate()) == before
    summary = monitor.summary(tokens=10_000)
    gpu = summary["gpus"][0]
    assert summary["available"] and gpu["available"], summary
    assert gpu["uuid"].startswith(("GPU-", "MIG-")) and gpu["requested"] == gpus[0]
    assert gpu["samples"] >= 15
    assert 0.08 <= gpu["interval_s"]["median"] <= 0.15, gpu["interval_s"]
    assert gpu["peak_memory_used_bytes"] >= 8192 * 8192 * 4
    assert gpu["peak_memory_used_bytes"] <= gpu["memory_total_bytes"]
    assert gpu["mean_utilization_percent"] > 10
    if "energy_j" not in gpu["refused"] or "power_w" not in gpu["refused"]:
        assert gpu["energy_j"] > 0 and gpu["energy_method"] in ("nvml_energy_counter", "trapezoid_power")
        assert gpu["energy_per_token_j"] == pytest.approx(gpu["energy_j"] / 10_000)
        assert summary["energy_j"] == pytest.approx(gpu["energy_j"])
    timeline = read_timeline(summary["timeline"])
    assert timeline.samples == monitor.samples and timeline.damaged_lines == 0
    assert timeline.header["gpus"][0]["uuid"] == gpu["uuid"]
    inside = monitor.summary(tokens=10_000, window=(begin, end))["gpus"][0]
    assert inside["samples"] < gpu["samples"] and inside["duration_s"] == pytest.approx(end - begin, abs=0.15)
    print(json.dumps(summary, indent=1))

    # the same GPU asked for by a prefix of its UUID, as CUDA_VISIBLE_DEVICES may name it
    with GpuMonitor([gpu["uuid"][:12]], tmp_path / "by-uuid") as again:
        time.sleep(0.3)
    assert again.summary()["gpus"][0]["uuid"] == gpu["uuid"]
