"""Nothing left behind: real sweeps, real signals, real processes, real locks.

Every process a sweep starts inherits a mark in its environment; a test that ends a sweep then
looks for any living process that carries it, and for any scratch directory in the sweep's TMPDIR.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fitbench.cli import main
from fitbench.launch.local import MAX_LINE_BYTES
from fitbench.results.store import ResultStore
from fitbench.worker import worker
from fitbench.spec import Assignment, RunSpec
from fitbench.util.host import host_memory, memory_cgroups, oom_kills
from conftest import cli

SHAPES = ["--mode", "forward", "--batch-size", "1", "--seq-len", "16", "--warmup-steps", "1", "--measure-steps", "1"]
MARK = "FITBENCH_TEST_MARK"
slow = pytest.mark.slow


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Each test in its own directory, with its own TMPDIR for the sweep's scratch directories and a mark
    that every process the sweep starts inherits."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv(MARK, uuid.uuid4().hex)


def marked(mark: str | None = None) -> set[int]:
    """Living processes (not zombies) that carry this test's mark (or ``mark``), this one excluded."""
    needle = f"{MARK}={mark or os.environ[MARK]}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.add(int(entry))
        except OSError:
            continue
    return found


def scratch(tmp_path: Path) -> list[Path]:
    """The sweep's scratch directories (torch keeps caches of its own beside them)."""
    return list((tmp_path / "tmp").glob("fitbench-*"))


