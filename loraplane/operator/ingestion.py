"""The adapter pipeline the operator runs off the event loop: the pools' limits and base model,
then fetch -> validate -> store.

Blocking, and idempotent by content: the shared `ingest` returns the existing version for
bytes already stored, and finishes a version a crash left half-written.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplane.adapters import signing
from loraplane.adapters.base_model import BaseModelSpec
from loraplane.adapters.ingest import AdapterVersion, ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.operator.basemodels import BaseModelPending, spec_of
from loraplane.operator.context import OperatorContext
from loraplane.operator.sources import fetch_source
from loraplane.operator.specs import PoolSpec, SpecError


@dataclass(frozen=True, slots=True)
class IndexedPool:
    """A ServingPool serving the adapter's base model: where it is and its spec."""

    namespace: str
    name: str
    spec: PoolSpec


def pool_limits(settings_max_bytes: int, pools: Iterable[IndexedPool]) -> AdapterLimits:
    """An adapter must fit every pool serving its base model: the lowest maxLoraRank, named
    in a refusal with its ServingPool ("the ServingPool ns/name's maxLoraRank 16")."""
    limits = AdapterLimits(max_archive_bytes=settings_max_bytes)
    strictest = min(pools, key=lambda p: p.spec.max_lora_rank, default=None)
    if strictest is None:
        return limits
    rank = strictest.spec.max_lora_rank
    named = f"the ServingPool {strictest.namespace}/{strictest.name}'s maxLoraRank {rank}"
    return limits.tightened(max_rank=rank, rank_limit=named)


def parse_pools(entries: Iterable[Mapping[str, Any]]) -> list[IndexedPool]:
    """The pool index's entries (`{"namespace", "name", "spec"}`) whose spec parses (a broken
    pool is the pool's problem)."""
    out = []
    for entry in entries:
        try:
            spec = PoolSpec.parse(entry["spec"])
        except SpecError:
            continue
        out.append(IndexedPool(str(entry["namespace"]), str(entry["name"]), spec))
    return out


def base_model_of(ctx: OperatorContext, pools: Sequence[IndexedPool], name: str) -> BaseModelSpec:
    """The base model's shapes (blocking): from the uri of a pool that can be read here, else
    from the config.json a volume pool's replicas reported to the catalog.

    BaseModelUnavailable when the config cannot be used, BaseModelPending while no volume
    pool has its config yet, CatalogError when the catalog cannot be asked.
    """
    readable = [p for p in pools if not p.spec.model_on_volume]
    if readable:
        return ctx.base_models.get(readable[0].spec.base_model_uri, name)
    for pool in pools:
        found = ctx.catalog.get_pool(pool.namespace, pool.name) or {}
        if found.get("base_model_config"):
            source = f"the config ServingPool {pool.namespace}/{pool.name} reported"
            return spec_of(found["base_model_config"], name, source)
    refs = ", ".join(f"{p.namespace}/{p.name}" for p in pools)
    raise BaseModelPending(
        f"no replica of ServingPool {refs} has reported base model {name!r} yet; waiting"
    )


def fetch_and_ingest(
    ctx: OperatorContext,
    *,
    uri: str,
    secret: Mapping[str, str] | None,
    tenant: str,
    name: str,
    base: BaseModelSpec,
    limits: AdapterLimits,
    check_digest: Callable[[str], None] | None = None,
) -> AdapterVersion:
    """Fetch the source into a private temp folder and ingest it into the store
    (`check_digest`: the signature check, run before anything is stored)."""
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
        return ingest(
            source, tenant, name, base, limits, ctx.store, created_by="operator",
            check_digest=check_digest,
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def signature_check(
    policy: Mapping[str, Any], signature: str | None, key_id: str | None
) -> Callable[[str], None]:
    """The check of a LoRAAdapter's `spec.source.signature` against the catalog's policy and
    the tenant's keys (`CatalogClient.signing_policy`): raises AdapterRejected
    SignatureRequired / SignatureInvalid, by the rule the control plane applies."""
    keys = [
        signing.SigningKey(str(k["key_id"]), str(k["public_key"]), bool(k["revoked"]))
        for k in policy.get("keys", [])
    ]

    def check(digest: str) -> None:
        signing.verify(
            digest,
            signature,
            key_id,
            keys,
            required=bool(policy.get("required")),
            policy=str(policy.get("reason") or "signatures are required"),
        )

    return check
