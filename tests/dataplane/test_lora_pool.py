"""LoRAPool: rank-exact storage per slot, free releases, bad input refused."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch

from loraplane.adapters.base_model import SUPPORTED_MODULES, BaseModelSpec
from loraplane.adapters.ingest import ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store import LocalStore
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.kernels import dispatch, sgmv_cpu
from loraplane.dataplane.lora import LoadedAdapter, LoRAPool, LoRAWeights, load_lora
from loraplane.dataplane.lora import pool as pool_module
from loraplane.dataplane.lora.host_form import PARALLEL_GRAIN, copy_serial, host_buffer
from loraplane.dataplane.model_step import build_model
from tests.test_import_cycles import import_graph

SPEC = BaseModelSpec("tiny", "llama", 2, 64, 128, 4, 2, 16)


def _adapter(rank: int, modules: tuple[str, ...] = SUPPORTED_MODULES) -> LoadedAdapter:
    weights = {}
    for layer in range(SPEC.num_layers):
        for module in modules:
            fan_in, fan_out = SPEC.module_shape(module)
            weights[(layer, module)] = LoRAWeights(
                torch.randn(rank, fan_in), torch.randn(fan_out, rank), 2.0
            )
    return LoadedAdapter(f"r{rank}", weights)


def test_memory_is_rank_exact_an_r8_adapter_takes_an_eighth_of_an_r64_one() -> None:
    pool = LoRAPool(4, SPEC, torch.bfloat16, "cpu")
    pool.load(0, _adapter(8))
    pool.load(1, _adapter(64))
    assert pool.slot_bytes(1) == 8 * pool.slot_bytes(0)
    assert pool.bytes_used == pool.slot_bytes(0) + pool.slot_bytes(1)
    assert pool.bytes_needed(_adapter(8)) == pool.slot_bytes(0)
    table = pool.module_slots(1, "down_proj")
    a0, a1 = table.lora_a[0], table.lora_a[1]
    assert a0 is not None and a1 is not None
    assert a0.shape == (8, 128) and a1.shape == (64, 128)  # no padding to the pool's max rank
    assert a0.dtype == torch.bfloat16


def test_real_peft_adapters_take_bytes_in_proportion_to_their_rank(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path]
) -> None:
    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    pool = LoRAPool(2, spec, torch.float32, "cpu")
    pool.load(0, load_lora(peft_adapters["r4"], spec))
    pool.load(1, load_lora(peft_adapters["r64"], spec))
    assert pool.slot_bytes(1) == 16 * pool.slot_bytes(0)


def test_free_releases_the_slot_and_clears_every_module_table() -> None:
    pool = LoRAPool(2, SPEC, torch.float32, "cpu")
    pool.load(1, _adapter(16))
    assert pool.is_loaded(1) and pool.free_slots() == [0]
    pool.free(1)
    assert not pool.is_loaded(1)
    assert pool.bytes_used == 0
    assert pool.free_slots() == [0, 1]
    for layer in range(SPEC.num_layers):
        for module in SUPPORTED_MODULES:
            table = pool.module_slots(layer, module)
            assert table.lora_a[1] is None and table.lora_b[1] is None
            assert float(table.scales[1]) == 0.0
    pool.load(1, _adapter(4))  # the slot is reusable
    assert pool.is_loaded(1)


def test_modules_an_adapter_does_not_target_stay_empty_in_its_slot() -> None:
    pool = LoRAPool(1, SPEC, torch.float32, "cpu")
    pool.load(0, _adapter(8, ("q_proj", "v_proj")))
    assert pool.module_slots(0, "q_proj").lora_a[0] is not None
    assert pool.module_slots(0, "k_proj").lora_a[0] is None
    assert float(pool.module_slots(0, "q_proj").scales[0]) == 2.0


def test_loading_into_an_occupied_slot_is_refused() -> None:
    pool = LoRAPool(1, SPEC, torch.float32, "cpu")
    pool.load(0, _adapter(4))
    with pytest.raises(ValueError, match="slot 0 already holds"):
        pool.load(0, _adapter(4))


def test_slot_ids_outside_the_pool_are_refused() -> None:
    pool = LoRAPool(2, SPEC, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"slot must be in 0\.\.1"):
        pool.load(2, _adapter(4))
    with pytest.raises(ValueError, match="num_slots"):
        LoRAPool(0, SPEC, torch.float32, "cpu")


def test_an_adapter_shaped_for_another_model_is_refused() -> None:
    adapter = LoadedAdapter(
        "wide", {(0, "q_proj"): LoRAWeights(torch.randn(4, 32), torch.randn(64, 4), 1.0)}
    )
    pool = LoRAPool(1, SPEC, torch.float32, "cpu")
    with pytest.raises(ValueError, match="in_features 64"):
        pool.load(0, adapter)
    assert not pool.is_loaded(0)
    deep = LoadedAdapter("deep", {(5, "q_proj"): _adapter(4).modules[(0, "q_proj")]})
    with pytest.raises(ValueError, match="layer 5"):
        pool.load(0, deep)


def test_a_host_copy_of_the_pools_device_and_dtype_is_read_in_place_others_are_copied() -> None:
    adapter = _adapter(8)  # float32 on the CPU
    same = LoRAPool(2, SPEC, torch.float32, "cpu")
    same.load(0, adapter)
    w = adapter.modules[(1, "q_proj")]
    table = same.module_slots(1, "q_proj")
    assert table.lora_a[0] is w.a and table.lora_b[0] is w.b  # no second copy
    assert same.slot_bytes(0) == same.bytes_needed(adapter)
    other = LoRAPool(2, SPEC, torch.bfloat16, "cpu")
    other.load(0, adapter)
    copied = other.module_slots(1, "q_proj").lora_a[0]
    assert copied is not None and copied.dtype == torch.bfloat16
    assert torch.equal(copied, w.a.to(torch.bfloat16))
    # Freeing the slot drops its reference; the host copy is untouched.
    same.free(0)
    assert table.lora_a[0] is None and not same.is_loaded(0)
    assert w.a.shape == (8, 64)


def _one_buffer(adapter: LoadedAdapter, dtype: torch.dtype) -> LoadedAdapter:
    """`adapter` as the loader reads a stored version: views of one buffer, back to back, in
    an order (reversed here) that is not the modules' order."""
    tensors = [t for w in adapter.modules.values() for t in (w.a, w.b)]
    whole = torch.empty(sum(t.numel() for t in tensors), dtype=dtype)
    offset, views = 0, {}
    for t in reversed(tensors):
        views[id(t)] = whole[offset : offset + t.numel()].view(t.shape)
        views[id(t)].copy_(t)
        offset += t.numel()
    return LoadedAdapter(
        adapter.source,
        {
            k: LoRAWeights(views[id(w.a)], views[id(w.b)], w.scale)
            for k, w in adapter.modules.items()
        },
    )


