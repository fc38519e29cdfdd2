"""Across components: what the data plane serves for an adapter's plain name follows what the
tenant chose with the CLI (serve a version, push another, roll back, follow the latest, delete).
Real HTTP everywhere: the control plane (SQLite, local store), the data plane in catalog mode
(resolve cache off, so each request asks the catalog), the OpenAI client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import ADMIN, SERVICE
from tests.dataplane.server.conftest import start_server
from tests.test_e2e_catalog import BASE_NAME, POOL, controlplane, pool_and_tenants
from tests.test_tenant_cli import cli

PROMPT = "Many tenants share one base model"
GREEDY = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_the_data_plane_serves_what_the_tenant_chose(
    tiny_llama_dir: Path,
    peft_adapters: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with controlplane(tmp_path) as cp:
        key = pool_and_tenants(cp, tiny_llama_dir, ("acme",))["acme"]
        monkeypatch.setenv("LORAPLANE_URL", cp)
        monkeypatch.setenv("LORAPLANE_API_KEY", key)
        monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", ADMIN)

        def run(*args: str) -> str:
            done = cli(capsys, *args)
            assert done.code == 0, (args, done.err)
            return done.out

        for source in ("r4", "r16"):
            run("adapters", "push", str(peft_adapters[source]), "--name", "bot",
                "--base-model", BASE_NAME)  # fmt: skip
        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name=BASE_NAME, controlplane_url=cp,
            service_token=SERVICE, store=str(tmp_path / "store"), pool=POOL,
            num_kv_blocks=256, max_loras=4, resolve_ttl_s=0,
        )  # fmt: skip
        with start_server(settings) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key=key)

            def text(model: str) -> str:
                out = client.completions.create(model=model, prompt=PROMPT, **GREEDY)  # type: ignore[call-overload]
                answer: str = out.choices[0].text
                return answer

            v1, v2 = text("bot@1"), text("bot@2")
            assert v1 != v2  # the versions are told apart by what they say
            assert text("bot") == v2  # a new adapter follows its latest

            run("adapters", "serve", "bot", "1", "--yes")
            assert text("bot") == v1
            run("adapters", "push", str(peft_adapters["r8-qv"]), "--name", "bot",
                "--base-model", BASE_NAME)  # fmt: skip
            v3 = text("bot@3")
            assert v3 not in (v1, v2)
            assert text("bot") == v1  # held across the push

            run("adapters", "follow-latest", "bot", "--yes")
            assert text("bot") == v3
            run("adapters", "rollback", "bot", "--yes")
            assert text("bot") == v2

            run("adapters", "delete", "bot", "--yes")
            for model in ("bot", "bot@2"):
                with pytest.raises(openai.NotFoundError) as info:
                    text(model)
                assert info.value.code == "model_not_found"
            assert "bot" not in {m.id for m in client.models.list().data}
