"""Options that would change nothing in the modes and layout asked for are refused (exit 2, one
paragraph naming the option and the fix) before anything runs, or, where only this machine makes them
inert, warned about; every rule of ``fitbench.inert_options.RULES`` is exercised here through the
command line, and the same rules hold for a YAML file and the API. Options that follow from others are
derived: ``--nodes 2 --gpus-per-node 1`` is ``--gpus 2``."""

import json

import pytest

from conftest import cli
from fitbench.config import SweepConfig
from fitbench.inert_options import RULES
from fitbench.util.errors import UserError

RUN = ["run", "--models", "tiny", "--device", "cpu"]
PLAN = ["plan", "--models", "tiny", "--gpu", "H100-80GB"]

# (the rule's option, the words that tell it from the option's other rules, the command line, words
# the paragraph must hold besides the option as written)
REFUSED = [
    ("new_tokens", "generates none", [*RUN, "--mode", "train", "--new-tokens", "64"],
     ["--new-tokens 64", "--mode train", "add infer to --mode"]),
    ("new_tokens", "generates none", [*PLAN, "--mode", "train", "forward", "--new-tokens", "64"],
     ["--new-tokens 64", "--mode train forward", "leave --new-tokens out"]),
    ("activation_checkpointing", "backward pass", [*RUN, "--mode", "forward", "infer", "--activation-checkpointing"],
     ["--activation-checkpointing", "--mode forward infer has none"]),
    ("checkpointed_layers", "backward pass", [*RUN, "--mode", "infer", "--checkpointed-layers", "3"],
     ["--checkpointed-layers 3", "--mode infer has none", "add --mode train"]),
    ("strategy", "--gpus is 1", [*RUN, "--mode", "infer", "--strategy", "pipeline"],
     ["--strategy pipeline", "--gpus is 1", "--gpus 2 or more"]),
    ("strategy", "generation would run", [*RUN, "--mode", "infer", "--gpus", "2", "--strategy", "ddp"],
     ["--strategy ddp", "--mode infer", "tp, pipeline or replicas"]),
    ("microbatches", "pipelined training", [*RUN, "--mode", "train", "--gpus", "2", "--microbatches", "2"],
     ["--microbatches 2", "--strategy is auto", "--strategy pipeline"]),
    ("microbatches", "pipelined training", [*RUN, "--mode", "infer", "--gpus", "2", "--strategy", "pipeline",
                                            "--microbatches", "2"], ["--mode infer does not train"]),
    ("cuda_graphs", "decodes", [*RUN, "--mode", "train", "--no-cuda-graphs"],
     ["--no-cuda-graphs", "no mode generates", "leave --no-cuda-graphs out"]),
    ("cuda_graphs", "decodes", [*RUN, "--mode", "infer", "--backend", "hf", "--cuda-graphs"],
     ["--cuda-graphs", "hf backend"]),
    ("compile_decode", "decodes", [*RUN, "--mode", "forward", "--no-compile-decode"],
     ["--no-compile-decode", "no mode generates"]),
    ("decode_tuning", "native infer", [*RUN, "--mode", "train", "--decode-tuning"], ["--decode-tuning", "no mode"]),
    ("decode_tuning", "compiles none", [*RUN, "--mode", "infer", "--no-compile-decode", "--decode-tuning"],
     ["--decode-tuning", "--no-compile-decode", "leave one of the two out"]),
    ("symmetric_memory", "native infer sums", [*RUN, "--mode", "train", "--no-symmetric-memory"],
     ["--no-symmetric-memory", "no mode generates"]),
    ("symmetric_memory", "no layer is split", [*RUN, "--mode", "infer", "--no-symmetric-memory"],
     ["--no-symmetric-memory", "--gpus 1", "--strategy tp"]),
    ("symmetric_memory", "compiles none", [*RUN, "--mode", "infer", "--gpus", "2", "--strategy", "tp",
                                           "--no-compile-decode", "--no-symmetric-memory"],
     ["--no-symmetric-memory", "--no-compile-decode"]),
    ("gpu_memory_utilization", "vLLM's engine", [*RUN, "--mode", "infer", "--gpu-memory-utilization", "0.5"],
     ["--gpu-memory-utilization 0.5", "add --backend vllm"]),
    ("kv_cache_bytes", "KV cache", [*RUN, "--mode", "infer", "--backend", "hf", "--kv-cache-bytes", "1000"],
     ["--kv-cache-bytes 1000", "add --backend vllm"]),
    ("ollama_timeout", "analysis", [*RUN, "--mode", "infer", "--ollama-timeout", "30"],
     ["--ollama-timeout 30", "add --ollama-model"]),
    ("strategy", "considers every layout", [*PLAN, "--requirements", "--strategy", "tp"],
     ["--strategy tp", "--requirements"]),
    ("gpus", "finds the fewest", [*PLAN, "--requirements", "--gpus", "4"], ["--gpus 4", "--requirements"]),
    ("nodes", "finds the fewest", [*PLAN[:3], "--gpu", "H100-80GB", "--gpus-per-node", "8", "--nodes", "2",
                                   "--requirements"], ["--nodes 2", "leave out --nodes"]),
    ("inter_node_bandwidth", "one node", [*PLAN, "--gpus", "4", "--inter-node-bandwidth", "100gbe"],
     ["--inter-node-bandwidth 100gbe", "4 GPU(s)", "one node of 8"]),
    ("trace", "chooses none", [*PLAN, "--requirements", "--trace"], ["--trace", "--requirements"]),
    ("preregister", "registers the forecasts", [*PLAN, "--requirements", "--preregister", "forecasts.json"],
     ["--preregister forecasts.json", "--requirements"]),
    ("batch_size", "one batch", [*PLAN, "--requirements", "--batch-size", "1", "4"],
     ["--batch-size 1 4", "give one --batch-size N"]),
    ("batch_size", "one batch", [*PLAN, "--requirements", "--batch-size", "auto"], ["--batch-size auto"]),
]

