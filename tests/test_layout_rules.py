"""What composes on several GPUs is ``Layout.problem``'s to say, in one paragraph that names the layout and
the way out: the sweep raises it before anything launches (exit 2), and the planner rejects the layouts it
names with the same words. A refusal for memory names the layout and says the need is per GPU."""

import json

import pytest

from conftest import cli
from fitbench.models.registry import resolve
from fitbench.planning.calibration import DEFAULT
from fitbench.planning.planner import Candidate, GpuTarget, assess
from fitbench.spec import Layout

MESSAGE_MAX = 700  # characters, as tests/test_bad_input.py holds every refusal to


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)


# Every combination the command line can ask for that a layout refuses: the options beside
# `fitbench run --models tiny --device cpu`, the layout the message names, and words of its way out.
REFUSED = [
    (["--gpus", "2", "--strategy", "tp", "--mode", "infer", "--offload"], ["tp x 2:"], "drop --offload"),
    (["--gpus", "2", "--strategy", "pipeline", "--mode", "infer", "--offload"], ["pipeline x 2:"], "drop --offload"),
    (["--gpus", "4", "--strategy", "fsdp", "--tp", "2", "--mode", "train", "--offload"], ["fsdp 2 x tp 2:"],
     "drop --offload"),
    (["--gpus", "2", "--strategy", "ddp", "--mode", "train", "--offload"], ["ddp x 2:"], "--strategy fsdp --offload"),
    (["--models", "gpt2", "--gpus", "2", "--strategy", "ddp", "--mode", "train"], ["ddp x 2:"], "--backend native"),
    (["--models", "gpt2", "--gpus", "2", "--mode", "train"], ["ddp x 2:", "fsdp x 2:"], "--backend native"),
    (["--gpus", "2", "--strategy", "fsdp", "--mode", "forward", "--precision", "int8-weight-only"], ["fsdp x 2:"],
     "use bf16 across GPUs"),
    (["--gpus", "2", "--strategy", "ddp", "--mode", "forward", "--precision", "int4"], ["ddp x 2:"],
     "use bf16 across GPUs"),
    (["--gpus", "2", "--strategy", "fsdp", "--mode", "train", "--precision", "nf4"], ["fsdp x 2:"], "--strategy ddp"),
    (["--gpus", "3", "--strategy", "tp", "--mode", "infer"], ["tp x 3:"], "divides 8"),
    (["--backend", "hf", "--gpus", "8", "--strategy", "tp", "--mode", "infer"], ["tp x 8:"], "--backend native"),
    (["--models", "gpt2", "--gpus", "2", "--strategy", "tp", "--mode", "infer"], ["tp x 2:"], "--strategy pipeline"),
    (["--gpus", "2", "--strategy", "tp", "--mode", "infer", "--precision", "nf4"], ["tp x 2:"], "--strategy pipeline"),
    (["--gpus", "2", "--strategy", "tp", "--mode", "train", "--precision", "fp8"], ["tp x 2:"], "--strategy pipeline"),
    (["--gpus", "4", "--strategy", "pipeline", "--tp", "2", "--backend", "hf", "--mode", "infer"],
     ["tp 2 x pipeline 2:"], "give --backend native"),
    (["--gpus", "8", "--strategy", "pipeline", "--mode", "infer"], ["pipeline x 8:"], "at most 4 stages"),
    (["--gpus", "2", "--strategy", "pipeline", "--mode", "train", "--precision", "fp16"], ["pipeline x 2:"], "bf16"),
    (["--gpus", "2", "--strategy", "pipeline", "--mode", "train", "--precision", "nf4"], ["pipeline x 2:"],
     "train with bf16"),
    (["--models", "gpt2", "--gpus", "2", "--strategy", "pipeline", "--mode", "train"], ["pipeline x 2:"],
     "--backend native"),
    (["--gpus", "4", "--strategy", "pipeline", "--tp", "2", "--mode", "train"], ["tp 2 x pipeline 2:"],
     "--strategy fsdp --tp 2"),
    (["--gpus", "2", "--strategy", "replicas", "--mode", "train"], ["replicas x 2:"], "--strategy ddp or fsdp"),
    (["--gpus", "2", "--strategy", "replicas", "--mode", "forward-backward"], ["replicas x 2:"],
     "--mode infer or forward"),
    (["--gpus", "2", "--strategy", "replicas", "--mode", "infer", "--offload"], ["replicas x 2:"], "drop --offload"),
]


