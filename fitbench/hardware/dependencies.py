"""Each dependency fitbench pins, its tested range against the installed version.

The ranges are fitbench's own requirements (``pyproject.toml``, read back from the installed package's
metadata): the lower bound the oldest versions the tests run on, the upper bound, where there is one,
the newest release series the suite has passed on. A version outside its range has not been tested:
the planner's transformers terms are read from the installed version, but nothing has checked the
rest of fitbench against it. ``fitbench env`` lists them; ``fitbench plan`` and ``fitbench run`` warn.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from packaging.requirements import InvalidRequirement, Requirement

from fitbench.hardware.environment import package_version


@dataclass(frozen=True)
class Dependency:
    """``name``: the distribution; ``tested``: its range (a specifier such as ">=5.17,<5.26");
    ``installed``: its version here, None where it is missing."""

    name: str
    tested: str
    installed: str | None

    @property
    def inside(self) -> bool:
        """Whether the installed version lies in the tested range (a pre-release or local build counts by its
        release: 2.13.0+cpu is 2.13.0)."""
        if self.installed is None:
            return False
        return Requirement(f"{self.name}{self.tested}").specifier.contains(self.installed, prereleases=True)

    @property
    def status(self) -> str:
        """"tested", "untested" (outside the range) or "missing"."""
        if self.installed is None:
            return "missing"
        return "tested" if self.inside else "untested"

    def warning(self) -> str | None:
        """One sentence for a version outside its range, with the command that returns to a tested one."""
        if self.inside:
            return None
        if self.installed is None:
            return f"{self.name} is not installed (fitbench needs {self.name}{self.tested})."
        return (f"{self.name} {self.installed} is outside fitbench's tested range {self.tested}: plans and "
                f"runs may differ from what the tests checked; `pip install '{self.name}{self.tested}'` "
                f"returns to a tested version.")


def dependencies() -> list[Dependency]:
    """fitbench's required (not optional) dependencies with their tested ranges and installed versions,
    in the order of its requirements; empty where fitbench's metadata is not installed."""
    try:
        requirements = importlib.metadata.requires("fitbench") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    found = []
    for text in requirements:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.marker is not None:  # an extra's, or another platform's
            continue
        bounds = sorted(map(str, requirement.specifier), key=lambda bound: bound.startswith("<"))  # lower first
        found.append(Dependency(requirement.name, ",".join(bounds), package_version(requirement.name)))
    return found


def untested_warnings() -> list[str]:
    """The warning of each dependency outside its tested range."""
    return [warning for dependency in dependencies() if (warning := dependency.warning())]
