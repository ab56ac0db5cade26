import compileall
import fcntl
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

# One intra-op thread per process, in this process and every process it starts: the suite runs
# several processes at once (sweeps side by side, a worker beside its parent) on machines of a few
# cores, where torch's threads of tiny models spin against each other (a training step of tiny:
# 0.07 s on one thread, 0.3 to 2.7 s on two of a busy 2-core machine). No test measures threading.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Started in the background of a non-interactive shell, the suite inherits SIGINT ignored, and so would
# every sweep it starts; the tests that interrupt a sweep with SIGINT, as Ctrl-C does, need it heard.
# A handler (unlike SIG_IGN) is not inherited: the processes started from here get the default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Every process the suite starts (hundreds: parents, workers, ranks) imports fitbench, and where
# bytecode is not written (PYTHONDONTWRITEBYTECODE) each would compile its sources again: about half
# a second of CPU apiece. Compiled once here, they are read by all. Where the tree is read-only, the
# processes compile as before.
compileall.compile_dir(Path(__file__).resolve().parents[1] / "fitbench", quiet=2)
compileall.compile_dir(Path(__file__).resolve().parent, maxlevels=0, quiet=2)

# Every model in the tests is built from a config; nothing is downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``fitbench ARGV`` in this process (its workers are child processes); exit code, stdout, stderr."""
    from fitbench.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@dataclass(frozen=True)
class Shape:
    """A model as a layout's rules read it (``fitbench.spec.ModelShape``): heads, kv heads, layers, family."""

    num_heads: int = 8
    num_kv_heads: int = 4
    num_layers: int = 8
    family: str | None = "llama"


def write_tiny_checkpoint(directory, fill: float | None = None, tokenizer: bool = True, seed: int = 0):
    """``tiny`` as a transformers-layout checkpoint in ``directory``: config.json, model.safetensors with
    the native model's bf16 weights (random from ``seed``, or every element ``fill``) and, with
    ``tokenizer``, a word-level tokenizer.json trained offline on fitbench's shipped text."""
    from pathlib import Path

    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig

    from fitbench.models.native import build_native
    from fitbench.models.registry import resolve
    from fitbench.worker.quality import reference_text

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arch = resolve("tiny")
    torch.manual_seed(seed)
    model = build_native(arch, "cpu", torch.bfloat16)
    if fill is not None:
        for parameter in model.parameters():
            parameter.data.fill_(fill)
    # the output projection is tied to the embedding; safetensors stores a tensor once
    save_file({name: value for name, value in model.state_dict().items() if name != "lm_head.weight"},
              str(directory / "model.safetensors"))
    LlamaConfig(hidden_size=arch.hidden_size, intermediate_size=arch.ffn_size, num_hidden_layers=arch.num_layers,
                num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads, vocab_size=arch.vocab_size,
                max_position_embeddings=arch.max_seq_len, tie_word_embeddings=True, rms_norm_eps=arch.norm_eps,
                rope_theta=arch.rope_theta).save_pretrained(directory)
    if tokenizer:
        words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        words.train_from_iterator([reference_text()], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
        words.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """``write_tiny_checkpoint``, for tests and fixtures of any scope."""
    return write_tiny_checkpoint


@dataclass
class PipedSweep:
    args: list[str]
    out: Path
    lines: list[tuple[str, int | None, int]]  # up to the first configuration's: (line, poll(), rows written)
    rest: str  # everything printed after it
    stderr: str


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory) -> PipedSweep:
    """``fitbench run`` of tiny, train then infer, as a real process with its output piped (as in CI
    logs), read line by line while it runs. Several modules check what it wrote, in both test processes
    of ``-n auto``: the first to need it runs it, in the run's directory above both, and the other reads
    what it recorded there (waiting on the lock while it runs)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run_tiny_sweep(tmp_path_factory.mktemp("tiny-sweep"))
    shared = tmp_path_factory.getbasetemp().parent
    with (shared / "tiny-sweep.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = shared / "tiny-sweep.json"
        if record.exists():
            fields = json.loads(record.read_text())
            return PipedSweep(fields["args"], Path(fields["out"]), [tuple(line) for line in fields["lines"]],
                              fields["rest"], fields["stderr"])
        directory = shared / f"tiny-sweep-{os.environ['PYTEST_XDIST_WORKER']}"
        directory.mkdir()
        sweep = run_tiny_sweep(directory)
        record.write_text(json.dumps({**asdict(sweep), "out": str(sweep.out)}))
        return sweep


def run_tiny_sweep(tmp_path: Path) -> PipedSweep:
    from fitbench.results.store import ResultStore

    out = tmp_path / "out"
    args = ["run", "--models", "tiny", "--mode", "train", "infer", "--batch-size", "1", "--seq-len", "16",
            "--new-tokens", "4", "--warmup-steps", "1", "--measure-steps", "2", "--out", str(out)]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env.pop("FITBENCH_INJECT", None)
    parent = subprocess.Popen([sys.executable, "-m", "fitbench", *args], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in parent.stdout:
            lines.append((line, parent.poll(), len(list(ResultStore(out).rows()))))
            if line.startswith("[1/2"):
                break
        rest = parent.stdout.read()
        stderr = parent.stderr.read()
        assert parent.wait(timeout=300) == 0, stderr
    finally:
        parent.kill()
    return PipedSweep(args, out, lines, rest, stderr)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real SLURM cluster of two CPU nodes on this host (tests/slurm_cluster.py), for the session; the
    tests that need it skip where SLURM and munge are not installed."""
    from slurm_cluster import missing_programs, start_cluster, stop_cluster

    missing = missing_programs()
    if missing:
        pytest.skip(f"SLURM is not installed here: no {', '.join(missing)} on PATH (Debian: apt-get install "
                    f"slurm-wlm munge)")
    cluster = start_cluster()
    yield cluster
    stop_cluster(cluster)


