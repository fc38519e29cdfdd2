"""`EngineSnapshot`: the engine's state the metrics, the gateway's gauges and the pressure
reports show, read at one point between steps (on the engine's thread, or in the engine
process by its `snapshot` command). A module of its own: the engine's commands take snapshots
and the server's metrics render them, and neither imports the other.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplane.dataplane.fairness import TenantShare

if TYPE_CHECKING:
    from loraplane.dataplane.engine import Engine


@dataclass(slots=True)
class EngineSnapshot:
    """The engine state the gauges show, read at one point between steps."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    deferred: int = 0
    deferred_total: int = 0
    max_loras: int = 0
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    resident: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tenant, name)
    registered: Counter[tuple[str, str]] = field(default_factory=Counter)
    waiting_per_adapter: Counter[tuple[str, str]] = field(default_factory=Counter)
    in_host: Counter[tuple[str, str]] = field(default_factory=Counter)  # host-memory tier
    gpu_loads: int = 0
    gpu_load_errors: int = 0
    gpu_hits: int = 0
    gpu_evictions: int = 0
    host_loads: int = 0
    host_failures: int = 0
    host_evictions: int = 0
    disk_loads: int = 0
    disk_hits: int = 0
    disk_failures: int = 0
    disk_evictions: int = 0
    gpu_bytes_used: int = 0
    gpu_bytes_capacity: int = 0
    # host bytes of the host tier's copies (tensor parallelism: every rank's part rank 0 keeps)
    cpu_bytes_used: int = 0
    cpu_bytes_limit: int | None = None  # max_cpu_lora_bytes (None: no byte limit)
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # free or cached prefix blocks nobody uses
    kv_blocks_adapters: int = 0  # lent to adapters (kv_lora_shared)
    # the model-server protocol's view: adapters resident on the device, and adapters that
    # waiting requests need and that are not resident (names as clients send them)
    lora_running: list[str] = field(default_factory=list)
    lora_waiting: list[str] = field(default_factory=list)
    # per tenant: its share of the replica (fairness.py), as the scheduler keeps it
    tenants: dict[str, TenantShare] = field(default_factory=dict)

    @classmethod
    def gateway(cls, engine: Engine) -> EngineSnapshot:
        """Only what an inference gateway reads (`vllm:*`), in time proportional to what
        runs, waits and is resident, never to what is registered: the endpoint picker scrapes
        every 50 ms and each reading runs on the engine thread."""
        sched = engine.scheduler
        resident = {r.name for r in engine.loras.resident}
        waiting = {r.name for r in sched.waiting_loras()}
        return cls(
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_usage=engine.block_manager.usage,
            deferred=sched.num_deferred,
            max_loras=engine.loras.capacity,
            lora_running=sorted(resident),
            lora_waiting=sorted(waiting - resident),
        )

    @classmethod
    def of(cls, engine: Engine) -> EngineSnapshot:
        """Read `engine` (call on the engine thread, between steps)."""
        sched, loras = engine.scheduler, engine.loras
        view = cls.gateway(engine)
        return cls(
            running=view.running,
            waiting=view.waiting,
            kv_usage=view.kv_usage,
            deferred=view.deferred,
            deferred_total=sched.deferred_total,
            max_loras=view.max_loras,
            lora_running=view.lora_running,
            lora_waiting=view.lora_waiting,
            running_adapters=sorted({s.lora.name for s in sched.running if s.lora is not None}),
            waiting_adapters=sorted({r.name for r in sched.waiting_loras()}),
            resident=Counter((r.tenant, r.name) for r in loras.resident),
            registered=Counter((r.tenant, r.name) for r in loras.registered),
            waiting_per_adapter=Counter(
                {(r.tenant, r.name): n for r, n in sched.waiting_per_lora().items()}
            ),
            in_host=Counter((r.tenant, r.name) for r in loras.in_host),
            gpu_loads=loras.loads_total,
            gpu_load_errors=loras.device_stats.failures,
            gpu_hits=loras.hits_total,
            gpu_evictions=loras.evictions_total,
            host_loads=loras.host_stats.loads,
            host_failures=loras.host_stats.failures,
            host_evictions=loras.host_stats.evictions,
            disk_loads=loras.disk.loads_total if loras.disk else 0,
            disk_hits=loras.disk.hits_total if loras.disk else 0,
            disk_failures=loras.disk.failures_total if loras.disk else 0,
            disk_evictions=loras.disk.evictions_total if loras.disk else 0,
            gpu_bytes_used=engine.runner.pool.bytes_used,
            gpu_bytes_capacity=engine.runner.lora_budget_bytes,
            cpu_bytes_used=loras.host.bytes,
            cpu_bytes_limit=loras.host.max_cpu_lora_bytes,
            kv_blocks_total=engine.block_manager.num_blocks,
            kv_blocks_free=engine.block_manager.num_free_blocks,
            kv_blocks_adapters=engine.block_manager.num_reserved,
            tenants={t: dataclasses.replace(share) for t, share in sched.shares.tenants.items()},
        )
