"""Bad input of every kind ends in one paragraph naming the field and where it was written, exit 2, before
anything launches: numbers, contradictions, YAML, model directories, output directories, saved sweeps and
results files that were damaged, a disk that fills up mid-sweep, and a resume that would change its sweep."""

import json
import os
import resource
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from fitbench.config import load_yaml
from fitbench.results.store import ROW_MAX_BYTES, ResultStore
from fitbench.util.errors import UserError
from conftest import cli

MESSAGE_MAX = 700  # characters: a message quotes input, it never echoes it
# Configurations that a CPU refuses before launch (int4 needs a GPU): real sweeps, real rows, no worker.
REFUSED = ["--models", "tiny", "--mode", "infer", "--precision", "int4", "--new-tokens", "4"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FITBENCH_INJECT", raising=False)


def check_user_error(code: int, stderr: str, *fields: str) -> str:
    assert code == 2, stderr
    assert "Traceback" not in stderr
    message = stderr.strip()
    assert message and len(message.splitlines()) == 1, message
    assert len(message) <= MESSAGE_MAX, message
    for field in fields:
        assert field in message, (field, message)
    return message


# ---- numbers and contradictions on the command line -----------------------------------------------


@pytest.mark.parametrize("argv, fields", [
    (["--seed", str(2**64)], ["seed", "--seed", "18,446,744,073,709,551,615"]),
    (["--seed", "-1"], ["seed", "--seed", "at least 0"]),
    (["--batch-size", str(2**40)], ["batch_size", "--batch-size", "at most"]),
    (["--seq-len", str(10**30)], ["seq_len", "--seq-len", "at most"]),
    (["--warmup-steps", "-1"], ["warmup_steps", "--warmup-steps"]),
    (["--measure-steps", str(2**63)], ["measure_steps", "--measure-steps"]),
    (["--new-tokens", "0"], ["new_tokens", "--new-tokens"]),
    (["--pass-type", "forward", "--mode", "train"], ["--pass-type", "--mode"]),
    (["--fallback", "bf16-pure", "--no-fallback"], ["--fallback", "--no-fallback"]),
    (["--resume", "somewhere", "--out", "elsewhere"], ["--resume", "--out"]),
    (["--extend"], ["--extend", "--resume"]),
])
def test_bad_run_options(argv, fields, tmp_path, capsys):
    code, _, stderr = cli(["run", "--models", "tiny", *argv, "--out", str(tmp_path / "out")]
                          if "--out" not in argv else ["run", *argv], capsys)
    check_user_error(code, stderr, *fields)
    assert not (tmp_path / "out").exists()


def test_bad_model_names_are_quoted_short(tmp_path, capsys):
    for name in ("x" * 5000, "", "no/such/model/" + "y" * 300):
        code, _, stderr = cli(["run", "--models", name, "--out", str(tmp_path / "out")], capsys)
        check_user_error(code, stderr, "models")
        assert "x" * 100 not in stderr and "y" * 100 not in stderr


@pytest.mark.parametrize("argv, fields", [
    (["--gpu-memory", "0GB"], ["gpu-memory", "0GB"]),
    (["--gpu-memory", "nanGB"], ["gpu-memory", "nanGB"]),
    (["--gpu-memory", "infGB"], ["gpu-memory"]),
    (["--gpu-memory", "1e400GB"], ["gpu-memory", "1e400GB"]),
    (["--gpu-memory=-80GB"], ["gpu-memory", "-80GB"]),
    (["--gpu-memory", "2000TB"], ["gpu-memory", "100 TB"]),
    (["--gpu-memory", "eightyGB"], ["gpu-memory", "not a size"]),
    (["--gpu", "H100-80GB", "--gpu-memory", "80GB"], ["--gpu", "--gpu-memory"]),
    (["--gpu-memory", "80GB", "--gpus", "0"], ["gpus"]),
    (["--gpu-memory", "80GB", "--gpus", str(10**6)], ["gpus", "65,536"]),
    (["--gpu-memory", "80GB", "--seq-len", "5000"], ["seq_len", "5000", "1024"]),
    (["--gpu-memory", "80GB", "--mode", "infer", "--seq-len", "1000"], ["seq_len", "new_tokens", "896"]),
    (["--gpu-memory", "80GB", "--seq-len", "5000", "--requirements"], ["seq_len", "1024"]),
    (["--gpu-memory", "80GB", "--seq-len", "0"], ["seq_len", "--seq-len"]),
    (["--gpu-memory", "80GB", "--seq-len", "1e3"], ["--seq-len", "1e3"]),
    (["--gpu-memory", "80GB", "--batch-size", "0"], ["batch_size", "--batch-size"]),
    (["--gpu-memory", "80GB", "--batch-size", "auto", "2"], ["batch_size", "auto"]),
    (["--gpu-memory", "80GB", "--new-tokens", "1"], ["new_tokens", "--new-tokens"]),
])
def test_bad_plan_options(argv, fields, capsys):
    code, stdout, stderr = cli(["plan", "--models", "tiny", *argv], capsys)
    check_user_error(code, stderr, *fields)
    assert stdout == ""


def test_run_and_plan_refuse_the_same_shapes(capsys):
    """One validation for both commands: the same values, the same sentence."""
    for argv in (["--seq-len", "0"], ["--batch-size", "0"], ["--new-tokens", "1"], ["--seq-len", "4096"]):
        _, _, ran = cli(["run", "--models", "tiny", "--mode", "train", *argv], capsys)
        _, _, planned = cli(["plan", "--models", "tiny", "--mode", "train", "--gpu-memory", "80GB", *argv], capsys)
        assert ran and ran == planned, (ran, planned)


# ---- YAML ----------------------------------------------------------------------------------------

ALIAS_BOMB = ('a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
              + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]\n"
                        for i in range(8))
              + "models: *i\n")


