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
        _say(f"[1/4] building a small Llama model in {model_dir} ...")
        build_llama(model_dir, hidden_size=128, intermediate_size=256, num_hidden_layers=4)
    else:
        _say(f"[1/4] using the model built earlier in {model_dir}")
    base = BaseModelSpec.from_dir(model_dir, name="demo-llama")
    store = LocalStore(workdir / "store")

    _say(f"[2/4] validating and storing three tenants' adapters in {store.url()}")
    for i, (tenant, rank) in enumerate(TENANTS.items()):
        src = build_adapter(
            model_dir, workdir / "uploads" / tenant, r=rank, lora_alpha=2 * rank, seed=i
        )
        _show(ingest(src, tenant, "support-bot", base, POOL_LIMITS, store))

    _say("[3/4] re-uploading acme's adapter unchanged, then changed")
    _show(ingest(workdir / "uploads" / "acme", "acme", "support-bot", base, POOL_LIMITS, store))
    changed = build_adapter(model_dir, workdir / "uploads" / "acme-v2", r=8, lora_alpha=16, seed=99)
    _show(ingest(changed, "acme", "support-bot", base, POOL_LIMITS, store))

    _say("[4/4] uploading bad adapters: each is rejected with its reason, nothing is stored")
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

    _say(f"done in {time.perf_counter() - start:.1f} s.")
    _say(
        "Still to come (see the project's issues): the engine and the OpenAI-compatible server "
        "(serving these adapters), the control plane REST API, the operator."
    )
    if not once:
        _say("Nothing is served yet, so the demo exits here.")
    return 0
