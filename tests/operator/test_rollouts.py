"""A LoRAAdapter's `spec.rollout` (GitOps weighted rollouts) end to end: the operator (Kopf)
against an emulated API server, moto S3 and the control plane on SQLite. A new source and a
split in one change serve the split with the old version as the rollback target; one version
at 100 promotes it; removing the split rolls it back; the status shows what the catalog
serves."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from loraplane.operator.rollouts import rollout_status
from loraplane.operator.specs import AdapterSpec, SpecError
from tests.operator.conftest import (
    PLATFORM,
    TENANT,
    Cluster,
    ControlPlane,
    StartOperator,
    adapter_body,
    pool_body,
    upload_source,
)
from tests.operator.harness import wait_for
from tests.operator.test_adapters import good_adapter

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


def served_split(controlplane: ControlPlane, name: str) -> tuple[Any, Any]:
    """(current_version, rollout) as the catalog's tenant API shows them."""
    r = controlplane.admin.post(f"/v1/tenants/{TENANT}/keys", json={"name": "t"})
    auth = {"Authorization": f"Bearer {r.json()['key']}"}
    body = httpx.get(f"{controlplane.url}/v1/adapters/{name}", headers=auth).json()
    return body["current_version"], body["rollout"]


@pytest.mark.k8s
def test_spec_rollout_is_served_shown_promoted_and_rolled_back(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    s3: S3Client,
    s3_secret: str,
    base_model_dir: Path,
    tmp_path: Path,
) -> None:
    start_operator()
    cluster.create("servingpools", PLATFORM, pool_body("tiny-pool", base_model_dir))
    cluster.create(
        "loraadapters", TENANT, adapter_body("bot", upload_source(s3, good_adapter(tmp_path, 1)))
    )
    cluster.wait_phase("bot", "Ready", "Rejected", "Failed")

    def status_is(split: Any, current: int) -> Any:
        def probe() -> Any:
            status = cluster.adapter("bot").get("status", {})
            return status if (status.get("rollout"), status.get("currentVersion")) == (
                split, current) else None  # fmt: skip

        return wait_for(probe, timeout=30, what=f"status.rollout {split}, current {current}")

    canary = [{"version": 1, "weight": 90}, {"version": 2, "weight": 10}]
    new_source = {
        "uri": upload_source(s3, good_adapter(tmp_path, 2)),
        "secretRef": {"name": s3_secret},
    }
    cluster.patch(
        "loraadapters", TENANT, "bot", {"spec": {"source": new_source, "rollout": canary}}
    )
    status_is(canary, 1)
    assert cluster.adapter("bot")["status"]["version"] == 2
    assert served_split(controlplane, "bot") == (1, canary)

    cluster.patch("loraadapters", TENANT, "bot", {"spec": {"rollout": [
        {"version": 1, "weight": 0}, {"version": 2, "weight": 100}]}})  # fmt: skip
    status_is(None, 2)  # promoted
    assert served_split(controlplane, "bot") == (2, None)

    cluster.patch("loraadapters", TENANT, "bot", {"spec": {"rollout": [
        {"version": 1, "weight": 50}, {"version": 2, "weight": 50}]}})  # fmt: skip
    status_is([{"version": 1, "weight": 50}, {"version": 2, "weight": 50}], 2)
    cluster.patch("loraadapters", TENANT, "bot", {"spec": {"rollout": None}})
    status_is(None, 2)  # rolled back to the version served before the split
    assert served_split(controlplane, "bot") == (2, None)
    reasons = {e["reason"] for e in cluster.events()}
    assert "Rollout" in reasons


@pytest.mark.parametrize(
    ("rollout", "words"),
    [
        ([{"version": 1, "weight": 90}, {"version": 2, "weight": 20}], "sum to 110"),
        ([{"version": 1, "weight": 50}, {"version": 1, "weight": 50}], "names version 1 twice"),
        ([{"version": 0, "weight": 100}], "version number"),
        ([{"version": 1, "weight": 101}], "from 0 to 100"),
        ([{"version": v, "weight": 20} for v in range(1, 6)], "at most 4"),
    ],
)
def test_a_split_the_catalog_would_refuse_is_refused_in_words(
    rollout: list[dict[str, int]], words: str
) -> None:
    with pytest.raises(SpecError, match=words):
        AdapterSpec.parse_rollout({"rollout": rollout})


def test_no_rollout_is_none_and_the_status_shows_the_catalogs_answer() -> None:
    assert (
        AdapterSpec.parse_rollout({}) is None and AdapterSpec.parse_rollout({"rollout": []}) is None
    )
    answer = {
        "current_version": 3,
        "rollout": [{"version": 3, "weight": 90}, {"version": 4, "weight": 10}],
    }
    assert rollout_status(answer) == {
        "rollout": [{"version": 3, "weight": 90}, {"version": 4, "weight": 10}],
        "currentVersion": 3,
    }
    assert rollout_status({"current_version": 4, "rollout": None}) == {
        "rollout": None,
        "currentVersion": 4,
    }
