"""Across components: a tenant uploads through the control plane's REST API; the data plane,
in catalog mode, resolves the tenant's key and model through the control plane, loads the
stored version through its tiers and serves it over the OpenAI API; pressure and usage flow
back. Real HTTP everywhere (uvicorn), SQLite catalog, local object store."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from loraplane.controlplane.main import create_app as create_controlplane
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.sockets import listen, port_of
from tests.controlplane.conftest import ADMIN, SERVICE, make_settings
from tests.dataplane.server.conftest import start_server
from tests.servers import free_port, serve_in_thread, serve_sockets_in_thread

POOL, BASE_NAME = "pool-a", "tiny-base"


@contextlib.contextmanager
def controlplane(tmp: Path) -> Iterator[str]:
    """The control plane on SQLite and a local store under `tmp`, over real HTTP."""
    settings = make_settings(tmp, f"sqlite:///{tmp / 'catalog.db'}")
    app = create_controlplane(settings)
    try:
        with serve_in_thread(app) as url:
            yield url
    finally:
        app.state.ctx.close()


@contextlib.contextmanager
def split_controlplane(tmp: Path) -> Iterator[tuple[str, str, FastAPI]]:
    """The control plane as the chart runs it: a public port (tenants, admins) and an internal
    port (the internal routes and /metrics, which the public one answers 404); both URLs and
    the app."""
    settings = make_settings(tmp, f"sqlite:///{tmp / 'catalog.db'}")
    sockets = [listen("127.0.0.1", 0), listen("127.0.0.1", 0)]
    app = create_controlplane(settings, internal_port=port_of(sockets[1]))
    try:
        with serve_sockets_in_thread(app, sockets) as (public, internal):
            yield public, internal, app
    finally:
        app.state.ctx.close()


def admin(url: str, method: str, path: str, **kw: object) -> httpx.Response:
    return httpx.request(method, url + path, headers={"Authorization": f"Bearer {ADMIN}"}, **kw)  # type: ignore[arg-type]


def pool_and_tenants(
    cp: str, base: Path, tenants: tuple[str, ...] = ("acme", "globex")
) -> dict[str, str]:
    """The pool POOL serving `base` as BASE_NAME, and each tenant with one API key: its key."""
    pool = {"name": POOL, "base_model": {"name": BASE_NAME, "uri": str(base)}}
    assert admin(cp, "POST", "/v1/pools", json=pool).status_code == 201
    keys = {}
    for tenant in tenants:
        assert admin(cp, "POST", "/v1/tenants", json={"name": tenant}).status_code == 201
        r = admin(cp, "POST", f"/v1/tenants/{tenant}/keys", json={"name": "k"})
        keys[tenant] = r.json()["key"]
    return keys


def test_tenant_upload_is_served_by_the_data_plane_and_isolated(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    with controlplane(tmp_path) as cp:
        keys = pool_and_tenants(cp, tiny_llama_dir)
        src = peft_adapters["r16"]
        files = [("files", (p.name, p.read_bytes())) for p in sorted(src.iterdir())]
        acme_h = {"Authorization": f"Bearer {keys['acme']}"}
        form = {"name": "support", "base_model": BASE_NAME}
        r = httpx.post(cp + "/v1/adapters", data=form, files=files, headers=acme_h)
        assert r.status_code == 201, r.text

        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name=BASE_NAME, controlplane_url=cp,
            service_token=SERVICE, store=str(tmp_path / "store"), pool=POOL,
            pressure_interval_s=0.3, num_kv_blocks=256, max_loras=4,
        )  # fmt: skip
        with start_server(settings) as (url, _):
            acme = openai.OpenAI(base_url=url + "/v1", api_key=keys["acme"])
            globex = openai.OpenAI(base_url=url + "/v1", api_key=keys["globex"])
            prompt = "Many tenants share one base model"
            greedy = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
            out = acme.completions.create(model="support", prompt=prompt, **greedy)  # type: ignore[call-overload]
            pinned = acme.completions.create(model="support@1", prompt=prompt, **greedy)  # type: ignore[call-overload]
            base = acme.completions.create(model=BASE_NAME, prompt=prompt, **greedy)  # type: ignore[call-overload]
            assert out.choices[0].text == pinned.choices[0].text
            # the same adapter, run on an engine directly, says the same
            engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu",
                                         dtype="float32", num_kv_blocks=64))  # fmt: skip
            ref = engine.register_lora("support", src, "acme")
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            direct, plain = engine.generate([prompt, prompt], params, [ref, None])
            assert out.choices[0].text == direct.text
            assert base.choices[0].text == plain.text
            assert direct.text != plain.text
            # another tenant neither uses nor sees acme's adapter
            with pytest.raises(openai.NotFoundError) as info:
                globex.completions.create(model="support", prompt=prompt, max_tokens=4)
            assert info.value.code == "model_not_found"
            for tenant, status in (("globex", 404), ("acme", 200)):  # tokenizer routes too
                r = httpx.post(url + "/tokenize", json={"model": "support", "prompt": prompt},
                               headers={"Authorization": f"Bearer {keys[tenant]}"})  # fmt: skip
                assert r.status_code == status, r.text
            assert "support" in {m.id for m in acme.models.list().data}
            assert "support" not in {m.id for m in globex.models.list().data}
            assert {m.id for m in globex.models.list().data} == {BASE_NAME}

            # the replica reports pressure and usage to the control plane
            def reported() -> bool:  # the usage may arrive over several reports
                rows = httpx.get(cp + "/v1/usage", headers=acme_h).json()
                rows = rows if isinstance(rows, list) else rows.get("items", rows.get("usage", []))
                return any(
                    row["adapter"] == "support" and row["completion_tokens"] >= 16 for row in rows
                )

            deadline = time.monotonic() + 60
            pressure = None
            while time.monotonic() < deadline and not (pressure and reported()):
                time.sleep(0.3)
                pressure = admin(cp, "GET", f"/v1/pools/{POOL}").json().get("pressure")
            assert pressure, "no pressure report arrived"
            assert reported(), "the usage of acme's support requests was not reported"


def test_known_tenants_are_served_through_a_control_plane_outage(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The control plane is stopped for longer than the resolve TTL while two tenants stream,
    then started again on the same port and database: no request of a known tenant fails, a
    key never seen gets 503 with Retry-After meanwhile, and the usage of the outage reaches
    the catalog once it is back, counted once."""
    port = free_port()
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'catalog.db'}")

    @contextlib.contextmanager
    def control_plane() -> Iterator[str]:
        app = create_controlplane(settings)
        try:
            with serve_in_thread(app, port=port) as url:
                yield url
        finally:
            app.state.ctx.close()

    with control_plane() as cp:
        pool = {"name": POOL, "base_model": {"name": BASE_NAME, "uri": str(tiny_llama_dir)}}
        assert admin(cp, "POST", "/v1/pools", json=pool).status_code == 201
        keys = {}
        for tenant in ("acme", "globex", "initech"):
            assert admin(cp, "POST", "/v1/tenants", json={"name": tenant}).status_code == 201
            r = admin(cp, "POST", f"/v1/tenants/{tenant}/keys", json={"name": "k"})
            keys[tenant] = r.json()["key"]
        src = peft_adapters["r16"]
        files = [("files", (p.name, p.read_bytes())) for p in sorted(src.iterdir())]
        form = {"name": "support", "base_model": BASE_NAME}
        acme_h = {"Authorization": f"Bearer {keys['acme']}"}
        r = httpx.post(cp + "/v1/adapters", data=form, files=files, headers=acme_h)
        assert r.status_code == 201, r.text
    data_plane = ServerSettings(
        model=str(tiny_llama_dir), served_model_name=BASE_NAME, controlplane_url=cp,
        service_token=SERVICE, store=str(tmp_path / "store"), pool=POOL,
        pressure_interval_s=0.3, resolve_ttl_s=0.5, num_kv_blocks=256,
    )  # fmt: skip
    greedy = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    clients = {
        (tenant, model): openai.OpenAI(base_url="", api_key=keys[tenant], max_retries=0)
        for tenant, model in (("acme", "support"), ("globex", BASE_NAME))
    }
    done: Counter[str] = Counter()
    failures: list[str] = []
    stop = threading.Event()

    def stream(url: str, tenant: str, model: str) -> None:
        client = clients[(tenant, model)].with_options(base_url=url + "/v1")
        while not stop.is_set():
            try:
                chunks = client.completions.create(model=model, prompt="outage", stream=True,
                                                   **greedy)  # type: ignore[call-overload]  # fmt: skip
                text = "".join(c.choices[0].text for c in chunks)
                assert text
                done[tenant] += 1
            except Exception as e:  # any failure of a known tenant's request is the finding
                failures.append(f"{tenant}: {type(e).__name__}: {e}")

    with start_server(data_plane) as (url, _):
        with control_plane():  # both tenants get resolved while it is up
            workers = [threading.Thread(target=stream, args=(url, t, m)) for t, m in clients]
            for w in workers:
                w.start()
            deadline = time.monotonic() + 30
            while min(done["acme"], done["globex"]) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert min(done["acme"], done["globex"]) >= 2, (done, failures)
        before = dict(done)
        time.sleep(2.0)  # down for four TTLs, streaming on
        during = {t: done[t] - before[t] for t in before}
        stranger = httpx.post(url + "/v1/completions", json={"model": BASE_NAME, "prompt": "x",
                              "max_tokens": 1}, headers={"Authorization":
                              f"Bearer {keys['initech']}"})  # fmt: skip
        with control_plane() as cp:
            time.sleep(1.0)
            stop.set()
            for w in workers:
                w.join(60)
            served = sum(done.values())
            deadline = time.monotonic() + 20
            rows: list[dict[str, Any]] = []
            while time.monotonic() < deadline:
                rows = [
                    row
                    for t in ("acme", "globex")
                    for row in httpx.get(
                        cp + "/v1/usage", headers={"Authorization": f"Bearer {keys[t]}"}
                    ).json()
                ]
                if sum(row["requests"] for row in rows) >= served:
                    break
                time.sleep(0.3)
    assert failures == []
    assert during["acme"] > 0 and during["globex"] > 0, during  # served while it was down
    assert stranger.status_code == 503 and stranger.headers.get("retry-after"), stranger.text
    assert sum(row["requests"] for row in rows) == served  # everything counted, once