# Inert on this machine alone (a CPU): warned, and the sweep goes on (here its batch script, written
# and not submitted).
WARNED = [("cuda_graphs", "--no-cuda-graphs"), ("compile_decode", "--compile-decode"),
          ("decode_tuning", "--decode-tuning"), ("symmetric_memory", "--no-symmetric-memory")]


def _rule(option: str, words: str):
    [rule] = [rule for rule in RULES if rule.option == option and words in rule.why and not rule.machine]
    return rule


@pytest.mark.parametrize("option, words, argv, says", REFUSED, ids=[f"{case[0]}-{case[1]}" for case in REFUSED])
def test_an_option_without_effect_is_refused_before_anything_runs(option, words, argv, says, tmp_path, capsys):
    out = tmp_path / "r"
    code, stdout, err = cli([*argv, *(["--out", str(out)] if argv[0] == "run" else [])], capsys)
    assert code == 2 and err.startswith(f"fitbench: {option}: ") and err.strip().count("\n") == 0, err
    rule = _rule(option, words)
    assert not rule.machine and rule.why.split("{")[0].split(",")[0] in err, err
    assert all(word in err for word in says), err
    assert not out.exists()


def test_every_rule_is_exercised():
    """A rule added to the table without a case here fails."""
    covered = {_rule(option, words) for option, words, _, _ in REFUSED} | {
        rule for rule in RULES if rule.machine and rule.option in dict(WARNED)}
    assert set(RULES) == covered


def test_what_this_machine_makes_inert_is_a_warning(tmp_path, capsys):
    code, stdout, err = cli([*RUN, "--mode", "infer", "--gpus", "2", "--strategy", "tp", "--launcher", "slurm",
                             "--dry-run", "--out", str(tmp_path / "r"), *(written for _, written in WARNED)], capsys)
    assert code == 0, err
    warned = [line for line in err.splitlines() if line.startswith("fitbench: warning: ")]
    assert [line.split(": ")[2] for line in warned] == [option for option, _ in WARNED], err
    assert all(written in line and "CPU" in line for line, (_, written) in zip(warned, WARNED)), err


