"""Slot pressure and usage reports to the control plane (catalog mode).

Every `interval` seconds the reporter posts `POST {url}/internal/v1/pressure`
(docs/controlplane.md, the internal API) with the replica's pressure, read from an engine
snapshot: requests deferred now (requests whose adapter does not fit in the adapter memory
beside the running ones), running and waiting adapters, adapters in the device pool, adapter
memory used and total, KV usage, waiting requests per adapter, and the tokens used per tenant
and adapter since the last report. Usage is counted once: each report's usage is a batch with an
id; a report that got no answer (or a 5xx or 429) is sent again with the same batch, which the
control plane counts only if it has not already (it keeps each replica's last batch), while new
usage waits in the log for the next batch; a report refused outright (4xx) puts its usage back
into the log. A failing control plane never stops serving. The body follows the control plane's
`PressureReport` schema (it forbids unknown fields): the host tier's bytes (`cpu_bytes`) and its
byte limit (`cpu_bytes_capacity`, null without `--max-cpu-lora-bytes`) are sent until a control
plane from before them refuses them (400 naming the field); the next reports go without them.

The pool is named by its namespace and name (LORAPLANE_POOL_NAMESPACE, LORAPLANE_POOL). Reports
carry the config.json the replica loaded its base model from until an answer says the pool has
one: a pool whose model is only on its replicas' volume learns it this way. A config the control
plane refuses (422) is not sent again; the next report goes without it. Reports go through
`loraplane.internal_api.AsyncInternalAPIClient`; whatever its error, no usage is lost. An
answer's `pins` (the versions this replica keeps resident) go to `on_pins` when they change,
and the next reports carry what became of each (`pin_states`, from `pin_states`: held or
refused, and why), sent only while some are assigned (a control plane from before pins
assigns none and would refuse the unknown field).

With a spool folder (LORAPLANE_USAGE_SPOOL_DIR, usage_spool.py) undelivered usage also survives
a crash: the batch in flight and the log are written to disk before a batch is first sent,
after each accepted report, and every `spool_debounce_s` while new usage comes in; at start
they are read back and the batch goes again under its id, so the control plane counts it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from loraplane import fileaccess
from loraplane.dataplane.sequence import LoRARef
from loraplane.dataplane.server.pins import assigned
from loraplane.dataplane.server.usage_spool import Key, UsageSpool
from loraplane.dataplane.snapshot import EngineSnapshot
from loraplane.internal_api import AsyncInternalAPIClient, InternalAPIError

log = logging.getLogger(__name__)
PRESSURE_PATH = "/internal/v1/pressure"
TIMEOUT_S = 5.0
SPOOL_DEBOUNCE_S = 1.0  # new usage reaches the spool file this much later at most


class UsageLog:
    """Requests and tokens per (tenant, adapter) since the last drain, least recently counted
    first (the order in which a full spool leaves rows out)."""

    def __init__(self) -> None:
        self._rows: dict[Key, list[int]] = {}
        self.changes = 0  # bumped by every change (the spool writes when it moved)

    def add(
        self, tenant: str, adapter: str | None, *, requests: int, prompt: int, completion: int
    ) -> None:
        """Count one finished (or aborted) request's usage."""
        key = (tenant, adapter or "")
        row = self._rows.pop(key, None) or [0, 0, 0]
        self._rows[key] = row  # now the most recent
        row[0] += requests
        row[1] += prompt
        row[2] += completion
        self.changes += 1

    def drain(self) -> dict[Key, list[int]]:
        """Take everything counted so far."""
        rows, self._rows = self._rows, {}
        self.changes += 1
        return rows

    def restore(self, rows: dict[Key, list[int]]) -> None:
        """Put drained rows back (their report failed, or they were read from the spool), as
        older than anything counted since."""
        merged = {k: list(v) for k, v in rows.items() if k not in self._rows}
        for key, row in self._rows.items():
            back = rows.get(key)
            merged[key] = [a + b for a, b in zip(row, back, strict=True)] if back else row
        self._rows = merged
        self.changes += 1

    def snapshot(self) -> dict[Key, list[int]]:
        """A copy of what is counted now."""
        return {k: list(v) for k, v in self._rows.items()}


