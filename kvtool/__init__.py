"""kvtool: make LLM checkpoints safe and cheap to serve."""

__version__ = "0.1.0"
