"""Control plane speed, on a throwaway PostgreSQL and a uvicorn server in its own process.

1. Resolve latency: 100 tenants, 2,000 adapters; GET /internal/v1/resolve at a fixed rate
   (open loop: latency counts from each request's scheduled time, so a stall is not hidden)
   from a load generator on 127.0.0.1, bounded in count and time. Goal: p99 <= 10 ms.
2. Upload-to-version: an 80 MiB rank-16 adapter (benchmarks/ingest.py's shape) uploaded over
   HTTP until its version is recorded, divided by a plain durable copy (copy + fsync) of the
   same bytes. An upload that big is ingested in the background (202 and a job): the time runs
   until a poll of `/v1/uploads/{id}` sees it succeed (`upload_background` 1).

Run: .venv/bin/python benchmarks/controlplane.py [--rate 500] [--requests 5000] [--workers 1]
(--smoke: 10 tenants, 100 adapters, 200 requests, a 5 MiB upload sent to the background too)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _common import add_smoke_flag, goal, report
from ingest import base_config, base_spec, build_adapter
from sqlalchemy import insert, text

from loraplane.controlplane import db, security
from loraplane.controlplane.models import Adapter, AdapterVersion, ApiKey, Pool, Tenant
from loraplane.readiness import NotReady, wait_ok

REPO = Path(__file__).resolve().parents[1]
ADMIN = "bench-admin-" + "Q7w9E2r4T6y8U1i3O5p0" * 2
SERVICE = "bench-service-" + "A1s3D5f7G9h2J4k6L8z0" * 2
TENANTS, ADAPTERS = 100, 2000
SMOKE_TENANTS, SMOKE_ADAPTERS, SMOKE_REQUESTS = 10, 100, 200
SMALL_BASE = "bench-base"
POLL_S = 0.02  # between polls of a background upload: at most this much added to its time


def seed(url: str, tenants: int, adapters: int) -> list[tuple[str, str]]:
    """Tenants, keys and adapters written straight into the catalog: (key, model) pairs."""
    engine = db.make_engine(url)
    db.upgrade(engine)
    keys = [security.generate_key() for _ in range(tenants)]
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
    with engine.begin() as conn:
        conn.execute(insert(Pool), [{
            "name": "bench", "base_model_name": SMALL_BASE, "base_model_uri": "/bench",
            "base_model_config": config, "max_lora_rank": 64, "max_loras": 8,
            "max_cpu_loras": 32}])  # fmt: skip
        conn.execute(insert(Tenant), [{
            "id": t + 1, "name": f"tenant-{t}", "namespace": f"tenant-{t}", "max_adapters": 100,
            "max_rank": 64, "max_bytes": 1 << 30, "requests_per_minute": 10**6,
            "tokens_per_minute": 10**9, "deleted": False} for t in range(tenants)])  # fmt: skip
        conn.execute(insert(ApiKey), [{
            "tenant_id": t + 1, "name": "bench", "prefix": k.prefix, "key_hash": k.key_hash}
            for t, k in enumerate(keys)])  # fmt: skip
        per = adapters // tenants
        conn.execute(insert(Adapter), [{
            "id": i + 1, "tenant_id": i // per + 1, "name": f"adapter-{i % per}",
            "base_model": SMALL_BASE, "current_version": 2, "deleted": False}
            for i in range(adapters)])  # fmt: skip
        conn.execute(insert(AdapterVersion), [{
            "adapter_id": i + 1, "version": v, "digest": f"{i:060d}{v:04d}",
            "path": f"adapters/x/adapter-{i}/v{v}-{i:012d}/", "rank": 8, "alpha": 16.0,
            "target_modules": ["q_proj", "v_proj"], "size_bytes": 1 << 20,
            "base_model": SMALL_BASE, "created_by": "bench"}
            for i in range(adapters) for v in (1, 2)])  # fmt: skip
        for table in ("tenants", "adapters"):  # ids were given: move the sequences past them
            conn.execute(
                text(
                    f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                    f"(SELECT max(id) FROM {table}))"
                )
            )
    engine.dispose()
    models = [f"adapter-{a}" for a in range(adapters // tenants)]
    return [(k.secret, m) for k in keys for m in models]


def start_server(
    url: str, store: Path, port: int, workers: int, background_bytes: int | None = None
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "LORAPLANE_DATABASE_URL": url, "LORAPLANE_STORE": str(store),
           "LORAPLANE_ADMIN_TOKEN": ADMIN, "LORAPLANE_SERVICE_TOKEN": SERVICE,
           "LORAPLANE_DATA_DIR": str(store.parent / "state")}  # fmt: skip
    if background_bytes is not None:
        env["LORAPLANE_BACKGROUND_INGEST_BYTES"] = str(background_bytes)
    cmd = [sys.executable, "-m", "uvicorn", "loraplane.controlplane.main:create_app", "--factory",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
           "--no-access-log", "--workers", str(workers)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=REPO)
    try:
        wait_ok(f"http://127.0.0.1:{port}/readyz", 30, alive=proc,
                interval=0.1)  # fmt: skip
    except NotReady as e:
        if e.stopped:
            raise RuntimeError(f"the control plane exited with {proc.returncode}") from None
        proc.kill()
        raise RuntimeError("the control plane did not start") from None
    return proc


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes) -> int:
    writer.write(req)
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)
    return status


async def load(port: int, pairs: list[tuple[str, str]], rate: float, count: int) -> list[float]:
    """Open-loop GETs at `rate`/s over keep-alive connections; latencies in seconds."""
    conns: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    for _ in range(64):
        conns.put_nowait(await asyncio.open_connection("127.0.0.1", port))
    rng = random.Random(0)
    latencies: list[float] = []
    errors = 0

    async def fire(scheduled: float, key: str, model: str) -> None:
        nonlocal errors
        req = (
            f"GET /internal/v1/resolve?model={model} HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {SERVICE}\r\nX-Tenant-Key: {key}\r\n\r\n"
        ).encode()
        conn = await conns.get()
        try:
            if await _one(*conn, req) != 200:
                errors += 1
        finally:
            conns.put_nowait(conn)
        latencies.append(time.perf_counter() - scheduled)

    loop = asyncio.get_running_loop()
    # The generator's own garbage collector once stalled it for ~80 ms mid-run, which showed as
    # the server's p99: no collections while the load runs (the heap is frozen, and small).
    gc.collect()
    gc.freeze()
    gc.disable()
    start = time.perf_counter() + 0.05
    tasks = []
    for i in range(count):
        scheduled = start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        key, model = pairs[rng.randrange(len(pairs))]
        tasks.append(loop.create_task(fire(scheduled, key, model)))
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    finally:
        gc.enable()
        gc.unfreeze()
    while not conns.empty():
        conns.get_nowait()[1].close()
    if errors:
        raise RuntimeError(f"{errors} resolve requests failed")
    return latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def await_job(http: httpx.Client, response: httpx.Response, auth: dict[str, str]) -> None:
    """Poll a background upload (202) at its Location until it succeeds; raise if it fails."""
    where = response.headers["location"]
    deadline, status = time.monotonic() + 300, "pending"
    while time.monotonic() < deadline:
        job = http.get(where, headers=auth)
        job.raise_for_status()
        status = job.json()["status"]
        if status == "succeeded":
            return
        if status == "failed":
            raise RuntimeError(f"background upload failed: {job.json()['error']}")
        time.sleep(POLL_S)
    raise TimeoutError(f"background upload {where} still {status} after 300 s")


def upload_ratio(port: int, root: Path, repeats: int, smoke: bool) -> dict[str, float]:
    """Median upload-to-version time of an 80 MiB adapter over a durable copy of its bytes."""
    base = base_spec(smoke)
    src = build_adapter(root / "big", base)
    model_dir = root / "big-base"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(base_config(base.num_layers)))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        body = {"name": "big", "base_model": {"name": base.name, "uri": str(model_dir)}}
        http.post("/v1/pools", json=body, headers=admin).raise_for_status()
        http.post("/v1/tenants", json={"name": "big"}, headers=admin).raise_for_status()
        key = http.post("/v1/tenants/big/keys", json={}, headers=admin).json()["key"]
        weights = src / "adapter_model.safetensors"
        copies, uploads, background = [], [], 0
        for i in range(repeats):
            os.sync()
            t = time.perf_counter()
            shutil.copyfile(weights, root / f"copy-{i}")
            with open(root / f"copy-{i}", "rb") as fh:
                os.fsync(fh.fileno())
            copies.append(time.perf_counter() - t)
            os.sync()
            t = time.perf_counter()
            with open(src / "adapter_config.json", "rb") as c, open(weights, "rb") as w:
                files = [("files", ("adapter_config.json", c)),
                         ("files", ("adapter_model.safetensors", w))]  # fmt: skip
                form = {"name": f"big-{i}", "base_model": base.name}
                auth = {"Authorization": f"Bearer {key}"}
                r = http.post("/v1/adapters", data=form, files=files, headers=auth)
            if r.status_code == 202:  # ingested in the background: done when its job is
                await_job(http, r, auth)
                background += 1
            elif r.status_code != 201:
                raise RuntimeError(f"upload failed: {r.status_code} {r.text[:300]}")
            uploads.append(time.perf_counter() - t)
    copy_s, upload_s = statistics.median(copies), statistics.median(uploads)
    return {"upload_mib": weights.stat().st_size / 2**20, "plain_copy_s": copy_s,
            "upload_to_version_s": upload_s, "upload_over_copy": upload_s / copy_s,
            "upload_background": background / repeats}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    add_smoke_flag(parser)
    args = parser.parse_args()
    tenants, adapters = (SMOKE_TENANTS, SMOKE_ADAPTERS) if args.smoke else (TENANTS, ADAPTERS)
    requests = SMOKE_REQUESTS if args.smoke else args.requests
    repeats = 1 if args.smoke else args.repeats
    sys.path.insert(0, str(REPO))  # the throwaway cluster helper lives with the tests
    from tests.controlplane.pg import PgCluster, find_bin, free_port

    bindir = find_bin()
    if bindir is None:
        sys.exit("needs PostgreSQL server binaries under /usr/lib/postgresql/*/bin")
    cluster = PgCluster(bindir)
    root = Path(tempfile.mkdtemp(prefix="cp-bench-", dir=Path.cwd()))
    proc = None
    try:
        cluster.start()
        url = cluster.create_database("bench")
        pairs = seed(url, tenants, adapters)
        port = free_port()
        # --smoke: its 5 MiB upload goes to the background too, the path the 80 MiB one takes
        background_bytes = 1 << 20 if args.smoke else None
        proc = start_server(url, root / "store", port, args.workers, background_bytes)
        asyncio.run(load(port, pairs, args.rate, min(500, requests // 2)))  # warm-up
        lat = asyncio.run(load(port, pairs, args.rate, requests))
        figures = {
            "workers": float(args.workers), "tenants": float(tenants),
            "adapters": float(adapters), "rate_per_s": args.rate,
            "requests": float(len(lat)), "resolve_p50_ms": pct(lat, 0.50) * 1000,
            "resolve_p90_ms": pct(lat, 0.90) * 1000, "resolve_p99_ms": pct(lat, 0.99) * 1000,
            "resolve_max_ms": max(lat) * 1000,
        }  # fmt: skip
        figures.update(upload_ratio(port, root, repeats, args.smoke))
        goals = [goal(figures, "resolve_p99_ms", "<=", 10.0)]
        return report("controlplane", figures, goals, smoke=args.smoke)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        cluster.destroy()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