@pytest.fixture(scope="session")
def slurm_overdue_job(slurm_cluster, tmp_path_factory) -> str:
    """The id of a job of ``slurm_cluster`` that outlives its time limit: one minute, SLURM's smallest,
    which slurmctld enforces at its check every 30 s, so the job ends 60 to 90 s after it starts."""
    from fitbench.launch.slurm.jobs import submit
    from fitbench.launch.slurm.options import SlurmOptions
    from fitbench.launch.slurm.script import ScriptJob, batch_script

    directory = tmp_path_factory.mktemp("overdue")
    script = directory / "overdue.sh"
    script.write_text(batch_script(SlurmOptions(time="1"), ScriptJob("overdue", str(directory / "%j.out")),
                                   ["-c", "import time; time.sleep(300)"]))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in slurm_cluster.environment.items():
            patch.setenv(name, value)
        return submit(script, cwd=directory)


@pytest.fixture(scope="session", autouse=True)
def overdue_from_the_start(request):
    """Where the session is to run a test of ``slurm_overdue_job``, the cluster starts and the job is
    submitted before the session's first test (about a second: the daemons are idle otherwise), so
    that its minute and a half passes while other files run instead of holding up its test. Each test
    process of ``-n auto`` does this for itself: none knows which files it will be given."""
    from slurm_cluster import missing_programs

    if not missing_programs() and any("slurm_overdue_job" in item.fixturenames for item in request.session.items):
        try:
            request.getfixturevalue("slurm_overdue_job")
        except Exception:
            pass  # a cluster that fails to start fails the tests that use it (pytest keeps the error), not all


# The files that keep a test process longest, in the order the test processes take them: each takes
# the next file as it finishes one (``--no-loadscope-reorder`` keeps this order, where xdist would hand
# out the files with the most tests first). The fallback sweeps first, and beside them the SLURM files,
# which mostly wait on slurmctld while the sweeps' processes use both cores; then the others longest
# first (the CPU seconds of every process a file starts, 48 s for test_tensor_parallel.py down to 8 s
# for test_planner.py, measured one file at a time on 2 cores), so that the long files overlap each
# other and the short ones fill in at the end. The files not named take a few seconds each.
FIRST = [
    "test_fallback.py", "test_slurm.py", "test_slurm_sweep.py", "test_tensor_parallel.py", "test_ranks_cli.py",
    "test_memory.py", "test_pipeline.py", "test_cli.py", "test_parallel.py", "test_quantize.py", "test_families.py",
    "test_report.py", "test_hf_parallel.py", "test_documents.py", "test_processes.py", "test_models.py",
    "test_nodes.py", "test_retries.py", "test_sanity.py", "test_compiled.py", "test_planner.py",
]
# The last file: its job, submitted as the session started (``overdue_from_the_start``), has ended by then.
LAST = "test_slurm_time_limit.py"


def pytest_collection_modifyitems(config, items):
    """The files in the order above: FIRST, the others in their own order, then LAST."""
    rank = {name: index for index, name in enumerate(FIRST)}
    items.sort(key=lambda item: len(FIRST) + 1 if item.path.name == LAST else rank.get(item.path.name, len(FIRST)))
