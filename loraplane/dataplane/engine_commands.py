"""The calls the API server makes into its engine between steps, by name.

A lambda cannot cross into the engine's process (engine_process.py), so the server names what
it wants and passes arguments that pickle; the engine's side runs `run_command`, on its loop,
between steps, whichever process that loop is in. Results pickle too (refs, snapshots).

    register_stored(ref, store_path) -> LoRARef   a stored version, loaded on first use
    warm_stored(ref, store_path) -> bool | str    the same, its load into host memory begun
                                                  now (a rollout's version, before requests);
                                                  True: in host memory, False: loading, a
                                                  string: why it cannot load (its last load
                                                  failed; the engine's retry rule applies)
    register_lora(name, path, tenant) -> LoRARef  a local adapter directory (AdapterRejected)
    unregister(name, tenant) -> list[LoRARef]     every version of (tenant, name), freed
    set_weight(tenant, weight) -> None            the tenant's share weight in the scheduler
    pin(ref) -> str                               keep a registered version resident (PinRefused)
    unpin(ref) -> bool                            let it be evicted again
    pin_states(refs) -> list[str]                 each version's pin state (LoRAManager.pin_state)
    snapshot() -> EngineSnapshot                  the metrics port's reading
    gateway_snapshot() -> EngineSnapshot          the inference gateway's (cheap) reading
"""

from __future__ import annotations

from typing import Any

from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.snapshot import EngineSnapshot

COMMANDS = (
    "register_stored",
    "warm_stored",
    "register_lora",
    "unregister",
    "set_weight",
    "pin",
    "unpin",
    "pin_states",
    "snapshot",
    "gateway_snapshot",
)


def run_command(engine: Engine, name: str, args: tuple[Any, ...]) -> Any:
    """Run command `name` on `engine` (on its loop, between steps); its result."""
    if name == "register_stored":
        return engine.loras.register_stored(*args)
    if name == "warm_stored":
        return warm_stored(engine, *args)
    if name == "register_lora":
        return engine.register_lora(*args)
    if name == "unregister":
        return engine.loras.unregister(*args)
    if name == "set_weight":
        return engine.scheduler.set_weight(*args)
    if name == "pin":
        return engine.loras.pin(*args)
    if name == "unpin":
        return engine.loras.unpin(*args)
    if name == "pin_states":
        return [engine.loras.pin_state(ref) for ref in args[0]]
    if name == "snapshot":
        return EngineSnapshot.of(engine)
    if name == "gateway_snapshot":
        return EngineSnapshot.gateway(engine)
    raise ValueError(f"unknown engine command {name!r} (known: {', '.join(COMMANDS)})")


def warm_stored(engine: Engine, ref: LoRARef, store_path: str) -> bool | str:
    """Register a stored version and start loading it into host memory ahead of its requests
    (the prefetch list is the waiting requests' again at the next step; a load begun now goes
    on). True when it is in host memory already, False while it loads, else why it cannot
    run (its last load failed and the retry window is open, or it is over the budget)."""
    engine.loras.register_stored(ref, store_path)
    if engine.loras.in_host_memory(ref):
        return True
    failed = engine.loras.failure(ref)
    if failed is not None:
        return failed
    engine.loras.prefetch([ref])
    return engine.loras.in_host_memory(ref)
