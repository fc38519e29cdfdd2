"""The chart's KEDA ScaledObject evaluated where KEDA evaluates it: its prometheus triggers'
queries run on a real Prometheus (Debian's, 1 s scrapes) scraping the operator's own metrics
server. They give KEDA the pool's pressure, so KEDA's replicas (the larger ceil(value /
threshold)) are the operator policy's need; while no replica reports they give the current
count times the target (KEDA holds, as the operator does); without the operator they give
nothing, which `ignoreNullValues: "false"` makes an error (the HPA holds)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from loraplane.operator.autoscaling import Pressure, ScalePolicy, needed_replicas
from loraplane.operator.metrics import PoolMetrics
from tests.charts.render import NAMESPACE, ROUTING, one, render
from tests.operator.harness import wait_for
from tests.prometheus import MISSING, PROMETHEUS, instant, running_prometheus
from tests.servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not PROMETHEUS.exists(), reason=MISSING)]
POOL = "llama-3-8b"  # ROUTING's first pool: replicas 1..4, the CRD's default targets
POLICY = ScalePolicy(
    min_replicas=1,
    max_replicas=4,
    deferred_per_replica=4,
    waiting_per_replica=2,
    scale_up_seconds=30,
    scale_down_seconds=300,
)


def _evaluate(prom: str, triggers: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, trigger in triggers.items():
        result = instant(prom, trigger["metadata"]["query"])
        assert len(result) <= 1, result  # KEDA needs a single element
        out[name] = float(result[0]["value"][1]) if result else None
    return out


def _replicas(values: dict[str, float | None], triggers: dict[str, dict[str, Any]]) -> int:
    """What KEDA's HPA runs: AverageValue targets, the largest of the triggers' needs."""
    return max(
        math.ceil((values[name] or 0) / float(t["metadata"]["threshold"]))
        for name, t in triggers.items()
    )


def test_scaled_object_queries_give_keda_the_operators_need_and_hold_without_reports(
    tmp_path: Path,
) -> None:
    scaled = one(render(ROUTING), "ScaledObject", POOL)
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
    metrics = PoolMetrics()
    pressure = Pressure(deferred=11, waiting_adapters=3, replicas_reporting=2)
    metrics.observe(NAMESPACE, POOL, replicas=2, ready=2, policy=POLICY, pressure=pressure)
    # a namesake in another namespace, under much more pressure: never mixed in
    metrics.observe("elsewhere", POOL, replicas=1, ready=1, policy=POLICY,
                    pressure=Pressure(deferred=100, waiting_adapters=50))  # fmt: skip
    server, _ = metrics.serve("127.0.0.1", free_port())
    # as the chart's ServiceMonitor scrapes it: Prometheus adds the Service's namespace
    job = {
        "job_name": "operator",
        "static_configs": [
            {"targets": [f"127.0.0.1:{server.server_port}"], "labels": {"namespace": NAMESPACE}}
        ],
    }
    try:
        with running_prometheus(tmp_path, [job]) as prom:
            values = wait_for(
                lambda: all((v := _evaluate(prom, triggers)).values()) and v,
                timeout=30,
                what="the triggers' first values",
            )
            assert values == {"deferred": 11, "waiting-adapters": 3}
            need = needed_replicas(POLICY, pressure)  # max(ceil(11 / 4), ceil(3 / 2)) = 3
            assert _replicas(values, triggers) == need == 3
            (exported,) = instant(
                prom,
                f'loraplane_pool_needed_replicas{{pool_namespace="{NAMESPACE}",pool="{POOL}"}}',
            )
            assert float(exported["value"][1]) == need

            # no replica reported lately: the pressure series go, KEDA holds the count
            metrics.observe(NAMESPACE, POOL, replicas=2, ready=2, policy=POLICY, pressure=None)
            held = wait_for(
                lambda: (v := _evaluate(prom, triggers))["deferred"] == 2 * 4 and v,
                timeout=30,
                what="the hold values",
            )
            assert held == {"deferred": 8, "waiting-adapters": 4}
            assert _replicas(held, triggers) == 2

            # the operator is gone: no value at all (an error for KEDA, not a scale to min)
            server.shutdown()
            wait_for(
                lambda: not any(_evaluate(prom, triggers).values()),
                timeout=30,
                what="the queries to return nothing",
            )
    finally:
        server.shutdown()
