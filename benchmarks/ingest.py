"""Ingest speed: validate + digest + store a rank-16 adapter shaped like a 7.8B Llama-family
model (32 layers x 7 modules, hidden 4096, KV out 1024, MLP 14336; 80 MiB in fp16) into a
LocalStore, against a plain durable copy (copy + fsync, as the store must) of the same bytes,
in the same run; the ratio to a page-cache-only copy (no fsync) is printed too.

Goal: ingest takes at most 2x the plain copy.
Run: .venv/bin/python benchmarks/ingest.py [--repeats N] [--smoke]
(--smoke: the same shape with 2 layers, 5 MiB, one repeat)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _common import add_smoke_flag, goal, median_seconds, report
from safetensors.numpy import save_file

from loraplane.adapters.base_model import SUPPORTED_MODULES, BaseModelSpec
from loraplane.adapters.ingest import ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store.local import LocalStore

RANK = 16
SMOKE_LAYERS = 2  # --smoke: the same adapter over 2 of the 32 layers (5 MiB instead of 80)


def base_config(layers: int = 32) -> dict[str, Any]:
    """config.json of the 7.8B Llama-family shape, with `layers` layers."""
    return {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": layers, "num_attention_heads": 32,
            "num_key_value_heads": 8}  # fmt: skip


def base_spec(smoke: bool = False) -> BaseModelSpec:
    """The base model the big adapter fits: all 32 layers, or SMOKE_LAYERS for --smoke."""
    if smoke:
        return BaseModelSpec.from_config(base_config(SMOKE_LAYERS), "llama-7.8b-shape-smoke")
    return BaseModelSpec.from_config(base_config(), "llama-7.8b-shape")


BASE = base_spec()


def build_adapter(out: Path, base: BaseModelSpec = BASE) -> Path:
    """A rank-16 fp16 adapter on every module of every layer of `base` (80 MiB for BASE)."""
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(base.num_layers):
        for module in SUPPORTED_MODULES:
            fan_in, fan_out = base.module_shape(module)
            stem = "base_model.model." + base.module_key(layer, module)
            a = rng.standard_normal((RANK, fan_in), dtype=np.float32) * 0.01
            b = rng.standard_normal((fan_out, RANK), dtype=np.float32) * 0.01
            tensors[f"{stem}.lora_A.weight"] = a.astype(np.float16)
            tensors[f"{stem}.lora_B.weight"] = b.astype(np.float16)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": "all-linear"}'
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    add_smoke_flag(parser)
    args = parser.parse_args()
    base = base_spec(args.smoke)
    repeats = 1 if args.smoke else args.repeats
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        root = Path(tmp)
        src = build_adapter(root / "src", base)
        size = (src / "adapter_model.safetensors").stat().st_size
        store = LocalStore(root / "store")
        copies = root / "copies"
        copies.mkdir()

        def plain_copy(i: int) -> None:
            dest = copies / f"{i}.safetensors"
            shutil.copyfile(src / "adapter_model.safetensors", dest)
            with open(dest, "rb") as f:
                os.fsync(f.fileno())

        def nosync_copy(i: int) -> None:
            shutil.copyfile(src / "adapter_model.safetensors", copies / f"n{i}.safetensors")

        def do_ingest(i: int) -> None:
            ingest(src, "bench", f"adapter-{i}", base, AdapterLimits(max_rank=64), store)

        def clean() -> None:
            # Each run starts from the same state: no growing page cache of earlier outputs.
            shutil.rmtree(copies)
            copies.mkdir()
            shutil.rmtree(root / "store" / "adapters", ignore_errors=True)
            os.sync()

        plain_copy(-1)  # warm the page cache for both
        # Interleaved, each after os.sync(), so no run pays for another's dirty pages.
        timed: dict[str, list[float]] = {"copy": [], "nosync": [], "ingest": []}
        for i in range(repeats):
            for key, fn in (("copy", plain_copy), ("nosync", nosync_copy), ("ingest", do_ingest)):
                clean()
                timed[key].append(median_seconds(lambda _, fn=fn, i=i: fn(i), 1))
        copy_s, nosync_s, ingest_s = (
            statistics.median(timed[k]) for k in ("copy", "nosync", "ingest")
        )
        mib = size / 2**20
        figures = {
            "adapter_mib": mib,
            "plain_copy_s": copy_s,
            "ingest_s": ingest_s,
            "plain_copy_mb_per_s": size / 1e6 / copy_s,
            "ingest_mb_per_s": size / 1e6 / ingest_s,
            "ingest_over_copy": ingest_s / copy_s,
            # A copy that is never fsynced only reaches the page cache; the store's contract
            # (objects survive a crash) needs the fsync, so the goal is set on the durable copy.
            "page_cache_copy_s": nosync_s,
            "ingest_over_page_cache_copy": ingest_s / nosync_s,
        }
    goals = [goal(figures, "ingest_over_copy", "<=", 2.0)]
    return report("ingest", figures, goals, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
