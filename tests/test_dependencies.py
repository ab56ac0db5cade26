"""The pinned dependencies' tested ranges (fitbench.hardware.dependencies): read from fitbench's own
metadata, held against the installed versions, listed by `fitbench env` and warned of by `plan` and `run`."""

import json
import os
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from fitbench.hardware.dependencies import Dependency, dependencies

ROOT = Path(__file__).parent.parent


def test_the_tested_ranges_are_the_requirements_of_pyproject():
    """Every required dependency of pyproject.toml, with its range, as the installed metadata gives it
    back; the libraries whose internals fitbench reads have an upper bound."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    written = {Requirement(text).name: Requirement(text).specifier for text in project["dependencies"]}
    read = {dependency.name: Requirement(f"{dependency.name}{dependency.tested}").specifier
            for dependency in dependencies()}
    assert read == written
    for name in ("transformers", "accelerate", "bitsandbytes", "torchao"):
        assert any(bound.operator in ("<", "<=") for bound in written[name]), name


def test_each_installed_version_is_read_and_placed_in_its_range():
    for dependency in dependencies():
        assert dependency.installed == version(dependency.name)
        inside = Requirement(f"x{dependency.tested}").specifier.contains(dependency.installed, prereleases=True)
        assert dependency.status == ("tested" if inside else "untested")


@pytest.mark.parametrize("installed, status", [
    ("5.17.0", "tested"), ("5.25.3", "tested"), ("5.26.0", "untested"), ("5.16.1", "untested"),
    ("5.26.0.dev0", "untested"),  # a pre-release of the bound is not below it (PEP 440)
    ("5.25.0rc1", "tested"), (None, "missing")])
def test_a_version_is_tested_only_inside_its_range(installed, status):
    dependency = Dependency("transformers", ">=5.17,<5.26", installed)
    assert dependency.status == status
    warning = dependency.warning()
    if status == "tested":
        assert warning is None
    else:
        assert "transformers" in warning and ">=5.17,<5.26" in warning
    if status == "untested":
        assert installed in warning and "pip install 'transformers>=5.17,<5.26'" in warning


def test_a_local_build_counts_by_its_release():
    assert Dependency("torch", ">=2.11", "2.13.0+cpu").status == "tested"
    assert Dependency("torch", ">=2.11", "2.10.0+cu128").status == "untested"


def test_env_lists_every_range_and_plan_warns_of_a_version_outside_it(tmp_path):
    """A fitbench whose metadata admits transformers below 5.0 only, as after an upgrade by hand past the
    bound: `fitbench env` marks transformers untested, `fitbench plan` warns before it plans (and plans),
    `fitbench models` says nothing."""
    info = tmp_path / "fitbench-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fitbench\nVersion: 0.1.0\n"
                                   "Requires-Dist: transformers<5.0\nRequires-Dist: torch>=2.11\n"
                                   "Requires-Dist: plotly>=6; extra == \"report\"\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}

    def fitbench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "import sys; from fitbench.cli import main; "
                               "sys.exit(main(sys.argv[1:]))", *args], env=env, capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)

    listed = fitbench("env", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["dependencies"] == [
        {"name": "transformers", "installed": version("transformers"), "tested": "<5.0", "status": "untested"},
        {"name": "torch", "installed": version("torch"), "tested": ">=2.11", "status": "tested"}]
    planned = fitbench("plan", "--models", "tiny", "--mode", "infer", "--gpu", "H100-80GB")
    assert planned.returncode == 0, planned.stderr
    assert (f"warning: transformers {version('transformers')} is outside fitbench's tested range <5.0"
            in " ".join(planned.stderr.split()))
    assert "tiny" in planned.stdout
    quiet = fitbench("models")
    assert quiet.returncode == 0 and "tested range" not in quiet.stderr
