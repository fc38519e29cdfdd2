"""GET /v1/models/{id}: the caller's own models answer as their /v1/models entry; another
tenant's adapter answers the same 404 as a name nobody has. Catalog mode over real HTTP (the
control plane on SQLite in a thread, the data plane in a thread, the openai client)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import SERVICE
from tests.dataplane.server.conftest import start_server
from tests.test_e2e_catalog import BASE_NAME, POOL, controlplane, pool_and_tenants


def _entry(model: Any) -> dict[str, Any]:
    data = dict(model if isinstance(model, dict) else model.model_dump())
    data.pop("created")  # the time of the answer
    return data


def test_retrieve_answers_own_models_and_hides_other_tenants(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    with controlplane(tmp_path) as cp:
        keys = pool_and_tenants(cp, tiny_llama_dir)
        src = peft_adapters["r16"]
        files = [("files", (p.name, p.read_bytes())) for p in sorted(src.iterdir())]
        r = httpx.post(
            cp + "/v1/adapters",
            data={"name": "support", "base_model": BASE_NAME},
            files=files,
            headers={"Authorization": f"Bearer {keys['acme']}"},
        )
        assert r.status_code == 201, r.text
        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name=BASE_NAME, controlplane_url=cp,
            service_token=SERVICE, store=str(tmp_path / "store"), pool=POOL,
            num_kv_blocks=64, max_loras=2,
        )  # fmt: skip
        with start_server(settings) as (url, _):
            acme = openai.OpenAI(base_url=url + "/v1", api_key=keys["acme"])
            globex = openai.OpenAI(base_url=url + "/v1", api_key=keys["globex"])
            listed = {m.id: _entry(m) for m in acme.models.list().data}
            assert set(listed) == {BASE_NAME, "support"}
            for name in (BASE_NAME, "support"):
                got = acme.models.retrieve(name)
                assert _entry(got) == listed[name]
            assert acme.models.retrieve("support").parent == BASE_NAME  # type: ignore[attr-defined]
            assert _entry(globex.models.retrieve(BASE_NAME)) == listed[BASE_NAME]

            def get(key: str, model: str) -> httpx.Response:
                auth = {"Authorization": f"Bearer {key}"}
                return httpx.get(f"{url}/v1/models/{model}", headers=auth)

            other, unknown = get(keys["globex"], "support"), get(keys["globex"], "nosuch")
            assert other.status_code == unknown.status_code == 404
            assert other.json()["error"]["code"] == "model_not_found"
            assert other.text.replace("support", "nosuch") == unknown.text
            with pytest.raises(openai.NotFoundError):
                globex.models.retrieve("support")
            # the key is checked as for the list
            bad = get("lp_" + "x" * 40, BASE_NAME)
            assert bad.status_code == 401, bad.text
