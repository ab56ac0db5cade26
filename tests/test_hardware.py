import hashlib
import json
import math
import subprocess

import pytest
import torch

from fitbench.hardware.ceilings import Ceilings, ceilings_path, load_ceilings, measure_ceilings, save_ceilings
from fitbench.hardware.datasheet import GPU_SPECS, gpu_spec, peak_bandwidth, peak_flops
from fitbench.hardware.devices import cpu_device_name, detect_gpus, driver_version
from fitbench.hardware.environment import code_diff, diff_sha256, environment
from fitbench.precisions.entry import PEAK_KINDS

REQUIRED_NAMES = [
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H100 PCIe",
    "NVIDIA H100 NVL",
    "NVIDIA H200",
    "NVIDIA H200 NVL",
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA A100-SXM4-40GB",
    "NVIDIA A100 80GB PCIe",
    "NVIDIA A100-PCIE-40GB",
    "NVIDIA L40S",
    "NVIDIA L4",
    "NVIDIA GeForce RTX 4090",
    "NVIDIA GeForce RTX 3090",
]


@pytest.mark.parametrize("name", REQUIRED_NAMES)
def test_required_gpus_are_found_by_their_exact_name(name):
    spec = gpu_spec(name)
    assert spec is not None
    assert spec.name == name


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA H20",  # a prefix of "NVIDIA H200", and a different, slower GPU
        "NVIDIA H200 141GB",  # a superstring of "NVIDIA H200"
        "NVIDIA H100",  # a prefix of several H100 entries
        "nvidia h200",  # case differs
        " NVIDIA L4",
        "",
        "Some Unknown Accelerator",
    ],
)
def test_names_that_are_not_exact_matches_are_unknown(name):
    assert gpu_spec(name) is None
    assert peak_flops(name, "bf16") is None
    assert peak_bandwidth(name) is None


def test_table_is_keyed_by_name_and_uses_known_kinds():
    for key, spec in GPU_SPECS.items():
        assert key == spec.name
        assert spec.tflops, key
        assert set(spec.tflops) <= set(PEAK_KINDS), key
        assert all(value > 0 for value in spec.tflops.values()), key
        assert spec.bandwidth_gbs > 0 and spec.memory_gb > 0, key
        assert spec.source.strip(), key


def test_tensor_core_kinds_are_not_slower_than_wider_ones():
    for spec in GPU_SPECS.values():
        rates = spec.tflops
        assert rates["tf32"] >= rates["fp32"], spec.name
        assert rates["bf16"] >= rates["tf32"], spec.name
        if "fp8" in rates:
            assert rates["fp8"] >= rates["bf16"], spec.name


def test_peak_flops_converts_tflops_to_flops():
    name = "NVIDIA H100 80GB HBM3"
    for kind, tflops in GPU_SPECS[name].tflops.items():
        assert peak_flops(name, kind) == pytest.approx(tflops * 1e12)
    assert peak_flops(name, "bf16") > 1e14


def test_peak_bandwidth_converts_gbs_to_bytes_per_second():
    name = "NVIDIA H200"
    assert peak_bandwidth(name) == pytest.approx(GPU_SPECS[name].bandwidth_gbs * 1e9)
    assert peak_bandwidth(name) > 1e12


def test_peak_flops_is_none_for_a_kind_the_gpu_lacks():
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp4") is None
    assert peak_flops("NVIDIA A100-SXM4-80GB", "int8") is not None


def test_detect_gpus_is_empty_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect_gpus() == []


def test_driver_version_never_raises():
    version = driver_version()
    assert version is None or (isinstance(version, str) and version)


def test_environment_is_json_serialisable_and_complete():
    env = environment()
    round_tripped = json.loads(json.dumps(env))
    assert round_tripped == env
    expected_keys = {
        "fitbench_version",
        "git_commit",
        "git_dirty",
        "git_diff_sha256",
        "python",
        "torch",
        "transformers",
        "accelerate",
        "torch_cuda",
        "cudnn",
        "driver",
        "gpus",
        "cpu_model",
        "cpu_count",
        "cpu_affinity_count",
        "host_memory_bytes",
        "hostname",
        "platform",
        "time_utc",
    }
    assert expected_keys <= set(env)
    assert env["torch"] == torch.__version__
    assert env["host_memory_bytes"] > 0
    assert env["git_dirty"] is None or isinstance(env["git_dirty"], bool)
    assert (env["git_commit"] is None) == (env["git_dirty"] is None)
    assert env["git_diff_sha256"] is None or (env["git_dirty"] and len(env["git_diff_sha256"]) == 64)
    assert env["time_utc"].endswith("+00:00")


