"""fitbench: plan, run and measure large language models on the GPUs you have.

The Python front door: ``fitbench.plan(...)``, ``fitbench.run(...)`` and ``fitbench.load(dir)``, the
commands ``fitbench plan``, ``fitbench run`` and ``fitbench report`` without a terminal
(``fitbench.api``).
"""

from fitbench.api import load, plan, run
from fitbench.util.version import __version__

__all__ = ["__version__", "load", "plan", "run"]
