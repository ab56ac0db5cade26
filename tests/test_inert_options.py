"""Options that would change nothing in the modes and layout asked for are refused (exit 2, one
paragraph naming the option and the fix) before anything runs, and options that follow from others
are derived: ``--nodes 2 --gpus-per-node 1`` is ``--gpus 2``."""

import pytest

from conftest import cli
from fitbench.config import SweepConfig


@pytest.mark.parametrize("extra, says", [
    (["--mode", "infer", "--checkpointed-layers", "3"], ["--checkpointed-layers", "--mode infer has none"]),
    (["--mode", "forward", "infer", "--activation-checkpointing"], ["--activation-checkpointing",
                                                                    "--mode forward infer has none"]),
    (["--mode", "infer", "--strategy", "pipeline"], ["--strategy pipeline", "--gpus is 1", "one process"]),
    (["--mode", "train", "--strategy", "fsdp", "--gpus", "1"], ["--strategy fsdp", "--gpus 2 or more"]),
])
def test_an_option_without_effect_is_refused_before_anything_runs(extra, says, tmp_path, capsys):
    code, out, err = cli(["run", "--models", "tiny", "--device", "cpu", "--out", str(tmp_path / "r"), *extra], capsys)
    assert code == 2 and err.startswith("fitbench: ") and err.strip().count("\n") == 0, err
    assert all(word in err for word in says), err
    assert not (tmp_path / "r" / "results.jsonl").exists()


def test_checkpointing_beside_a_training_mode_is_kept():
    """In a sweep of train and infer, the recomputation applies to the train rows: nothing to refuse."""
    from fitbench.config import expand

    config = SweepConfig(models=["tiny"], mode=["train", "infer"], checkpointed_layers=1, batch_size=[1], seq_len=[16])
    specs = expand(config, device="cpu", default_models=[])
    assert {(spec.mode, spec.activation_checkpointing) for spec in specs} == {("train", True), ("infer", False)}


def test_nodes_and_gpus_per_node_give_the_gpus():
    assert SweepConfig(nodes=2, gpus_per_node=1).gpus == 2
    assert SweepConfig(nodes=2, gpus_per_node=4).gpus == 8
    assert SweepConfig(nodes=2, gpus_per_node=4, gpus=4).gpus == 4  # given, it is kept (and checked where it is used)
    assert SweepConfig(nodes=2).gpus == 1
