"""Bad adapters uploaded over HTTP: 422 with the adapter core's reason code, store unchanged.

One sample per reason code from the adapter core's corpus (its builders make the files).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.adapters.limits import AdapterLimits
from loraplane.controlplane.settings import Settings
from tests.adapters.test_bad_corpus import BASE as CORPUS_BASE
from tests.adapters.test_bad_corpus import CASES, Case
from tests.controlplane.conftest import BASE, Api
from tests.controlplane.test_adapters import store_files


def one_per_code() -> list[Case]:
    """The first corpus case of each reason code that needs no special limits."""
    seen: dict[str, Case] = {}
    for case in CASES:
        if case.limits == AdapterLimits() and case.code.value not in seen:
            seen[case.code.value] = case
    return list(seen.values())


SAMPLES = one_per_code()


def test_corpus_base_model_is_the_pools_base_model() -> None:
    assert (CORPUS_BASE.hidden_size, CORPUS_BASE.num_layers) == (BASE.hidden_size, BASE.num_layers)
    assert CORPUS_BASE.intermediate_size == BASE.intermediate_size
    assert len(SAMPLES) >= 11


@pytest.mark.parametrize("case", SAMPLES, ids=[c.id for c in SAMPLES])
def test_bad_adapter_is_422_with_its_reason_code_and_nothing_stored(
    ready: Api, settings: Settings, tmp_path: Path, case: Case
) -> None:
    key = ready.keys["acme"]
    assert ready.upload(key, "good", ready.adapter_dir(seed=1)).status_code == 201
    before = store_files(settings)
    build = tmp_path / "case"
    build.mkdir()
    source = case.build(build)
    r = ready.upload(key, "bad", source)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == case.code.value
    assert case.fragment in r.json()["error"]["message"]
    assert store_files(settings) == before
    assert (
        ready.client.get("/v1/adapters/bad", headers={"Authorization": f"Bearer {key}"}).status_code
        == 404
    )
