"""`loraplane demo`: what is built so far, run for real on this machine.

Today that is the adapter core: a small Llama model and three tenants' adapters are built
locally, validated against the model, stored immutably (content-addressed, versioned) in a
local object store, re-uploaded (same version), changed (next version), and two bad adapters
are rejected with their reason codes. Serving joins when the engine and server land.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.errors import AdapterRejected
from loraplane.adapters.ingest import AdapterVersion, ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store.local import LocalStore
from loraplane.demo.build import build_adapter, build_llama

TENANTS = {"acme": 8, "globex": 16, "initech": 32}  # tenant -> adapter rank
POOL_LIMITS = AdapterLimits(max_rank=64)


def _say(message: str) -> None:
    print(message, flush=True)


def _show(v: AdapterVersion) -> None:
    state = "new version" if v.created else "existing version (identical content)"
    _say(f"    {v.tenant}/{v.name} v{v.version}: {state}")
    _say(
        f"      rank {v.rank}, alpha {v.alpha:g}, {v.size_bytes / 1024:.0f} KiB, "
        f"digest {v.digest[:16]}..."
    )
    _say(f"      stored at {v.path}")


def run_demo(workdir: Path, once: bool = False) -> int:
    """Run the tour; return the process exit code."""
    start = time.perf_counter()
    model_dir = workdir / "model"
    if not (model_dir / "config.json").exists():
        _say(f"[1/5] building a small Llama model in {model_dir} ...")
        build_llama(model_dir, hidden_size=128, intermediate_size=256, num_hidden_layers=4)
    else:
        _say(f"[1/5] using the model built earlier in {model_dir}")
    base = BaseModelSpec.from_dir(model_dir, name="demo-llama")
    store = LocalStore(workdir / "store")

    _say(f"[2/5] validating and storing three tenants' adapters in {store.url()}")
    for i, (tenant, rank) in enumerate(TENANTS.items()):
        src = build_adapter(
            model_dir, workdir / "uploads" / tenant, r=rank, lora_alpha=2 * rank, seed=i
        )
        _show(ingest(src, tenant, "support-bot", base, POOL_LIMITS, store))

    _say("[3/5] re-uploading acme's adapter unchanged, then changed")
    _show(ingest(workdir / "uploads" / "acme", "acme", "support-bot", base, POOL_LIMITS, store))
    changed = build_adapter(model_dir, workdir / "uploads" / "acme-v2", r=8, lora_alpha=16, seed=99)
    _show(ingest(changed, "acme", "support-bot", base, POOL_LIMITS, store))

    _say("[4/5] uploading bad adapters: each is rejected with its reason, nothing is stored")
    too_big = build_adapter(model_dir, workdir / "uploads" / "rank128", r=128, lora_alpha=16)
    pickled = workdir / "uploads" / "pickled"
    pickled.mkdir(parents=True, exist_ok=True)
    (pickled / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04 not unpickled, never opened")
    for what, src in (("rank 128 (pool max 64)", too_big), ("pickle weights", pickled)):
        try:
            ingest(src, "acme", "bad", base, POOL_LIMITS, store)
            _say(f"    {what}: unexpectedly accepted")
            return 1
        except AdapterRejected as e:
            _say(f"    {what}: rejected: {e.code.value}: {e.message}")

    _serve_mixed_batch(model_dir, store, base)
    _say(f"done in {time.perf_counter() - start:.1f} s.")
    _say(
        "Still to come (see the project's issues): the control plane and the OpenAI-compatible "
        "server in this demo, the operator, the Helm chart."
    )
    if not once:
        _say("The demo does not serve over HTTP yet, so it exits here.")
    return 0


def _serve_mixed_batch(model_dir: Path, store: LocalStore, base: BaseModelSpec) -> None:
    """One continuous batch on CPU: the base model and every tenant's stored adapter."""
    from loraplane.adapters.ingest import list_versions
    from loraplane.dataplane.config import EngineConfig
    from loraplane.dataplane.engine import Engine
    from loraplane.dataplane.sampling import SamplingParams
    from loraplane.dataplane.sequence import LoRARef
    from loraplane.dataplane.tiers.disk import DiskTier

    _say("[5/5] serving one mixed batch: the base model and each tenant's adapter, from the store")
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_loras=4,
                          num_kv_blocks=256, served_model_name=base.name)  # fmt: skip
    engine = Engine(config, disk=DiskTier(store))
    refs: list[LoRARef | None] = [None]
    for tenant in TENANTS:
        newest = list_versions(store, tenant, "support-bot")[-1]
        ref = LoRARef("support-bot", tenant, newest.digest)
        refs.append(engine.loras.register_stored(ref, newest.path))
    prompt = "Many tenants share one base model"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = engine.generate([prompt] * len(refs), params, refs)
    for used, out in zip(refs, outs, strict=True):
        who = "base model" if used is None else f"{used.tenant}/{used.name}"
        _say(f"    {who:<22} -> token ids {out.token_ids[:8]}...")
    distinct = len({tuple(o.token_ids) for o in outs})
    _say(f"    {len(outs)} requests in one batch, {distinct} distinct outputs "
         "(the model is random: the point is that each adapter changes it)")  # fmt: skip
    engine.loras.close()