def test_a_yaml_file_and_the_api_are_refused_alike(tmp_path, capsys):
    config = tmp_path / "sweep.yaml"
    config.write_text("models: [tiny]\nmode: train\nnew-tokens: 64\n")
    code, _, err = cli(["run", "--config", str(config), "--device", "cpu", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "new_tokens: --new-tokens 64" in err and "generates none" in err, err
    import fitbench

    with pytest.raises(UserError, match="checkpointed_layers: --checkpointed-layers 2 recomputes"):
        fitbench.run(["tiny"], mode=["infer"], checkpointed_layers=2, device="cpu", out=tmp_path / "api")
    with pytest.raises(UserError, match="new_tokens: --new-tokens 64 sets the tokens generated in infer"):
        fitbench.plan("tiny", "train", gpu="H100-80GB", new_tokens=64)
    assert fitbench.plan("tiny", "infer", gpu="H100-80GB", new_tokens=64).chosen is not None


def test_the_same_options_with_a_mode_they_act_in_are_kept(tmp_path, capsys):
    """Each refusal's fix, followed, runs: the rule looks at the whole sweep, not one mode of it."""
    from fitbench.config import expand

    config = SweepConfig(models=["tiny"], mode=["train", "infer"], checkpointed_layers=1, new_tokens=4,
                         cuda_graphs=False, batch_size=[1], seq_len=[16])
    specs = expand(config, device="cpu", default_models=[])
    assert {(spec.mode, spec.activation_checkpointing) for spec in specs} == {("train", True), ("infer", False)}
    code, stdout, err = cli([*PLAN, "--mode", "train", "infer", "--new-tokens", "64", "--json"], capsys)
    assert code == 0, err
    assert [plan["mode"] for plan in json.loads(stdout)] == ["train", "infer"]


def test_a_resumed_sweep_is_not_refused_for_its_saved_defaults(tmp_path):
    """sweep.json keeps every option, the defaults too; only what was given counts as given."""
    from fitbench.config import merge_sources, resumed_config, saved_options

    saved = saved_options({"config": SweepConfig(models=["tiny"], mode=["train"]).model_dump()}, "sweep.json")
    assert "cuda_graphs" not in saved and "new_tokens" not in saved
    config = resumed_config(saved, merge_sources(saved, {}, {}), extend=False)
    assert {"cuda_graphs", "symmetric_memory", "compile_decode"}.isdisjoint(config.model_fields_set)
    grown = resumed_config(saved, merge_sources(saved, {}, {"models": ["small"]}), extend=True)
    assert grown.models == ["tiny", "small"] and "cuda_graphs" not in grown.model_fields_set


def test_nodes_and_gpus_per_node_give_the_gpus(tmp_path, capsys):
    assert SweepConfig(nodes=2, gpus_per_node=1).gpus == 2
    assert SweepConfig(nodes=2, gpus_per_node=4).gpus == 8
    assert SweepConfig(nodes=2, gpus_per_node=4, gpus=4).gpus == 4  # given, it is kept (and checked where it is used)
    assert SweepConfig(nodes=2).gpus == 1
    code, stdout, err = cli(["run", "--models", "tiny", "--mode", "train", "--launcher", "slurm", "--nodes", "2",
                             "--gpus-per-node", "1", "--gpu", "H100-80GB", "--dry-run", "--out", str(tmp_path / "r")],
                            capsys)
    assert code == 0 and "ddp x 2" in stdout and "#SBATCH --nodes=2" in stdout, (stdout, err)
    code, stdout, err = cli([*PLAN[:3], "--gpu", "H100-80GB", "--nodes", "2", "--gpus-per-node", "1", "--json"],
                            capsys)
    assert code == 0 and json.loads(stdout)[0]["hardware"]["count"] == 2, (stdout, err)


def test_a_trace_the_chosen_plan_cannot_take_is_a_warning(capsys):
    """--trace traces one GPU's plan; where the planner chose several GPUs, the plan says it was not traced."""
    code, stdout, err = cli(["plan", "--models", "llama-2-70b", "--mode", "infer", "--gpu", "H100-80GB", "--gpus", "4",
                             "--trace", "--json"], capsys)
    [plan] = json.loads(stdout)
    assert code == 0 and plan["trace"] is None and plan["chosen"]["candidate"]["gpus"] > 1
    assert f"uses {plan['chosen']['candidate']['gpus']}; it is not traced" in err and "--trace" in err
