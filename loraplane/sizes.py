"""Memory sizes as users write them: `2GiB`, `512MiB`, `1G`, `1073741824`, or a fraction `0.1`.

Shared by the data plane (`--lora-memory`, `--max-cpu-lora-bytes`) and the operator (ServingPool
`spec.lora.memory`, `spec.lora.maxCpuLoraBytes`), which checks a pool's value the way the data
plane will read it. No torch here.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20,
          "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_memory(text: str | int | float) -> int | float:
    """`--lora-memory`: a byte size (`2GiB`, `512MiB`, `1G`, plain `1073741824`) or a fraction
    in (0, 1] (`0.1`) of the device memory the weights leave free.

    Returns an int (bytes) or a float (fraction); ValueError with the accepted forms otherwise.
    """
    if isinstance(text, bool):
        raise ValueError(f"lora_memory must be a size or a fraction, got {text!r}")
    if isinstance(text, int | float):
        value: int | float = text
    else:
        match = _SIZE.match(text)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"lora_memory must be a size such as 2GiB, 512MiB or 1073741824, or a fraction"
                f" in (0, 1] such as 0.1; got {text!r}"
            )
        number = match.group(1)
        is_fraction = unit == "" and "." in number
        value = float(number) if is_fraction else int(float(number) * _UNITS[unit])
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"lora_memory as a fraction must be in (0, 1], got {value!r}")
        return value
    if value < 1:
        raise ValueError(f"lora_memory must be at least 1 byte, got {value!r}")
    return value


def parse_bytes(text: str | int, name: str = "size") -> int:
    """A byte size only (`8GiB`, `512MiB`, `1G`, plain `1073741824`; no fraction), at least 1
    byte; ValueError naming `name` otherwise."""
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ValueError(f"{name} must be a size such as 8GiB or 1073741824, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(text)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS or (unit == "" and "." in match.group(1)):
            raise ValueError(
                f"{name} must be a size such as 8GiB, 512MiB or 1073741824, got {text!r}"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"{name} must be at least 1 byte, got {text!r}")
    return value


def resolve_memory(memory: int | float, free: int) -> int:
    """A `parse_memory` value in bytes: a size as given, or that fraction of `free` bytes (at
    least 1). The engine applies it to the device memory the weights leave free; the capacity
    planner to what it computes would be free."""
    if isinstance(memory, int):
        return memory
    return max(1, int(free * memory))


def format_bytes(n: int) -> str:
    """`n` bytes for people: KiB below a MiB, MiB below a GiB, else GiB (two decimals)."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"
