"""The rule of floors (docs/architecture.md, "The floors"): ``planning/`` is pure prediction and imports
nothing from ``worker/``, ``launch/`` or ``config.py``; ``worker/`` is what happens inside one rank and
imports nothing from ``planning/`` or ``launch/``; nothing imports the root package or the API above it;
no two parts of the package import each other, however indirectly, nor two of its modules. Read from the
source, lazy imports inside functions included, the root package's ``__init__.py`` too."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fitbench"
ROOT = "fitbench"  # the root package's part: fitbench/__init__.py
ENTRY = {ROOT, "api", "cli", "__main__"}


def part(module: str) -> str:
    """``fitbench.planning.memory`` -> ``planning``; ``fitbench.config`` -> ``config``; ``fitbench``, and
    a name ``from fitbench import`` takes that is no module of it (``__version__``), -> the root."""
    names = module.split(".")
    if len(names) == 1:
        return ROOT
    if len(names) == 2 and not ((PACKAGE / names[1]).is_dir() or (PACKAGE / f"{names[1]}.py").exists()):
        return ROOT
    return names[1]


def package_imports() -> dict[str, set[str]]:
    """Each module of the package (``fitbench.planning.memory``; a package by its ``__init__``) -> the names of
    the package it imports (``fitbench.planning.memory.estimate_memory``), lazy imports inside functions
    included."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets = found.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                source = ".".join(filter(None, [base, node.module]))
                names = [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            targets |= {name for name in names if name == ROOT or name.startswith("fitbench.")}
    return found


def imports() -> dict[str, set[str]]:
    """Each part of the package (a folder, a root module, or the root package) -> the other parts it imports."""
    edges: dict[str, set[str]] = {}
    for module, targets in package_imports().items():
        for target in targets:
            if part(target) != part(module):
                edges.setdefault(part(module), set()).add(part(target))
    return edges


# The input floor: the options read, and which of them change nothing.
INPUT = ("config", "inert_options")


@pytest.mark.parametrize("floor, above", [("planning", {"worker", "launch", *INPUT, "sweep", *ENTRY}),
                                          ("worker", {"planning", "launch", *INPUT, "sweep", *ENTRY}),
                                          ("spec", {"planning", "worker", "launch", *INPUT, "sweep", *ENTRY}),
                                          ("serving", {"planning", "worker", "launch", *INPUT, "sweep", *ENTRY}),
                                          ("monitor", {"planning", "worker", "launch", *INPUT, "sweep", *ENTRY,
                                                       "report"}),
                                          ("results", {"planning", "worker", "launch", *INPUT, "sweep", *ENTRY,
                                                       "monitor", "models", "report"}),
                                          ("report", {"planning", "worker", "launch", *INPUT, "sweep", *ENTRY,
                                                      "models"}),
                                          ("hardware", {"planning", "worker", "launch", *INPUT, "sweep", *ENTRY,
                                                        "monitor", "models", "report", "results", "spec",
                                                        "precisions"}),
                                          ("util", {"planning", "worker", "launch", *INPUT, "sweep", *ENTRY,
                                                    "monitor", "models", "report", "results", "spec",
                                                    "precisions", "hardware"})])
def test_a_floor_imports_nothing_above_it(floor, above):
    assert not imports().get(floor, set()) & above


def test_nothing_but_the_entry_imports_the_root_package_or_the_api():
    edges = imports()
    assert edges[ROOT] >= {"api", "util"}  # the reading found the root package's imports
    assert not [name for name, targets in edges.items() if targets & {ROOT, "api"} and name not in ENTRY]


def test_no_two_parts_import_each_other():
    edges = imports()
    assert "planning" in edges and "launch" in edges  # the reading found the package's imports

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(step == goal or (step not in seen and reaches(step, goal, seen | {step}))
                   for step in edges.get(start, ()))

    loops = sorted(name for name in edges if reaches(name, name))
    assert not loops, f"parts in an import loop: {loops}"


def module_imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (a name ``from X import`` takes is
    the module of that name where there is one, else X), lazy imports inside functions included."""
    found = package_imports()

    def module_of(target: str) -> str:
        while target and target not in found:
            target = target.rpartition(".")[0]
        return target

    return {module: {module_of(target) for target in targets} - {module, ""} for module, targets in found.items()}


def test_no_two_modules_import_each_other():
    """However indirectly: a module that reaches itself along the imports is in a circle."""
    edges = module_imports()
    assert "fitbench.planning.memory" in edges["fitbench.planning.planner"]  # the reading found the imports
    circles = set()
    for start in edges:
        seen, frontier = set(), set(edges[start])
        while frontier:
            seen |= frontier
            frontier = {after for module in frontier for after in edges.get(module, ())} - seen
        if start in seen:
            circles.add(start)
    assert not circles, f"modules in an import circle: {sorted(circles)}"


PARENT_WITHOUT_TORCH = """
import sys
from fitbench.cli import main
from fitbench.hardware.devices import no_gpu_device

# the default device asks torch only where a GPU could be there
device = [] if no_gpu_device() else ["--device", "cpu"]
for argv in (["--help"], ["models"], ["plan", "--models", "7B", "--gpu", "H100-80GB"],
             ["run", "--models", "tiny", *device, "--mode", "forward", "--batch-size", "1", "--seq-len", "8",
              "--warmup-steps", "0", "--measure-steps", "1", "--out", sys.argv[1]]):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 0, (argv, code)
    assert "torch" not in sys.modules, f"fitbench {' '.join(argv[:2])} imported torch"
"""


@pytest.mark.slow
def test_the_parent_never_imports_torch(tmp_path):
    """torch takes seconds to import: ``--help``, ``plan`` on a described GPU and a CPU sweep's parent
    (which plans, launches and records) start without it, on a machine without a GPU with the default
    device too; only the workers import it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("FITBENCH_INJECT", None)
    done = subprocess.run([sys.executable, "-c", PARENT_WITHOUT_TORCH, str(tmp_path / "out")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"status": "ok"' in (tmp_path / "out" / "results.jsonl").read_text()
