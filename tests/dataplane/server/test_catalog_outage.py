"""HttpCatalog against the real control plane (uvicorn, SQLite), stopped mid-test: refusals
live in a bounded cache of their own, so a flood of random keys cannot push a known tenant's
good answer out before an outage; /v1/models is answered from a key's last good list during
one, for the stale window, as resolve is."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplane.controlplane.main import create_app as create_controlplane
from loraplane.dataplane.server.catalog_http import HttpCatalog
from loraplane.dataplane.server.errors import ModelNotFound, Unauthorized, Unavailable
from tests.adapters.crafting import (
    TINY_BASE,
    TINY_BASE_NAME,
    lora_config,
    lora_tensors,
    write_adapter,
)
from tests.controlplane.conftest import ADMIN, SERVICE, make_settings
from tests.servers import serve_in_thread

ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
TENANTS = ("acme", "globex", "initech")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def controlplane(tmp: Path, base_model_dir: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """The control plane over real HTTP, with a pool and three tenants' keys; stopped (its
    port refuses connections) when the block exits."""
    app = create_controlplane(make_settings(tmp, f"sqlite:///{tmp / 'catalog.db'}"))
    try:
        with serve_in_thread(app) as url:
            pool = {"name": "pool-a", "base_model": {"name": TINY_BASE_NAME,
                                                     "uri": str(base_model_dir)}}  # fmt: skip
            assert httpx.post(url + "/v1/pools", json=pool, headers=ADMIN_H).status_code == 201
            keys = {}
            for tenant in TENANTS:
                r = httpx.post(url + "/v1/tenants", json={"name": tenant}, headers=ADMIN_H)
                assert r.status_code == 201, r.text
                r = httpx.post(url + f"/v1/tenants/{tenant}/keys", json={"name": "k"},
                               headers=ADMIN_H)  # fmt: skip
                keys[tenant] = r.json()["key"]
            yield url, keys
    finally:
        app.state.ctx.close()


def upload(url: str, key: str, name: str, folder: Path) -> None:
    adapter = write_adapter(folder / name, lora_config(r=4), lora_tensors(TINY_BASE, 4, seed=1))
    files = [("files", (p.name, p.read_bytes())) for p in sorted(adapter.iterdir())]
    r = httpx.post(url + "/v1/adapters", data={"name": name, "base_model": TINY_BASE_NAME},
                   files=files, headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert r.status_code == 201, r.text


def test_a_flood_of_unknown_keys_cannot_push_known_tenants_out_before_an_outage(
    tmp_path: Path, base_model_dir: Path
) -> None:
    clock = Clock()
    with contextlib.ExitStack() as stack:
        url, keys = stack.enter_context(controlplane(tmp_path, base_model_dir))
        upload(url, keys["acme"], "support", tmp_path)

        async def run() -> None:
            catalog = HttpCatalog(url, SERVICE, TINY_BASE_NAME, ttl=5.0, clock=clock,
                                  stale=300.0, entries=8, negative_entries=16)  # fmt: skip
            for tenant in TENANTS:
                assert (await catalog.resolve(keys[tenant], TINY_BASE_NAME)).tenant == tenant
            assert (await catalog.resolve(keys["acme"], "support")).adapter == "support"
            with pytest.raises(ModelNotFound):  # a refusal: cached for less than the TTL
                await catalog.resolve(keys["acme"], "later")
            # many times the good answers' bound in random keys, each a 401 from the catalog
            for _ in range(8 * 12):
                with pytest.raises(Unauthorized):
                    await catalog.resolve("lp_" + uuid.uuid4().hex, TINY_BASE_NAME)
            upload(url, keys["acme"], "later", tmp_path)
            clock.now += 2.5  # past the refusal's time, within the good answers' TTL
            assert (await catalog.resolve(keys["acme"], "later")).adapter == "later"
            await asyncio.to_thread(stack.close)  # the control plane stops: connection refused
            clock.now += 10.0  # every answer is past its TTL: each one asks the catalog
            for tenant in TENANTS:  # ... which is down: known tenants keep being served
                assert (await catalog.resolve(keys[tenant], TINY_BASE_NAME)).tenant == tenant
            found = await catalog.resolve(keys["acme"], "support")
            assert (found.tenant, found.adapter) == ("acme", "support")
            with pytest.raises(Unavailable) as info:  # never resolved: 503, retry later
                await catalog.resolve("lp_" + uuid.uuid4().hex, TINY_BASE_NAME)
            assert info.value.status == 503 and info.value.retry_after
            assert catalog.stale_answers == len(TENANTS) + 1
            assert len(catalog._refused) <= 16  # refusals have a bound of their own
            await catalog.aclose()

        asyncio.run(run())


def test_models_are_listed_from_the_last_good_answer_through_an_outage(
    tmp_path: Path, base_model_dir: Path
) -> None:
    clock = Clock()
    with contextlib.ExitStack() as stack:
        url, keys = stack.enter_context(controlplane(tmp_path, base_model_dir))
        upload(url, keys["acme"], "support", tmp_path)

        async def run() -> None:
            catalog = HttpCatalog(url, SERVICE, TINY_BASE_NAME, ttl=5.0, clock=clock,
                                  stale=300.0)  # fmt: skip
            listed = [m.id for m in await catalog.list_models(keys["acme"])]
            assert listed == [TINY_BASE_NAME, "support"]
            with pytest.raises(Unauthorized):
                await catalog.list_models("lp_" + uuid.uuid4().hex)
            await asyncio.to_thread(stack.close)  # the control plane stops
            clock.now += 10.0
            for _ in range(2):  # the first call finds it down, the next leaves it alone
                assert [m.id for m in await catalog.list_models(keys["acme"])] == listed
            with pytest.raises(Unavailable) as info:  # a key that never listed: 503
                await catalog.list_models(keys["globex"])
            assert info.value.status == 503
            assert catalog.stale_answers == 2
            clock.now += 301.0  # too old to stand in any more
            with pytest.raises(Unavailable):
                await catalog.list_models(keys["acme"])
            await catalog.aclose()

        asyncio.run(run())
