"""Issue 32: every module of the adapter engine (`loraplane/dataplane/lora/`) stays under 350
lines: one job each, the manager a facade over the parts that do the work."""

from __future__ import annotations

from pathlib import Path

import loraplane.dataplane.lora as lora_package

LIMIT = 350


def test_every_module_of_the_lora_package_is_under_350_lines() -> None:
    folder = Path(lora_package.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in sorted(folder.glob("*.py"))}
    assert {"manager.py", "host_tier.py", "loads.py"} <= set(sizes)
    over = {name: lines for name, lines in sizes.items() if lines >= LIMIT}
    assert not over, f"modules of {LIMIT} lines or more: {over}"
