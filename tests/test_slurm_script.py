"""SLURM jobs without a cluster: options checked as sbatch would take them, batch scripts that quote
every word of input, and SLURM's states read into fitbench's. The scripts run here under bash, as
the batch host would run them (their #SBATCH lines are comments to bash)."""

import json
import shlex
import subprocess
import sys

import pytest

from fitbench.launch.slurm.jobs import parse_states, submit
from fitbench.launch.slurm.options import SlurmOptions
from fitbench.launch.slurm.script import ScriptJob, array_script, batch_script
from fitbench.util.errors import UserError

ECHO_ARGV = ["-c", "import json, sys; print(json.dumps(sys.argv[1:]))"]
HOSTILE = ["it's", '"quoted"', "$(touch pwned)", "`touch pwned`", "a;b", "${HOME}", "two words", "*", ""]


@pytest.mark.parametrize("time", ["90", "0:30", "24:00:00", "100:00:00", "1-12", "2-00:30", "1-00:00:00",
                                  "UNLIMITED", "infinite"])
def test_time_limits_in_sbatchs_formats_are_taken(time):
    assert SlurmOptions(time=time).time == time


@pytest.mark.parametrize("time", ["1h", "24:00:00:00", "1:60", "1:00:60", "1-24", "1-", "-5", "", "1.5", "1:2:3:4",
                                  "1-2-3", "24:00:00\n#SBATCH --x"])
def test_a_time_limit_in_another_format_names_the_field_and_the_formats(time):
    with pytest.raises(UserError) as error:
        SlurmOptions(time=time)
    message = str(error.value)
    assert message.startswith("time: ") and "days-hours:minutes:seconds" in message and "\n" not in message


@pytest.mark.parametrize("field, value, start", [
    ("nodes", 0, "nodes: 0 is not a positive whole number"), ("nodes", -2, "nodes: "), ("nodes", True, "nodes: "),
    ("gpus_per_node", 0, "gpus_per_node: "), ("cpus_per_task", 1.5, "cpus_per_task: "),
    ("mem", "256 GB", "mem: "), ("mem", "1.5G", "mem: "), ("partition", "large gpu", "partition: "),
    ("account", "a'b", "account: "),
    ("sbatch_args", ("qos=high",), "sbatch_args: 'qos=high' is not an sbatch option"),
    ("sbatch_args", ("--time=1:00:00",), "sbatch_args: '--time=1:00:00' sets sbatch's --time"),
    ("sbatch_args", ("-pdebug",), "sbatch_args: '-pdebug' sets sbatch's --partition"),
    ("sbatch_args", ("--array=0-3",), "sbatch_args: '--array=0-3' sets sbatch's --array"),
])
def test_bad_options_are_one_paragraph_naming_the_field(field, value, start):
    with pytest.raises(UserError) as error:
        SlurmOptions(**{field: value})
    assert str(error.value).startswith(start) and "\n" not in str(error.value)


def test_options_that_sbatch_takes_are_kept():
    options = SlurmOptions(partition="large_gpu", account="proj-1", time="1-00:00:00", nodes=2, gpus_per_node=4,
                           cpus_per_task=16, mem="256G", sbatch_args=("--qos=high", "--constraint=a100|h100"))
    assert options.nodes == 2 and options.sbatch_args[1] == "--constraint=a100|h100"


def run_script(script: str, tmp_path, **environment) -> list[str]:
    """Run a rendered script under bash in ``tmp_path``; the words its program received."""
    path = tmp_path / "job.sh"
    path.write_text(script)
    done = subprocess.run(["bash", str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **environment})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_one_rank_script_passes_every_word_to_its_program_as_written(tmp_path):
    job = ScriptJob(name="fitbench $(touch pwned)", output=str(tmp_path / "it's %j.out"))
    script = batch_script(SlurmOptions(sbatch_args=("--comment=a b $(touch pwned)",)), job, [*ECHO_ARGV, *HOSTILE])
    assert run_script(script, tmp_path) == HOSTILE
    assert not (tmp_path / "pwned").exists()
    assert "#SBATCH '--comment=a b $(touch pwned)'" in script.splitlines()


