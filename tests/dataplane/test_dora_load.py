"""DoRA's norm off the engine thread, and kept per node (issue 33, point 1).

`LoRAPool.host_form` (the loader threads) gives each DoRA module its g = m / ||W + s B A||_row;
`LoRAPool.load` (the engine thread) then only places it: these tests make the norm's
functions raise once the host copy is made. The norm cache (lora/dora_cache.py) serves g
again to a later host copy of the same adapter over the same base weights, in memory or from
its folder after a restart, and computes it again from a file that is not exactly right.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.dataplane.lora import LoadedAdapter, LoRAPool, install_lora, load_lora
from loraplane.dataplane.lora import dora as dora_math
from loraplane.dataplane.lora.dora import DoRAWeights
from loraplane.dataplane.lora.dora_cache import NormCache
from loraplane.dataplane.models import load_model
from tests.dataplane.test_dora import spread_magnitudes


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(a tiny Llama, a DoRA adapter of it, a plain LoRA adapter of it)."""
    from tests.factories import build_model, build_peft_adapter

    root = tmp_path_factory.mktemp("dora-load")
    model_dir = build_model(root / "llama", "llama")
    dora = build_peft_adapter(model_dir, root / "dora", seed=5, r=8, lora_alpha=16,
                              use_dora=True)  # fmt: skip
    spread_magnitudes(dora, seed=6)
    plain = build_peft_adapter(model_dir, root / "plain", seed=9, r=8, lora_alpha=16)
    return model_dir, dora, plain


def pool_for(
    model_dir: Path, cache: NormCache | None = None, slots: int = 2, device: str = "cpu"
) -> LoRAPool:
    spec = BaseModelSpec.from_dir(model_dir)
    model = load_model(model_dir, torch.float32, torch.device(device))
    pool = LoRAPool(slots, spec, torch.float32, device, norm_cache=cache)
    install_lora(model, pool)
    return pool


def peft_g(pool: LoRAPool, adapter: LoadedAdapter, key: tuple[int, str]) -> torch.Tensor:
    """m / ||W + s B A||_row in fp64, W + s B A formed in full (PEFT's formula)."""
    w, table = adapter.modules[key], pool.module_slots(*key)
    weight = getattr(table.base, "weight")  # noqa: B009 - typed nn.Module | None
    assert w.magnitude is not None
    a, b, m = (t.to(weight.device, torch.float64) for t in (w.a, w.b, w.magnitude))
    full = weight.double() + w.scale * (b @ a)
    return (m / torch.linalg.norm(full, dim=1)).float()


def forbid_norms(monkeypatch: pytest.MonkeyPatch, row_norms: bool = False) -> None:
    """From now on, any computation of DoRA's norm fails the test (and of the base's row
    norms too, unless `row_norms`: a new process fingerprints its base weights once)."""

    def fail(*_: Any, **__: Any) -> Any:
        raise AssertionError("DoRA's norm computed")

    monkeypatch.setattr(dora_math, "dora_scale", fail)
    if not row_norms:
        monkeypatch.setattr(dora_math, "row_norms_sq", fail)


def check_g(pool: LoRAPool, slot: int, adapter: LoadedAdapter) -> None:
    for key, w in adapter.modules.items():
        g = pool.module_slots(*key).dora[slot]
        assert g is not None and w.magnitude is not None
        torch.testing.assert_close(g, peft_g(pool, adapter, key), atol=1e-6, rtol=1e-6)


