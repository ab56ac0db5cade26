"""The environment each worker process starts with."""

import subprocess
import sys

import pytest

from fitbench.launch.local import ALLOCATOR_VARIABLES, worker_environment

SETTINGS = "from fitbench.worker.trackers import allocator_settings; print(allocator_settings())"
UNCONFIGURED = {"unset": {}, "empty": {"PYTORCH_CUDA_ALLOC_CONF": ""}, "blank": {"PYTORCH_ALLOC_CONF": " "}}
CONFIGURED = {name: {name: "max_split_size_mb:128"} for name in ALLOCATOR_VARIABLES}


@pytest.fixture(scope="module")
def settings_in_workers() -> dict[str, str]:
    """The allocator settings torch parses in a fresh process started with ``worker_environment()`` of
    each parent environment's allocator variables; the processes start at once, sharing the cores."""
    workers = {}
    for name, preset in {**UNCONFIGURED, **CONFIGURED}.items():
        with pytest.MonkeyPatch.context() as patch:
            for variable in ALLOCATOR_VARIABLES:
                patch.delenv(variable, raising=False)
            for variable, value in preset.items():
                patch.setenv(variable, value)
            environment = worker_environment()
        workers[name] = subprocess.Popen([sys.executable, "-c", SETTINGS], env=environment, stdout=subprocess.PIPE,
                                         text=True)
    settings = {}
    for name, worker in workers.items():
        settings[name] = worker.communicate(timeout=120)[0].strip()
        assert worker.returncode == 0, name
    return settings


@pytest.mark.parametrize("parent", UNCONFIGURED)
def test_workers_get_expandable_segments_unless_the_allocator_is_configured(settings_in_workers, parent):
    assert settings_in_workers[parent] == "expandable_segments:True"


@pytest.mark.parametrize("name", CONFIGURED)
def test_a_users_allocator_settings_are_kept(settings_in_workers, name):
    assert settings_in_workers[name] == "max_split_size_mb:128"


def test_workers_keep_triton_kernels_and_autotuning_in_fitbenchs_cache_unless_the_user_chose_one(monkeypatch, tmp_path):
    from fitbench.launch.local import worker_environment

    monkeypatch.setenv("FITBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    environment = worker_environment()
    assert environment["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert environment["TRITON_CACHE_AUTOTUNING"] == "1"
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    environment = worker_environment()
    assert environment["TRITON_CACHE_DIR"] == "/elsewhere" and "TRITON_CACHE_AUTOTUNING" not in environment


def test_the_planners_warnings_join_the_rows(tmp_path):
    """A warning in the configuration's prediction (a weight-only format forecast slower than bf16) is one
    of the row's warnings, beside the worker's; a row without any has none."""
    from fitbench.launch.job import Job
    from fitbench.launch.local import LocalLauncher, run_sweep
    from fitbench.results.store import ResultStore
    from fitbench.spec import RunSpec

    specs = [RunSpec(model="tiny", backend="native", mode="infer", precision=precision, batch_size=8, seq_len=16,
                     new_tokens=4, device="cpu", warmup_steps=1, measure_steps=1) for precision in ("int4", "fp32")]
    warning = "int4 is forecast slower than bf16-pure at batch 8"
    jobs = [Job(spec, 60, prediction={"warnings": [warning] if spec.precision == "int4" else []},
                refusal="refused before launch") for spec in specs]
    rows = run_sweep(jobs, ResultStore(tmp_path), launcher=LocalLauncher(), command="test")
    assert [row["warnings"] for row in rows] == [[warning], None]
