"""kernels/cpu_linear.py: the native and the weight-major CPU linears equal F.linear, take
only their cases, and the engine decodes the same through them as through F.linear."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.functional import linear

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.kernels import cpu_linear, sgmv_cpu
from loraplane.dataplane.lora import (
    LinearWithLoRA,
    LoadedAdapter,
    LoRABatch,
    LoRAContext,
    LoRAPool,
    LoRAWeights,
    install_lora,
)
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
    original, calls = lib.loraplane_linear_lora_f32, [0]

    def counted(*args: object) -> int:
        calls[0] += 1
        return int(original(*args))

    monkeypatch.setattr(lib, "loraplane_linear_lora_f32", counted)
    native = engine.generate(batch, params, loras)
    assert calls[0] > 0  # every decode step's projections and lm_head
    cpu_linear.set_mode("torch")
    seen = calls[0]
    plain = engine.generate(batch, params, loras)
    assert calls[0] == seen  # the torch path called nothing native
    assert_same_outputs(native, plain)


def _lora_host(pool: LoRAPool, n_in: int, n_out: int) -> tuple[list[LinearWithLoRA], LoRAContext]:
    """A layer's q_proj and k_proj (with biases), wrapped and bound to `pool`."""

    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Module()])
            self.layers[0].self_attn = nn.Module()
            self.layers[0].self_attn.q_proj = nn.Linear(n_in, n_out)
            self.layers[0].self_attn.k_proj = nn.Linear(n_in, n_out)
            self.lora_context: LoRAContext | None = None

    host = Host()
    context = install_lora(host, pool)
    layers = [host.layers[0].self_attn.q_proj, host.layers[0].self_attn.k_proj]
    assert all(isinstance(layer, LinearWithLoRA) for layer in layers)
    return layers, context


def _adapter(name: str, rank: int, n_in: int, n_out: int, scale: float) -> LoadedAdapter:
    modules = {(0, m): LoRAWeights(torch.randn(rank, n_in), torch.randn(n_out, rank), scale)
               for m in ("q_proj", "k_proj")}  # fmt: skip
    return LoadedAdapter(name, modules)


def _expected(layer: LinearWithLoRA, x: torch.Tensor, slots: list[int],
              adapters: dict[int, LoadedAdapter]) -> torch.Tensor:  # fmt: skip
    y = linear(x, layer.base_layer.weight, layer.base_layer.bias)
    for t, k in enumerate(slots):
        if k >= 0:
            w = adapters[k].modules[(0, layer.module_name)]
            y[t] += w.scale * (w.b @ (w.a @ x[t]))
    return y


def _assert_lora(y: torch.Tensor, layer: LinearWithLoRA, x: torch.Tensor, slots: list[int],
                 adapters: dict[int, LoadedAdapter]) -> None:  # fmt: skip
    torch.testing.assert_close(y, _expected(layer, x, slots, adapters), rtol=1e-5, atol=1e-4)


@native_library
def test_a_lora_layer_computes_in_one_native_call_what_the_two_calls_compute(
    auto: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(41)
    n_in, n_out = 96, 163
    spec = BaseModelSpec("m", "llama", 1, n_in, 2 * n_in, 1, 1, n_out)
    pool = LoRAPool(3, spec, torch.float32, "cpu", b_transposed=True)  # the engine's CPU layout
    adapters = {1: _adapter("a", 4, n_in, n_out, 0.5), 2: _adapter("b", 8, n_in, n_out, 2.0)}
    for k, adapter in adapters.items():
        pool.load(k, pool.host_form(adapter))
    (q, k_proj), context = _lora_host(pool, n_in, n_out)
    lib = sgmv_cpu.library()
    assert lib is not None
    original, fused = lib.loraplane_linear_lora_f32, []

    def counted(*args: object) -> int:
        fused.append(args[6] is not None and args[7] is not None)  # slots and step given
        return int(original(*args))

    monkeypatch.setattr(lib, "loraplane_linear_lora_f32", counted)
    token_slots = [1, -1, 2, 1, 2, 2, -1, 1]
    x = torch.randn(len(token_slots), n_in)
    context.activate(LoRABatch.from_token_slots(token_slots))
    pair = q(x)  # the step's first LoRA layer: the linear, then the SGMV kernel
    assert fused == [False]
    one = q(x)  # every later one: one call
    assert fused == [False, True]
    assert torch.equal(one, pair)
    _assert_lora(one, q, x, token_slots, adapters)
    _assert_lora(k_proj(x), k_proj, x, token_slots, adapters)
    assert fused[-1]

    # another adapter in slot 1: the pool's stamp moves, and the next step's calls read it
    pool.free(1)
    adapters[1] = _adapter("c", 16, n_in, n_out, 1.5)
    pool.load(1, pool.host_form(adapters[1]))
    context.activate(LoRABatch.from_token_slots(token_slots))
    _assert_lora(q(x), q, x, token_slots, adapters)  # the pair (its table brought up to date)
    swapped = k_proj(x)
    assert fused[-1]  # one call, its table checked again at the new stamp
    _assert_lora(swapped, k_proj, x, token_slots, adapters)


@native_library
def test_a_lora_layer_off_the_native_linear_takes_the_two_calls(auto: None) -> None:
    torch.manual_seed(43)
    n_in, n_out = 32, 48
    spec = BaseModelSpec("m", "llama", 1, n_in, 2 * n_in, 1, 1, n_out)
    pool = LoRAPool(2, spec, torch.float32, "cpu", b_transposed=True)
    adapters = {1: _adapter("a", 4, n_in, n_out, 0.5)}
    pool.load(1, pool.host_form(adapters[1]))
    (q, _), context = _lora_host(pool, n_in, n_out)
    token_slots = [1, -1, 1]
    x = torch.randn(3, n_in)
    batch = LoRABatch.from_token_slots(token_slots)
    context.activate(batch)
    q(x)
    assert batch.native_step is not None
    cpu_linear.set_mode("torch")  # F.linear for the base: apply_lora leaves it to the pair
    assert cpu_linear.apply_lora(q.base_layer, x, batch, pool.module_slots(0, "q_proj"),
                                 context.stamp) is None  # fmt: skip
    _assert_lora(q(x), q, x, token_slots, adapters)