@pytest.mark.parametrize("options, layouts, fix", REFUSED, ids=lambda value: " ".join(value)
                         if isinstance(value, list) and value and value[0].startswith("--") else None)
def test_every_refused_layout_is_one_paragraph_naming_it_and_exit_2(options, layouts, fix, tmp_path, capsys):
    argv = ["run", "--models", "tiny", "--device", "cpu", "--out", "r"]
    code, out, err = cli(argv + options, capsys)
    assert code == 2, out + err
    message = err.strip()
    assert "Traceback" not in out + err and len(message.splitlines()) == 1 and len(message) <= MESSAGE_MAX, message
    assert all(layout in message for layout in layouts) and fix in message, message
    assert not (tmp_path / "r" / "results.jsonl").exists()


def test_the_rules_no_command_line_reaches_are_the_layouts_own_too():
    """Layouts only the planner or a caller can build: DDP beside tensor parallelism, stages beside
    data parallelism, replicas beside anything."""
    tiny = resolve("tiny")
    assert "FSDP shards the data-parallel dimension" in Layout(dp_replicate=2, tp=2).problem(tiny, "train", "bf16",
                                                                                             "native")
    assert "beside no data parallelism" in Layout(dp_shard=2, pp=2).problem(tiny, "train", "bf16", "native")
    assert Layout(replicas=2, tp=2).problem(tiny, "infer", "bf16", "native").startswith("tp 2 x replicas 2: ")
    for layout in (Layout(), Layout(dp_shard=2, tp=2), Layout(tp=2, pp=2), Layout(replicas=4)):
        assert layout.problem(tiny, "forward", "bf16", "native") is None, layout


def test_the_planner_rejects_a_layout_with_the_rule_that_refuses_it():
    """The reason a plan records for a layout the run cannot launch is ``Layout.problem``'s, word for word."""
    arch, target = resolve("tiny"), GpuTarget("NVIDIA H100 80GB HBM3", 2, 80e9, described=True)
    for precision, layout in (("nf4", Layout(tp=2)), ("fp16", Layout(pp=2)), ("bf16", Layout(pp=2, tp=1))):
        problem = layout.problem(arch, "train", precision, "native")
        assessed = assess(arch, "train", Candidate(precision, layout, False, 1), target, seq_len=64,
                          new_tokens=1, calibration=DEFAULT)
        if problem is None:
            assert assessed.fits
        else:
            assert not assessed.fits and assessed.reason.endswith(f"the run cannot launch {problem}")


def test_a_refusal_for_memory_names_the_layout_and_says_per_gpu(tmp_path, capsys, monkeypatch):
    """On a CPU, FITBENCH_INJECT's mem-limit makes each rank a GPU of that size, planned as such: tiny under
    tensor parallelism over two of 2 MB each is refused before launch, its row naming the layout and the
    need per GPU, not "one GPU"."""
    monkeypatch.setenv("FITBENCH_INJECT", "mem-limit:2000000")
    code, out, err = cli(["run", "--models", "tiny", "--device", "cpu", "--gpus", "2", "--strategy", "tp", "--mode",
                          "forward", "--precision", "fp32", "--no-fallback", "--out", "r"], capsys)
    assert code == 1, out + err
    [row] = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert row["status"] == "refused"
    assert "under the layout tp x 2 is predicted to need" in row["error"]
    assert "per GPU, on 2 GPUs of 2 MB each" in row["error"] and "one GPU" not in row["error"]
