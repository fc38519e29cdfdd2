"""The usage spool: undelivered usage on disk, bounded, atomic, read back once; a damaged file
is ignored, never half-used. The reporter with a spool against the real control plane app (a
lost answer after the control plane counted a batch, then a crash): counted once."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from loraplane.controlplane.main import create_app as create_controlplane
from loraplane.dataplane.server.pressure import PressureReporter, UsageLog
from loraplane.dataplane.server.usage_spool import Spooled, UsageSpool
from loraplane.dataplane.snapshot import EngineSnapshot
from tests.controlplane.conftest import ADMIN, SERVICE, make_settings

ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
POOL, REPLICA = "pool-a", "pod-0"


def rows(*items: tuple[str, str, int, int, int]) -> dict[tuple[str, str], list[int]]:
    return {(t, a): [r, p, c] for t, a, r, p, c in items}


async def empty_snapshot() -> EngineSnapshot:
    return EngineSnapshot()


def test_the_spool_round_trips_the_batch_in_flight_and_the_log(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path, "host:8000")
    pending = ("b1", rows(("acme", "bot", 2, 30, 12)))
    log_rows = rows(("acme", "", 1, 5, 2), ("globex", "x", 3, 9, 4))
    spool.save(pending, log_rows)
    assert spool.path.parent == tmp_path and ":" not in spool.path.name
    assert [p.name for p in tmp_path.iterdir()] == [spool.path.name]  # no temp file left
    back = UsageSpool(tmp_path, "host:8000").load()
    assert back == Spooled(pending, log_rows)
    assert UsageSpool(tmp_path, "host:8001").load() == Spooled()  # another replica's file
    spool.save(None, {})  # nothing undelivered: no file
    assert not spool.path.exists() and spool.load() == Spooled()


def test_a_full_spool_keeps_the_most_recent_rows_with_a_warning_and_a_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    usage = UsageLog()
    for i in range(200):
        usage.add(f"t{i:03d}", "bot", requests=1, prompt=i, completion=1)
    usage.add("t000", "bot", requests=1, prompt=1, completion=1)  # now the most recent
    spool = UsageSpool(tmp_path, REPLICA, max_bytes=2048)
    with caplog.at_level(logging.WARNING):
        spool.save(None, usage.snapshot())
    assert spool.path.stat().st_size <= 2048
    kept = spool.load().rows
    assert 0 < len(kept) < 200 and spool.rows_left_out == 200 - len(kept)
    assert "not on disk" in caplog.text
    assert ("t000", "bot") in kept and ("t199", "bot") in kept  # the most recent
    assert ("t001", "bot") not in kept  # the least recent went first
    assert kept[("t000", "bot")] == [2, 1, 2]


def whole_file(tmp_path: Path) -> bytes:
    spool = UsageSpool(tmp_path, REPLICA)
    spool.save(("b1", rows(("acme", "bot", 2, 30, 12))), rows(("acme", "", 1, 5, 2)))
    return spool.path.read_bytes()


def edited(data: bytes, **changes: Any) -> bytes:
    doc = json.loads(data)
    doc.update(changes)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[: len(d) // 2],  # truncated
        lambda d: b"",
        lambda d: b"\x00\xff" * 40,
        lambda d: edited(d, format=2),
        lambda d: edited(d, replica="pod-1"),
        lambda d: edited(d, pending="not a batch id!"),
        lambda d: edited(d, usage=[["acme", "", -1, 5, 2]]),
        lambda d: edited(d, usage=[["acme", "", 1, 5]]),
        lambda d: edited(d, usage=[["acme", "", 1, 5, 2], ["acme", "", 1, 5, 2]]),
        lambda d: edited(d, usage=[["acme", "", True, 5, 2]]),
        lambda d: edited(d, pending=None),  # rows of a batch without its id
        lambda d: b"[1, 2, 3]",
    ],
    ids=[
        "truncated",
        "empty",
        "garbage",
        "format",
        "replica",
        "batch-id",
        "negative",
        "short-row",
        "twice",
        "bool",
        "batch-rows-without-id",
        "not-an-object",
    ],
)
def test_a_damaged_spool_is_logged_and_ignored_never_half_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any
) -> None:
    spool = UsageSpool(tmp_path, REPLICA)
    spool.path.write_bytes(damage(whole_file(tmp_path)))
    with caplog.at_level(logging.ERROR):
        assert spool.load() == Spooled()
    assert "is damaged" in caplog.text


def test_a_write_the_process_did_not_finish_leaves_the_last_whole_file(tmp_path: Path) -> None:
    data = whole_file(tmp_path)
    spool = UsageSpool(tmp_path, REPLICA)
    leftover = tmp_path / f".{spool.path.name}.x1y2.tmp"
    leftover.write_bytes(data[:10])  # killed mid-write: the rename never happened
    back = spool.load()
    assert back.pending is not None and back.pending[0] == "b1"
    assert not leftover.exists()


# -- the reporter with a spool, against the real control plane --------------------------------


@pytest.fixture
def controlplane(tmp_path: Path, sqlite_template: Path, base_model_dir: Path) -> Any:
    """The control plane app on a copy of the migrated SQLite catalog, a pool and a tenant;
    (app, the tenant's key)."""
    db = tmp_path / "catalog.db"
    shutil.copy(sqlite_template, db)
    app = create_controlplane(make_settings(tmp_path, f"sqlite:///{db}"))
    with TestClient(app) as client:
        pool = {"name": POOL, "base_model": {"name": "tiny", "uri": str(base_model_dir)}}
        assert client.post("/v1/pools", json=pool, headers=ADMIN_H).status_code == 201
        assert client.post("/v1/tenants", json={"name": "acme"}, headers=ADMIN_H).status_code == 201
        r = client.post("/v1/tenants/acme/keys", json={"name": "k"}, headers=ADMIN_H)
        yield app, r.json()["key"]
    app.state.ctx.close()


def counted(app: Any, key: str) -> int:
    with TestClient(app) as client:
        usage = client.get("/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    return sum(row["requests"] for row in usage)


def test_a_batch_counted_before_its_answer_was_lost_and_a_crash_is_counted_once(
    controlplane: Any, tmp_path: Path
) -> None:
    """The worst case for a spool: the control plane counted the batch, its answer never came,
    then the replica died. Read back, the batch goes again under its id: counted once. The
    file names the batch before it is first sent (a crash right after sending cannot turn
    the rows back into a new batch)."""
    app, key = controlplane
    spool_dir = tmp_path / "spool"
    asgi = httpx.ASGITransport(app=app)
    seen: list[tuple[str | None, str | None]] = []  # (batch sent, batch the file names)

    def record(request: httpx.Request) -> None:
        path = UsageSpool(spool_dir, REPLICA).path
        on_disk = json.loads(path.read_bytes())["pending"] if path.exists() else None
        seen.append((json.loads(request.content).get("usage_batch"), on_disk))

    async def lose_answers(request: httpx.Request) -> httpx.Response:
        record(request)
        await asgi.handle_async_request(request)  # counted ...
        raise httpx.ReadError("connection reset", request=request)  # ... answer lost

    async def answer(request: httpx.Request) -> httpx.Response:
        record(request)
        return await asgi.handle_async_request(request)

    async def first_life() -> None:
        usage = UsageLog()
        client = httpx.AsyncClient(transport=httpx.MockTransport(lose_answers))
        reporter = PressureReporter("http://cp", SERVICE, POOL, REPLICA, empty_snapshot, usage,
                                    client=client, spool_dir=spool_dir)  # fmt: skip
        usage.add("acme", None, requests=3, prompt=30, completion=12)
        assert not await reporter.report_once()  # no answer: the batch stays in flight
        usage.add("acme", None, requests=2, prompt=20, completion=8)  # not sent yet
        await reporter.save_spool()
        # the process dies here: no stop(), no last report

    asyncio.run(first_life())
    first = seen[0][0]
    assert first is not None and seen == [(first, first)]
    assert counted(app, key) == 3

    async def second_life() -> PressureReporter:
        client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        reporter = PressureReporter("http://cp", SERVICE, POOL, REPLICA, empty_snapshot,
                                    UsageLog(), interval=0.05, client=client,
                                    spool_dir=spool_dir, spool_debounce_s=60.0)  # fmt: skip
        reporter.start()  # reads the spool back and reports at once
        # (no debounced write comes in time: the file changes only when reports make it)
        for _ in range(200):
            if reporter.reports_ok >= 3:
                break
            await asyncio.sleep(0.02)
        await reporter.stop()
        return reporter

    reporter = asyncio.run(second_life())
    assert reporter.reports_ok >= 3
    assert seen[1][0] == first  # read back, the batch in flight went first, under its id
    # whenever a report went out, the file named the batch it carried or none: never an
    # older batch, which the control plane no longer remembers once a newer report replaced it
    assert all(on_disk in (None, sent) for sent, on_disk in seen), seen
    assert counted(app, key) == 5  # the lost-answer batch once, the rest once
    assert reporter.spool is not None and not reporter.spool.path.exists()


def test_usage_counted_while_the_control_plane_is_down_reaches_the_spool_debounced(
    tmp_path: Path,
) -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def run() -> None:
        usage = UsageLog()
        client = httpx.AsyncClient(transport=httpx.MockTransport(down))
        reporter = PressureReporter("http://cp", SERVICE, POOL, REPLICA, empty_snapshot, usage,
                                    interval=60.0, client=client, spool_dir=tmp_path,
                                    spool_debounce_s=0.05)  # fmt: skip
        reporter.start()
        assert reporter.spool is not None
        for i in range(50):  # many requests finish within one debounce
            usage.add("acme", "bot", requests=1, prompt=i, completion=1)
        assert not reporter.spool.path.exists()  # not written per request
        want = {("acme", "bot"): [50, sum(range(50)), 50]}
        deadline = time.monotonic() + 10
        while reporter.spool.writes == 0 or reporter.spool.load().rows != want:
            assert time.monotonic() < deadline, "the usage was never spooled"
            await asyncio.sleep(0.02)  # written after the debounce, fsyncs included
        writes = reporter.spool.writes
        assert writes <= 2  # debounced: not one write per request
        await asyncio.sleep(0.2)
        assert reporter.spool.writes == writes  # nothing changed: nothing written
        await reporter.stop()  # the last report fails: the usage stays spooled, in a batch
        spooled = reporter.spool.load()
        assert spooled.pending is not None and spooled.rows == {}
        assert spooled.pending[1] == {("acme", "bot"): [50, sum(range(50)), 50]}

    asyncio.run(run())
