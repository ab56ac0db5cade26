"""fitbench's version, as pyproject.toml gives it: rows and saved sweeps record it."""

__version__ = "0.1.0"