@pytest.mark.parametrize("b_transposed", [True, False])
@pytest.mark.parametrize("one_buffer", [True, False])
@pytest.mark.parametrize(
    ("dtype", "native"),
    [(torch.bfloat16, False), (torch.float32, True), (torch.float32, False)],
)
def test_host_form_converts_to_the_pools_dtype_into_one_buffer_exactly(
    one_buffer: bool,
    b_transposed: bool,
    dtype: torch.dtype,
    native: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # into fp32 the native library converts in one call; without it (and into other dtypes)
    # torch does: the same bytes either way
    if native and sgmv_cpu.library() is None:
        pytest.skip("no C compiler here: the native conversion is not built")
    if not native:
        monkeypatch.setattr(sgmv_cpu, "convert_f32", lambda *_args: False)
    source = _adapter(8)
    if dtype == torch.float32:  # separate fp16 tensors: an fp32 source is in host form already
        source = LoadedAdapter(source.source, {
            k: LoRAWeights(w.a.half(), w.b.half(), w.scale) for k, w in source.modules.items()
        })  # fmt: skip
    adapter = _one_buffer(source, torch.float16) if one_buffer else source
    pool = LoRAPool(2, SPEC, dtype, "cpu", b_transposed=b_transposed)
    host = pool.host_form(adapter)
    spans = sorted((t.data_ptr(), t.nbytes) for w in host.modules.values() for t in (w.a, w.b))
    assert all(p + n == q for (p, n), (q, _) in itertools.pairwise(spans))
    for key, w in host.modules.items():
        assert w.a.dtype == dtype and w.scale == adapter.modules[key].scale
        assert torch.equal(w.a, adapter.modules[key].a.to(dtype))
        assert torch.equal(w.b, adapter.modules[key].b.to(dtype))
        assert w.a.is_contiguous()
        # B keeps its [out, r] shape; its bytes are rows of B^T where the pool transposes
        assert w.b.shape == adapter.modules[key].b.shape
        assert (w.b.t().is_contiguous() and not w.b.is_contiguous()) == b_transposed
    assert pool.host_form(host) is host  # already in the pool's form: nothing to do
    pool.load(0, host)  # and a slot reads it in place
    table = pool.module_slots(1, "v_proj")
    assert table.lora_b[0] is host.modules[(1, "v_proj")].b


@pytest.mark.parametrize("one_buffer", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_host_form_within_one_dtype_copies_the_bits_into_one_huge_page_buffer(
    one_buffer: bool, dtype: torch.dtype
) -> None:
    # a 16-bit adapter into a transposing pool of its own dtype: numpy copies the bits (no
    # cast, no OpenMP team) into a buffer numpy allocated (huge pages, not 4 KiB faults)
    source = _adapter(8)
    adapter = _one_buffer(source, dtype) if one_buffer else LoadedAdapter(source.source, {
        k: LoRAWeights(w.a.to(dtype), w.b.to(dtype), w.scale) for k, w in source.modules.items()
    })  # fmt: skip
    host = LoRAPool(2, SPEC, dtype, "cpu", b_transposed=True).host_form(adapter)
    first = next(iter(host.modules.values())).a
    assert first.untyped_storage().nbytes() == adapter.nbytes  # one buffer, nothing more
    for key, w in host.modules.items():
        assert torch.equal(w.a.view(torch.int16), adapter.modules[key].a.view(torch.int16))
        assert torch.equal(w.b.view(torch.int16), adapter.modules[key].b.view(torch.int16))
        assert w.b.t().is_contiguous() and not w.b.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_stored_version_takes_a_transposing_pools_host_form_in_its_own_buffer(
    peft_adapters: dict[str, Path], tiny_llama_dir: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    # the loader's one file buffer becomes the host form: each B transposed where it lies
    from safetensors.torch import load_file, save_file

    spec = BaseModelSpec.from_dir(tiny_llama_dir)
    src = tmp_path / "src"
    shutil.copytree(peft_adapters["r8-patterns"], src)
    weights = src / "adapter_model.safetensors"
    save_file({k: v.to(dtype) for k, v in load_file(str(weights)).items()}, str(weights))
    version = ingest(src, "acme", "bot", spec, AdapterLimits(), LocalStore(tmp_path / "store"))
    stored = tmp_path / "store" / version.path
    expected = load_lora(stored, spec, expected_digest=version.digest)
    bits = {k: (w.a.view(torch.int16).clone(), w.b.view(torch.int16).clone())
            for k, w in expected.modules.items()}  # fmt: skip
    pool = LoRAPool(2, spec, dtype, "cpu", b_transposed=True)
    loaded = load_lora(stored, spec, expected_digest=version.digest)
    assert loaded.owns_tensors
    storage = next(iter(loaded.modules.values())).a.untyped_storage().data_ptr()
    host = pool.host_form(loaded)
    assert host is loaded  # converted where it lies: no second buffer
    for key, w in host.modules.items():
        assert torch.equal(w.a.view(torch.int16), bits[key][0])
        assert torch.equal(w.b.view(torch.int16), bits[key][1])
        assert w.b.t().is_contiguous() and w.b.untyped_storage().data_ptr() == storage
    assert pool.host_form(host) is host
    assert pool.load(0, host)
    # the same version held elsewhere (not its own): copied into a new buffer, left untouched
    shared = LoadedAdapter(expected.source, dict(expected.modules), expected.digest)
    copy = pool.host_form(shared)
    assert copy is not shared
    for key, w in copy.modules.items():
        assert torch.equal(w.b.view(torch.int16), bits[key][1]) and w.b.t().is_contiguous()
        assert torch.equal(shared.modules[key].b.view(torch.int16), bits[key][1])
        assert shared.modules[key].b.is_contiguous()


def test_host_buffer_is_of_the_dtype_and_size_asked() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        buffer = host_buffer(3 << 20, dtype)  # 6-12 MiB: numpy's huge-page size
        assert buffer.dtype == dtype and buffer.shape == (3 << 20,) and buffer.is_contiguous()
        buffer.fill_(1.5)
        assert float(buffer[-1]) == 1.5


def test_the_kernel_chooser_transposes_a_cpu_pools_b_unless_the_triton_kernels_read_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    assert dispatch.b_transposed(torch.float32, cpu)  # native or torch
    assert dispatch.b_transposed(torch.bfloat16, cpu)  # torch
    monkeypatch.setenv("LORAPLANE_SGMV", "triton")  # Triton's interpreter on CPU tensors
    assert not dispatch.b_transposed(torch.float32, cpu)


def test_the_pool_takes_its_layout_from_its_caller_and_imports_no_kernel_chooser(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layout is decided by whoever picks the kernels (the engine's model builder) and
    passed in: a pool told nothing keeps B as stored, whatever the chooser would say."""
    assert dispatch.b_transposed(torch.float32, torch.device("cpu"))
    assert not LoRAPool(1, SPEC, torch.float32, "cpu").b_transposed
    assert LoRAPool(1, SPEC, torch.float32, "cpu", b_transposed=True).b_transposed
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32")
    assert build_model(config, torch.device("cpu")).pool.b_transposed
    monkeypatch.setenv("LORAPLANE_SGMV", "triton")
    assert not build_model(config, torch.device("cpu")).pool.b_transposed
    graph = import_graph(Path(pool_module.__file__).parents[2])
    assert "loraplane.dataplane.kernels.dispatch" not in graph["loraplane.dataplane.lora.pool"]
    assert "loraplane.dataplane.kernels.dispatch" in graph["loraplane.dataplane.model_step"]


def test_the_transposed_layout_computes_what_the_plain_one_does() -> None:
    from loraplane.dataplane.kernels import sgmv_torch

    torch.manual_seed(7)
    adapters = [_adapter(4), _adapter(8)]
    x = torch.randn(5, 64)
    order, slots = torch.tensor([0, 3, 1, 2, 4]), torch.tensor([0, 0, 1, 1, 1])
    seg_slots, bounds = [0, 1], [0, 2, 5]
    results = []
    for transposed in (False, True):
        pool = LoRAPool(2, SPEC, torch.float32, "cpu", b_transposed=transposed)
        for slot, adapter in enumerate(adapters):
            pool.load(slot, pool.host_form(adapter))
        table = pool.module_slots(0, "q_proj")
        y = torch.zeros(5, 64)
        sgmv_torch.lora_apply_grouped(
            y, x, order, slots, seg_slots, bounds, table.lora_a, table.lora_b, table.scales,
            table.checked,
        )  # fmt: skip
        results.append(y)
    oracle = torch.zeros(5, 64)
    table = LoRAPool(2, SPEC, torch.float32, "cpu", b_transposed=False)
    for slot, adapter in enumerate(adapters):
        table.load(slot, adapter)
    t = table.module_slots(0, "q_proj")
    sgmv_torch.lora_apply(oracle, x, order, seg_slots, bounds, t.lora_a, t.lora_b, t.scales)
    # the layouts sum in other orders: fp32 rounding, relative to the outputs (max 74-286); the
    # default 1e-5 absolute failed once on an element of 0.68 that cancellation left small
    tol = {"rtol": 1e-5, "atol": 1e-6 * float(oracle.abs().max())}
    torch.testing.assert_close(results[1], results[0], **tol)
    torch.testing.assert_close(results[1], oracle, **tol)
    assert results[1].abs().sum() > 0


def test_copy_serial_copies_across_its_pieces_and_refuses_other_shapes() -> None:
    src = torch.randn(2 * PARALLEL_GRAIN + 5).to(torch.float16)
    dst = torch.empty(src.numel())
    copy_serial(dst, src)
    assert torch.equal(dst, src.float())
    # 2-D, from a transposed view: in blocks of rows, or row by row when rows are long
    for rows, cols in ((16, 1000), (3, 2 * PARALLEL_GRAIN + 7)):
        b = torch.randn(cols, rows).to(torch.float16)
        out = torch.empty(rows, cols)
        copy_serial(out, b.t())
        assert torch.equal(out, b.t().float())
    with pytest.raises(ValueError, match="1-D or 2-D tensors of one shape"):
        copy_serial(torch.empty(4), torch.empty(5))
    with pytest.raises(ValueError, match="1-D or 2-D tensors of one shape"):
        copy_serial(torch.empty(2, 2, 2), torch.empty(2, 2, 2))
