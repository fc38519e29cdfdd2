"""A one-line progress bar and status line on stderr, drawn only when stderr is a terminal.

Scripts that pipe or redirect stderr get nothing from here; `--json` output on stdout is never
touched.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30
REDRAW_S = 0.1


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class Progress:
    """Bytes sent out of `total`, redrawn at most every REDRAW_S seconds."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self._start = time.monotonic()
        self._drawn = 0.0
        self._line = 0

    def advance(self, n: int) -> None:
        """Count `n` more bytes sent."""
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= REDRAW_S or self.done >= self.total):
            self._drawn = now
            share = min(self.done / self.total, 1.0)
            bar = "#" * int(share * WIDTH)
            rate = self.done / max(now - self._start, 1e-6)
            self._write(
                f"{self.label} [{bar:<{WIDTH}}] {share:4.0%} "
                f"{_mib(self.done)}/{_mib(self.total)} {_mib(rate)}/s"
            )

    def status(self, text: str) -> None:
        """Replace the line with a status (waiting for a background job, ...)."""
        if self.enabled:
            self._write(f"{self.label} {text}")

    def close(self) -> None:
        """End the line, so what follows starts on a fresh one."""
        if self.enabled and self._line:
            self.stream.write("\n")
            self.stream.flush()
            self._line = 0

    def _write(self, line: str) -> None:
        pad = max(self._line - len(line), 0)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._line = len(line)
