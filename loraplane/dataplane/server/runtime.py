"""The live server: the engine (in a process of its own, or on a thread), the catalog, limits,
metrics, adapter leases.

`Runtime.start()` builds the engine off the event loop (so /health answers while the model
loads): in a child process (engine_process.py, `LORAPLANE_ENGINE_PROCESS`, the default) or on a
thread of this one (async_engine.py). Either way it registers the static `--lora-modules` (an
invalid one fails start with `adapter NAME rejected: <ReasonCode>: <message>`), and starts the
pressure reporter in catalog mode. Requests hold a `Lease` on their adapter while they run;
unloading an adapter first stops new requests for it (standalone: they no longer resolve it;
catalog mode: they are refused with 404 `model_unloading` while it drains), waits for its
leases (at most LORAPLANE_UNLOAD_TIMEOUT_S), then frees it on the engine's loop. Every call
into the engine is a named command (engine_commands.py), so that either front takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from loraplane import fileaccess
from loraplane.adapters.base_model import BaseModelError, read_config
from loraplane.adapters.errors import AdapterRejected
from loraplane.dataplane.async_engine import AsyncEngine, EngineHealth
from loraplane.dataplane.engine_process import EngineGone, ProcessEngine
from loraplane.dataplane.engine_setup import StartupError, build_engine
from loraplane.dataplane.heap import freeze_startup_heap
from loraplane.dataplane.lora.errors import PinRefused
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.server.admission import QueueLimits
from loraplane.dataplane.server.catalog import DEFAULT_TENANT, Catalog, Resolved, StaticCatalog
from loraplane.dataplane.server.catalog_http import HttpCatalog
from loraplane.dataplane.server.errors import (
    AdapterRefused,
    InvalidRequest,
    ModelNotFound,
    ModelUnloading,
    NotFound,
    PinsDoNotFit,
    Unavailable,
    UnloadTimeout,
    UpstreamError,
)
from loraplane.dataplane.server.intake import FairPool, auto_workers
from loraplane.dataplane.server.limits import RateLimiter
from loraplane.dataplane.server.metrics import ServerMetrics
from loraplane.dataplane.server.pins import PinSync
from loraplane.dataplane.server.pressure import PressureReporter, UsageLog
from loraplane.dataplane.server.rollout import Warmer
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.dataplane.snapshot import EngineSnapshot

if TYPE_CHECKING:  # in-process mode only (`_build_engine`): no torch in this process otherwise
    from loraplane.dataplane.engine import Engine

log = logging.getLogger(__name__)
T = TypeVar("T")
SNAPSHOT_TIMEOUT_S = 2.0
EngineFront = AsyncEngine | ProcessEngine  # the engine as the routes see it
__all__ = ["EngineFront", "Lease", "Runtime", "StartupError"]


@dataclass(slots=True)
class Lease:
    """A request's hold on its adapter version (None: the base model) and on its places in
    the replica's queue."""

    ref: LoRARef | None
    _runtime: Runtime | None
    tenant: str = ""
    queued: int = 0

    def release(self) -> None:
        """Let go (idempotent); an unload waiting for this adapter may proceed."""
        runtime, self._runtime = self._runtime, None
        if runtime is None:
            return
        runtime.queue.leave(self.tenant, self.queued)
        if self.ref is not None:
            runtime._release(self.ref.key)


