"""Kubernetes-shaped status conditions and the LoRAAdapter's status, built purely.

A condition keeps its `lastTransitionTime` while its status stays the same, as the Kubernetes
API conventions ask; only a change of status moves it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from loraplane.adapters.ingest import AdapterVersion

Condition = dict[str, Any]

VALIDATED, STORED, READY = "Validated", "Stored", "Ready"
ADAPTER_CONDITIONS = (VALIDATED, STORED, READY)


def now_iso(now: datetime | None = None) -> str:
    """A timestamp as Kubernetes writes them: UTC, seconds, 'Z'."""
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: str,
) -> list[Condition]:
    """`conditions` with `type_` set; other conditions are kept in order."""
    value = "Unknown" if status is None else "True" if status else "False"
    out: list[Condition] = []
    found = False
    for cond in conditions:
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        same = cond.get("status") == value
        out.append(_condition(type_, value, reason, message, generation, cond, now, same))
    if not found:
        out.append(_condition(type_, value, reason, message, generation, {}, now, False))
    return out


def _condition(
    type_: str,
    value: str,
    reason: str,
    message: str,
    generation: int | None,
    old: Mapping[str, Any],
    now: str,
    keep_time: bool,
) -> Condition:
    cond: Condition = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message[:4096],
        "lastTransitionTime": old.get("lastTransitionTime", now) if keep_time else now,
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


@dataclass(frozen=True, slots=True)
class Verdict:
    """Where an adapter stands: phase, reason, message, and each condition's value."""

    phase: str
    reason: str
    message: str
    validated: bool | None
    stored: bool | None

    @property
    def ready(self) -> bool:
        """Only a stored and recorded adapter is Ready."""
        return self.phase == "Ready"


def adapter_status(
    old: Mapping[str, Any],
    verdict: Verdict,
    *,
    generation: int | None,
    served_name: str | None = None,
    version: AdapterVersion | None = None,
    now: str | None = None,
) -> dict[str, Any]:
    """The status to write (a merge patch) for `verdict`.

    The stored-version fields describe the last version stored for this resource; they are
    kept while a later change is being processed or refused, and replaced by a new version.
    """
    stamp = now or now_iso()
    conds: Sequence[Mapping[str, Any]] = old.get("conditions") or []
    reasons = {
        VALIDATED: "Valid" if verdict.validated else verdict.reason,
        STORED: "Stored" if verdict.stored else verdict.reason,
        READY: "Ready" if verdict.ready else verdict.reason,
    }
    values = {VALIDATED: verdict.validated, STORED: verdict.stored, READY: verdict.ready}
    for type_ in ADAPTER_CONDITIONS:
        message = "" if values[type_] else verdict.message
        conds = set_condition(
            conds, type_, values[type_], reasons[type_], message, generation=generation, now=stamp
        )
    status: dict[str, Any] = {
        "phase": verdict.phase,
        "reason": verdict.reason,
        "message": verdict.message[:4096],
        "conditions": conds,
    }
    if generation is not None:
        status["observedGeneration"] = generation
    if served_name is not None:
        status["servedName"] = served_name
    if version is not None:
        status.update(
            version=version.version,
            digest=version.digest,
            storedPath=version.path,
            rank=version.rank,
            alpha=version.alpha,
            targetModules=list(version.target_modules),
            sizeBytes=version.size_bytes,
        )
    return status


def same_status(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether writing `new` would change nothing that matters in `old`."""
    return all(old.get(k) == v for k, v in new.items())
