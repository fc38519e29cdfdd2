"""kernels/interpreter.py: a launch in Triton's interpreter swaps the language once, however
many programs it runs and helpers they call, gives the same results, and leaves the language
as it found it."""

from __future__ import annotations

import pytest
import torch

from tests.dataplane.triton_mode import INTERPRETED, require_triton

require_triton()
if not INTERPRETED:
    pytest.skip("the wrapper only acts in Triton's interpreter", allow_module_level=True)

import triton  # noqa: E402  # type: ignore[import-untyped]
import triton.language as tl  # noqa: E402  # type: ignore[import-untyped]
from triton.runtime import interpreter as triton_interpreter  # noqa: E402

from loraplane.dataplane.kernels import interpreter  # noqa: E402


@triton.jit
def _square(x):  # a helper of ours, called per loop step of every program
    return x * x


@triton.jit
def _sum_of_squares_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * n + offs, mask=offs < n, other=0.0)
        acc += _square(x)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))  # tl.sum: Triton's own helper (tl.core)


def _launch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(rows))
    out = torch.empty(rows)
    _sum_of_squares_kernel[(rows,)](x, out, 40, BLOCK=8)
    return x, out


def test_a_launch_swaps_the_language_once_whatever_its_programs_and_helpers_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert interpreter.skip_nested_patching()  # installed by the kernel modules, or now
    walks: list[object] = []
    walk = triton_interpreter._patch_builtin

    def counted(pkg: object, *args: object) -> None:
        walks.append(pkg)
        walk(pkg, *args)

    monkeypatch.setattr(triton_interpreter, "_patch_builtin", counted)
    per_launch = []
    for rows in (1, 6):  # 1 program x 5 helper calls + tl.sum; 6 x (5 + 1)
        walks.clear()
        x, out = _launch(rows)
        torch.testing.assert_close(out, x.square().sum(1))
        per_launch.append(len(walks))
    # Triton alone walks the language again for each helper call: 6 programs would cost 6x
    assert per_launch[0] == per_launch[1] > 0, per_launch


def test_the_language_is_triton_s_own_after_a_launch_and_after_a_failing_one() -> None:
    assert interpreter.skip_nested_patching()
    builtins = ("load", "store", "arange", "program_id", "dot")

    def own() -> dict[str, bool]:  # each builtin Triton's own, not an interpreted stand-in
        return {f"{m.__name__}.{n}": tl.core.is_builtin(getattr(m, n)) for m in (tl, tl.core)
                for n in builtins if hasattr(m, n)}  # fmt: skip

    _launch(3)
    assert all(own().values()), own()
    with pytest.raises(triton_interpreter.InterpreterError):  # a program fails half-way
        _sum_of_squares_kernel[(2,)](torch.ones(2, 40), torch.empty(2), 40, BLOCK=None)
    assert all(own().values()), own()
    x, out = _launch(2)  # and the next launch swaps again
    torch.testing.assert_close(out, x.square().sum(1))


def test_installing_twice_wraps_once() -> None:
    assert interpreter.skip_nested_patching()
    wrapper = triton_interpreter._patch_lang
    assert interpreter.skip_nested_patching()
    assert triton_interpreter._patch_lang is wrapper