def pressure_body(
    pool: str,
    replica: str,
    snap: EngineSnapshot,
    usage: dict[Key, list[int]],
    *,
    namespace: str = "default",
    base_model_config: dict[str, Any] | None = None,
    host_bytes: bool = True,
) -> dict[str, Any]:
    """The JSON body of one report (`base_model_config` only when given; the host tier's
    bytes unless `host_bytes` is false)."""
    body: dict[str, Any] = {
        "namespace": namespace,
        "pool": pool,
        "replica": replica,
        "deferred": snap.deferred,
        "waiting_adapters": len(snap.waiting_adapters),
        "running_adapters": len(snap.running_adapters),
        "slots_used": sum(snap.resident.values()),
        "gpu_bytes": snap.gpu_bytes_used,
        "gpu_bytes_capacity": snap.gpu_bytes_capacity,
        "kv_usage": min(1.0, max(0.0, snap.kv_usage)),
        "adapters_waiting": [
            {"tenant": t, "adapter": a, "waiting_requests": n}
            for (t, a), n in sorted(snap.waiting_per_adapter.items())
        ],
        "usage": [
            {"tenant": t, "adapter": a, "requests": r, "prompt_tokens": p, "completion_tokens": c}
            for (t, a), (r, p, c) in sorted(usage.items())
        ],
    }
    if host_bytes:
        body["cpu_bytes"] = snap.cpu_bytes_used
        body["cpu_bytes_capacity"] = snap.cpu_bytes_limit
    if base_model_config is not None:
        body["base_model_config"] = base_model_config
    return body


def _accepted(response: httpx.Response) -> tuple[int, bool]:
    """From an accepted report's answer: the pool's live replicas (1 when absent or odd) and
    whether the pool has its base model config (true when absent: nothing more to send)."""
    try:
        answer = response.json()
        replicas, known = answer.get("replicas", 1), answer.get("base_model_config_known", True)
    except (ValueError, AttributeError):
        return 1, True
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        replicas = 1
    return replicas, known is not False


