"""A CPU linear over the few rows of a decode step, computed weight-major: (W @ x^T)^T.

`F.linear(x, W)` asks the BLAS for x @ W^T. For a decode step's few rows and fp32 weights
streamed from memory, torch's MKL sgemm shares that product out poorly among threads: on this
project's machines (AMD EPYC, AVX-512; torch 2.13, MKL 2024.2), with 2 threads it runs 1.26x
faster than on one, while W @ x^T, the same product taken the other way round, runs 1.67x
faster and so ends ahead. Measured on the SmolLM-135M shape, weights out of cache, 2 threads:
30 layers' seven projections at 8 rows 44.3 ms against 39.3 ms, at 32 rows 85.4 against
71.7 ms, at 64 rows 133.2 against 112.3 ms; the 49,152 x 576 lm_head at 8 rows 18.1 against
8.4 ms; an engine decode step of 8 requests 102-106 ms against 68-70 ms. On one thread the
order is the other way (55.9 against 65.5 ms at 8 rows), so one-thread processes keep
`F.linear`; from about 128 rows on x @ W^T is as fast or faster, so only steps of at most
`ROWS_MAX` rows take the other order. `benchmarks/engine_cpu.py` prints its own pair.

`LORAPLANE_CPU_LINEAR` (read once, at import): `auto` (the rule above) or `torch` (always
`F.linear`, e.g. on a CPU where that pair says its BLAS needs no help). Only plain
`nn.Linear` layers in fp32 take this path: FP8 and 4-bit layers have kernels of their own, and
bf16/fp16 on CPU were not measured.
"""

from __future__ import annotations

import torch
from torch import nn

from loraplane.dataplane.kernels.backends import Switch

ROWS_MAX = 64
MODES = Switch.MODES
_switch = Switch("LORAPLANE_CPU_LINEAR")


def set_mode(mode: str) -> None:
    """Choose the path for the rest of the process (tests and benchmarks compare the two)."""
    _switch.set(mode)


def mode() -> str:
    return _switch.mode()


def weight_major(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether `apply(layer, x)` takes the weight-major order (the module docstring)."""
    return (
        _switch.on
        and type(layer) is nn.Linear
        and x.dim() == 2
        and x.shape[0] <= ROWS_MAX
        and x.device.type == "cpu"
        and layer.weight.dtype == torch.float32
        and torch.get_num_threads() > 1
    )


def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
    """`layer(x)`, weight-major where that is the faster order."""
    if weight_major(layer, x):
        assert isinstance(layer, nn.Linear)
        y = torch.mm(layer.weight, x.t()).t().contiguous()
        if layer.bias is not None:
            y += layer.bias
        return y
    out: torch.Tensor = layer(x)
    return out


__all__ = ["MODES", "ROWS_MAX", "apply", "mode", "set_mode", "weight_major"]
