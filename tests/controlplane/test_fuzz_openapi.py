"""schemathesis against the OpenAPI document: no generated request, valid or not, gets a 5xx.

Bounded for CI: a few examples per operation and mode, derandomised, every credential kind
(each route gets the credential it expects, so generated bodies reach the handlers).
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.openapi import from_asgi

from tests.controlplane.conftest import ADMIN, SERVICE, Api

EXAMPLES = 12


def credentials(path: str, tenant_key: str) -> dict[str, str]:
    if path.startswith("/internal/"):
        return {"Authorization": f"Bearer {SERVICE}", "X-Tenant-Key": tenant_key}
    if path.startswith(("/v1/adapters", "/v1/usage")):
        return {"Authorization": f"Bearer {tenant_key}"}
    return {"Authorization": f"Bearer {ADMIN}"}


def test_no_generated_request_gets_a_server_error(app: FastAPI, api: Api) -> None:
    api.pool()
    key = api.tenant("acme", requests_per_minute=1_000_000)
    assert api.upload(key, "bot", api.adapter_dir(seed=1)).status_code == 201
    schema = from_asgi("/openapi.json", app)
    failures: list[str] = []
    statuses: dict[int, int] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    for op in operations:
        check(op, credentials(op.path, key), failures, statuses)
    # the fuzzing reached the handlers, not only the validation layer
    assert sum(n for code, n in statuses.items() if code < 300) >= 20, statuses
    assert failures == [], "\n".join(failures[:10])


def check(op: Any, headers: dict[str, str], failures: list[str], statuses: dict[int, int]) -> None:
    """Run one operation's generated cases (valid and invalid); collect any 5xx."""
    strategy = st.one_of(
        op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE)
    )

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: Case) -> None:
        response = case.call(headers={**(case.headers or {}), **headers})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            failures.append(
                f"{case.method} {case.formatted_path}: {response.status_code} "
                f"{response.text[:200]} <- {case.as_curl_command()[:300]}"
            )

    run()


@pytest.mark.parametrize("path", ["/openapi.json", "/docs"])
def test_openapi_document_is_served(api: Api, path: str) -> None:
    assert api.client.get(path).status_code == 200