def assert_nothing_left(tmp_path: Path, within: float = 30, mark: str | None = None) -> None:
    deadline = time.monotonic() + within
    while (marked(mark) or scratch(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not marked(mark), f"processes left running: {sorted(marked(mark))}"
    assert scratch(tmp_path) == [], "scratch directories left behind"


def rows_of(out: Path) -> list[dict]:
    return list(ResultStore(out).rows())


# ---- the worker dies with its parent ---------------------------------------------------------------


SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGKILL]
# name -> (options, FITBENCH_INJECT) of the sweeps that are not sent a signal
FINISHING = {
    # Each probe of --batch-size auto hangs: per attempt, the timeout would let every probe run its course.
    "timeout": (["--batch-size", "auto", "--timeout", "10"], "orphan:tiny,hang:tiny"),
    # The worker's child holds stdout open after the worker exits; its progress channel carries garbage.
    "misbehaving": (["--timeout", "120"], "orphan:tiny,garbage:tiny"),
}


@dataclass
class Sweep:
    """``fitbench run`` of tiny as a real process, what was running just before it was sent its signal
    (if it was) and what was left the moment it exited."""

    directory: Path  # the sweep's TMPDIR is directory / "tmp", its results directory / "out"
    mark: str  # in the environment of every process the sweep started
    process: subprocess.Popen
    started: float  # time.monotonic()
    running: int = 0  # processes with the mark, just before the signal
    scratch: list[Path] = field(default_factory=list)  # scratch directories, just before the signal
    elapsed: float = 0.0
    left: set[int] = field(default_factory=set)  # processes with the mark, the moment it exited
    scratch_left: list[Path] = field(default_factory=list)  # scratch directories, the moment it exited

    @property
    def out(self) -> Path:
        return self.directory / "out"

    @property
    def stdout(self) -> str:
        return (self.directory / "stdout").read_text()

    @property
    def stderr(self) -> str:
        return (self.directory / "stderr").read_text()


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> dict[int | str, Sweep]:
    """One sweep per signal of SIGNALS, each sent its signal once its worker hangs with a child in a
    session of its own holding its stdout, and the sweeps of FINISHING: started at once (they share
    the cores, and waits cost no time of their own), each looked at the moment it exits."""
    planned = {signum: ([], "orphan:tiny,hang:tiny") for signum in SIGNALS} | FINISHING
    started: dict[int | str, Sweep] = {}
    try:
        for name, (options, inject) in planned.items():
            label = name.name if isinstance(name, signal.Signals) else name
            directory, mark = tmp_path_factory.mktemp(label), uuid.uuid4().hex
            (directory / "tmp").mkdir()
            env = {**os.environ, "FITBENCH_INJECT": inject, MARK: mark, "TMPDIR": str(directory / "tmp")}
            with (directory / "stdout").open("w") as stdout, (directory / "stderr").open("w") as stderr:
                process = subprocess.Popen(
                    [sys.executable, "-m", "fitbench", "run", "--models", "tiny", *SHAPES, *options, "--out",
                     str(directory / "out")], cwd=directory, stdout=stdout, stderr=stderr, env=env)
            started[name] = Sweep(directory, mark, process, time.monotonic())
        unsignalled, running = set(SIGNALS), dict(started)
        deadline = time.monotonic() + 240  # then what still runs is killed, and its test fails
        while running and time.monotonic() < deadline:
            for name, sweep in list(running.items()):
                if sweep.process.poll() is not None:
                    sweep.elapsed = time.monotonic() - sweep.started
                    sweep.left, sweep.scratch_left = marked(sweep.mark), scratch(sweep.directory)
                    del running[name]
                elif name in unsignalled and any("hangs" in log.read_text(errors="replace")
                                                 for log in (sweep.out / "logs").glob("*.log")):
                    sweep.running, sweep.scratch = len(marked(sweep.mark)), scratch(sweep.directory)
                    sweep.process.send_signal(name)
                    unsignalled.remove(name)
            time.sleep(0.05)
    finally:
        for sweep in started.values():
            if sweep.process.poll() is None:
                sweep.process.kill()
                sweep.process.wait()
    return started


@slow
@pytest.mark.parametrize("signum", SIGNALS)
def test_a_killed_sweep_leaves_no_process_and_no_scratch_directory(signum, sweeps):
    sweep = sweeps[signum]
    out, stderr = sweep.out, sweep.stderr
    # the sweep, its worker, and the worker's child in a session of its own (none: it ended, or never
    # hung, before it could be interrupted)
    assert sweep.running >= 3, (sweep.process.returncode, stderr)
    assert sweep.scratch, "the worker runs in a scratch directory"
    assert_nothing_left(sweep.directory, mark=sweep.mark)
    if signum == signal.SIGKILL:
        assert sweep.process.returncode == -signal.SIGKILL
        assert rows_of(out) == []
        return
    assert sweep.process.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert f"interrupted by {signal.Signals(signum).name}" in stderr
    (row,) = rows_of(out)
    assert row["status"] == "interrupted" and row["spec"]["model"] == "tiny"
    assert signal.Signals(signum).name in row["error"] and "--resume" in row["error"]
    assert ResultStore(out).finished_keys() == set()  # --resume runs it again


@slow
def test_the_timeout_bounds_batch_probes_and_kills_all_the_worker_started(sweeps):
    sweep = sweeps["timeout"]
    assert sweep.process.returncode == 1, sweep.stderr
    (row,) = rows_of(sweep.out)
    assert row["status"] == "timeout"
    assert "10 s --timeout (batch probes and fallback attempts included)" in row["error"]
    assert [attempt["status"] for attempt in row["attempts"]] == ["timeout"]
    assert row["attempts"][0]["spec"]["auto_batch"]  # it was a probe
    assert sweep.elapsed < 10 + 25, sweep.elapsed
    assert not sweep.left and not sweep.scratch_left  # gone before the row was written
    assert "tiny forward fp32 autox16 [native]: timeout" in " ".join(sweep.stdout.split())


@slow
def test_a_misbehaving_worker_that_exits_0_is_ok_and_leaves_nothing(sweeps):
    sweep = sweeps["misbehaving"]
    assert sweep.process.returncode == 0, sweep.stderr
    (row,) = rows_of(sweep.out)
    assert row["status"] == "ok" and row["exit_code"] == 0, row.get("error")
    assert row["wall_s"] < 100  # not held until the timeout by the child's open stdout
    errors = row["protocol_errors"]
    assert [error.split(": ", 1)[1] for error in errors] == [
        "JSON that is not an object: '[1, 2, 3]'", "JSON that is not an object: '42'", "bytes that are not UTF-8",
        f"a line longer than {MAX_LINE_BYTES >> 20} MiB"]
    assert any(warning.startswith("protocol error") for warning in row["warnings"])
    assert (sweep.out / "logs" / f"{row['key']}-1.log").stat().st_size < MAX_LINE_BYTES  # the huge line was not kept
    assert not sweep.left and not sweep.scratch_left


# ---- one sweep per output directory -------------------------------------------------------------------


def test_one_sweep_per_output_directory(tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from fitbench.results.store import ResultStore;"
                               f"store = ResultStore({str(out)!r}); store.lock(); print('locked', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, stderr = cli(["run", "--models", "tiny", *SHAPES, "--out", str(out)], capsys)
        assert code == 2
        assert f"PID {holder.pid}" in stderr and "--out" in stderr and "Traceback" not in stderr
        assert len(stderr.strip().splitlines()) == 1
        assert sorted(path.name for path in out.iterdir()) == ["fitbench.lock"]  # nothing written, nothing ran
    finally:
        holder.kill()
        holder.wait()
    # The killed holder's lock file stays; its lock went with it.
    store = ResultStore(out)
    store.lock()
    assert (out / "fitbench.lock").read_text().strip() == str(os.getpid())
    store.unlock()


def test_an_interrupted_row_is_run_again_and_replaced(tmp_path):
    store = ResultStore(tmp_path / "store")
    spec = {"model": "tiny", "mode": "train", "precision": "fp32", "batch_size": 1, "seq_len": 16}
    store.append({"key": "a", "status": "ok", "spec": spec})
    store.append({"key": "b", "status": "interrupted", "spec": spec})
    assert store.finished_keys() == {"a"}
    assert [row["key"] for row in store.rows()] == ["a", "b"]
    store.append({"key": "b", "status": "oom", "spec": spec})
    assert store.finished_keys() == {"a", "b"}
    assert [(row["key"], row["status"]) for row in store.rows()] == [("a", "ok"), ("b", "oom")]


# ---- timeout values -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5", "-inf"])
def test_timeout_must_be_finite_and_positive(value, tmp_path, capsys):
    code, _, stderr = cli(["run", "--models", "tiny", f"--timeout={value}", "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert "timeout" in stderr and "--timeout" in stderr and "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_help_says_what_the_timeout_bounds_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "a configuration's whole life: its batch probes (--batch-size auto), fallback attempts and run" in text
    assert "exit status: 0 every configuration ok; 1 one or more did not finish ok" in text
    assert "2 bad input, nothing ran; 130 interrupted" in text


# ---- memory on a CPU ------------------------------------------------------------------------------------


def test_a_cpu_allocation_failure_is_an_out_of_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("FITBENCH_INJECT", "alloc:tiny")
    spec = RunSpec(model="tiny", backend="native", mode="forward", precision="fp32", batch_size=1, seq_len=16,
                   new_tokens=2, device="cpu", warmup_steps=0, measure_steps=1)
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(Assignment(spec=spec).model_dump_json())
    assert worker.main([str(spec_path), str(result_path)]) == worker.EXIT_FAILED
    result = json.loads(result_path.read_text())
    assert result["status"] == "oom"
    assert "DefaultCPUAllocator: can't allocate memory" in result["error"]
    assert worker.classify(MemoryError()) == "oom"
    assert worker.classify(RuntimeError("something else")) == "error"


@slow
def test_a_worker_killed_with_host_memory_exhausted_is_an_out_of_memory(tmp_path, capsys, monkeypatch):
    # A mem-limit makes this CPU a host of that size; the worker, far above it, dies of SIGKILL.
    limit = 150e6
    monkeypatch.setenv("FITBENCH_INJECT", f"sigkill:tiny,mem-limit:{limit:.0f}")
    out = tmp_path / "out"
    code, stdout, stderr = cli(["run", "--models", "tiny", *SHAPES, "--precision", "fp32", "--out", str(out)], capsys)
    assert code == 1, stderr
    (row,) = rows_of(out)
    assert row["status"] == "oom" and row["exit_code"] == -signal.SIGKILL
    assert "out of host memory" in row["error"] and "FITBENCH_INJECT mem-limit" in row["error"]
    peak = float(row["error"].split("peak resident memory, ")[1].split(" GB")[0]) * 1e9
    assert peak >= 0.9 * limit
    # the ladder ran: the out-of-memory was retried offloaded, and died the same way
    assert [attempt["status"] for attempt in row["attempts"]] == ["oom", "oom"]
    assert row["attempts"][1]["spec"]["offload"]


def test_a_cpu_configuration_beyond_the_host_memory_is_refused_before_launch(tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, stderr = cli(["run", "--models", "65B", "--mode", "train", "infer", "--batch-size", "1",
                                "--seq-len", "16", "--warmup-steps", "0", "--measure-steps", "1", "--out", str(out)],
                               capsys)
    assert code == 1, stderr
    train, infer = rows_of(out)
    assert not (out / "logs").exists()  # no worker started
    memory = host_memory()
    for row in (train, infer):
        assert row["status"] == "refused" and "timing" not in row
        assert row["error"].startswith(f"refused before launch: {row['label']} is predicted to need ")
        assert "of host memory; " in row["error"] and f"is available ({memory.source})" in row["error"]
    assert "--offload" in infer["error"] and "--offload" not in train["error"]  # offload is for inference


def test_host_memory_reads_meminfo_and_cgroups():
    memory = host_memory()
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()}
    assert 0 < memory.available <= meminfo["MemTotal"]
    assert memory.source == "/proc/meminfo MemAvailable" or memory.source.startswith("cgroup ")
    assert all(directory.is_dir() and version in (1, 2) for directory, version in memory_cgroups())
    assert oom_kills() >= 0 and not math.isnan(memory.available)
