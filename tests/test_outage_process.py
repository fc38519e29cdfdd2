"""Serving through a control-plane outage, with real processes: the control plane runs as
`loraplane controlplane` and is killed (SIGKILL, no goodbye) while two tenants stream from a
catalog-mode data plane, then started again on the same port and database. No request of a
known tenant fails, and it can list its models; a key never seen gets 503 with Retry-After
meanwhile; the usage of the outage reaches the catalog once the control plane is back, counted
once. And with a usage spool, the data plane killed too during the outage (SIGKILL) loses
none of the outage's usage: restarted, it sends it, counted once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from loraplane.dataplane.server.settings import ServerSettings
from loraplane.dataplane.server.usage_spool import UsageSpool
from tests.controlplane.conftest import ADMIN, SERVICE
from tests.dataplane.server.conftest import spawn, start_server, wait_ready
from tests.servers import free_port

REPO = Path(__file__).resolve().parents[1]
BASE = "tiny-base"


def start_controlplane(port: int, data: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LORAPLANE_DATA_DIR": str(data),
           "LORAPLANE_ADMIN_TOKEN": ADMIN, "LORAPLANE_SERVICE_TOKEN": SERVICE}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplane", "controlplane", "--port", str(port)], cwd=data,
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "the control plane exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the control plane did not start"
        time.sleep(0.1)


def models(url: str, key: str) -> list[str]:
    """The ids /v1/models lists for `key`, as an SDK reads them."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    return [m.id for m in client.models.list()]


def test_a_killed_control_plane_fails_no_request_of_a_known_tenant(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    port = free_port()
    cp = f"http://127.0.0.1:{port}"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    proc = start_controlplane(port, tmp_path)
    try:
        pool = {"name": "pool-a", "base_model": {"name": BASE, "uri": str(tiny_llama_dir)}}
        assert httpx.post(cp + "/v1/pools", json=pool, headers=admin).status_code == 201
        keys = {}
        for tenant in ("acme", "globex", "initech"):
            assert httpx.post(cp + "/v1/tenants", json={"name": tenant},
                              headers=admin).status_code == 201  # fmt: skip
            r = httpx.post(cp + f"/v1/tenants/{tenant}/keys", json={"name": "k"}, headers=admin)
            keys[tenant] = r.json()["key"]
        src = peft_adapters["r16"]
        files = [("files", (p.name, p.read_bytes())) for p in sorted(src.iterdir())]
        acme = {"Authorization": f"Bearer {keys['acme']}"}
        form = {"name": "support", "base_model": BASE}
        r = httpx.post(cp + "/v1/adapters", data=form, files=files, headers=acme)
        assert r.status_code == 201, r.text
        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name=BASE, controlplane_url=cp,
            service_token=SERVICE, store=str(tmp_path / "store"), pool="pool-a",
            pressure_interval_s=0.3, resolve_ttl_s=0.5, num_kv_blocks=256, metrics_port=0,
        )  # fmt: skip
        done: Counter[str] = Counter()
        failures: list[str] = []
        stop = threading.Event()
        with start_server(settings) as (url, _):
            targets = {"acme": "support", "globex": BASE}

            def stream(tenant: str) -> None:
                client = openai.OpenAI(base_url=url + "/v1", api_key=keys[tenant], max_retries=0)
                while not stop.is_set():
                    try:
                        chunks = client.completions.create(
                            model=targets[tenant], prompt="outage", stream=True, max_tokens=6,
                            temperature=0, extra_body={"ignore_eos": True},
                        )  # fmt: skip
                        assert "".join(c.choices[0].text for c in chunks)
                        done[tenant] += 1
                    except Exception as e:  # a known tenant's failure is the finding
                        failures.append(f"{tenant}: {type(e).__name__}: {e}")

            workers = [threading.Thread(target=stream, args=(t,)) for t in targets]
            for w in workers:
                w.start()
            deadline = time.monotonic() + 60
            while min(done["acme"], done["globex"]) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert min(done["acme"], done["globex"]) >= 2, (done, failures)
            assert models(url, keys["acme"]) == [BASE, "support"]  # an SDK starting up
            proc.send_signal(signal.SIGKILL)  # no graceful shutdown
            proc.wait(30)
            before = dict(done)
            time.sleep(2.0)  # four resolve TTLs without a control plane
            during = {t: done[t] - before[t] for t in before}
            listed = models(url, keys["acme"])
            stranger = httpx.post(url + "/v1/completions", json={"model": BASE, "prompt": "x",
                                  "max_tokens": 1}, headers={"Authorization":
                                  f"Bearer {keys['initech']}"})  # fmt: skip
            proc = start_controlplane(port, tmp_path)
            time.sleep(1.0)
            stop.set()
            for w in workers:
                w.join(60)
            served = sum(done.values())
            deadline = time.monotonic() + 20
            counted = 0
            while time.monotonic() < deadline:
                counted = sum(
                    row["requests"]
                    for t in targets
                    for row in httpx.get(cp + "/v1/usage",
                                         headers={"Authorization": f"Bearer {keys[t]}"}).json()
                )  # fmt: skip
                if counted >= served:
                    break
                time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(30)
    assert failures == []
    assert during["acme"] > 0 and during["globex"] > 0, during
    assert listed == [BASE, "support"]  # listed from its last good answer
    assert stranger.status_code == 503 and stranger.headers.get("retry-after"), stranger.text
    assert counted == served  # every request of the outage counted, once