BAD_YAML = [
    (ALIAS_BOMB, ["config", "aliases", "10,000"]),
    ("models: &a [tiny, *a]\n", ["config", "alias"]),
    ("models: [tiny]\n1: 2\n", ["config", "key 1", "int"]),
    ("models: [tiny]\n? [a, b]\n: 2\n", ["config", "not valid YAML"]),
    ("models: [tiny]\nnull: 2\n", ["config", "None"]),
    ("models: {sizes: [tiny], 3: x}\n", ["config", "`models`", "key 3"]),
    ("models: {sizes: [tiny], quantization: {priority_order: [fp16], 7: x}}\n", ["`models.quantization`", "7"]),
    ("models: [tiny]\npass_type: forward\nmode: train\n", ["`pass_type`", "`mode`"]),
    ("models: [tiny]\nno_fallback: true\nfallback: [bf16-pure]\n", ["`no_fallback`", "`fallback`"]),
    ("models: [tiny]\nseq_len: 16\ncontext_length: 32\n", ["`context_length`", "`seq_len`"]),
    ("models: [tiny]\nsamples: 2\nmeasure_steps: 3\n", ["`samples`", "`measure_steps`"]),
    ("models: [tiny]\nbatch_size: .nan\n", ["batch_size", "nan", "`batch_size` key of"]),
    ("models: [tiny]\nbatch_size: .inf\n", ["batch_size", "inf"]),
    ("models: [tiny]\nbatch_size: true\n", ["batch_size", "bool"]),
    ("models: [tiny]\nbatch_size: '4'\n", ["batch_size", "text"]),
    ("models: [tiny]\nwarmup_steps: 2.5\n", ["warmup_steps", "2.5"]),
    ("models: [tiny]\nseed: 18446744073709551616\n", ["seed", "`seed` key of"]),
    ("models: [tiny]\nseed: -3\n", ["seed", "at least 0"]),
    ("models: [tiny]\nnew_tokens: 1e400\n", ["new_tokens", "inf"]),
    ("models: [tiny]\nmeasure_steps: 0\n", ["measure_steps"]),
    ("models: ['']\n", ["models", "`models` key of"]),
    ("models: [1]\n", ["models"]),
    ("models: [tiny]\npriority_order: [16bit]\n", ["priority_order: ", "16bit", "`priority_order` key of"]),
    ("models: {sizes: [tiny], quantization: {priority_order: [16bit]}}\n",
     ["models.quantization.priority_order: ", "16bit"]),
    ("models: [tiny]\nbatch_size: [" + ", ".join(["-1"] * 5000) + "]\n", ["batch_size", "positive"]),
    ("models: [tiny]\nollama_url: localhost:11434\nollama_model: m\n", ["ollama_url", "http://localhost:11434"]),
]


