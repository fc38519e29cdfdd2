"""kernels/cpu_linear.py: the weight-major CPU linear equals F.linear, and takes only its cases."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.functional import linear

from loraplane.dataplane.kernels import cpu_linear


@pytest.fixture
def weight_major() -> Iterator[None]:
    before, threads = cpu_linear.mode(), torch.get_num_threads()
    cpu_linear.set_mode("auto")
    torch.set_num_threads(max(2, threads))  # where the weight-major order is taken
    yield
    cpu_linear.set_mode(before)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 8, 64, 65, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_it_equals_f_linear(weight_major: None, rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    layer = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    y = cpu_linear.apply(layer, x)
    assert y.shape == (rows, 160) and y.is_contiguous()
    torch.testing.assert_close(y, linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a slice of a wider activation) as well
    wide = torch.randn(rows, 2 * 96)[:, ::2]
    expected = linear(wide, layer.weight, layer.bias)
    torch.testing.assert_close(cpu_linear.apply(layer, wide), expected, rtol=1e-5, atol=1e-5)


def test_it_takes_decode_sized_fp32_rows_of_plain_linears_only(weight_major: None) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: F.linear is the faster order
    try:
        assert not cpu_linear.weight_major(nn.Linear(32, 48), torch.randn(8, 32))
    finally:
        torch.set_num_threads(threads)
    layer = nn.Linear(32, 48)
    assert cpu_linear.weight_major(layer, torch.randn(8, 32))
    assert cpu_linear.weight_major(layer, torch.randn(cpu_linear.ROWS_MAX, 32))
    assert not cpu_linear.weight_major(layer, torch.randn(cpu_linear.ROWS_MAX + 1, 32))
    assert not cpu_linear.weight_major(layer.to(torch.bfloat16), torch.randn(8, 32))

    class Quantized(nn.Linear):  # FP8/4-bit layers subclass nn.Linear with kernels of their own
        pass

    assert not cpu_linear.weight_major(Quantized(32, 48), torch.randn(8, 32))
    cpu_linear.set_mode("torch")
    assert not cpu_linear.weight_major(nn.Linear(32, 48), torch.randn(8, 32))


def test_a_wrong_mode_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="auto, torch"):
        cpu_linear.set_mode("fast")
