"""A CPU linear over the few rows of a decode step: the native kernel, else weight-major.

`F.linear(x, W)` asks the BLAS for x @ W^T. For a decode step's few rows and fp32 weights
streamed from memory, torch's MKL sgemm shares that product out poorly among threads, and at
row counts that are not a multiple of 8 it slows down further. On this project's machines
(AMD EPYC, AVX-512; torch 2.13, MKL 2024.2) two replacements beat it, in this order:

- `native`: `loraplane_linear_f32` in the native library (`sgmv_cpu.c`): each thread takes a
  band of W's rows, and a tile of 8 rows of W against 3 rows of x (3 against 4 on AVX2) keeps
  its dot products in vector registers, so W is read from memory once. Every output element
  is one dot product summed in one order whatever the rows around it: a row's result does
  not depend on the step's batch size. Taken where the library loads, its build has vectors
  of 8 lanes or more (AVX, AVX-512) and it shares torch's OpenMP team (or torch runs one
  thread). It wants the weights in the process's own memory, not in pages mapped from the
  checkpoint file (1.4x slower there at 64 rows): the loader copies them (models/loader.py
  `_owned`).
- `weight-major`: W @ x^T, the same product taken the other way round, which MKL shares out
  better (2 threads 1.67x faster than one, against 1.26x for x @ W^T). Where the native kernel
  is not there, and only with more than one thread (on one thread it is the slower order).

Measured on the SmolLM-135M shape (30 layers' seven projections, weights out of cache, 2
threads; `/tmp` scratch timing, best of 4), F.linear / weight-major / native:
1 row 37.2 / 38.6 / 17.0 ms; 8 rows 43.8 / 39.7 / 24.1; 13 rows 52.2 / 75.4 / 30.1; 32 rows
74.2 / 73.6 / 56.7; 64 rows 111.1 / 119.9 / 99.3. The 49,152 x 576 lm_head at 32 rows:
weight-major 25.6 ms, native 16.4. From about 96 rows on the BLAS is as fast or faster, so
only steps of at most `ROWS_MAX` rows leave it. `benchmarks/engine_cpu.py` prints the pair.

A LoRA layer's base linear and its adapters' SGMV go through the library in one call where both
take the native kernels (`apply_lora`, sgmv_cpu.c `loraplane_linear_lora_f32`): the same y to
the bit, for one call's Python and ctypes work instead of two.

`LORAPLANE_CPU_LINEAR` (read once, at import): `auto` (the rules above) or `torch` (always
`F.linear`, e.g. on a CPU where that pair says its BLAS needs no help). Only plain
`nn.Linear` layers in fp32 take these paths: FP8 and 4-bit layers have kernels of their own,
and bf16/fp16 on CPU were not measured.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from loraplane.dataplane.kernels import sgmv_cpu
from loraplane.dataplane.kernels.backends import Switch

if TYPE_CHECKING:
    from loraplane.dataplane.lora.metadata import LoRABatch
    from loraplane.dataplane.lora.module_slots import ModuleSlots

ROWS_MAX = 64
MODES = Switch.MODES
PATHS = ("native", "weight-major", "torch")
# below this many lanes a build's kernel does not beat the BLAS (a baseline x86-64 build)
MIN_LANES = 8
_switch = Switch("LORAPLANE_CPU_LINEAR")


def set_mode(mode: str) -> None:
    """Choose the path for the rest of the process (tests and benchmarks compare the two)."""
    _switch.set(mode)


def mode() -> str:
    return _switch.mode()


@functools.cache
def _lanes() -> int:
    """The native linear's vector lanes in the loaded library; 0 where none loads."""
    lib = sgmv_cpu.library()
    return 0 if lib is None else int(lib.loraplane_linear_lanes())