@pytest.mark.parametrize("text, fields", BAD_YAML, ids=[f"yaml{i}" for i in range(len(BAD_YAML))])
def test_bad_yaml(text, fields, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    code, _, stderr = cli(["run", "--config", str(config), "--out", str(tmp_path / "out")], capsys)
    message = check_user_error(code, stderr, *fields)
    assert "config.yaml" in message
    assert not message.startswith("fitbench: fallback")


@pytest.mark.parametrize("raw, fields", [
    (b"models: [t\xffny]\n", ["config", "UTF-8", "0xff"]),
    (b"models: [tiny]\n" + b"# padding\n" * 200_000, ["config", "1,000,000 bytes"]),
], ids=["not-utf8", "too-large"])
def test_bad_yaml_bytes(raw, fields, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_bytes(raw)
    code, _, stderr = cli(["run", "--config", str(config)], capsys)
    check_user_error(code, stderr, *fields, "config.yaml")


def test_an_alias_bomb_fails_fast_in_bounded_memory(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB.replace("[tiny]", "").replace(" 9", ""))
    tracemalloc.start()
    with pytest.raises(UserError, match="aliases"):
        load_yaml(bomb)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 20e6


def test_aliases_within_the_limit_still_work(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("models: &names [tiny]\nprecision: &ladder [bf16-pure, int8]\nfallback: *ladder\n")
    assert load_yaml(config) == {"models": ["tiny"], "precision": ["bf16-pure", "int8"],
                                 "fallback": ["bf16-pure", "int8"]}


# ---- model directories ---------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 120, "n_positions": 96}
FALCON = {"model_type": "falcon", "new_decoder_architecture": True, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_kv_heads": 2, "vocab_size": 100}


def without(config: dict, key: str) -> dict:
    return {k: v for k, v in config.items() if k != key}


BAD_CONFIGS = [
    (b"", ["config.json", "empty"]),
    (b"   \n", ["config.json", "empty"]),
    (b'{"model_type": "llama", ', ["config.json", "not valid JSON", "line 1"]),
    (b'{"model_type": "ll\xffama"}', ["config.json", "UTF-8"]),
    (b"[1, 2, 3]", ["config.json", "list", "object"]),
    (b"42", ["config.json", "int"]),
    (b'"llama"', ["config.json", "str"]),
    (b"null", ["config.json", "NoneType"]),
    (json.dumps(without(LLAMA, "model_type")).encode(), ["model_type"]),
    (json.dumps({**LLAMA, "model_type": "bert"}).encode(), ["model_type", "bert"]),
    (json.dumps({**LLAMA, "model_type": ["llama"]}).encode(), ["model_type"]),
    (json.dumps(without(LLAMA, "vocab_size")).encode(), ["`vocab_size`", "missing"]),
    (json.dumps(without(LLAMA, "hidden_size")).encode(), ["`hidden_size`", "missing"]),
    (json.dumps({**LLAMA, "num_attention_heads": None}).encode(), ["`num_attention_heads`", "missing"]),
    (json.dumps({**LLAMA, "num_attention_heads": "4"}).encode(), ["`num_attention_heads`", "text"]),
    (json.dumps({**LLAMA, "hidden_size": 64.0}).encode(), ["`hidden_size`", "float"]),
    (json.dumps({**LLAMA, "num_hidden_layers": True}).encode(), ["`num_hidden_layers`", "bool"]),
    (json.dumps({**LLAMA, "num_attention_heads": 0}).encode(), ["`num_attention_heads`", "0"]),
    (json.dumps({**LLAMA, "num_key_value_heads": 0}).encode(), ["`num_key_value_heads`"]),
    (json.dumps({**LLAMA, "hidden_size": -64}).encode(), ["`hidden_size`", "-64"]),
    (json.dumps({**LLAMA, "intermediate_size": -128}).encode(), ["`intermediate_size`"]),
    (json.dumps({**LLAMA, "num_hidden_layers": -2}).encode(), ["`num_hidden_layers`"]),
    (json.dumps({**LLAMA, "vocab_size": 0}).encode(), ["`vocab_size`"]),
    (json.dumps({**LLAMA, "max_position_embeddings": 0}).encode(), ["`max_position_embeddings`"]),
    (json.dumps({**LLAMA, "hidden_size": 66}).encode(), ["`hidden_size`", "66", "divisible", "`num_attention_heads`"]),
    (json.dumps({**LLAMA, "num_key_value_heads": 3}).encode(), ["`num_key_value_heads`", "3", "divide"]),
    (json.dumps({**LLAMA, "hidden_size": 12}).encode(), ["`hidden_size`", "even"]),
    (json.dumps({**LLAMA, "hidden_size": 10**30}).encode(), ["`hidden_size`", "1,048,576"]),
    (json.dumps({**LLAMA, "hidden_size": 1 << 20, "intermediate_size": 1 << 22, "num_hidden_layers": 1 << 14,
                 "num_attention_heads": 1 << 10, "num_key_value_heads": 1 << 10}).encode(), ["parameters"]),
    (json.dumps({**LLAMA, "rope_theta": "big"}).encode(), ["`rope_theta`"]),
    (json.dumps({**LLAMA, "rope_theta": -1}).encode(), ["`rope_theta`"]),
    (json.dumps({**LLAMA, "rms_norm_eps": 0}).encode(), ["`rms_norm_eps`"]),
    (json.dumps({**LLAMA, "rope_scaling": [1, 2]}).encode(), ["`rope_scaling`"]),
    (json.dumps({**LLAMA, "tie_word_embeddings": "yes"}).encode(), ["`tie_word_embeddings`", "true or false"]),
    (json.dumps({**LLAMA, "hidden_size": "64", "vocab_size": -1}).encode(), ["`hidden_size`", "`vocab_size`"]),
    (json.dumps({**GPT2, "n_head": 0}).encode(), ["`n_head`"]),
    (json.dumps({**GPT2, "n_embd": 66}).encode(), ["`n_embd`", "`n_head`"]),
    (json.dumps(without(GPT2, "n_layer")).encode(), ["`n_layer`"]),
    (json.dumps({**FALCON, "num_kv_heads": 3}).encode(), ["`num_kv_heads`"]),
    (json.dumps({**FALCON, "new_decoder_architecture": False}).encode(), ["falcon", "new decoder"]),
]


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("raw, fields", BAD_CONFIGS, ids=[f"config{i}" for i in range(len(BAD_CONFIGS))])
def test_bad_model_directories(command, raw, fields, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes(raw)
    extra = ["--out", str(tmp_path / "out")] if command == "run" else ["--gpu-memory", "80GB"]
    code, stdout, stderr = cli([command, "--models", str(model), *extra], capsys)
    message = check_user_error(code, stderr, "models", *fields)
    assert "config.json" in message and "Fix" in message
    assert not (tmp_path / "out").exists() and "tokens/s" not in stdout


def test_a_model_directory_without_a_config(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    code, _, stderr = cli(["plan", "--models", str(tmp_path / "model"), "--gpu-memory", "80GB"], capsys)
    check_user_error(code, stderr, "models", "config.json")


def test_a_good_model_directory_still_plans(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    code, stdout, stderr = cli(["plan", "--models", str(model), "--seq-len", "64", "--gpu-memory", "80GB",
                                "--json"], capsys)
    assert code == 0, stderr
    assert json.loads(stdout)[0]["chosen"]["speed"]["tokens_per_s"] > 0


# ---- output directories --------------------------------------------------------------------------


def test_out_is_an_existing_file(tmp_path, capsys):
    (tmp_path / "taken").write_text("not a directory")
    code, _, stderr = cli(["run", *REFUSED, "--out", str(tmp_path / "taken")], capsys)
    check_user_error(code, stderr, "out", "taken", "existing file")
    code, _, stderr = cli(["run", *REFUSED, "--out", str(tmp_path / "taken" / "below")], capsys)
    check_user_error(code, stderr, "out", "cannot write")
    assert (tmp_path / "taken").read_text() == "not a directory"


def test_out_is_not_writable(tmp_path, capsys):
    if os.geteuid() == 0:  # root writes through permissions: a read-only file system instead
        out = "/sys/fitbench-out"
    else:
        (tmp_path / "locked").mkdir(mode=0o500)
        out = str(tmp_path / "locked" / "out")
    code, _, stderr = cli(["run", *REFUSED, "--out", out], capsys)
    check_user_error(code, stderr, "out", "cannot write", out)


def _ignore_xfsz_and_limit(limit: int):
    def setup():
        # Past RLIMIT_FSIZE a write fails with EFBIG, as on a full disk it fails with ENOSPC, once the
        # signal that would kill the process instead is ignored.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return setup


def test_a_full_disk_mid_sweep_damages_nothing_and_resume_finishes(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, stderr = cli(["run", *REFUSED, "--seq-len", "16", "32", "64", "128", "--out", str(out)], capsys)
    assert code in (0, 1), stderr
    store = ResultStore(out)
    lines = store.path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 4
    store.path.write_bytes(b"".join(lines[:3]))  # the last configuration is to run again
    before = store.path.read_bytes()
    assert len(before) > (out / "sweep.json").stat().st_size

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "fitbench", "run", "--resume", str(out)], capture_output=True,
                          text=True, cwd=tmp_path, env=env, preexec_fn=_ignore_xfsz_and_limit(len(before) + 100),
                          timeout=120)
    message = check_user_error(done.returncode, done.stderr, "out", str(out), "--resume", "intact")
    assert "File too large" in message
    assert store.path.read_bytes() == before  # not even half a row was left behind

    code, stdout, stderr = cli(["run", "--resume", str(out)], capsys)
    assert code in (0, 1), stderr
    assert "3 already finished" in stdout
    rows = list(store.rows())
    assert len(rows) == 4 and len({row["key"] for row in rows}) == 4


# ---- damaged results and saved sweeps -------------------------------------------------------------


def test_damaged_results_lines_are_skipped_with_their_line_numbers(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, stderr = cli(["run", *REFUSED, "--seq-len", "16", "32", "--out", str(out)], capsys)
    assert code in (0, 1), stderr
    good = (out / "results.jsonl").read_bytes().splitlines(keepends=True)
    first = json.loads(good[0])
    damaged = [b"42\n", b"[1, 2]\n", b'{"key": "\xff\xfe"}\n', json.dumps(without(first, "spec")).encode() + b"\n",
               json.dumps({**first, "spec": {**first["spec"], "mode": None}}).encode() + b"\n",
               b"\n", b'"text"\n', b"null\n", b'{"key": "cut", "status": "ok", "spec": {"mo']
    (out / "results.jsonl").write_bytes(good[0] + b"".join(damaged[:-1]) + good[1] + damaged[-1])

    warnings: list[str] = []
    rows = list(ResultStore(out, on_bad_line=warnings.append).rows())
    assert [row["key"] for row in rows] == [json.loads(line)["key"] for line in good]
    numbers = [int(warning.split("line ")[1].split()[0]) for warning in warnings]
    assert numbers == [2, 3, 4, 5, 6, 8, 9, 11]
    assert len(list(ResultStore(out, on_bad_line=warnings.append).rows())) == 2

    code, stdout, stderr = cli(["report", str(out)], capsys)
    assert code == 0 and "Traceback" not in stderr
    assert "line 4" in stderr and "not UTF-8" in stderr and "spec" in stderr
    code, stdout, stderr = cli(["report", str(out), "--markdown"], capsys)
    assert code == 0 and stdout.count("| tiny |") == 2

    code, stdout, stderr = cli(["run", "--resume", str(out)], capsys)
    assert code in (0, 1) and "Traceback" not in stderr
    assert "2 already finished" in stdout and "line 11" in stderr
    assert len(list(ResultStore(out).rows())) == 2


@pytest.mark.parametrize("raw, fields", [
    (b"{not json", ["sweep.json", "damaged", "not valid JSON"]),
    (b"", ["sweep.json", "damaged"]),
    (b'{"config": {"models": ["t\xffny"]}}', ["sweep.json", "UTF-8"]),
    (b"[1, 2]", ["sweep.json", "damaged", "`config`"]),
    (b'{"config": 42}', ["sweep.json", "`config`"]),
    (b'{"config": {"models": 42}}', ["sweep.json", "models"]),
    (b'{"config": {"models": ["tiny"], "batch_size": ["x"]}}', ["sweep.json", "batch_size"]),
    (b'{"config": {"models": ["tiny"], "seed": 1e30}}', ["sweep.json", "seed"]),
    (b'{"config": {"models": ["tiny"], "colour": "red"}}', ["sweep.json", "colour"]),
])
def test_damaged_saved_sweep(raw, fields, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sweep.json").write_bytes(raw)
    code, _, stderr = cli(["run", "--resume", str(tmp_path / "out")], capsys)
    check_user_error(code, stderr, "resume", *fields)
    assert (tmp_path / "out" / "sweep.json").read_bytes() == raw


# ---- resume never forgets -------------------------------------------------------------------------


@pytest.fixture
def saved_sweep(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, stderr = cli(["run", *REFUSED, "--seq-len", "16", "--out", str(out)], capsys)
    assert code in (0, 1), stderr
    return out


@pytest.mark.parametrize("argv, shown", [
    (["--seq-len", "32"], "seq_len: saved [16], given [32]"),
    (["--models", "small"], "models: saved ['tiny'], given ['small']"),
    (["--warmup-steps", "3"], "warmup_steps: saved 5, given 3"),
    (["--no-fallback"], "no_fallback: saved False, given True"),
])
def test_resume_with_other_options_is_refused(saved_sweep, argv, shown, capsys):
    before = (saved_sweep / "sweep.json").read_bytes()
    code, _, stderr = cli(["run", "--resume", str(saved_sweep), *argv], capsys)
    check_user_error(code, stderr, "resume", shown, "--extend")
    assert (saved_sweep / "sweep.json").read_bytes() == before


def test_resume_with_a_config_file_that_changes_the_sweep_is_refused(saved_sweep, tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("seq_len: 64\n")
    code, _, stderr = cli(["run", "--resume", str(saved_sweep), "--config", str(tmp_path / "c.yaml")], capsys)
    check_user_error(code, stderr, "seq_len: saved [16], given [64]")


def test_resume_with_the_same_options_goes_on(saved_sweep, capsys):
    code, stdout, stderr = cli(["run", "--resume", str(saved_sweep), "--seq-len", "16", "--models", "tiny"], capsys)
    assert code in (0, 1), stderr
    assert "1 already finished" in stdout


def test_extend_adds_to_the_saved_sweep_and_keeps_it(saved_sweep, capsys):
    code, stdout, stderr = cli(["run", "--resume", str(saved_sweep), "--extend", "--seq-len", "32"], capsys)
    assert code in (0, 1), stderr
    assert "2 configuration(s)" in stdout and "1 already finished" in stdout
    saved = json.loads((saved_sweep / "sweep.json").read_text())["config"]
    assert saved["seq_len"] == [16, 32] and saved["models"] == ["tiny"]
    assert sorted(row["spec"]["seq_len"] for row in ResultStore(saved_sweep).rows()) == [16, 32]
    # a plain resume now knows both
    code, stdout, _ = cli(["run", "--resume", str(saved_sweep)], capsys)
    assert "2 already finished" in stdout


@pytest.mark.parametrize("argv, fields", [
    (["--warmup-steps", "3"], ["warmup_steps", "--extend adds"]),
    (["--batch-size", "2"], ["batch_size", "left to its defaults"]),
])
def test_extend_cannot_change_a_setting(saved_sweep, argv, fields, capsys):
    before = (saved_sweep / "sweep.json").read_bytes()
    code, _, stderr = cli(["run", "--resume", str(saved_sweep), "--extend", *argv], capsys)
    check_user_error(code, stderr, "resume", *fields)
    assert (saved_sweep / "sweep.json").read_bytes() == before


def test_help_documents_extend(capsys):
    code, stdout, _ = cli(["run", "--help"], capsys)
    assert code == 0 and "--extend" in stdout and "--resume" in stdout


# ---- a second round: held-out-style inputs ----------------------------------------------------------


@pytest.mark.parametrize("argv, fields", [
    (["--resume", ""], ["resume", "empty path"]),
    (["--config", ""], ["config", "empty path"]),
    (["--out", ""], ["out", "--out"]),
    (["--seq-len", "16", "--context-length", "32"], ["--seq-len", "--context-length"]),
    (["--samples", "2", "--measure-steps=3"], ["--measure-steps", "--samples"]),
    (["--mode", "infer", "--modes", "train"], ["--mode", "--modes"]),
    (["--timeout=-inf"], ["timeout", "finite", "--timeout"]),
    (["--timeout", "-inf"], ["--timeout"]),
    (["--timeout", "1e400"], ["timeout", "finite"]),
    (["--timeout", "nan"], ["timeout", "finite"]),
    (["--timeout", "0"], ["timeout", "greater than 0"]),
    (["--timeout", "0x10"], ["--timeout", "0x10"]),
    (["--seed=-1"], ["seed", "at least 0"]),
    (["--seed", "0x10"], ["--seed"]),
    (["--new-tokens=-4"], ["new_tokens", "--new-tokens"]),
    (["--warmup-steps", str(2**31)], ["warmup_steps", "2,147,483,647"]),
    (["--device", "c" * 5000], ["device", "--device"]),
])
def test_more_bad_run_options(argv, fields, tmp_path, capsys):
    out = [] if "--out" in argv or "--resume" in argv else ["--out", str(tmp_path / "out")]
    code, stdout, stderr = cli(["run", *REFUSED, *out, *argv] if "--resume" not in argv else ["run", *argv], capsys)
    check_user_error(code, stderr, *fields)
    assert "c" * 100 not in stderr and stdout == ""
    assert not (tmp_path / "out").exists() and not (tmp_path / "fitbench-results").exists()


@pytest.mark.parametrize("argv, fields", [
    (["--gpu", ""], ["gpu", "--gpu", "empty"]),
    (["--gpu-memory", ""], ["gpu-memory", "empty"]),
    (["--gpu-memory", "1B"], ["gpu-memory", "1B", "1 GB"]),
    (["--gpu-memory", "80"], ["gpu-memory", "bare number is bytes"]),
    (["--gpu-memory", "1e-300GB"], ["gpu-memory", "1e-300GB"]),
    (["--gpu-memory=-infGB"], ["gpu-memory", "-infGB"]),
    (["--gpu-memory", "80GB", "--seq-len", "16", "--context-length", "32"], ["--seq-len", "--context-length"]),
    (["--gpu-memory", "80GB", "--gpus=-1"], ["gpus"]),
    (["--gpu-memory", "80GB", "--mode", "infer", "--new-tokens", str(10**20)], ["new_tokens", "at most"]),
])
def test_more_bad_plan_options(argv, fields, capsys):
    code, stdout, stderr = cli(["plan", "--models", "tiny", *argv], capsys)
    check_user_error(code, stderr, *fields)
    assert stdout == ""


MORE_BAD_YAML = [
    ("", ["config", "holds no options"]),
    ("# only a comment\n", ["config", "holds no options"]),
    ("models: [tiny]\nseq_len: 16\nseq_len: 32\n", ["config", "seq_len", "twice", "line 1"]),
    ("models: {sizes: [tiny], sizes: [small]}\n", ["config", "sizes", "twice"]),
    ("models: [tiny]\nseq_len: 16\nseq-len: 32\n", ["config", "seq_len", "seq-len", "written twice"]),
    ("models: " + "[" * 5000 + "]" * 5000 + "\n", ["config", "too deeply"]),
    ("models: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", ["config", "too deeply"]),
    ("models: [tiny]\nseed: " + "9" * 5000 + "\n", ["config", "number"]),
    ("models: [tiny]\npriority_order: null\n", ["config", "priority_order", "empty"]),
    ("models: {sizes: [tiny], quantization: {priority_order: null}}\n", ["models.quantization.priority_order"]),
    ("models: {sizes: [tiny], quantization: 5}\n", ["config", "`models.quantization`", "mapping"]),
    ("models: [tiny]\ntimeout: '10'\n", ["timeout", "text", "`timeout` key of"]),
    ("models: [tiny]\ntimeout: true\n", ["timeout", "bool"]),
    ("models: [tiny]\ntimeout: -.inf\n", ["timeout", "finite"]),
    ("models: [tiny]\ndevice: " + "c" * 100_000 + "\n", ["device", "`device` key of"]),
    ("models: [tiny]\n? " + "k" * 5000 + "x\n: 1\n", ["unknown field"]),
    ("models: [tiny]\nout: ''\n", ["out", "`out` key of"]),
    ("models: [tiny]\nmode: train\n---\nmode: infer\n", ["config", "another document"]),
]


@pytest.mark.parametrize("text, fields", MORE_BAD_YAML, ids=[f"yaml{i}" for i in range(len(MORE_BAD_YAML))])
def test_more_bad_yaml(text, fields, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    out = [] if "out:" in text else ["--out", str(tmp_path / "out")]
    code, _, stderr = cli(["run", "--config", str(config), *out], capsys)
    message = check_user_error(code, stderr, *fields)
    assert "config.yaml" in message and "c" * 100 not in message and "k" * 100 not in message
    assert not (tmp_path / "out").exists() and not (tmp_path / "fitbench-results").exists()


MORE_BAD_CONFIGS = [
    (b'{"model_type": "llama", "hidden_size": ' + b"9" * 5000 + b"}", ["not valid JSON", "digits"]),
    (b'{"model_type": "llama", "hidden_size": NaN}', ["`hidden_size`", "nan"]),
    (b'{"model_type": "llama", "vocab_size": Infinity}', ["`vocab_size`", "inf"]),
    (json.dumps({**LLAMA, "model_type": "x" * 5000}).encode(), ["model_type", "Fix `model_type`"]),
    (json.dumps({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8}}).encode(),
     ["`rope_scaling`", "`low_freq_factor` is missing"]),
    (json.dumps({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
                                           "high_freq_factor": 1, "original_max_position_embeddings": 64}}).encode(),
     ["`rope_scaling`", "equals"]),
    (json.dumps({**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": -2}}).encode(), ["`factor`", "-2"]),
    (json.dumps({**LLAMA, "rope_scaling": {"type": "dynamic", "factor": "x"}}).encode(), ["`factor`", "text"]),
    (json.dumps({**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 0}}).encode(), ["`factor`"]),
    (json.dumps({**FALCON, "new_decoder_architecture": "yes"}).encode(), ["`new_decoder_architecture`",
                                                                          "true or false"]),
    (b"\xef\xbb\xbf" + json.dumps(LLAMA).encode(), ["not valid JSON", "BOM"]),
    (json.dumps(LLAMA).encode() + b"trailing", ["not valid JSON", "Extra data"]),
    (b"[" * 100_000 + b"]" * 100_000, ["not valid JSON"]),
]


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("raw, fields", MORE_BAD_CONFIGS, ids=[f"config{i}" for i in range(len(MORE_BAD_CONFIGS))])
def test_more_bad_model_directories(command, raw, fields, tmp_path, capsys):
    test_bad_model_directories(command, raw, fields, tmp_path, capsys)
    assert "x" * 100 not in capsys.readouterr().err


@pytest.mark.parametrize("name", ["/no/such/model", "./missing-model", "../" + "m" * 300])
def test_a_missing_model_path_is_not_a_hub_id(name, capsys):
    code, _, stderr = cli(["plan", "--models", name, "--gpu-memory", "80GB"], capsys)
    check_user_error(code, stderr, "models", "does not exist")
    assert "hub" not in stderr


@pytest.mark.parametrize("name", ["n" * 300, "/".join(["q"] * 2100)])
def test_out_names_the_file_system_refuses(name, tmp_path, capsys):
    code, _, stderr = cli(["run", *REFUSED, "--out", str(tmp_path / name)], capsys)
    check_user_error(code, stderr, "out", "--out", "too long")


def test_results_lines_that_json_cannot_read_and_fields_of_the_wrong_type(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, stderr = cli(["run", *REFUSED, "--out", str(out)], capsys)
    assert code == 1, stderr
    good = (out / "results.jsonl").read_bytes()
    row = json.loads(good)
    damaged = [b'{"key": "a", "status": "ok", "spec": {"seq_len": ' + b"9" * 5000 + b"}}\n", b"[" * 100_000 + b"\n",
               json.dumps({**row, "key": "k1", "timing": float("nan")}).encode() + b"\n",
               json.dumps({**row, "key": "k2", "memory": [1]}).encode() + b"\n",
               json.dumps({**row, "key": "k3", "label": 5}).encode() + b"\n"]
    (out / "results.jsonl").write_bytes(good + b"".join(damaged))
    for argv in (["report", str(out)], ["report", str(out), "--markdown"], ["run", "--resume", str(out)]):
        code, stdout, stderr = cli(argv, capsys)
        assert code in (0, 1) and "Traceback" not in stderr, stderr
        assert [f"line {n}" in stderr for n in range(2, 7)] == [True] * 5, stderr
        assert "timing" in stderr and "memory" in stderr and "label" in stderr


def test_a_results_file_of_garbage_warns_in_a_few_lines(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.jsonl").write_bytes(bytes(range(256)) * 200)
    code, _, stderr = cli(["report", str(tmp_path / "out")], capsys)
    assert code == 0 and "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 11 and "more damaged line(s)" in lines[-1], stderr


def test_a_results_file_that_is_a_directory(tmp_path, capsys):
    (tmp_path / "out" / "results.jsonl").mkdir(parents=True)
    code, _, stderr = cli(["report", str(tmp_path / "out")], capsys)
    check_user_error(code, stderr, "results.jsonl", "Is a directory")


@pytest.mark.parametrize("raw", [b'{"config": {"models": ["tiny"], "seed": ' + b"9" * 5000 + b"}}", b"[" * 100_000,
                                 b'{"config": {"' + b"k" * 10_000 + b'": 1}}'], ids=["digits", "deep", "long-key"])
def test_saved_sweeps_json_cannot_read(raw, tmp_path, capsys):
    test_damaged_saved_sweep(raw, ["sweep.json"], tmp_path, capsys)


# ---- values that start with a minus --------------------------------------------------------------


@pytest.mark.parametrize("command, argv, fields", [
    ("run", ["--timeout", "-inf"], ["timeout", "finite", "--timeout"]),
    ("run", ["--timeout", "-5"], ["timeout", "greater than 0", "--timeout"]),
    ("run", ["--timeout", "-1e3"], ["timeout", "greater than 0", "--timeout"]),
    ("run", ["--timeout", "-nan"], ["timeout", "finite", "--timeout"]),
    ("run", ["--timeout", "-Infinity"], ["timeout", "finite", "--timeout"]),
    ("run", ["--seed", "-1"], ["seed", "at least 0", "--seed"]),
    ("run", ["--new-tokens", "-3"], ["new_tokens", "at least 2", "--new-tokens"]),
    ("run", ["--warmup-steps", "-1"], ["warmup_steps", "--warmup-steps"]),
    ("run", ["--measure-steps", "-2"], ["measure_steps", "--measure-steps"]),
    ("run", ["--batch-size", "4", "-2"], ["batch_size", "positive", "--batch-size"]),
    ("run", ["--seq-len", "16", "-.5"], ["--seq-len", "whole number", "-.5"]),
    ("run", ["--seed", "-1e3"], ["--seed", "whole number", "-1e3"]),
    ("plan", ["--gpu-memory", "-80GB"], ["gpu-memory", "-80GB", "1 GB to 100 TB"]),
    ("plan", ["--gpu-memory", "-inf"], ["gpu-memory", "-inf"]),
    ("plan", ["--gpus", "-2"], ["gpus", "from 1", "--gpus"]),
    ("plan", ["--gpu-memory", "80GB", "--gpus", "-2"], ["gpus", "from 1", "--gpus"]),
    ("plan", ["--gpu-memory", "80GB", "--seq-len", "-5"], ["seq_len", "positive", "--seq-len"]),
    ("plan", ["--gpu-memory", "80GB", "--new-tokens", "-3"], ["new_tokens", "at least 2", "--new-tokens"]),
    ("plan", ["--gpu-memory", "80GB", "--batch-size", "4", "-2"], ["batch_size", "positive", "--batch-size"]),
])
def test_negative_and_non_finite_values_given_apart_reach_the_options_check(command, argv, fields, tmp_path,
                                                                             capsys):
    """argparse alone takes `-inf` or `-80GB` after an option for an unknown option ("expected one
    argument"); each reaches the option's own check instead, for `run` and `plan` alike."""
    extra = ["--out", str(tmp_path / "out")] if command == "run" else []
    code, stdout, stderr = cli([command, "--models", "tiny", *argv, *extra], capsys)
    message = check_user_error(code, stderr, *fields)
    assert "expected one argument" not in message and "unrecognized" not in message
    assert not (tmp_path / "out").exists() and stdout == ""


# ---- a third round: every command, files, numbers, contradictions and output directories -----------


def _run(tmp: Path, *argv: str) -> list[str]:
    return ["run", "--models", "tiny", *argv, "--out", str(tmp / "out")]


def _yaml(tmp: Path, text: str) -> list[str]:
    (tmp / "c.yaml").write_text(text)
    return ["run", "--config", str(tmp / "c.yaml"), "--out", str(tmp / "out")]


def _model(tmp: Path, config: dict | None = None, link: str | None = None) -> list[str]:
    (tmp / "m").mkdir()
    if link:
        (tmp / "m" / "config.json").symlink_to(link)
    else:
        (tmp / "m" / "config.json").write_text(json.dumps(config))
    return ["plan", "--models", str(tmp / "m"), "--gpu-memory", "80GB"]


def _earlier_sweep(tmp: Path) -> list[str]:
    code = ResultStore(tmp / "out")
    code.save_sweep({"config": {"models": ["tiny"]}})
    return ["run", *REFUSED, "--out", str(tmp / "out")]


THIRD_ROUND = [
    # (what, how to make the command line in a fresh directory, words the message must hold)
    ("device name", lambda t: _run(t, "--device", "cuda:abc"), ["device", "cuda:N", "--device"]),
    ("calibrate device name", lambda t: ["calibrate", "--device", "foo"], ["device", "'foo'", "cuda:N"]),
    ("env device name", lambda t: ["env", "--measure", "--device", "gpu0"], ["device", "'gpu0'", "cuda:N"]),
    ("calibrate on a CPU", lambda t: ["calibrate", "--device", "cpu"], ["device", "GPU"]),
    ("a switch and its negation", lambda t: _run(t, "--cuda-graphs", "--no-cuda-graphs"),
     ["--cuda-graphs", "--no-cuda-graphs", "contradict"]),
    ("a quoted yes for a switch", lambda t: _yaml(t, "models: [tiny]\ncompile: 'yes'\n"),
     ["compile", "boolean", "true or false", "`compile` key of"]),
    ("a number for a switch", lambda t: _yaml(t, "models: [tiny]\nno_fallback: 1\n"), ["no_fallback", "true or false"]),
    ("a quoted off for a switch", lambda t: _yaml(t, "models: [tiny]\noffload: 'off'\n"), ["offload", "true or false"]),
    ("plan training with precisions that cannot train", lambda t: ["plan", "--models", "tiny", "--gpu-memory", "80GB",
                                                                   "--precision", "int4", "--mode", "train"],
     ["precision", "int4", "--mode infer"]),
    ("the requirements of training that cannot train",
     lambda t: ["plan", "--models", "tiny", "--gpu-memory", "80GB", "--precision", "int4", "int8-dynamic", "--mode",
                "forward-backward", "--requirements"], ["precision", "int4"]),
    ("--out of an earlier sweep", _earlier_sweep, ["out", "already holds a sweep", "--resume", "another --out"]),
    ("report of an empty path", lambda t: ["report", ""], ["report", "empty"]),
    ("report of a file", lambda t: (t / "f").write_text("x") and ["report", str(t / "f")], ["report", "is a file"]),
    ("--gpus alone below one", lambda t: ["plan", "--models", "tiny", "--gpus", "-2"], ["gpus", "from 1"]),
    ("a seed in scientific notation", lambda t: _run(t, "--seed", "1e3"), ["--seed", "whole number", "1e3"]),
    ("a timeout that is a word", lambda t: _run(t, "--timeout", "soon"), ["--timeout", "a number", "soon"]),
    ("a huge mode", lambda t: _run(t, "--mode", "x" * 3000), ["--mode", "invalid choice"]),
    ("a seed of 5000 digits", lambda t: _run(t, "--seed", "9" * 5000), ["--seed", "whole number"]),
    ("a huge command", lambda t: ["y" * 3000], ["invalid choice"]),
    ("a timeout past a double", lambda t: _run(t, "--timeout", "1e309"), ["timeout", "finite"]),
    ("a NaN timeout in YAML", lambda t: _yaml(t, "models: [tiny]\ntimeout: .nan\n"),
     ["timeout", "finite", "`timeout`"]),
    ("a mapping for batch sizes", lambda t: _yaml(t, "models: [tiny]\nbatch_size: {a: 1}\n"), ["batch_size", "dict"]),
    ("a number among modes", lambda t: _yaml(t, "models: [tiny]\nmode: [train, 42]\n"), ["mode", "42"]),
    ("a YAML list of options", lambda t: _yaml(t, "- models\n- tiny\n"), ["config", "mapping", "list"]),
    ("a tab in YAML", lambda t: _yaml(t, "models: [tiny]\n\tmode: train\n"), ["config", "line 2", "YAML"]),
    ("a Python tag in YAML", lambda t: _yaml(t, "models: !!python/object:os.system [ls]\n"), ["config", "YAML"]),
    ("a number for the device", lambda t: _yaml(t, "models: [tiny]\ndevice: 0\n"), ["device", "`device` key of"]),
    ("resume as a YAML key", lambda t: _yaml(t, "models: [tiny]\nresume: x\n"), ["resume", "unknown field"]),
    ("a float for a count in YAML", lambda t: _yaml(t, "models: [tiny]\nwarmup_steps: 1.0\n"),
     ["warmup_steps", "float"]),
    ("a context of 10^30 tokens", lambda t: _model(t, {**LLAMA, "max_position_embeddings": 10**30}),
     ["`max_position_embeddings`", "1,073,741,824"]),
    ("more key/value heads than heads", lambda t: _model(t, {**LLAMA, "num_key_value_heads": 8}),
     ["`num_key_value_heads`", "divide"]),
    ("a float vocabulary", lambda t: _model(t, {**LLAMA, "vocab_size": 1e5}), ["`vocab_size`", "float"]),
    ("a config.json that is a device", lambda t: _model(t, link="/dev/zero"), ["models", "config.json"]),
    ("an unknown size unit", lambda t: ["plan", "--models", "tiny", "--gpu-memory", "80XB"], ["gpu-memory", "80XB"]),
    ("a resume of a file", lambda t: (t / "f").write_text("x") and ["run", "--resume", str(t / "f")],
     ["resume", "no sweep.json"]),
]


@pytest.mark.parametrize("make, fields", [case[1:] for case in THIRD_ROUND], ids=[case[0] for case in THIRD_ROUND])
def test_a_third_round_of_bad_input(make, fields, tmp_path, capsys):
    argv = make(tmp_path)

    def files() -> dict:  # a lock file may stay behind: it holds nothing
        return {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file() and path.suffix != ".lock"
                and path.name != "config.json"}

    before = files()
    code, stdout, stderr = cli(argv, capsys)
    message = check_user_error(code, stderr, *fields)
    assert "x" * 100 not in message and "9" * 100 not in message and "y" * 100 not in message
    assert files() == before and not (tmp_path / "out" / "results.jsonl").exists()  # nothing written, nothing ran


def _one_row(tmp: Path, capsys, **fields) -> Path:
    """A real sweep's one refused row (no worker runs), with ``fields`` changed."""
    out = tmp / "out"
    code, _, stderr = cli(["run", *REFUSED, "--out", str(out)], capsys)
    assert code == 1, stderr
    row = json.loads((out / "results.jsonl").read_text())
    row = {key: value for key, value in {**row, **fields}.items() if value is not MISSING}
    (out / "results.jsonl").write_text(json.dumps(row) + "\n")
    return out


MISSING = object()


@pytest.mark.parametrize("fields, command", [
    ({"spec": {"model": "~nobody-here/models/x", "mode": "infer", "precision": "int4", "batch_size": 1,
               "seq_len": 128, "new_tokens": 4}}, ["report"]),
    ({"command": None}, ["report", "--markdown"]),
    ({"label": MISSING}, ["run", "--resume"]),
], ids=["a path under an unknown user's home", "a null command", "no label"])
def test_rows_that_crashed_a_reader(fields, command, tmp_path, capsys):
    """Each was a traceback: a model path under the home of a user this machine does not have (the
    table expanded it), a null command beside another row's (the Markdown sorted them), a row without
    a label in the summary of a resumed sweep."""
    out = _one_row(tmp_path, capsys, **fields)
    with (out / "results.jsonl").open("a") as handle:  # a second row, as written
        handle.write(json.dumps({**json.loads((out / "results.jsonl").read_text()), "key": "other",
                                 "label": "other", "command": "fitbench run"}) + "\n")
    code, stdout, stderr = cli([*command, str(out)], capsys)
    assert code in (0, 1) and "Traceback" not in stderr and stderr.strip() == "", stderr
    assert "refused" in stdout


def test_a_results_line_too_long_to_be_a_row_is_skipped_unread(tmp_path, capsys):
    out = _one_row(tmp_path, capsys)
    good = (out / "results.jsonl").read_bytes()
    (out / "results.jsonl").write_bytes(good + b"[" * (ROW_MAX_BYTES + 10) + b"\n" + good + b"x" * (ROW_MAX_BYTES + 1))
    code, stdout, stderr = cli(["report", str(out)], capsys)
    assert code == 0 and "Traceback" not in stderr
    assert "line 2 is longer than" in stderr and "line 4 is longer than" in stderr
    assert stdout.count("refused") == 4  # each of the two rows, and its reason under the table


@pytest.mark.parametrize("argv, fields", [
    (["--nodes", "2"], ["nodes:", "--nodes", "--launcher slurm"]),
    (["--partition", "gpu"], ["partition:", "--launcher slurm"]),
    (["--launcher", "slurm", "--time", "1:2:3:4"], ["time:", "'1:2:3:4'", "24:00:00"]),
    (["--launcher", "slurm", "--time", "25:61"], ["time:", "'25:61'"]),
    (["--launcher", "slurm", "--mem", "lots"], ["mem:", "256G"]),
    (["--launcher", "slurm", "--gpus", "3", "--nodes", "2"], ["nodes:", "--gpus 3", "--nodes 2"]),
    (["--launcher", "slurm", "--sbatch-arg=--nodes=3"], ["sbatch_args:", "--nodes"]),
    (["--dry-run"], ["dry-run:", "--launcher slurm"]),
])
def test_bad_cluster_options(argv, fields, tmp_path, capsys):
    code, _, stderr = cli(["run", "--models", "tiny", "--device", "cpu", *argv, "--dry-run", "--out",
                           str(tmp_path / "out")], capsys)
    check_user_error(code, stderr, *fields)
    assert not (tmp_path / "out").exists()


def test_no_sbatch_on_path_is_one_paragraph_and_a_dry_run_needs_none(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, _, stderr = cli(["run", "--models", "tiny", "--device", "cpu", "--launcher", "slurm", "--out",
                           str(tmp_path / "out")], capsys)
    check_user_error(code, stderr, "sbatch is not on PATH", "--dry-run")
    assert not (tmp_path / "out").exists()
    code, printed, stderr = cli(["run", "--models", "tiny", "--device", "cpu", "--launcher", "slurm", "--partition",
                                 "debug", "--dry-run", "--out", str(tmp_path / "out")], capsys)
    assert code == 0, stderr
    assert "#SBATCH --partition=debug" in printed and "nothing was submitted" in printed
    assert not (tmp_path / "out" / "slurm.json").exists()


# ---- activation checkpointing of some layers --------------------------------------------------------


@pytest.mark.parametrize("argv, fields", [
    (["--checkpointed-layers", "0"], ["checkpointed_layers", "--checkpointed-layers", "positive", "leave both out"]),
    (["--checkpointed-layers", "-3"], ["checkpointed_layers", "--checkpointed-layers", "positive"]),
    (["--checkpointed-layers", "2.5"], ["--checkpointed-layers", "2.5"]),
    (["--checkpointed-layers", str(2**40)], ["checkpointed_layers", "at most"]),
    (["--checkpointed-layers", "2", "--backend", "hf"], ["checkpointed_layers", "hf backend", "--backend native",
                                                         "--activation-checkpointing alone"]),
])
def test_bad_checkpointed_layers(argv, fields, tmp_path, capsys):
    code, stdout, stderr = cli(["run", "--models", "tiny", "--mode", "train", "--device", "cpu", *argv,
                                "--out", str(tmp_path / "out")], capsys)
    check_user_error(code, stderr, *fields)
    assert stdout == "" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, argv, fields", [
    ("checkpointed_layers: true\n", [], ["checkpointed_layers", "bool", "`checkpointed_layers` key of"]),
    ("checkpointed_layers: '4'\n", [], ["checkpointed_layers", "text"]),
    ("activation_checkpointing: false\ncheckpointed_layers: 2\n", [], ["checkpointed_layers",
                                                                       "activation_checkpointing is false"]),
    ("activation_checkpointing: false\n", ["--checkpointed-layers", "2"], ["checkpointed_layers",
                                                                           "leave out one of the two"]),
])
def test_bad_checkpointed_layers_in_yaml(text, argv, fields, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("models: [tiny]\nmode: train\ndevice: cpu\n" + text)
    code, _, stderr = cli(["run", "--config", str(config), *argv, "--out", str(tmp_path / "out")], capsys)
    check_user_error(code, stderr, *fields)
    assert not (tmp_path / "out").exists()
