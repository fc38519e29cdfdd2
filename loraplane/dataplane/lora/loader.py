"""Read a PEFT LoRA adapter into host torch tensors, through the shared validating reader.

Adapter files come from tenants: they are opened and checked by `loraplane.adapters` (the same
code the control plane and operator run), never by a trusting loader. The scales honour
lora_alpha, use_rslora, rank_pattern and alpha_pattern as validation computed them.

An adapter of the other layout than its base's (split q/k/v and gate/up on Phi-3's fused
`qkv_proj` / `gate_up_proj`, or the fused names on a split base) is converted to the base's
layout as it is loaded (`conversions.base_layout`), so the pool, the LoRA layers and the
kernels only ever see the base's own modules. A stored version is read in one pass
(`stored.py`). The host form's types are in `weights.py`.

A DoRA adapter's modules carry their magnitude vectors (`LoRAWeights.magnitude`, [out]) as
stored; the pool turns each into the per-row scale it serves with when it places the adapter
(`lora/dora.py`). Validation refused DoRA on modules a conversion would build.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.canonical import canonical_digest
from loraplane.adapters.errors import IntegrityError
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.safetensors_io import SafetensorsFile
from loraplane.adapters.source import open_adapter_source
from loraplane.adapters.validate import validate_adapter
from loraplane.dataplane.lora.conversions import base_layout, per_expert_modules
from loraplane.dataplane.lora.stored import layout_key, load_known, read_stored, remember_layout
from loraplane.dataplane.lora.weights import LoadedAdapter, LoRAWeights

__all__ = ["LoRAWeights", "LoadedAdapter", "base_layout", "load_lora", "per_expert_modules"]


def _to_torch(weights: SafetensorsFile, name: str) -> torch.Tensor:
    """Copy one tensor out of the memory map (BF16 arrives as uint16 bit patterns)."""
    view: np.ndarray[Any, Any] = weights.array(name)
    copy = np.array(view, copy=True)
    if weights.tensors[name].dtype == "BF16":
        return torch.from_numpy(copy.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(copy)


def load_lora(
    path: Path | str,
    base: BaseModelSpec,
    limits: AdapterLimits | None = None,
    expected_digest: str | None = None,
) -> LoadedAdapter:
    """Validate and read the adapter at `path` (see `_load_lora`), in the base's layout
    (`base_layout`); on a mixture-of-experts base, packed experts' factors are split per
    expert (`lora/experts.py`)."""
    loaded = base_layout(_load_lora(path, base, limits, expected_digest), base)
    if not base.num_experts:
        return loaded
    return per_expert_modules(loaded, base)


def _load_lora(
    path: Path | str,
    base: BaseModelSpec,
    limits: AdapterLimits | None = None,
    expected_digest: str | None = None,
) -> LoadedAdapter:
    """Validate the adapter at `path` (folder or archive) against `base`; copy its weights.

    Raises `AdapterRejected` with the reason code when any check fails. With
    `expected_digest` (a stored version: validated in full when it was ingested) the NaN/Inf
    scan is skipped and the digest must match, else IntegrityError: a canonical weights file
    (every stored one) is read in one pass into one buffer, hashed as it arrives, and the
    tensors are views of that buffer; another file is copied out of its memory map while a
    second thread hashes it. The weights file is closed before returning.

    A stored version's validation is remembered by the exact bytes it read (config, weights
    header, file size) with the base model and limits: a later version with the same bytes
    there (adapters trained by one recipe differ only in their tensors' values) is read and
    digest-checked without validating again. Its digest covers every byte of both files, so
    nothing unchecked gets through; a cold load of such a version costs a read and a hash.
    """
    limits = limits or AdapterLimits()
    source = str(path)
    with open_adapter_source(path, limits) as files:
        if expected_digest is not None:
            known = load_known(files, base, limits, expected_digest, source)
            if known is not None:
                return known
        adapter = validate_adapter(files, base, limits, scan_weights=expected_digest is None)
        if expected_digest is not None:
            try:
                stored = read_stored(adapter, source)
            except BaseException:
                adapter.close()
                raise
            if stored is not None:
                adapter.close()
                loaded, layout, header = stored
                if loaded.digest != expected_digest:
                    raise IntegrityError(source, expected_digest, loaded.digest)
                key = layout_key(adapter.config_bytes, header, adapter.weights.size, base, limits)
                remember_layout(key, layout)
                return loaded
        adapter.weights.will_need()
        digest: list[str] = []
        hasher = threading.Thread(target=lambda: digest.append(canonical_digest(adapter)))
        hasher.start()
        try:
            modules = {
                (m.layer, m.module): LoRAWeights(
                    a=_to_torch(adapter.weights, m.a_name),
                    b=_to_torch(adapter.weights, m.b_name),
                    scale=m.scale,
                    magnitude=_to_torch(adapter.weights, m.m_name) if m.m_name else None,
                )
                for m in adapter.modules
            }
        finally:
            hasher.join()
            adapter.close()
    if not digest:  # pragma: no cover - canonical_digest only fails on I/O errors
        raise IntegrityError(str(path), expected_digest or "", "")
    if expected_digest is not None and digest[0] != expected_digest:
        raise IntegrityError(str(path), expected_digest, digest[0])
    return LoadedAdapter(source=str(path), modules=modules, digest=digest[0])
