"""Faults that stop a run: one-line messages, exit status 1 (`dsjax.cli.run_main`).

Configuration and input errors are `ValueError`s (`dsjax.config.ConfigError`), exit status 2.
"""
from __future__ import annotations


class RunStopped(RuntimeError):
    """The run stopped on a fault it detected while running (a failed checkpoint write,
    non-finite training). The message is one line and names the step or the path."""
