"""Printing for the demo: progress lines flushed at once, replies shown on one line."""

from __future__ import annotations


def say(message: str) -> None:
    """Print one progress line now (the demo's output is read as it happens)."""
    print(message, flush=True)


def one_line(text: str, width: int = 96) -> str:
    """`text` on one line (newlines shown as ' | '), cut to `width` characters."""
    flat = " | ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def step(number: int, total: int, title: str) -> None:
    """A numbered heading."""
    say(f"[{number}/{total}] {title}")