class Runtime:
    """Everything a route needs, built once per app."""

    def __init__(self, settings: ServerSettings, freeze_heap: bool = False) -> None:
        self.settings = settings
        self.freeze_heap = freeze_heap
        self.metrics = ServerMetrics()
        self.usage = UsageLog()
        self.limiter = RateLimiter()
        self.queue = QueueLimits(
            settings.max_queued_requests,
            settings.max_queued_requests_per_tenant,
            self.metrics.refused,
        )
        # intake work off the event loop, each kind on workers of its own shared fairly by
        # tenants (intake.py); the tokenizer is shared by them: `tokenizers` (Rust) and the
        # jinja2 chat template (compiled once, rendered with fresh state) are thread-safe
        self.tokenizing = FairPool("tokenize", settings.tokenize_workers or auto_workers())
        self.compiling = FairPool("grammar", settings.grammar_workers or auto_workers())
        self._token_texts: list[str] | None = None
        self.base_model = settings.served_model_name or os.path.basename(
            os.path.normpath(settings.model)
        )
        self.engine: EngineFront | None = None
        self._starting: ProcessEngine | None = None  # a child loading the model
        self.catalog: Catalog | None = None
        self.static: StaticCatalog | None = None
        self.max_model_len = 0
        self.ready = False
        self.draining = False
        self.fatal: str | None = None  # why start failed
        self._inflight: Counter[str] = Counter()  # adapter key -> leases
        # catalog mode: (tenant, name) -> unloads under way; their new requests are refused
        self._unloading: Counter[tuple[str, str]] = Counter()
        self._weights: dict[str, float] = {}  # tenant -> share weight the scheduler has
        self._released = asyncio.Condition()
        self._loading: dict[str, asyncio.Future[LoRARef]] = {}
        self._reporter: PressureReporter | None = None
        self.warmer: Warmer | None = None  # catalog mode: a rollout's versions, loaded ahead
        self.pins = PinSync(self.command)  # this replica's pinned versions (pins.py)

    # -- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model and static adapters, then serve. Raises StartupError."""
        s = self.settings
        front: EngineFront
        if s.engine_process:
            self._starting = front = ProcessEngine(s)
            try:
                await asyncio.to_thread(front.wait_ready)
            except BaseException:
                await asyncio.to_thread(front.shutdown)
                raise
            finally:
                self._starting = None
            self._observe_loads(front.start_loads)
            front.on_loads = self._observe_loads
        else:
            front = AsyncEngine(await asyncio.to_thread(self._build_engine))
        self.metrics.cpu_loads["ok"] += len(s.adapter_dirs())
        self.max_model_len = front.max_model_len
        self.engine = front
        self.metrics.watch_engine(self.engine_health)
        if s.controlplane_url:
            self.catalog = HttpCatalog(
                s.controlplane_url, s.service_token, self.base_model, ttl=s.resolve_ttl_s,
                stale=s.resolve_stale_s,
            )  # fmt: skip
            self.warmer = Warmer(self.command)  # a rollout's versions load before requests
            self.catalog.picker.readiness = self.warmer
            diverted = self.metrics.version_diverted
            self.catalog.picker.diverted = lambda tenant, adapter, version, why: diverted.labels(
                tenant=tenant, adapter=adapter, version=version, reason=why
            ).inc()
            replica = s.replica or f"{socket.gethostname()}:{s.port}"
            self._reporter = PressureReporter(
                s.controlplane_url, s.service_token, s.pool, replica, self.snapshot, self.usage,
                interval=s.pressure_interval_s, namespace=s.pool_namespace,
                base_model_config=await asyncio.to_thread(self._base_model_config),
                spool_dir=s.usage_spool_dir,
            )  # fmt: skip
            self._reporter.on_pins = self.pins.apply
            self._reporter.pin_states = self.pins.states
            self._reporter.pins_retry = self.pins.retry_due
            self._reporter.start()
        else:
            self.static = StaticCatalog(
                self.base_model, s.api_key, s.requests_per_minute, s.tokens_per_minute
            )
            for ref in front.registered:
                self.static.add(ref.name, ref.digest)
            self.catalog = self.static
            self.metrics.add_tenant(DEFAULT_TENANT)
        if self.freeze_heap:
            freeze_startup_heap()
        self.ready = True

    def _base_model_config(self) -> dict[str, Any] | None:
        """The config.json the engine loaded the base model from, for the pressure reports (a
        pool whose model only its replicas see learns it from them)."""
        try:
            return read_config(self.settings.model)
        except BaseModelError as e:
            log.warning("the base model's config.json cannot be reported: %s", e)
            return None

    def _build_engine(self) -> Engine:
        """The engine of this process (LORAPLANE_ENGINE_PROCESS=0), load times observed."""
        return build_engine(self.settings, self._observe_load)

    def _observe_load(self, tier: str, seconds: float) -> None:
        """Feed an adapter load's time (cpu: into host memory; gpu: into a device slot) to
        loraplane_adapter_load_seconds."""
        self.metrics.load_seconds.labels(tier=tier).observe(seconds)

    def _observe_loads(self, loads: list[tuple[str, float]]) -> None:
        for tier, seconds in loads:
            self._observe_load(tier, seconds)

    async def stop(self) -> None:
        """Stop reporting and stop the engine (its process, or its thread)."""
        self.draining, self.ready = True, False
        if self._reporter is not None:
            await self._reporter.stop()
        if self.catalog is not None:
            await self.catalog.aclose()
        if self._starting is not None:  # stopped while loading: no orphan child
            await asyncio.to_thread(self._starting.shutdown)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        self.tokenizing.shutdown()
        self.compiling.shutdown()

    # -- the engine -------------------------------------------------------------------------

    def engine_health(self) -> EngineHealth | None:
        """The engine loop's verdict under LORAPLANE_READY_*; None before it exists."""
        if self.engine is None:
            return None
        s = self.settings
        return self.engine.health(stall_s=s.ready_stall_s, max_failed_steps=s.ready_failed_steps)

    def require_engine(self) -> EngineFront:
        """The engine, or 503 while loading or shutting down."""
        if self.engine is None or not self.ready or self.draining:
            raise Unavailable("the server is not ready", retry_after=1)
        if not self.engine.alive:  # its queue would never be read: fail now, not hang
            raise Unavailable("the engine has stopped", retry_after=1)
        return self.engine

    async def command(self, name: str, *args: Any) -> Any:
        """Run the named engine command (engine_commands.py) between steps; its result."""
        engine = self.engine
        if engine is None:
            raise Unavailable("the server is not ready", retry_after=1)
        try:
            return await engine.command(name, *args)
        except EngineGone as e:
            raise Unavailable(str(e), retry_after=1) from None

    async def gateway_snapshot(self) -> EngineSnapshot:
        """The inference gateway's reading (EngineSnapshot.gateway), on the engine thread."""
        try:
            snap: EngineSnapshot = await asyncio.wait_for(
                self.command("gateway_snapshot"), SNAPSHOT_TIMEOUT_S
            )
        except (TimeoutError, Unavailable):
            return self.metrics.gateway_snapshot
        self.metrics.gateway_snapshot = snap
        return snap

    async def snapshot(self) -> EngineSnapshot:
        """The engine state, read on its loop (when it does not answer: a racy read of a
        thread's engine, the last reading of a process's)."""
        try:
            snap: EngineSnapshot = await asyncio.wait_for(
                self.command("snapshot"), SNAPSHOT_TIMEOUT_S
            )
        except (TimeoutError, Unavailable):
            if not isinstance(self.engine, AsyncEngine):
                return self.metrics.snapshot
            with contextlib.suppress(RuntimeError):  # a queue changed size while read
                snap = EngineSnapshot.of(self.engine.engine)
                self.metrics.snapshot = snap
            return self.metrics.snapshot
        self.metrics.snapshot = snap
        return snap

    # -- adapters ---------------------------------------------------------------------------

    def share(self, per_minute: int) -> int:
        """This replica's share of a tenant's per-minute limit: the limit divided among the
        pool's live replicas (catalog mode; the control plane counts them), rounded up; 0
        (unlimited) stays 0."""
        replicas = self._reporter.replicas if self._reporter is not None else 1
        return per_minute if per_minute <= 0 else -(-per_minute // replicas)

    async def tokenize(self, tenant: str, fn: Callable[[], T]) -> T:
        """Run `fn` (tokenization, a chat template, formatting) on a tokenizing worker in
        `tenant`'s turn."""
        return await self.tokenizing.run(tenant, fn)

    async def compile_grammar(self, tenant: str, fn: Callable[[], T]) -> T:
        """Run `fn` (a grammar compilation) on a compiling worker in `tenant`'s turn."""
        return await self.compiling.run(tenant, fn)

    async def token_texts(self, tenant: str) -> list[str]:
        """The text of each token id alone (what log-probabilities show), built once on a
        tokenizing worker: a list lookup per token instead of a decode call."""
        if self._token_texts is None:
            tokenizer = self.require_engine().tokenizer
            self._token_texts = await self.tokenize(
                tenant,
                lambda: [
                    tokenizer.decode([i], skip_special_tokens=False)
                    for i in range(tokenizer.vocab_size)
                ],
            )
        return self._token_texts

    async def lease(self, resolved: Resolved, model: str, requests: int = 1) -> Lease:
        """Take `requests` places in the queue (QueueFull past the caps) and hold the adapter
        `resolved` names (loading it in catalog mode) for one request."""
        self.queue.enter(resolved.tenant, requests)
        self._share_weight(resolved.tenant, resolved.weight)
        try:
            ref = await self._hold(resolved, model)
        except BaseException:
            self.queue.leave(resolved.tenant, requests)
            raise
        return Lease(ref, self, resolved.tenant, requests)

    def _share_weight(self, tenant: str, weight: float) -> None:
        """Tell the scheduler the tenant's share weight when it is new or changed (on the
        engine thread, queued before this request's own add: the same queue, in order)."""
        if self._weights.get(tenant) == weight or self.engine is None:
            return
        self._weights[tenant] = weight
        self.engine.post("set_weight", tenant, weight)

    async def _hold(self, resolved: Resolved, model: str) -> LoRARef | None:
        if resolved.adapter is None:
            return None
        if resolved.digest is None:
            raise UpstreamError("the catalog resolved an adapter without a digest")
        ref = LoRARef(resolved.adapter, resolved.tenant, resolved.digest)
        if self.static is not None:
            if self.static.get(ref.name) is None:  # unloaded since it was resolved
                raise ModelNotFound(model)
        else:
            self._refuse_unloading(ref, model)
            await self._ensure_loaded(ref, resolved)
            self._refuse_unloading(ref, model)  # an unload began while it registered
        self._inflight[ref.key] += 1  # no await since the check: the unload waits for it
        return ref

    def _refuse_unloading(self, ref: LoRARef, model: str) -> None:
        if self._unloading[(ref.tenant, ref.name)]:
            raise ModelUnloading(model)

    def _release(self, key: str) -> None:
        self._inflight[key] -= 1
        if self._inflight[key] <= 0:
            del self._inflight[key]
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._released:
            self._released.notify_all()

    async def _wait_idle(self, keys: Callable[[], list[str]]) -> None:
        async with self._released:
            await self._released.wait_for(lambda: not any(self._inflight[k] for k in keys()))

    async def _ensure_loaded(self, ref: LoRARef, resolved: Resolved) -> None:
        if self.require_engine().is_registered(ref):  # a dict lookup: safe from this thread
            self.metrics.cpu_hits += 1
            return
        pending = self._loading.get(ref.key)
        if pending is None:
            pending = asyncio.ensure_future(self._register_from_store(ref, resolved))
            self._loading[ref.key] = pending
            pending.add_done_callback(lambda _: self._loading.pop(ref.key, None))
        await asyncio.shield(pending)

    async def _register_from_store(self, ref: LoRARef, resolved: Resolved) -> LoRARef:
        """Record a stored version; its bytes load in the background (store -> disk -> host),
        digest-checked, when a request needs them (a failure fails only those requests)."""
        if not resolved.path:
            raise UpstreamError("the catalog resolved an adapter without a store path")
        try:
            registered: LoRARef = await self.command("register_stored", ref, resolved.path)
        except ValueError as e:  # an unsafe path (object keys are checked by the store)
            raise UpstreamError(f"the catalog resolved an unusable store path: {e}") from e
        return registered

    async def load_static(self, name: str) -> bool:
        """Register static adapter `name` again; False if it is already served."""
        if self.static is None:
            raise InvalidRequest("in catalog mode adapters load on first use", param="lora_name")
        path = self.settings.adapter_dirs().get(name)
        if path is None:
            raise NotFound(f"no adapter {name!r} among --lora-modules", param="lora_name")
        if self.static.get(name) is not None:
            return False
        start = time.perf_counter()
        try:
            ref = await self.command("register_lora", name, path, DEFAULT_TENANT)
        except AdapterRejected as e:
            self.metrics.cpu_loads["rejected"] += 1
            raise AdapterRefused(f"adapter {name} rejected: {e.message}", code=e.code.value) from e
        except OSError as e:  # e.g. its files are not readable by this process
            self.metrics.cpu_loads["error"] += 1
            raise Unavailable(
                f"adapter {name}: {fileaccess.message(e)}", code="AdapterUnreadable"
            ) from e
        self.metrics.cpu_loads["ok"] += 1
        self.metrics.load_seconds.labels(tier="cpu").observe(time.perf_counter() - start)
        self.static.add(name, ref.digest)
        return True

    async def unload(self, lora_name: str) -> None:
        """Stop new requests for an adapter at once, wait for its running ones, then free it
        on the engine thread.

        Standalone: `lora_name` is a --lora-modules name, no longer resolved from now on.
        Catalog mode: `tenant/name`; its new requests are refused (ModelUnloading) until it
        is freed, after which the next one registers it again from the store (catalog
        adapters load on first use). Past LORAPLANE_UNLOAD_TIMEOUT_S the unload is given
        up, the adapter served as before, and UnloadTimeout raised.
        """
        self.require_engine()
        tenant, _, name = lora_name.rpartition("/")
        tenant = tenant or DEFAULT_TENANT
        catalog, removed = self.static, None
        if catalog is not None:
            removed = catalog.remove(name) if tenant == DEFAULT_TENANT else None
            if removed is None:
                raise NotFound(f"adapter {lora_name!r} is not loaded", param="lora_name")
        self._unloading[(tenant, name)] += 1
        try:
            try:
                await self._drain(tenant, name, lora_name)
            except BaseException:
                if catalog is not None and removed is not None:  # given up: served again
                    catalog.add(removed.name, removed.digest)
                raise
            # still refused until it is freed, so no request finds it half gone
            gone = await self.command("unregister", name, tenant)
        finally:
            self._unloading[(tenant, name)] -= 1
            if not self._unloading[(tenant, name)]:
                del self._unloading[(tenant, name)]
        if self.warmer is not None:
            for ref in gone:
                self.warmer.forget(ref.key)
        if not gone and self.static is None:
            raise NotFound(f"adapter {lora_name!r} is not loaded", param="lora_name")
        self.metrics.cpu_evictions += len(gone)

    async def _drain(self, tenant: str, name: str, lora_name: str) -> None:
        """Wait until no request holds a version of (tenant, name); UnloadTimeout past the
        setting."""
        prefix = f"{tenant}/{name}@"

        def keys() -> list[str]:
            return [k for k in self._inflight if k.startswith(prefix)]

        timeout = self.settings.unload_timeout_s
        try:
            await asyncio.wait_for(self._wait_idle(keys), timeout)
        except TimeoutError:
            running = sum(self._inflight[k] for k in keys())
            raise UnloadTimeout(
                f"adapter {lora_name!r} still had {running} running request(s) after"
                f" {timeout:g} s (LORAPLANE_UNLOAD_TIMEOUT_S): the unload is given up and the"
                " adapter is served as before",
                param="lora_name",
                retry_after=timeout,
            ) from None

    async def pin_static(self, name: str, pin: bool = True) -> str:
        """Pin (or unpin) static adapter `name`: its pin state ('unpinned' after an unpin).
        Catalog mode: the control plane assigns pins (InvalidRequest here)."""
        if self.static is None:
            raise InvalidRequest(
                "in catalog mode the control plane assigns pins: PUT"
                " /v1/adapters/{name}/versions/{version}/pin there",
                param="lora_name",
            )
        adapter = self.static.get(name)
        if adapter is None:
            raise NotFound(f"no adapter {name!r} is served", param="lora_name")
        ref = LoRARef(name, DEFAULT_TENANT, adapter.digest)
        if not pin:
            await self.command("unpin", ref)
            return "unpinned"
        try:
            state: str = await self.command("pin", ref)
        except PinRefused as e:
            raise PinsDoNotFit(str(e), param="lora_name") from e
        return state