def test_an_array_task_runs_its_own_configuration(tmp_path):
    tasks = [[*ECHO_ARGV, "first"], [*ECHO_ARGV, *HOSTILE], [*ECHO_ARGV, "third"]]
    script = array_script(SlurmOptions(time="10"), ScriptJob(name="sweep", output="%A_%a.out"), tasks, limit=2)
    assert "#SBATCH --array=0-2%2" in script.splitlines()
    assert run_script(script, tmp_path, SLURM_ARRAY_TASK_ID="1") == HOSTILE
    assert run_script(script, tmp_path, SLURM_ARRAY_TASK_ID="2") == ["third"]


def test_an_array_limit_below_one_is_refused():
    with pytest.raises(UserError, match="^array limit: 0 tasks at once"):
        array_script(SlurmOptions(), ScriptJob(name="sweep", output="%A_%a.out"), [ECHO_ARGV], limit=0)


def test_sbatch_lines_come_from_the_options():
    options = SlurmOptions(partition="large_gpu", account="proj", time="24:00:00", nodes=1, gpus_per_node=4,
                           cpus_per_task=8, mem="256G")
    lines = [line for line in batch_script(options, ScriptJob("job", "%j.out"), ["x.py"]).splitlines()
             if line.startswith("#SBATCH")]
    assert lines == ["#SBATCH --job-name=job", "#SBATCH --output=%j.out", "#SBATCH --nodes=1",
                     "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=large_gpu", "#SBATCH --account=proj",
                     "#SBATCH --time=24:00:00", "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=8",
                     "#SBATCH --mem=256G"]


def test_ranks_of_one_node_start_under_torchrun_standalone():
    script = batch_script(SlurmOptions(gpus_per_node=4), ScriptJob("job", "%j.out", python="py"), ["-m", "w", "a"])
    assert script.splitlines()[-1] == ("exec py -m torch.distributed.run --standalone --nproc-per-node=4 "
                                       "--max-restarts=0 -m w a")


def test_several_nodes_start_one_torchrun_agent_per_node_meeting_on_the_first_host(tmp_path):
    options = SlurmOptions(nodes=2, gpus_per_node=8, cpus_per_task=32)
    script = batch_script(options, ScriptJob("job", "%j.out", python=sys.executable), ["-m", "w", "a b"])
    lines = script.splitlines()
    assert 'rendezvous_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)' in lines
    port = next(line for line in lines if line.startswith("rendezvous_port="))
    found = subprocess.run(["bash", "-c", f"{port}; echo $rendezvous_port"], capture_output=True, text=True, timeout=60)
    assert 0 < int(found.stdout) < 65536
    launch = shlex.split(script[script.index("exec "):].replace("\\\n", ""))
    assert launch[:6] == ["exec", "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=32"]
    assert launch[6:] == [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=8",
                          "--rdzv-backend=c10d", "--max-restarts=0", "--rdzv-endpoint=$rendezvous_host:$rendezvous_port",
                          "--rdzv-id=$SLURM_JOB_ID", "-m", "w", "a b"]


SQUEUE = """\
41|COMPLETED|None
42_0|RUNNING|None
42_1|PENDING|JobArrayTaskLimit
43|TIMEOUT|TimeLimit
44|COMPLETING|None
"""
SACCT = """\
50|CANCELLED by 0|None
50.batch|CANCELLED|
51|OUT_OF_MEMORY|None
51.0|OUT_OF_MEMORY|
52|NODE_FAIL|None
53|PREEMPTED|None
54|BOOT_FAIL|None
55|SOMETHING_NEW|None
"""