def test_measure_ceilings_on_cpu_gives_plausible_numbers():
    ceilings = measure_ceilings("cpu", size=256, repeats=3, warmup=1)
    assert ceilings.device_name == cpu_device_name()
    assert ceilings.torch_version == torch.__version__
    assert set(ceilings.matmul_flops) == {"fp32", "bf16"}
    numbers = [ceilings.bandwidth, *ceilings.matmul_flops.values()]
    assert all(math.isfinite(number) and number > 0 for number in numbers)
    # No CPU reaches a PFLOP/s or 10 TB/s; a seconds/milliseconds mix-up would.
    assert max(ceilings.matmul_flops.values()) < 1e15
    assert ceilings.bandwidth < 1e13
    assert "256x256x256" in ceilings.method


def test_measure_ceilings_rejects_bad_arguments():
    with pytest.raises(ValueError):
        measure_ceilings("cpu", size=16, repeats=0)
    with pytest.raises(ValueError):
        measure_ceilings("meta", size=16, repeats=1)


def _ceilings(device_name, torch_version=torch.__version__, bf16=1.5e14):
    return Ceilings(
        device_name=device_name,
        torch_version=torch_version,
        matmul_flops={"bf16": bf16, "fp32": 5.0e13},
        bandwidth=3.0e12,
        measured_at="2025-01-01T00:00:00+00:00",
        method="test",
    )


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FITBENCH_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_ceilings_path_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FITBENCH_CACHE_DIR", str(tmp_path / "explicit"))
    assert ceilings_path() == tmp_path / "explicit" / "ceilings.json"
    monkeypatch.delenv("FITBENCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ceilings_path() == tmp_path / "xdg" / "fitbench" / "ceilings.json"


def test_save_then_load_round_trips_and_merges(cache_dir):
    first = _ceilings("GPU A")
    second = _ceilings("GPU B", bf16=2.5e14)
    path = save_ceilings(first)
    assert path == cache_dir / "ceilings.json"
    save_ceilings(second)
    assert load_ceilings("GPU A") == first
    assert load_ceilings("GPU B") == second
    assert load_ceilings("GPU C") is None
    assert [p.name for p in cache_dir.iterdir()] == ["ceilings.json"]


def test_save_replaces_the_entry_for_the_same_device(cache_dir):
    save_ceilings(_ceilings("GPU A", bf16=1.0e14))
    newer = _ceilings("GPU A", bf16=2.0e14)
    save_ceilings(newer)
    assert load_ceilings("GPU A") == newer
    assert len(json.loads(ceilings_path().read_text())) == 1


def test_load_ignores_entries_from_another_torch_version(cache_dir):
    save_ceilings(_ceilings("GPU A", torch_version="0.0.1"))
    assert load_ceilings("GPU A") is None


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2, 3]",
        json.dumps({f"GPU A|torch {torch.__version__}": {"device_name": "GPU A"}}),
        json.dumps({f"GPU A|torch {torch.__version__}": "text"}),
    ],
)
def test_load_of_a_corrupt_file_is_none_and_save_recovers(cache_dir, content):
    ceilings_path().write_text(content)
    assert load_ceilings("GPU A") is None
    fresh = _ceilings("GPU A")
    save_ceilings(fresh)
    assert load_ceilings("GPU A") == fresh


def test_load_without_a_file_is_none(cache_dir):
    assert not ceilings_path().exists()
    assert load_ceilings("GPU A") is None


def test_cpu_device_name_is_stable():
    assert cpu_device_name() == cpu_device_name()
    assert cpu_device_name().startswith("cpu: ")


def test_no_gpu_device_file_means_torch_sees_no_gpu():
    """Where no GPU device file exists, the answer given without torch is torch's own."""
    import torch

    from fitbench.hardware.devices import no_gpu_device
    from fitbench.sweep import resolve_device

    if no_gpu_device():
        assert not torch.cuda.is_available()
        assert resolve_device("auto") == "cpu"
    else:
        assert resolve_device("auto") == ("cuda:0" if torch.cuda.is_available() else "cpu")


def test_the_code_diff_is_the_packages_changes_and_its_hash_their_sha256(tmp_path):
    """Tracked changes, then untracked files, of the package and its pins; nothing else of the checkout."""
    root = tmp_path / "checkout"
    (root / "fitbench").mkdir(parents=True)
    (root / "fitbench" / "__init__.py").write_text("A = 1\n")

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=root, check=True,
                       capture_output=True)

    git("init", "-q")
    git("add", "fitbench/__init__.py")
    git("commit", "-q", "-m", "first")
    assert code_diff(root) == b"" and diff_sha256(code_diff(root)) is None
    (root / "fitbench" / "__init__.py").write_text("A = 2\n")
    (root / "fitbench" / "added.py").write_text("B = 3\n")
    (root / "results.jsonl").write_text("{}\n")
    diff = code_diff(root)
    text = diff.decode()
    assert "-A = 1\n+A = 2\n" in text and "+B = 3\n" in text and "results.jsonl" not in text
    assert text.index("fitbench/__init__.py") < text.index("fitbench/added.py")
    assert diff_sha256(diff) == hashlib.sha256(diff).hexdigest()
    assert code_diff(tmp_path) is None  # no checkout of fitbench
