"""Pinned adapter versions: REST pin and unpin, the tenant quota, the pool's fit, audit, and
the assignment of each pin's copies to replicas in the pressure answers."""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

from loraplane.controlplane.crud.audit import list_events
from loraplane.controlplane.crud.pins import assign
from tests.controlplane.conftest import ADMIN_H, SERVICE_H, Api, bearer

PIN = "/v1/adapters/bot/versions/{v}/pin"


def report(api: Api, replica: str, capacity: int = 0) -> dict[str, Any]:
    """A pressure report from `replica` of pool-a; the answer."""
    body = {"pool": "pool-a", "replica": replica, "gpu_bytes_capacity": capacity}
    r = api.client.post("/internal/v1/pressure", json=body, headers=SERVICE_H)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def pinned_on(api: Api, replicas: list[str], capacity: int = 0) -> dict[str, list[int]]:
    """Replica -> the versions of bot its pressure answer says to keep."""
    return {r: [p["version"] for p in report(api, r, capacity)["pins"]] for r in replicas}


def setup(api: Api, quota: int, versions: int = 2) -> tuple[str, list[dict[str, Any]]]:
    key = api.tenant("acme", max_pinned_bytes=quota)
    api.pool(max_loras=8)
    uploaded = [api.upload(key, "bot", api.adapter_dir(seed=i)).json()["version"]
                for i in range(versions)]  # fmt: skip
    return key, uploaded


def test_a_tenant_pins_a_version_on_k_replicas_and_unpins_it_in_one_call(api: Api) -> None:
    key, (v1, _) = setup(api, quota=1 << 30)
    replicas = ["r0", "r1", "r2"]
    assert pinned_on(api, replicas) == {r: [] for r in replicas}
    r = api.client.put(PIN.format(v=1), json={"pool": "pool-a", "replicas": 2},
                       headers=bearer(key))  # fmt: skip
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["tenant"] == "acme" and pin["adapter"] == "bot" and pin["version"] == 1
    assert pin["digest"] == v1["digest"] and pin["replicas"] == 2
    assert pin["pinned_bytes"] == 2 * v1["size_bytes"]
    kept = pinned_on(api, replicas)
    assert sorted(len(v) for v in kept.values()) == [0, 1, 1]  # two copies, on two replicas
    answer = report(api, next(r for r, v in kept.items() if v))["pins"][0]
    assert answer["tenant"] == "acme" and answer["adapter"] == "bot"
    assert answer["digest"] == v1["digest"] and answer["path"].startswith("adapters/acme/bot/v1-")
    assert [p["version"] for p in api.client.get("/v1/pins", headers=bearer(key)).json()] == [1]
    # the operator reads the pool: it keeps at least 2 replicas while this pin holds
    pool = api.client.get("/internal/v1/pools/pool-a", headers=SERVICE_H).json()
    assert pool["pinned_replicas"] == 2
    # ... and shows each pin as GET /v1/pins does, for the ServingPool's status
    (shown,) = pool["pins"]
    assert shown["adapter"] == "bot" and shown["version"] == 1
    assert shown["replicas"] == 2 and shown["held"] == 0  # no report says it is held yet
    holders = sorted(r for r, v in kept.items() if v)
    assert sorted(p["replica"] for p in shown["placement"]) == holders
    r = api.client.delete(PIN.format(v=1), params={"pool": "pool-a"}, headers=bearer(key))
    assert r.status_code == 204
    assert pinned_on(api, replicas) == {r: [] for r in replicas}
    pool = api.client.get("/internal/v1/pools/pool-a", headers=SERVICE_H).json()
    assert pool["pinned_replicas"] == 0 and pool["pins"] == []
    r = api.client.delete(PIN.format(v=1), params={"pool": "pool-a"}, headers=bearer(key))
    assert r.status_code == 404 and "is not pinned" in r.json()["error"]["message"]


