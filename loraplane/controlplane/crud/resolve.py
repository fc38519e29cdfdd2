"""Resolution, the data plane's hot path: (tenant key, model name[@version]) -> what to load.

One indexed query finds the key by its prefix, its tenant, and the adapter joined to the
version it serves; only when no adapter matches, a second looks for the base model.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from loraplane.controlplane import security
from loraplane.controlplane.crud.keys import verify
from loraplane.controlplane.errors import NotFound
from loraplane.controlplane.models import Adapter, AdapterVersion, ApiKey, Pool, Tenant


@dataclass(frozen=True, slots=True)
class Resolution:
    """An adapter version (adapter set) or the base model (adapter None) for a tenant."""

    tenant: Tenant
    base_model: str
    adapter: str | None = None
    version: AdapterVersion | None = None


def split_model(model: str) -> tuple[str, int | None]:
    """`name@7` -> ("name", 7); `name` -> ("name", None); NotFound for a bad pin."""
    name, sep, pin = model.rpartition("@")
    if not sep:
        return model, None
    if not pin.isdigit() or len(pin) > 9 or int(pin) < 1:
        raise NotFound(f"model {model!r} not found: a version pin is name@<positive integer>")
    return name, int(pin)


def resolve(session: Session, *, secret: str, model: str) -> Resolution:
    """What `model` means for the tenant whose key is `secret`.

    Unauthorized for a bad key; NotFound when the tenant has no such adapter (or version)
    and no pool serves a base model of that name.
    """
    name, pin = split_model(model)
    prefix = security.key_prefix(secret) or ""
    wanted = AdapterVersion.version == (pin if pin is not None else Adapter.current_version)
    row = session.execute(
        select(ApiKey, Adapter.name, AdapterVersion)
        .outerjoin(
            Adapter,
            and_(
                Adapter.tenant_id == ApiKey.tenant_id,
                Adapter.name == name,
                Adapter.deleted.is_(False),
            ),
        )
        .outerjoin(AdapterVersion, and_(AdapterVersion.adapter_id == Adapter.id, wanted))
        .where(ApiKey.prefix == prefix)
    ).first()
    key = verify(session, key=row[0] if row else None, secret=secret)
    tenant = key.tenant
    if row is not None and row[2] is not None:
        version: AdapterVersion = row[2]
        return Resolution(tenant, version.base_model, adapter=row[1], version=version)
    if pin is None:
        base = session.scalar(
            select(Pool.base_model_name).where(Pool.base_model_name == name).limit(1)
        )
        if base is not None:
            return Resolution(tenant, base)
    raise NotFound(f"model {model!r} not found")