def test_squeue_and_sacct_lines_become_states_with_slurms_reason():
    states = {job: (status.state, status.reason) for job, status in parse_states(SQUEUE + SACCT).items()}
    assert states == {"41": ("COMPLETED", None), "42_0": ("RUNNING", None), "42_1": ("PENDING", "JobArrayTaskLimit"),
                      "43": ("TIMEOUT", "TimeLimit"), "44": ("RUNNING", None), "50": ("CANCELLED", None),
                      "51": ("OUT_OF_MEMORY", None), "52": ("NODE_FAIL", None), "53": ("PREEMPTED", None),
                      "54": ("NODE_FAIL", None), "55": ("FAILED", None)}
    assert parse_states(SACCT)["50"].slurm_state == "CANCELLED"


def test_without_sbatch_on_path_submitting_is_one_paragraph_saying_where_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError) as error:
        submit(tmp_path / "job.sh")
    assert str(error.value).startswith("launcher: sbatch is not on PATH") and "\n" not in str(error.value)


def test_each_node_runs_its_agent_inside_its_gpu_sampler(tmp_path, monkeypatch):
    from pathlib import Path

    from fitbench.launch.slurm.nodes import AgentsOnNodes

    command = AgentsOnNodes(2, 4, "node1:29500", "job-1", tmp_path, 4).command(Path("a.json"), Path("r.json"))
    sampler = command.index("fitbench.launch.slurm.sampler")
    assert command[0] == "srun" and command[sampler + 1:sampler + 4] == [str(tmp_path), "4", "--"]
    assert command.index("torch.distributed.run") > sampler and command[-3:] == ["fitbench.worker.worker", "a.json",
                                                                                  "r.json"]
    # the lines the batch script exports, as a person edited them, replace fitbench's own
    monkeypatch.setenv("FITBENCH_SRUN", "srun --nodes=2 --ntasks=2 --kill-on-bad-exit=1")
    monkeypatch.setenv("FITBENCH_TORCHRUN", "python3 -m torch.distributed.run --nnodes=2 --nproc-per-node=4 --x='a b'")
    command = AgentsOnNodes(2, 4, "node1:29500", "job-1", tmp_path, 4).command(Path("a.json"), Path("r.json"))
    assert command[:5] == ["srun", "--nodes=2", "--ntasks=2", "--kill-on-bad-exit=1", "env"]
    torchrun = command.index("python3")
    assert command[torchrun:torchrun + 6] == ["python3", "-m", "torch.distributed.run", "--nnodes=2",
                                              "--nproc-per-node=4", "--x=a b"]
    assert command[torchrun + 6:torchrun + 8] == ["--rdzv-endpoint=node1:29500", "--rdzv-id=job-1"]


def test_a_nodes_sampler_passes_its_agents_status_and_leaves_a_summary_with_or_without_nvml(tmp_path, monkeypatch):
    from fitbench.launch.slurm.sampler import merge_nodes, sample_while

    for node, status in (("n1", 0), ("n2", 3)):
        monkeypatch.setenv("SLURMD_NODENAME", node)
        assert sample_while(tmp_path, 0, [sys.executable, "-c", f"raise SystemExit({status})"]) == status
        summary = json.loads((tmp_path / f"nvml-{node}.json").read_text())
        assert summary["node"] == node and summary["gpus"] == [] and not summary["available"] and summary["reason"]
    merged = merge_nodes(tmp_path, ["n2", "n1", "n3"])  # n3 named, its sampler gone before its summary
    assert [node["node"] for node in merged["nodes"]] == ["n2", "n1", "n3"]
    assert not merged["available"] and merged["gpus"] == [] and merged["energy_j"] is None
    assert "n3: no summary" in merged["reason"]


SINFO_GRES = """\
gpu*|gpu:h100:8(S:0-1)
gpu*|gpu:h100:8(S:0-1),nvme:1
mixed|gpu:a100_80gb:4
mixed|gpu:4
cpu|(null)
"""


def test_a_partitions_gpus_are_read_from_its_gres():
    from fitbench.launch.slurm.jobs import parse_gres

    assert parse_gres(SINFO_GRES, None) == [("h100", 8)]
    assert parse_gres(SINFO_GRES, "mixed") == [("a100_80gb", 4), (None, 4)]
    assert parse_gres(SINFO_GRES, "cpu") == []