def test_pins_past_the_tenant_quota_are_refused_naming_the_numbers_but_not_the_admin_s(
    api: Api,
) -> None:
    key, (v1, _) = setup(api, quota=1)
    pinned_on(api, ["r0", "r1"])
    r = api.client.put(PIN.format(v=1), json={"pool": "pool-a", "replicas": 2},
                       headers=bearer(key))  # fmt: skip
    assert r.status_code == 409
    error = r.json()["error"]
    assert error["code"] == "QuotaExceeded"
    size = v1["size_bytes"]
    assert f"2 replicas of a {size}-byte version take {2 * size} bytes" in error["message"]
    assert "max_pinned_bytes quota of 1" in error["message"]
    r = api.client.put("/v1/tenants/acme/adapters/bot/versions/1/pin",
                       json={"pool": "pool-a", "replicas": 2}, headers=ADMIN_H)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["created_by"] == "admin"
    r = api.client.delete("/v1/tenants/acme/adapters/bot/versions/1/pin",
                          params={"pool": "pool-a"}, headers=ADMIN_H)  # fmt: skip
    assert r.status_code == 204
    # a tenant's key is no admin, the admin token no tenant
    r = api.client.put("/v1/tenants/acme/adapters/bot/versions/1/pin",
                       json={"pool": "pool-a"}, headers=bearer(key))  # fmt: skip
    assert r.status_code == 401


def test_pins_that_would_not_fit_on_the_pool_s_replicas_are_refused_with_the_numbers(
    api: Api,
) -> None:
    key, (v1, v2) = setup(api, quota=1 << 30)
    pinned_on(api, ["r0", "r1"])
    put = lambda v, n: api.client.put(  # noqa: E731
        PIN.format(v=v), json={"pool": "pool-a", "replicas": n}, headers=bearer(key)
    )
    r = put(1, 3)
    assert r.status_code == 409 and r.json()["error"]["code"] == "PinsDoNotFit"
    assert "pool default/pool-a has 2 live replicas" in r.json()["error"]["message"]
    # replicas whose adapter memory holds one version's pin (pins: half the memory)
    capacity = 2 * v1["size_bytes"] + 1
    pinned_on(api, ["r0", "r1"], capacity)
    assert put(1, 2).status_code == 200
    r = put(2, 1)
    assert r.status_code == 409
    message = r.json()["error"]["message"]
    used = v1["size_bytes"] + v2["size_bytes"]
    assert f"would keep {used} bytes of pinned versions" in message
    assert f"more than the {capacity // 2} bytes pins may take there" in message
    assert f"half of its {capacity}-byte adapter memory" in message
    # a refused change leaves the pin as it was
    assert [p["replicas"] for p in api.client.get("/v1/pins", headers=bearer(key)).json()] == [2]
    r = api.client.put(PIN.format(v=9), json={"pool": "pool-a"}, headers=bearer(key))
    assert r.status_code == 404
    r = api.client.put(PIN.format(v=1), json={"pool": "nope"}, headers=bearer(key))
    assert r.status_code == 404
    r = api.client.put(PIN.format(v=1), json={"pool": "pool-a", "replicas": 0},
                       headers=bearer(key))  # fmt: skip
    assert r.status_code == 400 and "replicas" in r.json()["error"]["message"]


def test_pins_unpins_and_refusals_are_audited(api: Api) -> None:
    key, _ = setup(api, quota=1)
    pinned_on(api, ["r0"])
    body = {"pool": "pool-a"}
    assert api.client.put(PIN.format(v=1), json=body, headers=bearer(key)).status_code == 409
    path = "/v1/tenants/acme/adapters/bot/versions/1/pin"
    assert api.client.put(path, json=body, headers=ADMIN_H).status_code == 200
    assert api.client.delete(path, params=body, headers=ADMIN_H).status_code == 204
    with api.client.app.state.ctx.sessions() as session:  # type: ignore[attr-defined]
        events = [(e.action, e.outcome, e.actor) for e in list_events(session)][:3][::-1]
    assert events[0][:2] == ("adapter.pin", "refused:QuotaExceeded")
    assert events[0][2].startswith("tenant:acme/")
    assert events[1:] == [
        ("adapter.pin", "success", "admin"),
        ("adapter.unpin", "success", "admin"),
    ]


