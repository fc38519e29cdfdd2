"""The operator's Prometheus metrics: each ServingPool's replicas, bounds, autoscaling targets,
the pressure the policy saw, and scale events (the Autoscaling dashboard reads them).

Updated by the pool timer on every tick (`observe`), forgotten when a pool is deleted, and
served by `serve` (`loraplane operator --metrics-port`). The labels are `pool` (the
ServingPool's name, as on the data plane's metrics) and `pool_namespace` (not `namespace`,
which Prometheus sets to the scraped Service's namespace).
"""

from __future__ import annotations

import contextlib
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server

from loraplane.operator.autoscaling import Pressure, ScalePolicy, needed_replicas

LABELS = ("pool_namespace", "pool")
SIGNALS = (
    "deferred",
    "waiting_adapters",
    "running_adapters",
    "slots_used",
    "adapter_memory_used",
    "adapter_memory_total",
    "host_adapter_memory_used",
    "replicas_reporting",
)
DIRECTIONS = ("up", "down")


class PoolMetrics:
    """The operator's metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.replicas = Gauge(
            "loraplane_pool_replicas",
            "Replicas a pool's Deployment asks for now (its spec)",
            LABELS,
            registry=r,
        )
        self.ready = Gauge(
            "loraplane_pool_ready_replicas",
            "Ready replicas of a pool's Deployment",
            LABELS,
            registry=r,
        )
        self.needed = Gauge(
            "loraplane_pool_needed_replicas",
            "Replicas a pool's fresh pressure asks for now, within its bounds (the policy "
            "scales to it once the stabilization window agrees)",
            LABELS,
            registry=r,
        )
        self.bound = Gauge(
            "loraplane_pool_replicas_bound",
            "A pool's replicas.min and replicas.max",
            (*LABELS, "bound"),
            registry=r,
        )
        self.target = Gauge(
            "loraplane_pool_autoscaling_target",
            "A pool's per-replica autoscaling targets",
            (*LABELS, "signal"),
            registry=r,
        )
        self.pressure = Gauge(
            "loraplane_pool_pressure",
            "A pool's pressure summed over its replicas' fresh reports, as the policy saw it",
            (*LABELS, "signal"),
            registry=r,
        )
        self.scales = Counter(
            "loraplane_pool_scale_events",
            "Replica changes the operator made, by direction",
            (*LABELS, "direction"),
            registry=r,
        )
        self._lock = threading.Lock()
        self._pools: set[tuple[str, str]] = set()

    def observe(
        self,
        namespace: str,
        pool: str,
        *,
        replicas: int,
        ready: int,
        policy: ScalePolicy,
        pressure: Pressure | None,
    ) -> None:
        """One timer tick's view of a pool: `replicas` its Deployment asks for after the tick.
        Without fresh pressure the need is the current count (the policy holds) and the
        pressure series go away."""
        key = (namespace, pool)
        with self._lock:
            self._pools.add(key)
        self.replicas.labels(*key).set(replicas)
        self.ready.labels(*key).set(ready)
        need = replicas if pressure is None else needed_replicas(policy, pressure)
        self.needed.labels(*key).set(need)
        self.bound.labels(*key, "min").set(policy.min_replicas)
        self.bound.labels(*key, "max").set(policy.max_replicas)
        self.target.labels(*key, "deferred_per_replica").set(policy.deferred_per_replica)
        self.target.labels(*key, "waiting_adapters_per_replica").set(policy.waiting_per_replica)
        for direction in DIRECTIONS:  # present at 0 before the first scale
            self.scales.labels(*key, direction)
        for signal in SIGNALS:
            if pressure is None:
                self._remove(self.pressure, (*key, signal))
            else:
                self.pressure.labels(*key, signal).set(getattr(pressure, signal))

    def scaled(self, namespace: str, pool: str, before: int, after: int) -> None:
        """Count a replica change."""
        if after != before:
            self.scales.labels(namespace, pool, "up" if after > before else "down").inc()

    def forget(self, namespace: str, pool: str) -> None:
        """Drop every series of a deleted pool."""
        key = (namespace, pool)
        with self._lock:
            self._pools.discard(key)
        for gauge in (self.replicas, self.ready, self.needed):
            self._remove(gauge, key)
        for bound in ("min", "max"):
            self._remove(self.bound, (*key, bound))
        for signal in ("deferred_per_replica", "waiting_adapters_per_replica"):
            self._remove(self.target, (*key, signal))
        for signal in SIGNALS:
            self._remove(self.pressure, (*key, signal))
        for direction in DIRECTIONS:
            self._remove(self.scales, (*key, direction))

    @staticmethod
    def _remove(metric: Gauge | Counter, labels: tuple[str, ...]) -> None:
        with contextlib.suppress(KeyError):  # never set
            metric.remove(*labels)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
        """Serve `/metrics` on host:port in a daemon thread; the server (shut it down with
        `.shutdown()`) and its thread."""
        return start_http_server(port, addr=host, registry=self.registry)
