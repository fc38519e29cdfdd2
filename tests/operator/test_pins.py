"""A ServingPool's pinned versions in its status: `status.pins` and the `PinsHeld` condition,
from what the replicas' pressure reports say of each pin (`loraplane/operator/pins.py`).

End to end: the operator (Kopf) against the emulated API server, the control plane on
SQLite, a version ingested from a LoRAAdapter, pinned by the admin, two replicas reporting as
the data plane does (one holds the pin, one refuses it with its engine's reason)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import pytest

from loraplane.operator import crds
from loraplane.operator.pins import MAX_SHOWN, pins_status, shown, verdict
from tests.operator.conftest import (
    PLATFORM,
    SERVICE,
    TENANT,
    Cluster,
    ControlPlane,
    StartOperator,
    adapter_body,
    pool_body,
    upload_source,
)
from tests.operator.harness import wait_for
from tests.operator.test_adapters import good_adapter

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

DIGEST = "ab" * 32
REFUSAL = "pins may take at most 2 of this replica's 4 slots; 2 are pinned already"


def _pin(replicas: int, placement: list[tuple[str, str]], **extra: Any) -> dict[str, Any]:
    """A pin as the control plane's pool view shows it (`PinPublic`)."""
    states = [s for _, s in placement]
    return {
        "tenant": "team-a", "adapter": "bot", "version": 1, "digest": DIGEST,
        "replicas": replicas,
        "held": sum(s in ("resident", "host", "loading") for s in states),
        "resident": states.count("resident"),
        "placement": [{"replica": r, "state": s} for r, s in placement],
        **extra,
    }  # fmt: skip


# -- the pure part ----------------------------------------------------------------------------


def test_a_pin_held_on_all_its_replicas_makes_PinsHeld_true() -> None:
    entries = pins_status([_pin(2, [("r0", "resident"), ("r1", "host")])])
    assert entries[0]["held"] == 2 and entries[0]["resident"] == 1
    assert entries[0]["refused"] == [] and entries[0]["failed"] == []
    held = verdict(entries)
    assert (held.held, held.reason) == (True, "Held")
    assert held.message == "1 pinned versions held on all their 2 replicas"


def test_a_refused_pin_is_false_with_the_replica_and_its_own_reason() -> None:
    entries = pins_status([_pin(2, [("r0", "resident"), ("r1", "refused: " + REFUSAL)])])
    assert entries[0]["refused"] == [{"replica": "r1", "reason": REFUSAL}]
    held = verdict(entries)
    assert (held.held, held.reason) == (False, "PinRefused")
    assert held.message == f"team-a/bot v1 held by 1 of 2; refused by r1: {REFUSAL}"
    # a refusal outranks a failed load, which outranks copies not reported yet
    failed = pins_status([_pin(1, [("r0", "failed: the store answered 503")])])
    assert verdict(failed).reason == "PinLoadFailed"
    assert "failed to load by r0: the store answered 503" in verdict(failed).message
    assert verdict(entries + failed).reason == "PinRefused"


def test_copies_not_reported_or_without_a_live_replica_are_pending_with_the_counts() -> None:
    held = verdict(pins_status([_pin(3, [("r0", "resident"), ("r1", "pending")])]))
    assert (held.held, held.reason) == (False, "PinsPending")
    assert held.message == (
        "team-a/bot v1 held by 1 of 3: 1 assigned replicas have not reported it yet, 1 copies"
        " have no live replica (the pool has fewer than asked)"
    )
    # the negative control: the same pin held on all three is no longer pending
    full = pins_status([_pin(3, [("r0", "resident"), ("r1", "host"), ("r2", "loading")])])
    assert verdict(full).held
    assert (verdict([]).held, verdict([]).reason) == (True, "NoPins")


def test_status_lists_pins_not_held_first_within_the_cap_and_fits_the_crd() -> None:
    many = [_pin(1, [("r0", "resident")], version=v) for v in range(1, MAX_SHOWN + 5)]
    many.append(_pin(1, [("r0", "refused: " + "x" * 5000)], version=999))
    entries = pins_status(many)
    listed = shown(entries)
    assert len(listed) == MAX_SHOWN and listed[0]["version"] == 999
    assert len(listed[0]["refused"][0]["reason"]) == 1000  # bounded as the CRD bounds it
    status = {"pins": listed}
    jsonschema.Draft4Validator(crds.pool_schema()["properties"]["status"]).validate(status)


# -- end to end -------------------------------------------------------------------------------


def _report(controlplane: ControlPlane, replica: str, states: list[dict[str, str]]) -> None:
    """A pressure report of a replica of tiny-pool, with its pins' states."""
    body = {"namespace": PLATFORM, "pool": "tiny-pool", "replica": replica, "pin_states": states}
    r = httpx.post(f"{controlplane.url}/internal/v1/pressure", json=body,
                   headers={"Authorization": f"Bearer {SERVICE}"})  # fmt: skip
    assert r.status_code == 200, r.text