class PressureReporter:
    """Posts a pressure report every `interval` seconds until stopped."""

    def __init__(
        self,
        url: str,
        token: str | None,
        pool: str,
        replica: str,
        snapshot: Callable[[], Awaitable[EngineSnapshot]],
        usage: UsageLog,
        interval: float = 5.0,
        client: httpx.AsyncClient | None = None,
        *,
        namespace: str = "default",
        base_model_config: dict[str, Any] | None = None,
        spool_dir: Path | str | None = None,
        spool_debounce_s: float = SPOOL_DEBOUNCE_S,
    ) -> None:
        self.pool, self.replica, self.interval = pool, replica, interval
        self.namespace = namespace
        # sent until the control plane has the pool's config (or refuses this one)
        self.base_model_config = base_model_config
        # the host tier's bytes in each report, until a control plane from before them refuses
        self.host_bytes = True
        self._snapshot = snapshot
        self._usage = usage
        self._api = AsyncInternalAPIClient(url, token, timeout=TIMEOUT_S, client=client)
        self._task: asyncio.Task[None] | None = None
        self._spool_task: asyncio.Task[None] | None = None
        self.reports_ok = self.reports_failed = 0
        # undelivered usage on disk (None: memory only); one file per replica name
        self.spool = UsageSpool(spool_dir, replica) if spool_dir is not None else None
        self.spool_debounce_s = spool_debounce_s
        self._spool_lock = asyncio.Lock()
        self._spooled: tuple[int, str | None] | None = None  # the state the file holds
        # live replicas of the pool, from the last accepted report: tenants' rate limits are
        # split among them (each replica enforces its share)
        self.replicas = 1
        # usage sent but not acknowledged: sent again, as it is, with its batch id, until an
        # answer comes (the control plane counts a batch once); new usage waits in the log
        self._pending: tuple[str, dict[Key, list[int]]] | None = None
        # told the versions each answer assigns to this replica when they change (pins.py)
        self.on_pins: Callable[[list[tuple[LoRARef, str]]], Awaitable[None]] | None = None
        self._pins: list[tuple[LoRARef, str]] | None = None  # the last assignment applied
        # whether an unchanged assignment is due to be applied again (PinSync.retry_due)
        self.pins_retry: Callable[[], bool] | None = None
        # what became of each assigned version here (PinSync.states), sent in each report
        self.pin_states: Callable[[], Awaitable[list[dict[str, str]]]] | None = None

    async def report_once(self) -> bool:
        """Send one report; True when the control plane accepted it."""
        snap = await self._snapshot()
        if self._pending is None:
            self._pending = (uuid.uuid4().hex, self._usage.drain())
            if self._pending[1]:
                await self.save_spool()  # the file names the batch before it can be counted
        batch, rows = self._pending
        body = pressure_body(
            self.pool, self.replica, snap, rows, namespace=self.namespace,
            base_model_config=self.base_model_config, host_bytes=self.host_bytes,
        )  # fmt: skip
        if rows:
            body["usage_batch"] = batch
        states = await self._pin_states()
        if states:
            body["pin_states"] = states
        try:
            response = await self._api.request("POST", PRESSURE_PATH, json=body)
        except InternalAPIError as e:
            if e.status == 422 and self.base_model_config is not None:
                log.error("the control plane refused this replica's base model config.json: %s",
                          e.message[:500])  # fmt: skip
                self.base_model_config = None
            elif e.status == 400 and self.host_bytes and "cpu_bytes" in e.message:
                log.warning("the control plane does not take the host tier's bytes (it is older"
                            " than them): left out of the reports from now on")  # fmt: skip
                self.host_bytes = False
            elif e.status is None:
                log.warning("pressure report failed: %s", type(e.__cause__).__name__)
            else:
                log.warning("pressure report refused: HTTP %s (%s)", e.status, e.code)
            self.reports_failed += 1
            if e.status is not None and e.status < 500 and e.status != 429:
                # refused, so not counted: the rows go back into the log, in a new batch
                self._pending = None
                self._usage.restore(rows)
                await self.save_spool()
            return False  # otherwise the same batch goes again (it may have been counted)
        self._pending = None
        if rows:
            # counted: off the disk before the next report replaces the control plane's
            # record of this batch (a crash between the two would then count it again)
            await self.save_spool()
        self.replicas, known = _accepted(response)
        if known:
            self.base_model_config = None
        self.reports_ok += 1
        await self._apply_pins(response)
        return True

    async def _pin_states(self) -> list[dict[str, str]]:
        """The assigned versions' states, or none when there are none or the engine cannot say
        now (the report goes without them: pins never stop the reports)."""
        if self.pin_states is None or not self._pins:
            return []
        try:
            return await self.pin_states()
        except Exception as e:
            log.warning("this replica's pin states are left out of the report: %s", e)
            return []

    async def _apply_pins(self, response: httpx.Response) -> None:
        """Hand a changed pin assignment to `on_pins`, or an unchanged one when `pins_retry`
        says so (a failure is logged and tried again with the next answer: pins never stop
        the reports)."""
        try:
            pins = assigned(response.json())
        except ValueError:
            return
        if pins is None or self.on_pins is None:
            return
        if pins == self._pins and not (self.pins_retry is not None and self.pins_retry()):
            return
        try:
            await self.on_pins(pins)
        except Exception:
            log.exception("applying this replica's pins failed (tried again next report)")
            return
        self._pins = pins

    def _spool_state(self) -> tuple[int, str | None]:
        return self._usage.changes, None if self._pending is None else self._pending[0]

    async def save_spool(self) -> None:
        """Write the undelivered usage (the batch in flight, the log) to the spool file now.
        A failed write is logged and the file removed: a crash then loses that usage, but
        an old file can never make the control plane count a batch twice."""
        if self.spool is None:
            return
        spool = self.spool
        async with self._spool_lock:  # writes in order: the file never goes back in time
            state = self._spool_state()
            pending = self._pending
            rows = self._usage.snapshot()
            try:
                await asyncio.to_thread(spool.save, pending, rows)
            except OSError as e:
                spool.write_failures += 1
                log.error("usage spool %s cannot be written (%s): removed", spool.path,
                          fileaccess.message(e, "write"))  # fmt: skip
                with contextlib.suppress(OSError):
                    spool.path.unlink(missing_ok=True)
            self._spooled = state

    def _restore_spool(self) -> bool:
        """Take back what the spool file holds; True when there was usage in it."""
        if self.spool is None:
            return False
        spooled = self.spool.load()
        if spooled.pending is not None and self._pending is None:
            self._pending = spooled.pending
        self._usage.restore(spooled.rows)
        self._spooled = self._spool_state()
        found = spooled.pending is not None or bool(spooled.rows)
        if found:
            batch = spooled.pending[0] if spooled.pending is not None else None
            rows = len(spooled.rows) + (len(spooled.pending[1]) if spooled.pending else 0)
            log.info("usage spool %s: %d rows of undelivered usage read back (batch in flight:"
                     " %s)", self.spool.path, rows, batch)  # fmt: skip
        return found

    async def _run(self, now: bool) -> None:
        while True:
            if not now:
                await asyncio.sleep(self.interval)
            now = False
            try:
                await self.report_once()
            except Exception:  # a bad snapshot must not end the reporter
                log.exception("pressure report failed")

    async def _run_spool(self) -> None:
        while True:
            await asyncio.sleep(self.spool_debounce_s)
            if self._spool_state() != self._spooled:
                await self.save_spool()

    def start(self) -> None:
        """Read back the spool, if any, and start the background tasks (in the running loop);
        spooled usage is sent at once."""
        loop = asyncio.get_running_loop()
        restored = self._restore_spool()
        self._task = loop.create_task(self._run(restored), name="pressure")
        if self.spool is not None:
            self._spool_task = loop.create_task(self._run_spool(), name="usage-spool")

    async def stop(self) -> None:
        """Stop the tasks, send a last report, spool what it could not deliver, close."""
        tasks = [t for t in (self._task, self._spool_task) if t is not None]
        async with self._spool_lock:  # cancelled between writes, never in the middle of one
            for task in tasks:
                task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(Exception):
            await self.report_once()
        await self.save_spool()
        await self._api.aclose()
