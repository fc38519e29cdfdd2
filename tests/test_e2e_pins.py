"""Across components: the control plane assigns a pool's pins to a real data plane replica in
its pressure answers; the replica's engine keeps what fits under its own cap and refuses the
rest; the replica's next reports say so, and the tenant's `GET /v1/pins` shows, per pin, the
replica that holds it and the one that refused it with the engine's reason. Real HTTP
(uvicorn), SQLite catalog, local object store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import SERVICE
from tests.dataplane.server.conftest import start_server
from tests.test_e2e_catalog import BASE_NAME, POOL, admin, controlplane, pool_and_tenants


def upload(cp: str, key: str, src: Path) -> None:
    files = [("files", (p.name, p.read_bytes())) for p in sorted(src.iterdir())]
    form = {"name": "support", "base_model": BASE_NAME}
    r = httpx.post(cp + "/v1/adapters", data=form, files=files,
                   headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert r.status_code == 201, r.text


def wait_for(probe: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    seen: list[Any] = []
    while time.monotonic() < deadline:
        value = probe(seen)
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last seen: {seen[-1:]}")


def test_a_replica_reports_the_pins_its_engine_refused_and_the_tenant_sees_why(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    with controlplane(tmp_path) as cp:
        keys = pool_and_tenants(cp, tiny_llama_dir, tenants=("acme",))
        upload(cp, keys["acme"], peft_adapters["r16"])
        upload(cp, keys["acme"], peft_adapters["r8-qv"])
        # the pool's registration says 8 slots (4 pins); this replica has 2 (1 pin)
        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name=BASE_NAME, controlplane_url=cp,
            service_token=SERVICE, store=str(tmp_path / "store"), pool=POOL, replica="rep-0",
            pressure_interval_s=0.2, num_kv_blocks=128, max_loras=2,
        )  # fmt: skip
        with start_server(settings):
            wait_for(lambda _: admin(cp, "GET", f"/v1/pools/{POOL}").json().get("pressure"),
                     "the replica's first report")  # fmt: skip
            for version in (1, 2):
                r = admin(cp, "PUT", f"/v1/tenants/acme/adapters/support/versions/{version}/pin",
                          json={"pool": POOL, "replicas": 1})  # fmt: skip
                assert r.status_code == 200, r.text
                time.sleep(0.5)  # version 1 reaches the engine first

            def settled(seen: list[Any]) -> list[dict[str, Any]] | None:
                pins: list[dict[str, Any]] = httpx.get(
                    cp + "/v1/pins", headers={"Authorization": f"Bearer {keys['acme']}"}
                ).json()
                seen.append(pins)
                states = [p["placement"][0]["state"] for p in pins]
                done = states[0] in ("host", "resident") and states[1].startswith("refused")
                return pins if done else None

            first, second = wait_for(settled, "the replica's word on both pins")
    # kept: in host memory, placed on the device at the next step (none ran: no requests)
    assert first["version"] == 1 and first["held"] == 1
    assert first["refused"] == []
    assert second["version"] == 2 and second["held"] == 0
    assert second["refused"] == [{"replica": "rep-0", "reason": second["refused"][0]["reason"]}]
    reason = second["refused"][0]["reason"]
    assert "would pin 2 adapters on this replica, more than its cap of 1" in reason
    assert "of its 2 adapter slots" in reason