def _route(layer: nn.Module, x: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """The path `apply(layer, x)` takes, and the layer's weight and bias where it is not
    `torch`. Called for every linear of every step (about 210 a decode step of a 30-layer
    model), so it reads the parameters from the module's dict once: `layer.weight` goes
    through nn.Module.__getattr__, about 1 us a read, and the checks read them five times."""
    none = ("torch", x, None)  # `torch` calls the layer itself: the tensors go unread
    if not (
        _switch.on
        and type(layer) is nn.Linear
        and x.dim() == 2
        and x.is_cpu
        and x.dtype == torch.float32
        and 0 < x.shape[0] <= ROWS_MAX
    ):
        return none
    params = layer._parameters
    weight, bias = params["weight"], params["bias"]
    if weight is None or weight.dtype != torch.float32:
        return none
    threads = torch.get_num_threads()
    loaded = sgmv_cpu.loaded()
    if (
        _lanes() >= MIN_LANES
        and loaded is not None
        and (loaded.threading == "openmp" or threads == 1)
        and x.stride(1) == 1
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    ):
        return "native", weight, bias
    return ("weight-major", weight, bias) if threads > 1 else none


def path(layer: nn.Module, x: torch.Tensor) -> str:
    """Which of PATHS `apply(layer, x)` takes (the module docstring)."""
    return _route(layer, x)[0]


def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
    """`layer(x)`, by the fastest path that takes it."""
    way, weight, bias = _route(layer, x)
    if way == "torch":
        out: torch.Tensor = layer(x)
        return out
    if way == "native":
        rows, (n_out, n_in) = x.shape[0], weight.shape
        if x.shape[1] != n_in:  # the message F.linear would give
            raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied "
                               f"({rows}x{x.shape[1]} and {n_in}x{n_out})")  # fmt: skip
        y = torch.empty(rows, n_out, dtype=torch.float32)
        _native(x, y, _words(layer, weight, bias), None, None)
        return y
    y = torch.mm(weight, x.t()).t().contiguous()
    if bias is not None:
        y += bias
    return y


def apply_lora(
    layer: nn.Module,  # the LoRA layer's base linear
    x: torch.Tensor,  # [T, in]
    batch: LoRABatch,  # the step's segments
    slots: ModuleSlots,  # the LoRA layer's slots
    stamp: int,  # the pool's stamp for this step (LoRAContext.stamp)
) -> torch.Tensor | None:  # [T, out], or None: nothing computed
    """`apply(layer, x)` then `dispatch.lora_apply` on the native kernels, in one native call
    (sgmv_cpu.c `loraplane_linear_lora_f32`): the same y to the bit, for one call's Python
    and ctypes work instead of two (a decode step of 8 rows over one adapter, on this project's
    2-core AVX2 machine: 3.7 ms less at a 30-layer model of hidden 64, about 7 ms less at the
    SmolLM-135M shape; docs/dataplane.md). None where that pair would not take
    both native kernels; the caller then takes it. Until the step's first LoRA layer has gone
    through the pair, which makes the batch's native arguments (`batch.native_step`, only
    where the dispatch chose the native kernel), it is None too."""
    step = batch.native_step
    if step is None:
        return None
    way, weight, bias = _route(layer, x)
    if way != "native" or x.shape[1] != weight.shape[1]:
        return None
    native = sgmv_cpu.native_table(slots)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    if not native.current_at(stamp, slots, batch.seg_slots, x, y):
        return None  # tensors the kernel does not take: the pair's torch path serves them
    status = _native(x, y, _words(layer, weight, bias), native.words_address, step[1])
    sgmv_cpu.finish(status, y, x, batch, slots)
    return y


def _words(layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The address of the layer's `linear` words for the native call (W, bias, in, out), made
    on first use and again only when its parameters are other tensors or storage. Kept in
    the module's __dict__, where a read does not go through nn.Module.__getattr__."""
    held = layer.__dict__.get("_loraplane_words")
    pointer = weight.data_ptr()
    if held is None or held[0] is not weight or held[1] is not bias or held[2] != pointer:
        words = np.array([pointer, 0 if bias is None else bias.data_ptr(), weight.shape[1],
                          weight.shape[0]], dtype=np.int64)  # fmt: skip
        held = layer.__dict__["_loraplane_words"] = (weight, bias, pointer, words,
                                                     int(words.ctypes.data))  # fmt: skip
    address: int = held[4]
    return address


def _native(x: torch.Tensor, y: torch.Tensor, linear: int, slots: int | None,
            step: int | None) -> int:  # fmt: skip
    """y = x W^T + bias (+ the LoRA where `slots` and `step` are given), y a fresh dense one."""
    status: int = sgmv_cpu.library().loraplane_linear_lora_f32(  # type: ignore[union-attr]
        x.data_ptr(), x.stride(0), y.data_ptr(), x.shape[0], torch.get_num_threads(), linear,
        slots, step,
    )  # fmt: skip
    return status


__all__ = ["MIN_LANES", "MODES", "PATHS", "ROWS_MAX", "apply", "apply_lora", "mode", "path",
           "set_mode"]  # fmt: skip
