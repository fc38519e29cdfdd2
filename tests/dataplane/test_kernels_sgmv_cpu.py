"""The native CPU SGMV kernel (sgmv_cpu.c through ctypes) against the torch oracle; the cases
it hands back to the torch path; how it is built, cached, and done without."""

from __future__ import annotations

import ctypes
import json
import logging
import platform
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from loraplane.dataplane.kernels import dispatch, sgmv_cpu
from loraplane.dataplane.kernels import sgmv_cpu_prebuilt as prebuilt
from loraplane.dataplane.kernels.sgmv_torch import lora_apply as oracle
from loraplane.dataplane.lora import LoRABatch
from loraplane.dataplane.lora.module_slots import ModuleSlots

IN, OUT = 96, 80


@pytest.fixture
def native() -> None:
    if sgmv_cpu.library() is None:
        pytest.skip("no C compiler here: the native kernel is not built (the torch path serves)")


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """library() built anew into an empty cache folder; the process's own one afterwards."""
    monkeypatch.setenv("LORAPLANE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(sgmv_cpu.PREBUILT_ENV, raising=False)
    sgmv_cpu.library.cache_clear()
    yield tmp_path
    sgmv_cpu.library.cache_clear()


def _slots(ranks: list[int | None], transposed: bool = True, seed: int = 0) -> ModuleSlots:
    g = torch.Generator().manual_seed(seed)
    slots = ModuleSlots(len(ranks), torch.device("cpu"))
    for k, r in enumerate(ranks):
        if r is None:
            continue
        slots.lora_a[k] = torch.randn(r, IN, generator=g) * 0.2
        b = torch.randn(OUT, r, generator=g) * 0.2
        slots.lora_b[k] = b.t().contiguous().t() if transposed else b
        slots.scales[k] = 0.5 + k / 4
    return slots


def _token_slots(lengths: dict[int, int], base: int, seed: int) -> list[int]:
    """Tokens of each slot (slot -> count) and `base` base-model tokens, shuffled."""
    tokens = [k for k, n in lengths.items() for _ in range(n)] + [-1] * base
    random.Random(seed).shuffle(tokens)
    return tokens


def _expected(
    slots: ModuleSlots, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch
) -> torch.Tensor:
    return oracle(y.clone(), x, batch.token_order, batch.seg_slots, batch.seg_bounds,
                  slots.lora_a, slots.lora_b, slots.scales)  # fmt: skip


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_native_kernel_equals_the_oracle_over_mixed_ranks_and_segment_lengths(
    seed: int,
) -> None:
    # ranks 4..64 and an untargeted slot; segments of 1 to 9 tokens (partial and whole blocks of
    # four) and one longer than MAX_SEGMENT, which goes to a GEMM
    slots = _slots([4, 8, None, 16, 64, 8, 4], seed=seed)
    lengths = {0: 1, 1: 3, 2: 2, 3: 4, 4: 9, 5: sgmv_cpu.MAX_SEGMENT + 6, 6: 5}
    batch = LoRABatch.from_token_slots(_token_slots(lengths, base=7, seed=seed))
    wide_x = torch.randn(batch.num_tokens, IN + 16)
    x = wide_x[:, 3 : 3 + IN]  # rows not contiguous with each other: strides are honoured
    y_store = torch.randn(batch.num_tokens, OUT + 8)
    y = y_store[:, :OUT]
    padding = y_store[:, OUT:].clone()
    expected = _expected(slots, x, y, batch)
    assert sgmv_cpu.lora_apply(y, x, batch, slots)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(y_store[:, OUT:], padding)  # the columns beside y are not written
    base_rows = [t for t, k in enumerate(_token_slots(lengths, base=7, seed=seed)) if k == -1]
    torch.testing.assert_close(y[base_rows], expected[base_rows])


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("threads", [2, 3, 5])
def test_a_call_split_over_threads_gives_the_one_thread_result_bit_for_bit(threads: int) -> None:
    # 40 slots of rank 32 to 64 (about 1.3 MB of weights: enough to split), segments of 1 to
    # 9 tokens, one long one for the GEMM, an untargeted slot and base tokens
    ranks: list[int | None] = [32 + (k * 7) % 33 for k in range(40)]
    ranks[5] = None
    slots = _slots(ranks, seed=threads)
    lengths = {k: 1 + k % 9 for k in range(40)}
    lengths[11] = sgmv_cpu.MAX_SEGMENT + 3
    token_slots = _token_slots(lengths, base=5, seed=threads)
    batch = LoRABatch.from_token_slots(token_slots)
    x = torch.randn(batch.num_tokens, IN)
    y0 = torch.randn(batch.num_tokens, OUT)
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            y = y0.clone()
            assert sgmv_cpu.lora_apply(y, x, batch, slots)
            results.append(y)
    finally:
        torch.set_num_threads(before)
    # every short segment is done whole by one thread, with the same arithmetic; the long one
    # goes to torch's GEMM, whose own threads may split its sums differently (seen on an AMD
    # EPYC with AVX-512: a few ulps at 3 and 5 threads)
    short = torch.tensor([k != 11 for k in token_slots])
    assert torch.equal(results[0][short], results[1][short])
    torch.testing.assert_close(results[0][~short], results[1][~short], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[1], _expected(slots, x, y0, batch), atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("native")
def test_the_native_table_follows_the_slots_tensors_and_forgets_freed_slots() -> None:
    slots = _slots([8, 8])
    batch = LoRABatch.from_token_slots([0, 1, 1, 0])
    x, y = torch.randn(4, IN), torch.zeros(4, OUT)
    assert sgmv_cpu.lora_apply(y, x, batch, slots)
    swapped = _slots([8, 8], seed=5)  # slot 1 gets other tensors (a load into a freed slot)
    slots.lora_a[1], slots.lora_b[1] = swapped.lora_a[1], swapped.lora_b[1]
    y2 = torch.zeros(4, OUT)
    assert sgmv_cpu.lora_apply(y2, x, batch, slots)
    torch.testing.assert_close(y2, _expected(slots, x, torch.zeros(4, OUT), batch))
    assert slots.native is not None and slots.native.held[1][0] is swapped.lora_a[1]
    slots.clear(1)  # the pool frees the slot: its tensors are not kept alive by the table
    assert slots.native.held[1] == (None, None) and int(slots.native.table[2, 1]) == 0


@pytest.mark.usefixtures("native")
def test_what_the_kernel_does_not_take_goes_back_to_the_torch_path_untouched() -> None:
    batch = LoRABatch.from_token_slots([0, 0, 1])
    x = torch.randn(3, IN)
    y = torch.zeros(3, OUT)
    assert not sgmv_cpu.lora_apply(y, x, batch, _slots([4, 4], transposed=False))  # B as is
    assert not sgmv_cpu.lora_apply(y, x, batch, _slots([4, sgmv_cpu.MAX_RANK + 8]))
    assert not sgmv_cpu.lora_apply(y.bfloat16(), x.bfloat16(), batch, _slots([4, 4]))
    assert torch.equal(y, torch.zeros(3, OUT))
    # through dispatch, the torch path then serves the same request
    slots = _slots([4, 4], transposed=False)
    got = dispatch.lora_apply(y, x, batch, slots)
    torch.testing.assert_close(got, _expected(slots, x, torch.zeros(3, OUT), batch))


@pytest.mark.usefixtures("native")
def test_a_slot_that_does_not_fit_the_layer_is_refused_before_any_pointer_is_read() -> None:
    slots = _slots([4, 4])
    slots.lora_a[1] = torch.zeros(4, IN + 1)  # a bad copy: A no longer fits the layer
    with pytest.raises(ValueError, match="slot 1"):
        sgmv_cpu.lora_apply(torch.zeros(2, OUT), torch.randn(2, IN),
                            LoRABatch.from_token_slots([0, 1]), slots)  # fmt: skip


def test_the_library_is_built_once_into_its_cache_and_reused(fresh_library: Path) -> None:
    if sgmv_cpu.library() is None:
        pytest.skip("no C compiler here")
    built = list(fresh_library.glob("loraplane-sgmv-cpu-*.so"))
    assert len(built) == 1 and not list(fresh_library.glob("*.part"))
    stamp = built[0].stat().st_mtime_ns
    sgmv_cpu.library.cache_clear()
    assert sgmv_cpu.library() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not built again


def test_the_library_joins_torchs_openmp_team_and_builds_serial_where_openmp_fails(
    fresh_library: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if sgmv_cpu.library() is None:
        pytest.skip("no C compiler here")
    maps = Path("/proc/self/maps").read_text()
    assert sgmv_cpu._threading() == (sgmv_cpu.OPENMP if "libgomp" in maps else sgmv_cpu.SERIAL)
    # loading the kernel added no second OpenMP runtime to the process
    gomp = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if "libgomp" in line}  # fmt: skip
    assert len(gomp) <= 1
    # a compiler that cannot build with OpenMP: the kernel is built for one thread instead
    cc = fresh_library / "cc-no-openmp"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\n'
                  'exec cc "$@"\n')  # fmt: skip
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    sgmv_cpu.library.cache_clear()
    with caplog.at_level(logging.INFO, logger=sgmv_cpu.__name__):
        assert sgmv_cpu.library() is not None
    if sgmv_cpu._threading() == sgmv_cpu.OPENMP:
        assert "did not build with OpenMP" in caplog.text
    slots = _slots([8, 16, 4])
    batch = LoRABatch.from_token_slots(_token_slots({0: 3, 1: 5, 2: 2}, base=2, seed=0))
    x, y = torch.randn(batch.num_tokens, IN), torch.zeros(batch.num_tokens, OUT)
    expected = _expected(slots, x, y, batch)
    assert sgmv_cpu.lora_apply(y, x, batch, slots)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("env", "why"),
    [
        ({"CC": "/nonexistent/cc"}, "no C compiler"),
        ({"CC": "false"}, "did not build"),
        ({"LORAPLANE_SGMV_NATIVE": "0"}, None),
    ],
)
def test_without_the_kernel_the_torch_path_serves_and_a_warning_says_why(
    fresh_library: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    env: dict[str, str],
    why: str | None,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(dispatch.ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger=sgmv_cpu.__name__):
        assert sgmv_cpu.library() is None
    assert dispatch.backend(torch.zeros(1)) == "torch"
    if why is not None:
        assert why in caplog.text and "the torch path serves" in caplog.text
    slots = _slots([4])
    batch = LoRABatch.from_token_slots([0, -1])
    x = torch.randn(2, IN)
    got = dispatch.lora_apply(torch.zeros(2, OUT), x, batch, slots)
    torch.testing.assert_close(got, _expected(slots, x, torch.zeros(2, OUT), batch))


# -- the loader's conversion (loraplane_host_form_f32) ---------------------------------------


def _every_half() -> torch.Tensor:
    """All 65,536 fp16 bit patterns (zeros, subnormals, normals, infinities, NaNs), [256, 256]."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.float16).reshape(256, 256)


def _same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, except that any NaN stands for any NaN."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_conversion_writes_each_tensor_back_to_back_as_fp32_transposed_where_asked(
    dtype: torch.dtype,
) -> None:
    g = torch.Generator().manual_seed(7)
    # shapes that are not multiples of the 16 x 16 tiles or of 8 lanes; one empty tensor
    shapes = [(5, 37), (37, 5), (16, 16), (33, 1), (0, 4), (3, 300)]
    parts = [(torch.randn(s, generator=g).to(dtype), k % 2 == 1) for k, s in enumerate(shapes)]
    out = torch.full((sum(r * c for r, c in shapes),), float("nan"))
    assert sgmv_cpu.convert_f32(parts, out)
    offset = 0
    for t, transpose in parts:
        want = (t.t() if transpose else t).float().contiguous().reshape(-1)
        _same_values(out[offset : offset + t.numel()], want)
        offset += t.numel()


@pytest.mark.usefixtures("native")
def test_every_fp16_value_converts_exactly_with_and_without_f16c(fresh_library: Path) -> None:
    halves = _every_half()
    want = halves.float()
    portable = sgmv_cpu._declare(
        ctypes.CDLL(str(sgmv_cpu._build("cc", (*sgmv_cpu.SERIAL, "-DLORAPLANE_PORTABLE_F16"))))
    )
    for lib in (sgmv_cpu.library(), portable):
        for transpose in (False, True):
            out = torch.empty(halves.numel())
            assert sgmv_cpu.convert_f32([(halves, transpose)], out, lib)
            _same_values(out, (want.t() if transpose else want).contiguous().reshape(-1))


@pytest.mark.usefixtures("native")
def test_what_the_conversion_does_not_take_is_refused_with_nothing_written() -> None:
    a = torch.randn(4, 6).half()
    out = torch.zeros(24)
    assert not sgmv_cpu.convert_f32([(a.t(), False)], out)  # not contiguous
    assert not sgmv_cpu.convert_f32([(a.to(torch.int16), False)], out)  # not a float dtype
    assert not sgmv_cpu.convert_f32([(a.reshape(-1), False)], out)  # not 2-D
    assert not sgmv_cpu.convert_f32([(a, False)], torch.zeros(25))  # not its size
    assert not sgmv_cpu.convert_f32([(a, False)], torch.zeros(24).double())  # not fp32 out
    assert not sgmv_cpu.convert_f32([(a, False)], torch.zeros(48)[::2])  # out not contiguous
    assert torch.equal(out, torch.zeros(24))
    assert sgmv_cpu.convert_f32([(a, False)], out)
    assert torch.equal(out, a.float().reshape(-1))


def test_a_conversion_into_another_dtype_never_builds_the_library(
    fresh_library: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # a GPU pool's host form (fp16 or bf16, pinned): no compile, no "no compiler" warning
    monkeypatch.setenv("CC", "/nonexistent/cc")
    a = torch.randn(2, 3).half()
    with caplog.at_level(logging.WARNING, logger=sgmv_cpu.__name__):
        for dtype in (torch.float16, torch.bfloat16):
            assert not sgmv_cpu.convert_f32([(a, False)], torch.zeros(6, dtype=dtype))
    assert sgmv_cpu.library.cache_info().currsize == 0
    # the module's own (another test's background thread may log into caplog meanwhile)
    assert not [r for r in caplog.records if r.name == sgmv_cpu.__name__]


# -- prebuilt libraries (the image's; sgmv_cpu_prebuilt) -------------------------------------

V3_FLAGS = sorted(prebuilt.variants("x86_64")[1].cpu_flags)
V2_FLAGS = sorted(set(V3_FLAGS) - {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"})


@pytest.fixture(scope="module")
def prebuilt_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every variant built once by the image's build step (this machine's compiler)."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here: nothing to prebuild")
    out = tmp_path_factory.mktemp("prebuilt")
    assert prebuilt.main([str(out)]) == 0
    return out


@pytest.fixture
def prebuilt_dir(
    prebuilt_template: Path, fresh_library: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A copy of the prebuilt folder named by LORAPLANE_KERNEL_PREBUILT; an empty cache."""
    folder = fresh_library / "prebuilt"
    shutil.copytree(prebuilt_template, folder)
    monkeypatch.setenv(sgmv_cpu.PREBUILT_ENV, str(folder))
    monkeypatch.setenv("LORAPLANE_KERNEL_CACHE", str(fresh_library / "cache"))
    return folder


def _compiled_nothing(prebuilt_dir: Path) -> bool:
    return not list((prebuilt_dir.parent / "cache").glob("*.so"))


def _serves_like_the_oracle() -> None:
    slots = _slots([8, 16, 4])
    batch = LoRABatch.from_token_slots(_token_slots({0: 3, 1: 5, 2: 2}, base=2, seed=0))
    x, y = torch.randn(batch.num_tokens, IN), torch.zeros(batch.num_tokens, OUT)
    expected = _expected(slots, x, y, batch)
    assert sgmv_cpu.lora_apply(y, x, batch, slots)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_the_build_step_writes_every_variant_and_a_manifest_of_this_source(
    prebuilt_template: Path,
) -> None:
    manifest = json.loads((prebuilt_template / prebuilt.MANIFEST).read_text())
    assert manifest["source_sha256"] == prebuilt.source_digest()
    assert manifest["machine"] == platform.machine()
    built = [(e["variant"], e["threading"]) for e in manifest["libraries"]]
    names = [v.name for v in prebuilt.variants(platform.machine())]
    # best level first, OpenMP before serial within one (the loader relies on this order)
    assert built == [(n, t) for n in names for t in ("openmp", "serial")]
    for entry in manifest["libraries"]:
        assert (prebuilt_template / entry["file"]).stat().st_size > 0
    # the baseline build needs nothing of the CPU; no build is -march=native
    assert manifest["libraries"][-1]["cpu_flags"] == []


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels only")
@pytest.mark.parametrize(
    ("cpu", "variant"),
    [
        ([*sorted(prebuilt.variants("x86_64")[0].cpu_flags), "sse2"], "x86-64-v4"),
        ([*V3_FLAGS, "avx512f"], "x86-64-v3"),  # one AVX-512 flag is not the v4 level
        (V2_FLAGS, "baseline"),  # no AVX2: the baseline build
        ([], "baseline"),  # flags unreadable
    ],
)
def test_the_prebuilt_library_of_the_best_level_this_cpu_has_is_loaded_without_compiling(
    prebuilt_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cpu: list[str],
    variant: str,
) -> None:
    here = sgmv_cpu._cpu_flags()  # this machine's, before the pretended ones replace them
    monkeypatch.setattr(sgmv_cpu, "_cpu_flags", lambda: frozenset(cpu))
    monkeypatch.setenv("CC", "/nonexistent/cc")  # a compile would fail: none is tried
    with caplog.at_level(logging.INFO, logger=sgmv_cpu.__name__):
        loaded = sgmv_cpu.loaded()
    assert loaded is not None and loaded.origin == "prebuilt" and loaded.variant == variant
    threads = "openmp" if sgmv_cpu._threading() == sgmv_cpu.OPENMP else "serial"
    assert loaded.threading == threads
    assert loaded.path == prebuilt_dir / f"sgmv-{variant}-{threads}.so"
    assert f"prebuilt {variant} ({threads}), {loaded.path}" in caplog.text
    assert _compiled_nothing(prebuilt_dir)
    if set(cpu) <= here:  # runnable here: it computes what the oracle does
        _serves_like_the_oracle()


def test_without_torchs_openmp_runtime_the_serial_prebuilt_is_loaded(
    prebuilt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sgmv_cpu, "_threading", lambda: sgmv_cpu.SERIAL)
    loaded = sgmv_cpu.loaded()
    assert loaded is not None and loaded.origin == "prebuilt" and loaded.threading == "serial"
    _serves_like_the_oracle()


def _corrupt(folder: Path) -> None:
    for so in folder.glob("*.so"):
        so.write_bytes(b"not an ELF file")


def _stale(folder: Path) -> None:
    manifest = json.loads((folder / prebuilt.MANIFEST).read_text())
    manifest["source_sha256"] = "0" * 64
    (folder / prebuilt.MANIFEST).write_text(json.dumps(manifest))


def _other_machine(folder: Path) -> None:
    manifest = json.loads((folder / prebuilt.MANIFEST).read_text())
    manifest["machine"] = "riscv64"
    (folder / prebuilt.MANIFEST).write_text(json.dumps(manifest))


def _too_demanding(folder: Path) -> None:
    manifest = json.loads((folder / prebuilt.MANIFEST).read_text())
    for entry in manifest["libraries"]:
        entry["cpu_flags"] = ["a-flag-no-cpu-has"]
    (folder / prebuilt.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (_corrupt, "does not load"),
        (_stale, "built from another sgmv_cpu.c"),
        (_other_machine, "built from another machine (riscv64)"),
        (_too_demanding, "runs on this CPU"),
        (lambda folder: (folder / prebuilt.MANIFEST).unlink(), "no prebuilt"),
        (lambda folder: shutil.rmtree(folder), "no prebuilt"),
        (lambda folder: (folder / prebuilt.MANIFEST).write_text("{"), "no prebuilt"),
    ],
)
def test_a_prebuilt_folder_that_cannot_serve_falls_back_to_compiling_with_a_warning(
    prebuilt_dir: Path,
    caplog: pytest.LogCaptureFixture,
    spoil: Callable[[Path], None],
    why: str,
) -> None:
    spoil(prebuilt_dir)
    with caplog.at_level(logging.INFO, logger=sgmv_cpu.__name__):
        loaded = sgmv_cpu.loaded()
    assert why in caplog.text and "falling back to compiling it" in caplog.text
    assert loaded is not None and loaded.origin == "compiled" and loaded.variant == "native"
    assert not _compiled_nothing(prebuilt_dir)
    assert "compiled here (-march=native" in caplog.text
    _serves_like_the_oracle()


def test_a_corrupt_prebuilt_without_a_compiler_leaves_the_torch_path(
    prebuilt_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _corrupt(prebuilt_dir)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.delenv(dispatch.ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger=sgmv_cpu.__name__):
        assert sgmv_cpu.library() is None
    assert sgmv_cpu.loaded() is None
    assert "does not load" in caplog.text and "no C compiler" in caplog.text
    assert dispatch.backend(torch.zeros(1)) == "torch"
