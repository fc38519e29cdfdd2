"""Serving through a control-plane outage, with real processes: the control plane runs as
`loraplane controlplane` and is killed (SIGKILL, no goodbye) while two tenants stream from a
catalog-mode data plane, then started again on the same port and database. No request of a
known tenant fails; a key never seen gets 503 with Retry-After meanwhile; the usage of the
outage reaches the catalog once the control plane is back, counted once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import openai

from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import ADMIN, SERVICE
from tests.dataplane.server.conftest import start_server
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
            proc.send_signal(signal.SIGKILL)  # no graceful shutdown
            proc.wait(30)
            before = dict(done)
            time.sleep(2.0)  # four resolve TTLs without a control plane
            during = {t: done[t] - before[t] for t in before}
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
    assert stranger.status_code == 503 and stranger.headers.get("retry-after"), stranger.text
    assert counted == served  # every request of the outage counted, once
