"""Across components: a tenant uploads through the control plane's REST API; the data plane,
in catalog mode, resolves the tenant's key and model through the control plane, loads the
stored version through its tiers and serves it over the OpenAI API; pressure and usage flow
back. Real HTTP everywhere (uvicorn), SQLite catalog, local object store."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from loraplane.controlplane.main import create_app as create_controlplane
from loraplane.dataplane.config import EngineConfig
from loraplane.dataplane.engine import Engine
from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import ADMIN, SERVICE, make_settings
from tests.dataplane.server.conftest import start_server
from tests.servers import serve_in_thread

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


def admin(url: str, method: str, path: str, **kw: object) -> httpx.Response:
    return httpx.request(method, url + path, headers={"Authorization": f"Bearer {ADMIN}"}, **kw)  # type: ignore[arg-type]


def test_tenant_upload_is_served_by_the_data_plane_and_isolated(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    with controlplane(tmp_path) as cp:
        pool = {"name": POOL, "base_model": {"name": BASE_NAME, "uri": str(tiny_llama_dir)}}
        assert admin(cp, "POST", "/v1/pools", json=pool).status_code == 201
        keys = {}
        for tenant in ("acme", "globex"):
            assert admin(cp, "POST", "/v1/tenants", json={"name": tenant}).status_code == 201
            r = admin(cp, "POST", f"/v1/tenants/{tenant}/keys", json={"name": "k"})
            keys[tenant] = r.json()["key"]
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
            assert "support" in {m.id for m in acme.models.list().data}
            assert "support" not in {m.id for m in globex.models.list().data}
            assert {m.id for m in globex.models.list().data} == {BASE_NAME}
            # the replica reports pressure and usage to the control plane
            deadline = time.monotonic() + 20
            pressure, usage = None, []
            while time.monotonic() < deadline and not (pressure and usage):
                time.sleep(0.3)
                pressure = admin(cp, "GET", f"/v1/pools/{POOL}").json().get("pressure")
                usage = httpx.get(cp + "/v1/usage", headers=acme_h).json()
            assert pressure, "no pressure report arrived"
            rows = usage if isinstance(usage, list) else usage.get("items", usage.get("usage", []))
            assert any(
                row["adapter"] == "support" and row["completion_tokens"] >= 16 for row in rows
            ), usage
