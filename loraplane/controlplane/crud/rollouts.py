"""Weighted rollouts: an adapter's unpinned traffic split across versions by weight.

A rollout is `{version: weight}` on the adapter row (`Adapter.rollout`, versions as text keys
in JSON). `current_version` is the version a rollback returns to and what a data plane that
knows nothing of splits keeps serving: when a split starts it becomes the split's heaviest
version (of a tie, the one serving, else the older), so a canary pushed while the adapter
followed its latest (the GitOps way: new source and split in one change) is not taken for the
stable version; while the split runs it stays, unless a change takes its weight to 0. Setting
a split holds the adapter (`follow_latest` false), as serving a chosen version does, so a push
during a rollout never moves it. Promotion makes one version of the split current and ends
the split; rollback ends it with `current_version` unchanged. `name@version` requests bypass
the split (the resolve route answers a pin alone). Every change is audited.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplane.controlplane.crud import audit
from loraplane.controlplane.crud.adapters import get_adapter, version_ranges
from loraplane.controlplane.errors import Conflict, InvalidRequest, NotFound
from loraplane.controlplane.models import Adapter, AdapterVersion, Tenant

MAX_VERSIONS = 4  # versions in one split: a canary, or a few candidates, not a fleet
TOTAL = 100  # the weights are percentages


def parse(rollout: Mapping[str, int] | None) -> dict[int, int]:
    """A stored split as {version: weight}, versions ascending ({} for none)."""
    return {int(v): int(w) for v, w in sorted((rollout or {}).items(), key=lambda i: int(i[0]))}


def check_weights(weights: Mapping[int, int]) -> None:
    """InvalidRequest, saying what is wrong, unless `weights` is a split we serve: 1 to
    MAX_VERSIONS versions, integer weights from 0 to 100 summing to 100."""
    if not weights:
        raise InvalidRequest("a rollout names at least one version")
    if len(weights) > MAX_VERSIONS:
        raise InvalidRequest(
            f"a rollout splits traffic across at most {MAX_VERSIONS} versions; "
            f"this one names {len(weights)}"
        )
    bad = sorted(v for v, w in weights.items() if not 0 <= w <= TOTAL)
    if bad:
        raise InvalidRequest(f"a version's weight is an integer from 0 to {TOTAL} (v{bad[0]})")
    total = sum(weights.values())
    if total != TOTAL:
        shown = ", ".join(f"v{v}: {w}" for v, w in sorted(weights.items()))
        raise InvalidRequest(f"a rollout's weights sum to {TOTAL}; these ({shown}) sum to {total}")


def _recorded(session: Session, adapter: Adapter) -> list[int]:
    return list(
        session.scalars(
            select(AdapterVersion.version)
            .where(AdapterVersion.adapter_id == adapter.id)
            .order_by(AdapterVersion.version)
        )
    )


def _target(tenant: Tenant, name: str) -> str:
    return f"tenants/{tenant.name}/adapters/{name}"


def set_rollout(
    session: Session, *, tenant: Tenant, name: str, weights: Mapping[int, int], actor: str
) -> Adapter:
    """Split the plain name's traffic by `weights` (checked with `check_weights`; NotFound,
    naming the versions there are, for one never recorded). One version at 100 is a
    promotion of that version."""
    check_weights(weights)
    adapter = get_adapter(session, tenant=tenant, name=name)
    recorded = _recorded(session, adapter)
    missing = sorted(set(weights) - set(recorded))
    if missing:
        raise NotFound(
            f"adapter {name!r} has no version {missing[0]}; its versions: "
            f"{version_ranges(recorded)}"
        )
    live = {v: w for v, w in weights.items() if w > 0}
    if len(live) == 1:
        return _promote(session, adapter, tenant, next(iter(live)), actor, via="rollout")
    before = parse(adapter.rollout)
    previous = adapter.current_version
    if not before or adapter.current_version not in live:
        # the rollback target: what the split mostly serves as it starts (of a tie, the
        # version serving now, else the older)
        adapter.current_version = max(live, key=lambda v: (live[v], v == previous, -v))
    adapter.rollout = {str(v): int(w) for v, w in sorted(weights.items())}
    adapter.follow_latest = False
    audit.record(
        session,
        actor=actor,
        action="adapter.rollout.set",
        target=_target(tenant, name),
        detail={
            "from": _shown(before),
            "to": adapter.rollout,
            "current_version": adapter.current_version,
            **({"current_before": previous} if previous != adapter.current_version else {}),
        },
    )
    session.commit()
    return adapter


def promote(
    session: Session, *, tenant: Tenant, name: str, version: int | None, actor: str
) -> Adapter:
    """Make `version` (by default the split's one version other than the current) current
    and end the split. Conflict when no split runs, or when the default is ambiguous;
    NotFound for a version outside the split."""
    adapter = get_adapter(session, tenant=tenant, name=name)
    split = parse(adapter.rollout)
    if not split:
        raise Conflict(f"adapter {name!r} has no rollout to promote; set one first")
    if version is None:
        candidates = [v for v, w in split.items() if v != adapter.current_version and w > 0]
        if len(candidates) != 1:
            raise Conflict(
                f"adapter {name!r}'s rollout has {len(candidates)} versions besides the "
                f"current one (v{adapter.current_version}): name the version to promote"
            )
        version = candidates[0]
    elif version not in split:
        raise NotFound(
            f"version {version} is not in adapter {name!r}'s rollout "
            f"({version_ranges(sorted(split))})"
        )
    return _promote(session, adapter, tenant, version, actor, via="promote")


def _promote(
    session: Session, adapter: Adapter, tenant: Tenant, version: int, actor: str, *, via: str
) -> Adapter:
    before = (adapter.current_version, parse(adapter.rollout))
    adapter.current_version = version
    adapter.follow_latest = False
    adapter.rollout = None
    audit.record(
        session,
        actor=actor,
        action="adapter.rollout.promote",
        target=_target(tenant, adapter.name),
        detail={"from": before[0], "to": version, "rollout": _shown(before[1]), "via": via},
    )
    session.commit()
    return adapter


def rollback(session: Session, *, tenant: Tenant, name: str, actor: str) -> Adapter:
    """End the split: the plain name serves `current_version` alone again. Conflict when no
    split runs."""
    adapter = get_adapter(session, tenant=tenant, name=name)
    split = parse(adapter.rollout)
    if not split:
        raise Conflict(f"adapter {name!r} has no rollout to roll back")
    adapter.rollout = None
    audit.record(
        session,
        actor=actor,
        action="adapter.rollout.rollback",
        target=_target(tenant, name),
        detail={"rollout": _shown(split), "to": adapter.current_version},
    )
    session.commit()
    return adapter


def _shown(split: Mapping[int, int]) -> dict[str, int] | None:
    return {str(v): w for v, w in split.items()} or None
