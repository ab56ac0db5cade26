"""The environment each worker process starts with."""

import subprocess
import sys

import pytest

from fitbench.launch.local import worker_environment

SETTINGS = "from fitbench.run.trackers import allocator_settings; print(allocator_settings())"


def allocator_settings_in_a_worker(environment: dict) -> str:
    """The allocator settings torch parses in a fresh process started with ``environment``."""
    return subprocess.run([sys.executable, "-c", SETTINGS], env=environment, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.parametrize("preset", [{}, {"PYTORCH_CUDA_ALLOC_CONF": ""}, {"PYTORCH_ALLOC_CONF": " "}])
def test_workers_get_expandable_segments_unless_the_allocator_is_configured(monkeypatch, preset):
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in preset.items():
        monkeypatch.setenv(name, value)
    assert allocator_settings_in_a_worker(worker_environment()) == "expandable_segments:True"


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_users_allocator_settings_are_kept(monkeypatch, name):
    for variable in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv(name, "max_split_size_mb:128")
    assert allocator_settings_in_a_worker(worker_environment()) == "max_split_size_mb:128"
