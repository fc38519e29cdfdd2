"""How adapters pack into KV blocks, with no tensors: the one rule the KV arena
(`lora/arena.py`) places adapters by and the planner (`planner/memory.py`) predicts with.

An adapter inside the KV cache takes n whole blocks of every layer: per layer, its A and B
tensors (largest first) go first-fit into the layer's two regions of those blocks (K's and
V's), each tensor's offset rounded up to ALIGN_BYTES, and n is the fewest blocks that hold
every layer's tensors. Torch-free, so the planner imports it without torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

ALIGN_BYTES = 16  # every view's first byte: the kernels' widest vector load, the graphs' promise


def pack(sizes: Sequence[int], room: int, align: int) -> list[tuple[int, int]] | None:
    """First-fit of `sizes` (elements, largest first) into two regions of `room` elements:
    (region, offset) per size, each offset a multiple of `align` elements; None when they do
    not fit (the padding after a region's last tensor costs nothing)."""
    used = [0, 0]
    out = []
    for size in sizes:
        for region in (0, 1):
            if used[region] + size <= room:
                out.append((region, used[region]))
                used[region] += -(-size // align) * align  # the next one starts aligned
                break
        else:
            return None
    return out


def blocks_needed(layers: Iterable[Sequence[int]], chunk: int, align: int) -> int:
    """The fewest blocks n (at least 1) such that every layer's tensor sizes (elements,
    largest first) pack into two regions of n * `chunk` elements."""
    needed = 1
    for sizes in layers:
        if not sizes:
            continue
        n = max(1, -(-max(sizes) // chunk), -(-sum(sizes) // (2 * chunk)))
        while pack(sizes, n * chunk, align) is None:
            n += 1
        needed = max(needed, n)
    return needed