@pytest.mark.parametrize("gres, name", [("h100", "NVIDIA H100 80GB HBM3"), ("a100_80g", "NVIDIA A100-SXM4-80GB"),
                                        ("A100-40GB", "NVIDIA A100-SXM4-40GB"), ("tesla_k80", None)])
def test_a_gres_type_names_the_gpu_it_is(gres, name):
    from fitbench.launch.slurm.planned import gres_gpu

    assert gres_gpu(gres) == name


def test_the_login_node_plans_for_the_gpu_named_with_its_datasheet_memory(monkeypatch):
    from fitbench.hardware.datasheet import gpu_spec
    from fitbench.launch.slurm.planned import login_target

    monkeypatch.delenv("FITBENCH_INJECT", raising=False)
    target, calibration = login_target("cuda:0", 16, "H100-80GB", None)
    assert (target.name, target.count) == ("NVIDIA H100 80GB HBM3", 16)
    assert target.memory == gpu_spec("NVIDIA H100 80GB HBM3").total_memory and calibration is not None
    with pytest.raises(UserError, match="^gpu: 'B200X' is not a known GPU"):
        login_target("cuda:0", 16, "B200X", None)


def sized(shape=None, **given):
    from fitbench.launch.slurm.sizing import size_job

    options = {"on_gpus": True, "gpus": None, "nodes": None, "gpus_per_node": None, "cpus_per_task": None,
               "mem": None, **given}
    return size_job(**options, node=lambda: shape)


@pytest.mark.parametrize("given, start", [
    ({"gpus": 16, "nodes": 2, "gpus_per_node": 4}, "gpus: --gpus 16 ranks are not --nodes 2 x --gpus-per-node 4 = 8"),
    ({"gpus": 12, "gpus_per_node": 8}, "gpus: --gpus 12 ranks do not fill whole nodes of --gpus-per-node 8"),
    ({"gpus": 1, "gpus_per_node": 8}, "gpus: --gpus 1 ranks do not fill whole nodes"),
    ({"gpus": 3, "nodes": 2}, "nodes: --gpus 3 ranks do not spread evenly over --nodes 2"),
    ({"on_gpus": False, "gpus": 2, "gpus_per_node": 2}, "gpus-per-node: --gpus-per-node 2 asks GPUs"),
])
def test_a_job_whose_ranks_nodes_and_gpus_disagree_is_refused(given, start):
    with pytest.raises(UserError) as error:
        sized(**given)
    assert str(error.value).startswith(start) and "\n" not in str(error.value)


def test_options_that_follow_from_others_are_derived_and_cpus_and_memory_are_the_nodes_share():
    from fitbench.launch.slurm.sizing import NodeShape

    node = NodeShape(cpus=96, memory_mb=1_000_000, gpus=8)
    size = sized(node, gpus=16, gpus_per_node=8)
    assert (size.gpus, size.nodes, size.gpus_per_node) == (16, 2, 8)
    assert (size.cpus_per_task, size.mem, size.warnings) == (96, "1000000M", ())
    size = sized(node, gpus=8, nodes=2)  # 4 of a node's 8 GPUs: half its CPUs and memory
    assert (size.nodes, size.gpus_per_node, size.cpus_per_task, size.mem) == (2, 4, 48, "500000M")
    size = sized(node, nodes=2, gpus_per_node=1, cpus_per_task=4)
    assert (size.gpus, size.cpus_per_task, size.mem) == (2, 4, "125000M")
    with pytest.raises(UserError, match="^gpus-per-node: 16 GPUs asked of each node; the partition's nodes have 8"):
        sized(node, gpus=16, gpus_per_node=16)
    unknown = sized(None, gpus=8)
    assert (unknown.nodes, unknown.gpus_per_node, unknown.cpus_per_task) == (1, 8, None)
    assert unknown.warnings and "sinfo could not be asked" in unknown.warnings[0]


