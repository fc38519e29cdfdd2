"""Quotas as documented (issue 28): a tenant's requests_per_minute and tokens_per_minute of 0
mean unlimited end to end. The control plane accepts 0 over its REST API, resolves it to the
data plane, and the data plane's limiter lets every request through; a tenant beside it with a
small limit is refused (the negative control: the same path does limit); the tenant CLI agrees
and refuses a max_adapters of 0 with the reason. Real HTTP, catalog mode, SQLite, a tiny model
on CPU."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import SERVICE
from tests.dataplane.server.conftest import start_server
from tests.test_e2e_catalog import BASE_NAME, POOL, admin, pool_and_tenants
from tests.test_e2e_catalog import controlplane as running_controlplane
from tests.test_tenant_cli import cli, controlplane, env

__all__ = ["controlplane", "env"]  # the tenant CLI's fixtures (tests/test_tenant_cli.py)


def test_rates_of_0_are_unlimited_through_the_data_planes_limiter(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    with running_controlplane(tmp_path) as cp:
        keys = pool_and_tenants(cp, tiny_llama_dir, ("free", "tight"))
        free = {"requests_per_minute": 0, "tokens_per_minute": 0}
        r = admin(cp, "PATCH", "/v1/tenants/free", json=free)
        assert r.status_code == 200, r.text
        assert {k: r.json()[k] for k in free} == free
        r = admin(cp, "PATCH", "/v1/tenants/tight", json={"requests_per_minute": 2})
        assert r.status_code == 200, r.text
        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name=BASE_NAME, controlplane_url=cp,
            service_token=SERVICE, store=str(tmp_path / "store"), pool=POOL,
            pressure_interval_s=0.3, num_kv_blocks=128, max_loras=2,
        )  # fmt: skip
        body = {"model": BASE_NAME, "prompt": "one base model, many tenants", "max_tokens": 2}
        with start_server(settings) as (url, _):

            def complete(tenant: str) -> httpx.Response:
                auth = {"Authorization": f"Bearer {keys[tenant]}"}
                return httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=60)

            statuses = [complete("free").status_code for _ in range(8)]
            assert statuses == [200] * 8  # 0 requests and 0 tokens per minute: no limit
            tight = [complete("tight") for _ in range(3)]
            assert [t.status_code for t in tight] == [200, 200, 429]
            assert "2 requests" in tight[2].text and tight[2].headers.get("retry-after")


@pytest.mark.usefixtures("env")
def test_the_cli_agrees_0_rates_are_unlimited_and_0_adapters_refused_with_the_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    made = cli(capsys, "tenants", "create", "zero-rates", "--requests-per-minute", "0",
               "--tokens-per-minute", "0", "--json")  # fmt: skip
    assert made.code == 0, made.err
    assert (made.json()["requests_per_minute"], made.json()["tokens_per_minute"]) == (0, 0)
    shown = cli(capsys, "tenants", "update", "zero-rates", "--max-rank", "8").out.splitlines()
    assert "  requests_per_minute   0 (unlimited)" in shown
    assert "  tokens_per_minute     0 (unlimited)" in shown and "  max_rank              8" in shown
    run = cli(capsys, "tenants", "update", "zero-rates", "--max-adapters", "0")
    assert (run.code, run.out) == (1, "")
    assert run.err == (
        "error: InvalidRequest: max_adapters: must be an integer from 1 to 1000000 (0 is "
        "refused: only the per-minute rate limits take 0 for unlimited) (got 0)\n"
    )
    helped = cli(capsys, "tenants", "update", "--help").out
    assert "(0: unlimited)" in helped and "(at least 1)" in helped
