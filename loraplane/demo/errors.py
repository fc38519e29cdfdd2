"""The demo's one error base: anything it raises on purpose ends the run with a message."""

from __future__ import annotations


class DemoError(RuntimeError):
    """The demo cannot go on; the message says why (printed, exit code 1)."""