GPU_JOB = ["run", "--models", "tiny", "--mode", "forward", "--launcher", "slurm", "--gpu", "H100-80GB", "--dry-run"]


def test_a_mis_sized_job_is_one_paragraph_before_anything_is_written(tmp_path, capsys):
    from conftest import cli

    code, _, stderr = cli([*GPU_JOB, "--gpus", "16", "--nodes", "2", "--gpus-per-node", "4", "--out",
                           str(tmp_path / "out")], capsys)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "--gpus 16 ranks are not --nodes 2 x --gpus-per-node 4" in stderr and not (tmp_path / "out").exists()


def test_the_dry_run_script_asks_for_the_nodes_that_follow_from_the_ranks(tmp_path, capsys):
    from conftest import cli

    out = tmp_path / "out"
    code, printed, stderr = cli([*GPU_JOB, "--gpus", "16", "--gpus-per-node", "8", "--cpus-per-task", "32",
                                 "--mem", "512G", "--out", str(out)], capsys)
    assert code == 0, stderr
    assert "#SBATCH --nodes=2" in printed and "#SBATCH --gpus-per-node=8" in printed
    [planned] = (out / "planned").glob("*.json")
    kept = json.loads(planned.read_text())
    assert kept["target"]["name"] == "NVIDIA H100 80GB HBM3" and kept["spec"]["layout"] and kept["prediction"]


@pytest.mark.parametrize("time, seconds", [("90", 5400), ("1:30", 90), ("24:00:00", 86400), ("1-12", 129600),
                                           ("2-00:30", 174600), ("1-00:00:01", 86401), ("UNLIMITED", float("inf"))])
def test_a_time_limit_in_seconds(time, seconds):
    from fitbench.launch.slurm.options import time_seconds

    assert time_seconds(time) == seconds


def test_setup_lines_run_before_the_program_as_written_and_a_failing_one_ends_the_job(tmp_path):
    options = SlurmOptions(setup=("export GREETING='hello there'", 'echo "$GREETING" > setup.txt'))
    script = batch_script(options, ScriptJob("job", "%j.out"), [*ECHO_ARGV, "ran"])
    assert run_script(script, tmp_path) == ["ran"] and (tmp_path / "setup.txt").read_text() == "hello there\n"
    failing = batch_script(SlurmOptions(setup=("false",)), ScriptJob("job", "%j.out"), [*ECHO_ARGV, "ran"])
    path = tmp_path / "failing.sh"
    path.write_text(failing)
    assert subprocess.run(["bash", str(path)], cwd=tmp_path, capture_output=True, timeout=60).returncode != 0
    with pytest.raises(UserError, match="^setup: "):
        SlurmOptions(setup=("a\nb",))


def test_a_time_limit_shorter_than_the_timeout_is_a_warning(tmp_path, capsys):
    from conftest import cli

    code, printed, stderr = cli([*GPU_JOB, "--time", "30", "--timeout", "3600", "--cpus-per-task", "8", "--mem",
                                 "64G", "--out", str(tmp_path / "out")], capsys)
    assert code == 0 and "--time 30 ends a job before --timeout 3600 s" in " ".join(stderr.split()), stderr


def test_a_scripts_tasks_name_their_configurations_for_its_own_directory_only(tmp_path):
    from fitbench.launch.slurm.sweep import script_keys

    tasks = [["-m", "fitbench.cli.allocation", str(tmp_path), key] for key in ("k0", "k1")]
    script = array_script(SlurmOptions(), ScriptJob("sweep", "%A_%a.out"), tasks, limit=1)
    assert script_keys(script, tmp_path) == {"0": "k0", "1": "k1"}
    assert script_keys(script, tmp_path / "other") == {}
    one = batch_script(SlurmOptions(), ScriptJob("job", "%j.out"), tasks[1])
    assert script_keys(one + "# exec python -m fitbench.cli.allocation x y\n", tmp_path) == {None: "k1"}
