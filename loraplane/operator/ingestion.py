"""The adapter pipeline the operator runs off the event loop: fetch -> validate -> store.

Blocking, and idempotent by content: the shared `ingest` returns the existing version for
bytes already stored, and finishes a version a crash left half-written.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.ingest import AdapterVersion, ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.operator.context import OperatorContext
from loraplane.operator.sources import fetch_source
from loraplane.operator.specs import PoolSpec, SpecError


def pool_limits(settings_max_bytes: int, pools: Iterable[PoolSpec]) -> AdapterLimits:
    """An adapter must fit every pool serving its base model: the lowest maxLoraRank."""
    ranks = [p.max_lora_rank for p in pools]
    return AdapterLimits(max_archive_bytes=settings_max_bytes).tightened(
        max_rank=min(ranks) if ranks else None
    )


def parse_pools(entries: Iterable[Mapping[str, Any]]) -> list[PoolSpec]:
    """The index's pool specs that parse (a broken pool is the pool's problem)."""
    out = []
    for entry in entries:
        try:
            out.append(PoolSpec.parse(entry))
        except SpecError:
            continue
    return out


def fetch_and_ingest(
    ctx: OperatorContext,
    *,
    uri: str,
    secret: Mapping[str, str] | None,
    tenant: str,
    name: str,
    base: BaseModelSpec,
    limits: AdapterLimits,
) -> AdapterVersion:
    """Fetch the source into a private temp folder and ingest it into the store."""
    work = Path(tempfile.mkdtemp(prefix="loraplane-operator-"))
    try:
        source = fetch_source(
            uri,
            work,
            policy=ctx.source_policy,
            store=ctx.store,
            secret=secret,
            transport=ctx.http_transport,
        )
        return ingest(source, tenant, name, base, limits, ctx.store, created_by="operator")
    finally:
        shutil.rmtree(work, ignore_errors=True)
