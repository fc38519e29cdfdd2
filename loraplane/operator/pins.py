"""A ServingPool's pinned versions in its status, built purely from the control plane's view.

The control plane assigns each pin's k copies to the pool's live replicas and keeps what each
replica's pressure reports say became of its copies (`pin_states`: `resident`, `host`,
`loading`, `failed: <why>`, `refused: <why>`; docs/controlplane.md, "Pinned adapters"). The
pool timer reads them with the pool (`GET /internal/v1/pools/{pool}`, `pins`) and writes:
- `status.pins`: per pinned version its tenant, adapter, version, digest, the replicas it
  asks for (`replicas`, k), the live replicas it is assigned to (`assigned`), how many hold
  it (`held`) and have it on the device (`resident`), how many have not reported it yet
  (`pending`), and those that refused it or failed to load it (`refused`, `failed`), each
  with the replica's reason; at most `MAX_SHOWN` versions, those not held on all k first;
- the `PinsHeld` condition: True `Held` when every pin is held on all its k replicas, False
  `PinRefused` (a replica's engine would not keep one: the reason is its own), False
  `PinLoadFailed` (a replica could not load one), False `PinsPending` (copies not reported
  yet, or fewer live replicas than k); True `NoPins` once the last pin goes. A pool that never
  had a pin gets no condition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CONDITION = "PinsHeld"
MAX_SHOWN = 100  # versions listed in status.pins (the condition counts them all)
MAX_NAMED = 5  # versions a condition's message names
MAX_REPLICAS = 64  # copies of one pinned version, at most (the control plane's bound)
MAX_REASON = 1000  # characters of a replica's reason (as its pressure report bounds it)
MAX_NAME = 253
REFUSED, FAILED = "refused: ", "failed: "


@dataclass(frozen=True, slots=True)
class PinsVerdict:
    """The `PinsHeld` condition's value, reason and message."""

    held: bool
    reason: str
    message: str


def _int(value: Any) -> int:
    return max(0, value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _count(value: Any) -> int:
    return min(_int(value), MAX_REPLICAS)


def _str(value: Any, limit: int = MAX_NAME) -> str:
    return str(value if value is not None else "")[:limit]


def _by_state(placement: Sequence[Mapping[str, Any]], prefix: str) -> list[dict[str, str]]:
    """The replicas whose state starts with `prefix`, each with the rest of it (its reason)."""
    return [
        {"replica": _str(p.get("replica")), "reason": _str(state.removeprefix(prefix), MAX_REASON)}
        for p in placement
        if (state := str(p.get("state", ""))).startswith(prefix)
    ][:MAX_REPLICAS]


def pin_entry(pin: Mapping[str, Any]) -> dict[str, Any]:
    """One pin of the control plane's pool view (`PinPublic`) as `status.pins` shows it."""
    placement = [p for p in pin.get("placement") or [] if isinstance(p, Mapping)]
    return {
        "tenant": _str(pin.get("tenant")),
        "adapter": _str(pin.get("adapter")),
        "version": _int(pin.get("version")),
        "digest": _str(pin.get("digest"), 64),
        "replicas": _count(pin.get("replicas")),
        "held": _count(pin.get("held")),
        "resident": _count(pin.get("resident")),
        "refused": _by_state(placement, REFUSED),
        "failed": _by_state(placement, FAILED),
        # the live replicas it is assigned to (fewer than `replicas` when the pool has fewer),
        # and those of them whose reports do not say yet
        "assigned": min(len(placement), MAX_REPLICAS),
        "pending": min(sum(p.get("state") == "pending" for p in placement), MAX_REPLICAS),
    }


def pins_status(pins: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every pin as `status.pins` shows it (before the `MAX_SHOWN` cap): see `pin_entry`."""
    return [pin_entry(p) for p in pins if isinstance(p, Mapping)]


def shown(entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What `status.pins` lists: the versions not held on all their replicas first (each
    group in the catalog's order: oldest pin first), at most `MAX_SHOWN`."""
    short = [e for e in entries if e["held"] < e["replicas"]]
    full = [e for e in entries if e["held"] >= e["replicas"]]
    return (short + full)[:MAX_SHOWN]


def _name(e: Mapping[str, Any]) -> str:
    return f"{e['tenant']}/{e['adapter']} v{e['version']}"


def _held_of(e: Mapping[str, Any]) -> str:
    return f"held by {e['held']} of {e['replicas']}"


def _listed(parts: list[str]) -> str:
    more = len(parts) - MAX_NAMED
    return "; ".join(parts[:MAX_NAMED]) + (f"; and {more} more" if more > 0 else "")


def _why(e: Mapping[str, Any], key: str, verb: str) -> str:
    whys = ", ".join(f"{r['replica']}: {r['reason']}" for r in e[key])
    return f"{_name(e)} {_held_of(e)}; {verb} by {whys}"


def verdict(entries: Sequence[Mapping[str, Any]]) -> PinsVerdict:
    """The `PinsHeld` condition for the pool's pins (`pins_status`), the worst case first:
    a refusal, then a failed load, then copies not held yet."""
    if not entries:
        return PinsVerdict(True, "NoPins", "no version is pinned on this pool")
    refused = [_why(e, "refused", "refused") for e in entries if e["refused"]]
    if refused:
        return PinsVerdict(False, "PinRefused", _listed(refused))
    failed = [_why(e, "failed", "failed to load") for e in entries if e["failed"]]
    if failed:
        return PinsVerdict(False, "PinLoadFailed", _listed(failed))
    short = []
    for e in entries:
        if e["held"] >= e["replicas"]:
            continue
        why = []
        if e["pending"]:
            why.append(f"{e['pending']} assigned replicas have not reported it yet")
        missing = e["replicas"] - e["assigned"]
        if missing > 0:
            why.append(f"{missing} copies have no live replica (the pool has fewer than asked)")
        short.append(f"{_name(e)} {_held_of(e)}" + (f": {', '.join(why)}" if why else ""))
    if short:
        return PinsVerdict(False, "PinsPending", _listed(short))
    copies = sum(e["replicas"] for e in entries)
    return PinsVerdict(
        True, "Held", f"{len(entries)} pinned versions held on all their {copies} replicas"
    )
