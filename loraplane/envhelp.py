"""`--help` text for the `LORAPLANE_*` environment variables a command reads."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

PREFIX = "LORAPLANE_"


def format_env_help(settings: Iterable[tuple[str, object, str]]) -> str:
    """One entry per (field name, default, meaning): the variable, its default shown as the
    environment would spell it (None and empty: unset; booleans: 1/0), the meaning below."""
    lines = ["environment variables:"]
    for name, default, meaning in settings:
        if isinstance(default, bool):
            shown = "1" if default else "0"
        elif default is None or default in ((), []):
            shown = "unset"
        else:
            shown = str(default)
        lines.append(f"  {PREFIX}{name.upper()} (default: {shown})")
        lines += textwrap.wrap(meaning, 88, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)