def _state(digest: str, state: str) -> list[dict[str, str]]:
    return [{"tenant": TENANT, "adapter": "bot", "digest": digest, "state": state}]


def _pins_held(cluster: Cluster, status: str, reason: str) -> dict[str, Any]:
    """Wait for the pool's PinsHeld condition to be (status, reason); the pool's status."""

    def probe() -> dict[str, Any] | None:
        found = cluster.get("servingpools", PLATFORM, "tiny-pool").get("status", {})
        conds = {c["type"]: c for c in found.get("conditions") or []}
        cond = conds.get("PinsHeld")
        return found if cond and (cond["status"], cond["reason"]) == (status, reason) else None

    result: dict[str, Any] = wait_for(probe, timeout=30, what=f"PinsHeld {status} {reason}")
    return result


def _declared(schema: dict[str, Any], value: Any, where: str = "status") -> None:
    """Every field of `value` is in `schema` (the API server would prune the others)."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key, item in value.items():
            assert key in props, f"{where}.{key} is not in the CRD"
            _declared(props[key], item, f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _declared(schema["items"], item, f"{where}[]")


@pytest.mark.k8s
def test_pool_status_shows_each_pin_held_refused_with_the_replica_s_reason_then_gone(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    s3: S3Client,
    s3_secret: str,
    base_model_dir: Path,
    tmp_path: Path,
) -> None:
    start_operator()
    cluster.create("servingpools", PLATFORM, pool_body("tiny-pool", base_model_dir))
    cluster.create(
        "loraadapters", TENANT, adapter_body("bot", upload_source(s3, good_adapter(tmp_path, 1)))
    )
    adapter = cluster.wait_phase("bot", "Ready", "Rejected", "Failed")
    assert adapter["status"]["phase"] == "Ready", adapter["status"]
    digest = adapter["status"]["digest"]
    # no pin yet: no condition, no list (a pool that never had a pin shows neither)
    status = cluster.get("servingpools", PLATFORM, "tiny-pool").get("status", {})
    assert "pins" not in status
    assert "PinsHeld" not in {c["type"] for c in status.get("conditions") or []}

    replicas = ["tiny-pool-a", "tiny-pool-b"]
    for replica in replicas:  # live replicas, so a pin of 2 fits
        _report(controlplane, replica, [])
    where = {"pool": "tiny-pool", "namespace": PLATFORM}
    pin = f"/v1/tenants/{TENANT}/adapters/bot/versions/1/pin"
    r = controlplane.admin.put(pin, json={**where, "replicas": 2})
    assert r.status_code == 200, r.text

    status = _pins_held(cluster, "False", "PinsPending")
    assert status["pins"][0]["replicas"] == 2 and status["pins"][0]["held"] == 0

    # one replica holds it on its device, the other's engine refuses it
    _report(controlplane, "tiny-pool-a", _state(digest, "resident"))
    _report(controlplane, "tiny-pool-b", _state(digest, "refused: " + REFUSAL))
    status = _pins_held(cluster, "False", "PinRefused")
    (entry,) = status["pins"]
    assert entry == {
        "tenant": TENANT, "adapter": "bot", "version": 1, "digest": digest, "replicas": 2,
        "held": 1, "resident": 1, "refused": [{"replica": "tiny-pool-b", "reason": REFUSAL}],
        "failed": [], "assigned": 2, "pending": 0,
    }  # fmt: skip
    cond = {c["type"]: c for c in status["conditions"]}["PinsHeld"]
    assert cond["message"] == f"{TENANT}/bot v1 held by 1 of 2; refused by tiny-pool-b: {REFUSAL}"
    schema = crds.pool_schema()["properties"]["status"]
    jsonschema.Draft4Validator(schema).validate(status)
    _declared(schema, {"pins": status["pins"], "conditions": status["conditions"]})
    wait_for(
        lambda: any(
            e["reason"] == "PinRefused" and e["type"] == "Warning" and REFUSAL in e["message"]
            for e in cluster.events(PLATFORM)
        ),
        what="the PinRefused event",
    )

    # the refusing replica makes room: the pin is held on both
    _report(controlplane, "tiny-pool-b", _state(digest, "host"))
    status = _pins_held(cluster, "True", "Held")
    assert status["pins"][0]["held"] == 2 and status["pins"][0]["refused"] == []

    # unpinned: the list empties and the condition says so
    r = controlplane.admin.delete(pin, params=where)
    assert r.status_code == 204, r.text
    status = _pins_held(cluster, "True", "NoPins")
    assert status["pins"] == []