def spooled_requests(path: Path) -> int:
    """Requests the spool file holds (the batch in flight and the rest), 0 without one."""
    try:
        doc = json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return 0  # none yet (an atomic write never shows half a file)
    return sum(row[2] for row in doc["pending_usage"] + doc["usage"])


def settled(path: Path, counts: tuple[int, ...], quiet: float = 1.0) -> bool:
    """Whether the spool holds one of `counts` requests and still does `quiet` seconds later."""
    first = spooled_requests(path)
    if first not in counts:
        return False
    time.sleep(quiet)
    return spooled_requests(path) == first


def counted_requests(cp: str, key: str) -> int:
    usage = httpx.get(cp + "/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    return sum(row["requests"] for row in usage)


@pytest.mark.slow
def test_usage_of_a_data_plane_killed_during_an_outage_arrives_once_after_restarts(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Control plane down, the data plane serves known tenants and spools their usage; the
    data plane is killed too (SIGKILL). Both restarted: the spooled usage is counted, once."""
    port, dp_port = free_port(), free_port()
    cp, dp = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{dp_port}"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    spool = tmp_path / "spool"
    args = ["--model", str(tiny_llama_dir), "--served-model-name", BASE, "--port", str(dp_port),
            "--controlplane-url", cp, "--usage-spool-dir", str(spool)]  # fmt: skip
    env = {"LORAPLANE_SERVICE_TOKEN": SERVICE, "LORAPLANE_STORE": str(tmp_path / "store"),
           "LORAPLANE_POOL": "pool-a", "LORAPLANE_REPLICA": "dp-0",
           "LORAPLANE_PRESSURE_INTERVAL_S": "0.3", "LORAPLANE_RESOLVE_TTL_S": "0.3",
           "LORAPLANE_NUM_KV_BLOCKS": "64"}  # fmt: skip
    spool_file = UsageSpool(spool, "dp-0").path
    control = start_controlplane(port, tmp_path)
    data = spawn(args, env)
    try:
        pool = {"name": "pool-a", "base_model": {"name": BASE, "uri": str(tiny_llama_dir)}}
        assert httpx.post(cp + "/v1/pools", json=pool, headers=admin).status_code == 201
        r = httpx.post(cp + "/v1/tenants", json={"name": "acme"}, headers=admin)
        assert r.status_code == 201, r.text
        r = httpx.post(cp + "/v1/tenants/acme/keys", json={"name": "k"}, headers=admin)
        key = r.json()["key"]
        wait_ready(dp, proc=data)
        body = {"model": BASE, "prompt": "spool", "max_tokens": 2}
        auth = {"Authorization": f"Bearer {key}"}

        def complete(n: int) -> None:
            for _ in range(n):
                r = httpx.post(dp + "/v1/completions", json=body, headers=auth, timeout=60)
                assert r.status_code == 200, r.text

        complete(3)
        assert wait_for(lambda: counted_requests(cp, key) == 3)  # delivered the usual way
        control.send_signal(signal.SIGKILL)
        control.wait(30)
        complete(4)  # known: served from its last good resolution; usage spooled
        # 4, or 7 where the report of the first 3 was in flight when the control plane died:
        # counted there, its answer lost, so it stays pending and is sent again after the
        # restarts (counted once: below). Settled: 3 pending + 1 new must not pass for 4.
        assert wait_for(lambda: settled(spool_file, (4, 7))), spooled_requests(spool_file)
        data.send_signal(signal.SIGKILL)  # no last report, no last write
        data.communicate(timeout=30)
        control = start_controlplane(port, tmp_path)
        data = spawn(args, env)
        wait_ready(dp, proc=data)
        assert wait_for(lambda: counted_requests(cp, key) == 7), counted_requests(cp, key)
        assert wait_for(lambda: not spool_file.exists())  # delivered: nothing left on disk
        time.sleep(1.0)  # three more reports: the batch is not counted again
        assert counted_requests(cp, key) == 7
    finally:
        for proc in (data, control):
            if proc.poll() is None:
                proc.terminate()
        data.communicate(timeout=30)  # (its pipes drained)
        control.wait(30)


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
