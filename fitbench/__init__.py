"""fitbench: plan, run and measure large language models on the GPUs you have.

The Python front door is ``fitbench.plan(...)``, ``fitbench.run(...)`` and ``fitbench.load(dir)``
(``fitbench.api``). ``fitbench.plan`` and ``fitbench.run`` are also the names of the planner's and the
worker's packages: those two packages are made callable, each call going to its function of
``fitbench.api``, so that ``fitbench.plan(...)`` plans and ``fitbench.plan.memory`` stays the module
it is, however they were imported.
"""

import sys
import types

__version__ = "0.1.0"


class _CallsApi(types.ModuleType):
    """A package whose call is the function of ``fitbench.api`` of the same name."""

    def __call__(self, *args, **kwargs):
        from fitbench import api

        return getattr(api, self.__name__.rpartition(".")[2])(*args, **kwargs)


def load(directory):
    """The rows of a results directory (``fitbench.api.load``)."""
    from fitbench.api import load as load_rows

    return load_rows(directory)


import fitbench.plan  # noqa: E402  (after __version__, which the packages below may read)
import fitbench.run  # noqa: E402

for _package in (sys.modules["fitbench.plan"], sys.modules["fitbench.run"]):
    _package.__class__ = _CallsApi
