"""The rule of floors (docs/architecture.md, "The floors"): ``plan/`` is pure prediction and imports nothing from
``run/``, ``launch/`` or ``config.py``; ``run/`` is what happens inside one rank and imports nothing
from ``plan/`` or ``launch/``; no two parts of the package import each other, however indirectly.
Read from the source, lazy imports inside functions included."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fitbench"


def part(module: str) -> str:
    """``fitbench.plan.memory`` -> ``plan``; ``fitbench.config`` -> ``config``."""
    return module.split(".")[1]


def imports() -> dict[str, set[str]]:
    """Each part of the package (a folder or a root module) -> the other parts it imports."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(relative.parts)
        if module.endswith(".__init__"):
            module = module.removesuffix(".__init__")
        if module == "fitbench":
            continue
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                source = ".".join(filter(None, [base, node.module]))
                targets = [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("fitbench.") and part(target) != part(module):
                    edges.setdefault(part(module), set()).add(part(target))
    return edges


@pytest.mark.parametrize("floor, above", [("plan", {"run", "launch", "config", "sweep", "cli"}),
                                          ("run", {"plan", "launch", "config", "sweep", "cli"}),
                                          ("spec", {"plan", "run", "launch", "config", "sweep", "cli"}),
                                          ("serving", {"plan", "run", "launch", "config", "sweep", "cli"}),
                                          ("monitor", {"plan", "run", "launch", "config", "sweep", "cli",
                                                       "report"}),
                                          ("results", {"plan", "run", "launch", "config", "sweep", "cli",
                                                       "monitor", "models", "report"}),
                                          ("report", {"plan", "run", "launch", "config", "sweep", "cli",
                                                      "models"}),
                                          ("hardware", {"plan", "run", "launch", "config", "sweep", "cli",
                                                        "monitor", "models", "report", "results", "spec",
                                                        "precisions"}),
                                          ("util", {"plan", "run", "launch", "config", "sweep", "cli",
                                                    "monitor", "models", "report", "results", "spec",
                                                    "precisions", "hardware"})])
def test_a_floor_imports_nothing_above_it(floor, above):
    assert not imports().get(floor, set()) & above


def test_no_two_parts_import_each_other():
    edges = imports()
    assert "plan" in edges and "launch" in edges  # the reading found the package's imports

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(step == goal or (step not in seen and reaches(step, goal, seen | {step}))
                   for step in edges.get(start, ()))

    loops = sorted(name for name in edges if reaches(name, name))
    assert not loops, f"parts in an import loop: {loops}"


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