def test_the_assignment_spreads_copies_evenly_and_moves_few_when_a_replica_leaves() -> None:
    digests = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(2000)]
    replicas = [f"pool-{i}" for i in range(10)]
    before = {d: assign(d, replicas, 2) for d in digests}
    assert all(len(set(r)) == 2 for r in before.values())  # two distinct replicas each
    load = Counter(r for kept in before.values() for r in kept)
    assert max(load.values()) < 1.2 * 400 and min(load.values()) > 0.8 * 400
    assert assign(digests[0], reversed(replicas), 2) == before[digests[0]]  # order-free
    after = {d: assign(d, replicas[1:], 2) for d in digests}
    moved = [d for d in digests if set(after[d]) != set(before[d])]
    assert all("pool-0" in before[d] for d in moved)  # only the leaving replica's copies move
    assert all(set(after[d]) - {"pool-0"} >= set(before[d]) - {"pool-0"} for d in digests)
    assert assign(digests[0], ["a"], 3) == ["a"]


def test_the_pin_view_shows_which_replicas_hold_a_pin_and_which_refused_it_and_why(
    api: Api,
) -> None:
    key, (v1, _) = setup(api, quota=1 << 30)
    replicas = ["r0", "r1", "r2"]
    pinned_on(api, replicas)
    r = api.client.put(PIN.format(v=1), json={"pool": "pool-a", "replicas": 2},
                       headers=bearer(key))  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["held"] == 0 and r.json()["refused"] == []
    kept = sorted(r for r, v in pinned_on(api, replicas).items() if v)
    assert kept == sorted(assign(v1["digest"], replicas, 2))
    # nothing said yet: the assigned replicas are pending
    (pin,) = api.client.get("/v1/pins", headers=bearer(key)).json()
    assert pin["placement"] == [{"replica": r, "state": "pending"} for r in kept]
    assert pin["held"] == 0 and pin["resident"] == 0 and pin["refused"] == []
    # the next reports say what became of it: one keeps it, the other's engine refused it
    state = {"tenant": "acme", "adapter": "bot", "digest": v1["digest"]}
    why = "pinning bot would pin 5 adapters on this replica, more than its cap of 4"
    for replica, said in ((kept[0], "resident"), (kept[1], f"refused: {why}")):
        body = {"pool": "pool-a", "replica": replica,
                "pin_states": [{**state, "state": said}]}  # fmt: skip
        r = api.client.post("/internal/v1/pressure", json=body, headers=SERVICE_H)
        assert r.status_code == 200, r.text
    (pin,) = api.client.get("/v1/pins", headers=bearer(key)).json()
    assert pin["held"] == 1 and pin["resident"] == 1
    assert pin["refused"] == [{"replica": kept[1], "reason": why}]
    assert {p["replica"]: p["state"] for p in pin["placement"]} == {
        kept[0]: "resident", kept[1]: f"refused: {why}",
    }  # fmt: skip
    # the admin's pin answer says the same
    r = api.client.put("/v1/tenants/acme/adapters/bot/versions/1/pin",
                       json={"pool": "pool-a", "replicas": 2}, headers=ADMIN_H)  # fmt: skip
    assert r.json()["held"] == 1 and r.json()["refused"][0]["replica"] == kept[1]
    # another tenant's version of the same digest, or a bad state, is not this pin's
    other = {**state, "tenant": "globex", "state": "resident"}
    body = {"pool": "pool-a", "replica": kept[1], "pin_states": [other]}
    r = api.client.post("/internal/v1/pressure", json=body, headers=SERVICE_H)
    assert r.status_code == 200, r.text
    (pin,) = api.client.get("/v1/pins", headers=bearer(key)).json()
    assert pin["held"] == 1 and pin["refused"] == []
    assert {p["replica"]: p["state"] for p in pin["placement"]}[kept[1]] == "pending"
    body = {"pool": "pool-a", "replica": kept[1], "pin_states": [{**state, "digest": "x"}]}
    r = api.client.post("/internal/v1/pressure", json=body, headers=SERVICE_H)
    assert r.status_code == 400 and "digest" in r.text
