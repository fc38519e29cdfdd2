"""kernels/cpu_linear.py: the native and the weight-major CPU linears equal F.linear, take
only their cases, and the engine decodes the same through them as through F.linear."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.functional import linear

from loraplane.dataplane.kernels import cpu_linear, sgmv_cpu
from tests.dataplane.conftest import Family
from tests.dataplane.test_engine import assert_same_outputs, mixed_batch

native_library = pytest.mark.skipif(
    sgmv_cpu.library() is None or cpu_linear._lanes() < cpu_linear.MIN_LANES,
    reason="no native CPU library with wide enough vectors here",
)


@pytest.fixture
def auto() -> Iterator[None]:
    before, threads = cpu_linear.mode(), torch.get_num_threads()
    cpu_linear.set_mode("auto")
    torch.set_num_threads(max(2, threads))  # where the weight-major order is taken
    yield
    cpu_linear.set_mode(before)
    torch.set_num_threads(threads)


@pytest.fixture
def no_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process as where the library does not load (or its build is too narrow)."""
    monkeypatch.setattr(cpu_linear, "_lanes", lambda: 0)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest, auto: None) -> int:
    torch.set_num_threads(request.param)  # (the `auto` fixture restores it)
    return int(request.param)


# in, out: whole vectors and tiles, and neither (a tail of the dot product, rows of W left over)
SHAPES = [(96, 160), (100, 163), (7, 5)]


@native_library
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 13, 31, 32, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("bias", [False, True])
def test_the_native_linear_equals_f_linear(
    threads: int, rows: int, shape: tuple[int, int], bias: bool
) -> None:
    n_in, n_out = shape
    torch.manual_seed(rows + n_in)
    layer = nn.Linear(n_in, n_out, bias=bias)
    x = torch.randn(rows, n_in)
    assert cpu_linear.path(layer, x) == "native"
    y = cpu_linear.apply(layer, x)
    assert y.shape == (rows, n_out) and y.is_contiguous()
    torch.testing.assert_close(y, linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    # rows further apart than `in` (a slice of a wider activation, e.g. q of a fused qkv)
    wide = torch.randn(rows, n_in + 9)[:, 3 : 3 + n_in]
    assert cpu_linear.path(layer, wide) == "native"
    expected = linear(wide, layer.weight, layer.bias)
    torch.testing.assert_close(cpu_linear.apply(layer, wide), expected, rtol=1e-5, atol=1e-5)


@native_library
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(auto: None) -> None:
    """Each output is one dot product summed in one order: a row alone, in a batch of 37 (full
    and partial tiles), on one thread or two, gives the same bits."""
    torch.manual_seed(3)
    layer = nn.Linear(200, 300)
    batch = torch.randn(37, 200)
    together = cpu_linear.apply(layer, batch)
    torch.set_num_threads(1)
    for i in (0, 17, 35, 36):
        alone = cpu_linear.apply(layer, batch[i : i + 1])
        assert torch.equal(alone[0], together[i]), i


@native_library
def test_a_wrong_width_is_refused_as_f_linear_refuses_it(auto: None) -> None:
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        cpu_linear.apply(nn.Linear(32, 48), torch.randn(4, 31))


@pytest.mark.parametrize("rows", [1, 8, 13, 64, 65, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_the_weight_major_linear_equals_f_linear(
    auto: None, no_native: None, rows: int, bias: bool
) -> None:
    torch.manual_seed(rows)
    layer = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    assert cpu_linear.path(layer, x) == ("weight-major" if rows <= cpu_linear.ROWS_MAX else "torch")
    y = cpu_linear.apply(layer, x)
    assert y.shape == (rows, 160) and y.is_contiguous()
    torch.testing.assert_close(y, linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    # a non-contiguous input (every other column of a wider activation) as well
    wide = torch.randn(rows, 2 * 96)[:, ::2]
    expected = linear(wide, layer.weight, layer.bias)
    torch.testing.assert_close(cpu_linear.apply(layer, wide), expected, rtol=1e-5, atol=1e-5)


@native_library
def test_the_native_path_takes_decode_sized_fp32_rows_of_plain_linears_only(auto: None) -> None:
    layer = nn.Linear(32, 48)
    assert cpu_linear.path(layer, torch.randn(8, 32)) == "native"
    assert cpu_linear.path(layer, torch.randn(cpu_linear.ROWS_MAX, 32)) == "native"
    torch.set_num_threads(1)  # the native kernel is the faster one on one thread too
    assert cpu_linear.path(layer, torch.randn(8, 32)) == "native"
    torch.set_num_threads(2)
    # columns not dense: weight-major, which takes any strides
    assert cpu_linear.path(layer, torch.randn(8, 64)[:, ::2]) == "weight-major"
    assert cpu_linear.path(layer, torch.randn(cpu_linear.ROWS_MAX + 1, 32)) == "torch"
    assert cpu_linear.path(layer, torch.randn(0, 32)) == "torch"
    assert cpu_linear.path(layer, torch.randn(8, 32, dtype=torch.float64)) == "torch"
    assert cpu_linear.path(layer.to(torch.bfloat16), torch.randn(8, 32)) == "torch"

    class Quantized(nn.Linear):  # FP8/4-bit layers subclass nn.Linear with kernels of their own
        pass

    assert cpu_linear.path(Quantized(32, 48), torch.randn(8, 32)) == "torch"
    cpu_linear.set_mode("torch")
    assert cpu_linear.path(nn.Linear(32, 48), torch.randn(8, 32)) == "torch"


def test_without_the_native_kernel_weight_major_takes_more_than_one_thread_only(
    auto: None, no_native: None
) -> None:
    layer = nn.Linear(32, 48)
    assert cpu_linear.path(layer, torch.randn(8, 32)) == "weight-major"
    torch.set_num_threads(1)  # one thread: F.linear is the faster order
    assert cpu_linear.path(layer, torch.randn(8, 32)) == "torch"


def test_a_wrong_mode_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="auto, torch"):
        cpu_linear.set_mode("fast")


@native_library
def test_the_engine_decodes_the_same_through_the_native_linear_and_f_linear(
    families: dict[str, Family], monkeypatch: pytest.MonkeyPatch, auto: None
) -> None:
    # qwen2: q/k/v bias, tied embeddings, 4 heads over 1 KV head
    engine, batch, params, loras = mixed_batch(families["qwen2"], seed=29)
    lib = sgmv_cpu.library()
    assert lib is not None
    original, calls = lib.loraplane_linear_f32, [0]

    def counted(*args: object) -> None:
        calls[0] += 1
        original(*args)

    monkeypatch.setattr(lib, "loraplane_linear_f32", counted)
    native = engine.generate(batch, params, loras)
    assert calls[0] > 0  # every decode step's projections and lm_head
    cpu_linear.set_mode("torch")
    seen = calls[0]
    plain = engine.generate(batch, params, loras)
    assert calls[0] == seen  # the torch path called nothing native
    assert_same_outputs(native, plain)
