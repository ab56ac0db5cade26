"""``fitbench --help``, each command's ``--help`` and the docs say the same, read from the parser in this
process (``fitbench.cli.build_parser``): the README names every command in ``--help``'s order; every
option of every command is in the docs (``docs/*.md`` or the README) and every option the docs name is
fitbench's, or another program's named in ``OTHER_PROGRAMS``; the tables of options list exactly the
options of what they describe; and every ``fitbench`` line of the docs' ``bash`` blocks parses."""

import argparse
import re
import shlex
from pathlib import Path

import pytest

from fitbench.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Options the docs name that are not fitbench's: the program each belongs to.
OTHER_PROGRAMS = {"--qos": "sbatch", "--array": "sbatch", "--job-name": "sbatch", "--output": "sbatch",
                  "--ntasks-per-node": "sbatch", "--signal": "sbatch", "--ntasks": "srun", "--mpi": "srun",
                  "--nnodes": "torchrun", "--nproc-per-node": "torchrun", "--rdzv-backend": "torchrun",
                  "--max-restarts": "torchrun", "--standalone": "torchrun",
                  "--min-gpus": "benchmarks/memory_error.py and the other error scripts",
                  "--one-shot": "benchmarks/tp_decode_profile.py", "--by": "benchmarks/out_of_sample.py",
                  "--out-of-sample": "benchmarks/repredict.py", "--baseline-again": "benchmarks/ddp_overlap.py",
                  "--load-format": "vllm serve", "--tensor-parallel-size": "vllm serve",
                  "--pipeline-parallel-size": "vllm serve", "--dtype": "vllm serve", "--quantization": "vllm serve"}
# The pages' tables of options: (command, its argument group's title or None for all its options, page, heading).
TABLES = [("plan", None, "docs/planning.md", "## The options of `fitbench plan`"),
          ("run", "SLURM clusters (docs/clusters.md)", "docs/clusters.md", "## Options")]
NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, by name, in ``fitbench --help``'s order, and ``fitbench``'s own as ``""``."""
    parser = build_parser()
    [commands] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return {"": parser, **commands.choices}


def long_options(actions) -> list[list[str]]:
    """The long spellings of each option among ``actions``."""
    return [spellings for action in actions if (spellings := [s for s in action.option_strings if s.startswith("--")])]


def options_in(text: str) -> set[str]:
    return set(OPTION.findall(text))


DOCUMENTED = set().union(*(options_in(page.read_text()) for page in PAGES))


def test_the_readme_names_every_command_in_the_order_of_help():
    said = re.search(r"`fitbench --help` lists the (\w+) commands \(([^)]*)\)", (ROOT / "README.md").read_text())
    assert said, "README.md no longer says which commands `fitbench --help` lists"
    names = re.findall(r"`([\w-]+)`", said.group(2))
    assert names == list(COMMANDS) and said.group(1) == NUMBERS[len(COMMANDS)], said.group(0)


@pytest.mark.parametrize("command", ["", *COMMANDS], ids=lambda name: f"fitbench {name}".strip())
def test_every_option_of_a_command_is_in_the_docs(command):
    """Each spelling of each option (``--seq-len`` and ``--context-length``), but only one of a switch and
    its negation (``--cuda-graphs``, ``--no-cuda-graphs``)."""
    parser = command_parsers()[command]
    missing = []
    for action in parser._actions:
        spellings = [s for s in action.option_strings if s.startswith("--")]
        if isinstance(action, argparse.BooleanOptionalAction):
            missing += [] if DOCUMENTED & set(spellings) else [spellings[0]]
        else:
            missing += [spelling for spelling in spellings if spelling not in DOCUMENTED]
    shown = " ".join(["fitbench", command]).strip()
    assert not missing, f"`{shown} --help` lists options no page of docs/ nor the README names: {missing}"


def test_every_option_the_docs_name_exists():
    fitbench = {spelling for parser in command_parsers().values()
                for spellings in long_options(parser._actions) for spelling in spellings}
    assert not set(OTHER_PROGRAMS) & fitbench, "an option listed as another program's is fitbench's"
    for page in PAGES:
        unknown = sorted(options_in(page.read_text()) - fitbench - set(OTHER_PROGRAMS))
        assert not unknown, f"{page.relative_to(ROOT)} names options no command has: {unknown}"


def table_options(page: str, heading: str) -> set[str]:
    """The options in the first column of the table under ``heading`` of ``page``: each backticked item's
    leading option (``--sbatch-arg=--qos=high`` is ``--sbatch-arg``)."""
    text = (ROOT / page).read_text()
    assert heading in text, f"{page} has no {heading!r}"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `--")]
    return {option for cell in cells for option in re.findall(r"`(--[a-z][a-z0-9-]*)", cell)}


@pytest.mark.parametrize("command, group, page, heading", TABLES, ids=[table[2] for table in TABLES])
def test_a_table_of_options_lists_exactly_the_parsers(command, group, page, heading):
    parser = command_parsers()[command]
    actions = parser._actions if group is None else next(
        g for g in parser._action_groups if g.title == group)._group_actions
    parsed = {spelling for spellings in long_options(actions) for spelling in spellings} - {"--help"}
    listed = table_options(page, heading)
    assert listed == parsed, f"{page}: listed, not parsed: {sorted(listed - parsed)}; parsed, not listed: " \
                             f"{sorted(parsed - listed)}"


def command_lines() -> list[tuple[str, str]]:
    """Each ``fitbench`` command line of the pages' ``bash`` blocks (continued lines joined), with its page."""
    found = []
    for page in PAGES:
        block, line_so_far = False, ""
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                block = line == "```bash"
                continue
            if not block:
                continue
            line = line_so_far + line
            line_so_far = line[:-1] + " " if line.endswith("\\") else ""
            if not line_so_far and line.startswith("fitbench"):
                found.append((str(page.relative_to(ROOT)), line))
    return found


def test_every_command_line_of_the_docs_parses(capsys):
    lines = command_lines()
    assert len(lines) > 30  # the blocks were read
    refused = []
    for page, line in lines:
        try:
            build_parser().parse_args(shlex.split(line, comments=True)[1:])
        except SystemExit:
            refused.append(f"{page}: {line} ({capsys.readouterr().err.strip()})")
    assert not refused, "\n".join(refused)
