"""The allocator's record of a run's steps (``fitbench.worker.snapshot``): what it sums per CUDA stream, by hand
on a small record, and that only a GPU worker records."""

from __future__ import annotations

import pytest
import torch

from fitbench.worker.snapshot import SNAPSHOT_VARIABLE, maker, recorded, snapshot_path, stream_figures

COMPUTE, SIDE = 0, 7  # two streams, as FSDP's compute stream and its reduce-scatter stream
MIB = 1 << 20


def event(action: str, stream: int, addr: int, size: int, filename: str = "x.py") -> dict:
    return {"action": action, "stream": stream, "addr": addr, "size": size,
            "frames": [{"filename": filename, "line": 1, "name": "f"}]}


def test_stream_figures_by_hand():
    # Before the recording the compute stream holds 10 MiB (weights); during it: 30 MiB of activations
    # on the compute stream, then 6 MiB of gradients on the side stream while the activations go.
    events = [
        event("segment_map", COMPUTE, 0, 40 * MIB),
        event("alloc", COMPUTE, 100, 30 * MIB, "/site-packages/fitbench/models/native.py"),  # compute 40
        event("segment_map", SIDE, 0, 6 * MIB),
        event("alloc", SIDE, 200, 6 * MIB, "/site-packages/torch/distributed/fsdp/x.py"),  # 40 + 6: the peak
        event("free_requested", COMPUTE, 100, 30 * MIB),  # not yet free
        event("free_completed", COMPUTE, 100, 30 * MIB),  # compute 10
    ]
    segments = [{"device": 0, "stream": COMPUTE, "total_size": 50 * MIB, "allocated_size": 10 * MIB},
                {"device": 0, "stream": SIDE, "total_size": 6 * MIB, "allocated_size": 6 * MIB},
                {"device": 1, "stream": COMPUTE, "total_size": 99 * MIB, "allocated_size": 99 * MIB}]
    figures = stream_figures({"segments": segments, "device_traces": [events, []]}, 0)
    compute, side = figures["streams"][COMPUTE], figures["streams"][SIDE]
    assert compute == {"allocated_at_start": 10 * MIB, "allocated_most": 40 * MIB, "allocated_at_peak": 40 * MIB,
                       "mapped_most_in_steps": 40 * MIB, "mapped_at_end": 50 * MIB}
    assert side == {"allocated_at_start": 0, "allocated_most": 6 * MIB, "allocated_at_peak": 6 * MIB,
                    "mapped_most_in_steps": 6 * MIB, "mapped_at_end": 6 * MIB}
    assert figures["allocated_peak"] == 46 * MIB and figures["mapped_at_end"] == 56 * MIB
    # the blocks alive at the peak (the weights predate the recording: no event names them)
    assert figures["live_at_peak"] == [(30 * MIB, COMPUTE, "fitbench/models/native.py:1 f"),
                                       (6 * MIB, SIDE, "torch/distributed/fsdp/x.py:1 f")]


def test_maker_names_the_innermost_frame_of_interest():
    frames = [{"filename": "/lib/torch/nn/modules/linear.py", "line": 3, "name": "forward"},
              {"filename": "/lib/site-packages/torch/optim/adam.py", "line": 182, "name": "_init_group"},
              {"filename": "/lib/site-packages/fitbench/worker/loops.py", "line": 9, "name": "train"}]
    assert maker(frames) == "torch/optim/adam.py:182 _init_group"
    assert maker(frames[:1]) == "forward" and maker([]) == "?"


def test_a_cpu_worker_records_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(SNAPSHOT_VARIABLE, str(tmp_path))
    with recorded(torch.device("cpu"), "key", 0):
        torch.ones(4)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator's record needs a GPU")
def test_a_gpu_worker_writes_the_allocators_record(tmp_path, monkeypatch):
    import pickle

    monkeypatch.setenv(SNAPSHOT_VARIABLE, str(tmp_path))
    device = torch.device("cuda")
    with recorded(device, "key", 3):
        kept = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
    snapshot = pickle.loads(snapshot_path(str(tmp_path), "key", 3).read_bytes())
    figures = stream_figures(snapshot, torch.cuda.current_device())
    stream = torch.cuda.current_stream().cuda_stream
    assert figures["streams"][stream]["allocated_most"] >= kept.numel()
    assert any(size == kept.numel() for size, _, _ in figures["live_at_peak"])
