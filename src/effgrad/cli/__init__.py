"""The ``effgrad`` command: its entry point (``main``), its input reader and the demo."""

from effgrad.cli.main import main

__all__ = ["main"]
