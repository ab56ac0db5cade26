"""The Python front door: ``fitbench.plan``, ``fitbench.run`` and ``fitbench.load`` do what the commands
do and return typed results, and stay functions beside the package's modules."""

import hashlib
import inspect
import json
import pydoc

import pytest

import fitbench
from fitbench.cli import main
from fitbench.results.row import Row
from fitbench.util.errors import UserError


def test_plan_chooses_as_the_command_does():
    plan = fitbench.plan("7B", "infer", gpu="H100-80GB")
    assert plan.model == "7B" and plan.mode == "infer" and plan.chosen is not None and plan.chosen.fits
    assert plan.target.count == 1 and plan.target.described


def test_plan_considers_batch_1_unless_asked_for_the_largest():
    """``fitbench plan``'s default, the batch ``fitbench run`` runs in infer; ``["auto"]`` the largest that fits."""
    assert fitbench.plan("7B", "infer", gpu="H100-80GB").chosen.candidate.batch_size == 1
    assert fitbench.plan("7B", "infer", gpu="H100-80GB", batch_sizes=["auto"]).chosen.candidate.batch_size > 1


@pytest.mark.parametrize("model, mode, where", [
    ("7B", "infer", ["--gpu", "H100-80GB"]),
    ("7B", "train", ["--gpu", "H100-80GB", "--gpus", "4"]),
    ("13B", "forward", ["--gpu-memory", "40GB", "--gpus", "2"]),
    ("small", "forward-backward", ["--gpu", "A100-40GB", "--batch-size", "auto"]),
    ("llama-2-70b", "infer", ["--gpu", "H100-80GB", "--gpus-per-node", "4", "--nodes", "2"]),
])
def test_the_command_and_the_function_give_the_same_plan(model, mode, where, capsys):
    options = {"--gpu": "gpu", "--gpus": "gpus", "--gpu-memory": "gpu_memory", "--gpus-per-node": "gpus_per_node",
               "--nodes": "nodes", "--batch-size": "batch_sizes"}
    given = dict(zip(where[::2], where[1::2]))
    kwargs = {options[k]: (int(v) if v.isdigit() else [v] if k == "--batch-size" else v) for k, v in given.items()}
    planned = fitbench.plan(model, mode, **kwargs)
    assert main(["plan", "--models", model, "--mode", mode, *where, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps([{**planned.as_dict(), "trace": None}], default=str))
    assert printed[0]["chosen"] is not None


def test_plan_refuses_bad_input_with_the_commands_paragraph():
    with pytest.raises(UserError, match="gpu-memory"):
        fitbench.plan("7B", gpus=2)


def test_run_returns_typed_rows_that_load_reads_again(tmp_path):
    rows = fitbench.run(["tiny"], device="cpu", mode=["forward"], batch_size=[1], seq_len=[8], warmup_steps=0,
                        measure_steps=1, out=tmp_path)
    assert [type(row) for row in rows] == [Row] and rows[0].status == "ok" and rows[0].spec["model"] == "tiny"
    assert fitbench.load(tmp_path) == rows
    # the code's changes, if any, saved beside the rows under the hash the row records
    sha256 = rows[0].environment["git_diff_sha256"]
    assert [path.name for path in tmp_path.glob("diffs/*.diff")] == ([f"{sha256}.diff"] if sha256 else [])
    assert sha256 is None or hashlib.sha256((tmp_path / "diffs" / f"{sha256}.diff").read_bytes()).hexdigest() == sha256
    # as `fitbench run`: a directory holding a sweep is resumed, not replaced; resuming a finished one runs nothing
    with pytest.raises(UserError, match="already holds a sweep"):
        fitbench.run(["tiny"], device="cpu", out=tmp_path)
    assert fitbench.run(resume=tmp_path) == rows
    with pytest.raises(UserError, match="no results.jsonl"):
        fitbench.load(tmp_path / "elsewhere")


def test_the_front_door_names_are_functions_that_help_describes():
    """No package shares a name with the API's functions, so importing the planner's and the worker's packages
    leaves them functions, whose parameters ``help`` lists."""
    import fitbench.planning.memory  # noqa: F401
    import fitbench.worker.worker  # noqa: F401

    assert all(inspect.isfunction(function) for function in (fitbench.plan, fitbench.run, fitbench.load))
    described = pydoc.render_doc(fitbench.plan, renderer=pydoc.plaintext)
    assert all(f"{name}:" in described for name in inspect.signature(fitbench.api.plan).parameters)
