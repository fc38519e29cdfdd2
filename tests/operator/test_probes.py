"""A pool's data plane pods are probed on what the server means by health (docs/operations.md,
Probes): liveness on /health, readiness on /ready, and a startup probe that lets the model load."""

from __future__ import annotations

from typing import Any

from loraplane.operator import manifests
from loraplane.operator.specs import PoolSpec

POOL = {"baseModel": {"name": "tiny", "uri": "/models/tiny"}, "image": "img:1"}


def container() -> dict[str, Any]:
    dep = manifests.deployment(
        "p", "ns", PoolSpec.parse(POOL), controlplane_url="http://cp:8080", replicas=1
    )
    c: dict[str, Any] = dep["spec"]["template"]["spec"]["containers"][0]
    return c


def test_liveness_asks_health_and_readiness_asks_ready_on_the_api_port() -> None:
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == manifests.PORT
    for probe, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready")):
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe


def test_a_loading_model_is_never_killed_and_a_dead_engine_is_restarted_within_a_minute() -> None:
    c = container()
    startup, live, ready = c["startupProbe"], c["livenessProbe"], c["readinessProbe"]
    # liveness runs only after the startup probe passed, and that needs the model loaded
    assert startup["httpGet"] == {"path": "/ready", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    assert live["periodSeconds"] * live["failureThreshold"] <= 60
    # out of rotation soon after /ready says so (the server's own stall limit comes first)
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 15
    for probe in (startup, live, ready):  # the routes never wait on the engine thread
        assert probe["timeoutSeconds"] <= probe["periodSeconds"]
