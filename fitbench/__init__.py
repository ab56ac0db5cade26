"""fitbench: plan, run and measure large language models on the GPUs you have."""

__version__ = "0.1.0"