def test_placing_a_host_copy_computes_no_norm_and_serves_pefts_g(
    base: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, dora_dir, plain_dir = base
    pool = pool_for(model_dir)
    spec = pool.spec
    raw = load_lora(dora_dir, spec)
    host = pool.host_form(raw)  # the loader thread's work: the norm runs here
    assert all(isinstance(w, DoRAWeights) for w in host.modules.values())
    forbid_norms(monkeypatch)
    assert pool.load(0, host)  # the engine thread's: no norm
    check_g(pool, 0, raw)
    table = pool.module_slots(0, "q_proj")
    host_g = host.modules[(0, "q_proj")]
    assert isinstance(host_g, DoRAWeights) and table.dora[0] is host_g.g  # read in place
    # a negative control: an adapter host_form did not make has its norm computed in load
    with pytest.raises(AssertionError, match="DoRA's norm computed"):
        pool.load(1, load_lora(dora_dir, spec))
    pool.free(1)
    assert pool.load(1, pool.host_form(load_lora(plain_dir, spec)))
    assert pool.module_slots(0, "q_proj").dora[1] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_g_is_made_on_the_device_kept_pinned_and_placed_in_one_copy(
    base: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, dora_dir, _ = base
    pool = pool_for(model_dir, device="cuda")
    raw = load_lora(dora_dir, pool.spec)
    host = pool.host_form(raw)
    gs = [w.g for w in host.modules.values() if isinstance(w, DoRAWeights)]
    assert len(gs) == len(raw.modules)
    assert all(g.device.type == "cpu" and g.is_pinned() for g in gs)
    forbid_norms(monkeypatch)
    assert pool.load(0, host)
    torch.cuda.synchronize()
    placed = [pool.module_slots(*key).dora[0] for key in raw.modules]
    assert all(g is not None and g.device.type == "cuda" for g in placed)
    assert len({g.untyped_storage().data_ptr() for g in placed if g is not None}) == 1
    check_g(pool, 0, raw)


def test_the_host_copy_and_the_slot_count_g_in_their_bytes(base: tuple[Path, Path, Path]) -> None:
    model_dir, dora_dir, _ = base
    pool = pool_for(model_dir)
    host = pool.host_form(load_lora(dora_dir, pool.spec))
    rows = sum(w.b.shape[0] for w in host.modules.values())
    factors = sum(w.a.numel() + w.b.numel() for w in host.modules.values())
    assert host.nbytes == 4 * (factors + rows + rows)  # A and B, m, g: all fp32
    assert pool.load(0, host)
    assert pool.slot_bytes(0) == pool.bytes_needed(host) == 4 * (factors + rows)


def test_a_reload_reads_g_from_the_memory_cache_without_computing_it(
    base: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, dora_dir, _ = base
    pool = pool_for(model_dir)
    first = pool.host_form(load_lora(dora_dir, pool.spec))
    assert (pool.norm_cache.hits, pool.norm_cache.misses) == (0, 1)
    forbid_norms(monkeypatch)  # the host copy evicted, then needed again
    again = pool.host_form(load_lora(dora_dir, pool.spec))
    assert pool.norm_cache.hits == 1
    for key, w in again.modules.items():
        assert isinstance(w, DoRAWeights)
        assert torch.equal(w.g, getattr(first.modules[key], "g"))  # noqa: B009


def test_a_restarted_pool_reads_g_from_the_cache_folder(
    base: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, dora_dir, _ = base
    pool = pool_for(model_dir, NormCache(tmp_path))
    pool.host_form(load_lora(dora_dir, pool.spec))
    (kept,) = tmp_path.glob("*.safetensors")
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary name, renamed
    forbid_norms(monkeypatch, row_norms=True)
    restarted = pool_for(model_dir, NormCache(tmp_path))  # a new process: nothing in memory
    raw = load_lora(dora_dir, restarted.spec)
    assert restarted.load(0, restarted.host_form(raw))
    assert restarted.norm_cache.hits == 1 and kept.exists()
    check_g(restarted, 0, raw)


@pytest.mark.parametrize("damage", ["shape", "nan", "dtype", "missing", "torn"])
def test_a_damaged_cache_file_is_never_served_g_is_computed_again(
    base: tuple[Path, Path, Path], tmp_path: Path, damage: str
) -> None:
    model_dir, dora_dir, _ = base
    pool = pool_for(model_dir, NormCache(tmp_path))
    pool.host_form(load_lora(dora_dir, pool.spec))
    (path,) = tmp_path.glob("*.safetensors")
    kept = load_file(path)
    name = sorted(kept)[0]
    if damage == "torn":
        path.write_bytes(path.read_bytes()[:-64])
    else:
        if damage == "shape":
            kept[name] = kept[name][:-1].clone()
        elif damage == "nan":
            kept[name][3] = float("nan")
        elif damage == "dtype":
            kept[name] = kept[name].double()
        else:
            del kept[name]
        save_file(kept, path)
    restarted = pool_for(model_dir, NormCache(tmp_path))
    raw = load_lora(dora_dir, restarted.spec)
    assert restarted.load(0, restarted.host_form(raw))
    cache = restarted.norm_cache
    assert (cache.rejected, cache.misses, cache.hits) == (1, 1, 0)
    check_g(restarted, 0, raw)
    again = NormCache(tmp_path).get(path.name.removesuffix(".safetensors"), _rows(raw))
    assert again is not None  # the file written again, whole
    torch.testing.assert_close(again[name], peft_g(restarted, raw, _key(name)), atol=1e-6,
                               rtol=1e-6)  # fmt: skip


def _key(name: str) -> tuple[int, str]:
    layer, module = name.split(".", 1)
    return int(layer), module


def _rows(adapter: LoadedAdapter) -> dict[str, int]:
    return {f"{layer}.{module}": int(w.b.shape[0]) for (layer, module), w in
            adapter.modules.items()}  # fmt: skip


def test_other_base_weights_are_another_key_their_own_g(
    base: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """The key holds the base weights' fingerprint: one weight changed, g is computed for
    it, not read from the first base's file."""
    model_dir, dora_dir, _ = base
    pool = pool_for(model_dir, NormCache(tmp_path))
    pool.host_form(load_lora(dora_dir, pool.spec))
    other = pool_for(model_dir, NormCache(tmp_path))
    weight = getattr(other.module_slots(1, "v_proj").base, "weight")  # noqa: B009
    with torch.no_grad():
        weight[5, 7] += 0.25  # one element, not a sampled one: the row norms see it
    raw = load_lora(dora_dir, other.spec)
    assert other.load(0, other.host_form(raw))
    assert (other.norm_cache.hits, other.norm_cache.misses) == (0, 1)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    check_g(other, 0, raw)


def test_a_g_not_finite_is_served_but_not_kept(tmp_path: Path) -> None:
    cache = NormCache(tmp_path)
    cache.put("k", {"0.q_proj": torch.tensor([1.0, float("inf")])})
    assert cache.get("k", {"0.q_proj": 2}) is None
    assert not list(tmp_path.iterdir())


def test_an_engine_over_a_remote_store_keeps_g_beside_its_disk_tier_across_a_restart(
    base: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored DoRA version served from S3 (moto) through the disk tier: its g lands in the
    tier's root (`NORM_FOLDER`); an engine started again over that root serves the same
    tokens and log-probs without computing DoRA's norm."""
    from loraplane.adapters.ingest import ingest
    from loraplane.adapters.limits import AdapterLimits
    from loraplane.adapters.store import S3Store
    from loraplane.dataplane.config import EngineConfig
    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.lora.dora_cache import NORM_FOLDER
    from loraplane.dataplane.sampling import SamplingParams
    from loraplane.dataplane.sequence import LoRARef
    from loraplane.dataplane.tiers.disk import DiskTier
    from tests import s3server

    model_dir, dora_dir, _ = base
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True)

    def serve(store: S3Store, version: Any) -> tuple[list[int], list[float]]:
        disk = DiskTier(store, tmp_path / "disk")
        config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                              num_kv_blocks=64, block_size=4, max_loras=1)  # fmt: skip
        engine = Engine(config, disk=disk)
        try:
            ref = engine.loras.register_stored(LoRARef("d", "acme", version.digest), version.path)
            (out,) = engine.generate([[5, 17, 33, 60]], params, [ref])
        finally:
            engine.close()
        assert out.error is None, out.error
        return out.token_ids, out.logprobs

    with s3server.moto_s3_server() as endpoint:
        client = s3server.s3_client(endpoint)
        client.create_bucket(Bucket="dora")
        store = S3Store("dora", "root", client=client)
        spec = BaseModelSpec.from_dir(model_dir)
        version = ingest(dora_dir, "acme", "d", spec, AdapterLimits(), store)
        first = serve(store, version)
        assert len(list((tmp_path / "disk" / NORM_FOLDER).glob("*.safetensors"))) == 1
        forbid_norms(monkeypatch, row_norms=True)  # the restart fingerprints W, no more
        assert serve(store, version) == first


def test_an_engine_step_that_fills_a_dora_slot_computes_no_norm(
    base: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registering reads the adapter and makes its host copy (the norm runs there); the
    engine's step that puts it in a slot, and those that serve it, compute no norm."""
    from loraplane.dataplane.config import EngineConfig
    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.sampling import SamplingParams

    model_dir, dora_dir, _ = base
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                          num_kv_blocks=64, block_size=4, max_loras=1)  # fmt: skip
    engine = Engine(config)
    try:
        ref = engine.register_lora("d", dora_dir, "t")
        assert engine.runner.pool.free_slots() == [0]  # not in a slot yet
        forbid_norms(monkeypatch)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        (out,) = engine.generate([[5, 17, 33, 60]], params, [ref])
    finally:
        engine.close()
    assert out.error is None and len(out.token_ids) == 3
    assert engine.runner.pool.module_slots(0, "q_proj").dora[0] is not None
