"""The planner's plot: p99 time to first token and tokens/s per policy, against the fleet size
or the request rate. matplotlib (the `plan` extra) is imported only here, when a plot is
asked for, and drawn without a display (Agg).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from loraplane.planner.fleet import FleetResult

Curves = dict[str, list[tuple[float, FleetResult]]]  # policy -> (x, result), any order


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            "plotting needs matplotlib: pip install 'loraplane[plan]' (or matplotlib>=3.8)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(curves: Curves, x_label: str, ttft_p99_s: float, path: Path | str,
                title: str) -> Path:  # fmt: skip
    """Write a PNG with two panels (p99 TTFT, log scale, with the target; tokens/s)."""
    return plot_panels([(title, curves)], x_label, ttft_p99_s, path)


def plot_panels(panels: list[tuple[str, Curves]], x_label: str, ttft_p99_s: float,
                path: Path | str) -> Path:  # fmt: skip
    """Write a PNG with a panel per (title, curves), two to a row: p99 TTFT (log scale, with
    the target) above, tokens/s below."""
    plt = _pyplot()
    columns = min(2, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(2 * rows, columns, figsize=(8 * columns, 7 * rows), squeeze=False)
    for i, (title, curves) in enumerate(panels):
        row, column = 2 * (i // columns), i % columns
        top, bottom = axes[row][column], axes[row + 1][column]
        for policy, points in curves.items():
            points = sorted(points, key=lambda p: p[0])
            xs = [x for x, _ in points]
            top.plot(xs, [max(r.ttft_p99_s, 1e-3) for _, r in points], marker="o", label=policy)
            bottom.plot(xs, [r.tokens_per_s for _, r in points], marker="o", label=policy)
        top.axhline(ttft_p99_s, color="grey", linestyle="--", label=f"target {ttft_p99_s:g} s")
        top.set_yscale("log")
        top.set_ylabel("p99 time to first token (s)")
        top.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=10)
        top.legend()
        top.grid(True, which="both", alpha=0.3)
        bottom.set_ylabel("generated tokens/s")
        bottom.set_xlabel(x_label)
        bottom.grid(True, alpha=0.3)
        if x_label == "replicas":
            from matplotlib.ticker import MaxNLocator

            top.xaxis.set_major_locator(MaxNLocator(integer=True))
            bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
