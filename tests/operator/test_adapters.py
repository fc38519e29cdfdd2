"""LoRAAdapter end to end: the operator (Kopf) against an emulated API server over HTTP, moto S3
and the control plane on SQLite."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from loraplane.adapters.errors import SIGNATURE_CODES, ReasonCode
from loraplane.adapters.ingest import list_versions
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.source import WEIGHTS_NAME
from loraplane.adapters.store import LocalStore
from tests.adapters.crafting import lora_config, lora_tensors, write_adapter
from tests.adapters.test_bad_corpus import CASES
from tests.operator.conftest import (
    BASE,
    BASE_CONFIG,
    BASE_NAME,
    PLATFORM,
    SERVICE,
    TENANT,
    Cluster,
    ControlPlane,
    StartOperator,
    adapter_body,
    pool_body,
    upload_source,
)
from tests.operator.harness import wait_for

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

pytestmark = pytest.mark.k8s


def good_adapter(tmp: Path, seed: int = 0, r: int = 8) -> Path:
    return write_adapter(
        tmp / f"good-{seed}-{r}", lora_config(r=r), lora_tensors(BASE, r, seed=seed)
    )


def test_valid_adapter_becomes_ready_with_its_digest_and_stored_path(
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
    uri = upload_source(s3, good_adapter(tmp_path))
    created = cluster.create("loraadapters", TENANT, adapter_body("support-bot", uri))

    obj = cluster.wait_phase("support-bot", "Ready", "Rejected", "Failed")
    status = obj["status"]
    assert status["phase"] == "Ready", status
    assert status["reason"] == "Ready"
    assert status["version"] == 1
    assert len(status["digest"]) == 64
    assert status["storedPath"] == f"adapters/{TENANT}/support-bot/v1-{status['digest'][:12]}/"
    assert (status["rank"], status["alpha"], status["sizeBytes"] > 0) == (8, 16, True)
    assert status["targetModules"] == ["q_proj", "v_proj"]
    assert status["servedName"] == "support-bot"
    assert status["observedGeneration"] == 1
    conditions = {c["type"]: c for c in status["conditions"]}
    assert {t: c["status"] for t, c in conditions.items()} == {
        "Validated": "True",
        "Stored": "True",
        "Ready": "True",
    }
    assert all(
        c["lastTransitionTime"] and c["observedGeneration"] == 1 for c in conditions.values()
    )
    # the catalog has the version, at the same path
    versions = controlplane.versions(TENANT, "support-bot")
    assert [(v["version"], v["digest"], v["created_by"]) for v in versions] == [
        (1, status["digest"], "operator")
    ]
    # the operator never writes spec: spec and generation are as created
    assert obj["spec"] == created["spec"]
    assert obj["metadata"]["generation"] == 1
    # events are posted in the background: wait for them
    wait_for(
        lambda: ("Normal", "Ready") in {(e["type"], e["reason"]) for e in cluster.events()},
        what="the Ready event",
    )


def _one_case_per_code() -> dict[ReasonCode, Any]:
    """The first corpus case of each reason code that needs no special limits and builds a
    folder or an archive (what an s3:// source can hold)."""
    chosen: dict[ReasonCode, Any] = {}
    for case in CASES:
        if case.code in chosen or case.limits.max_rank is not None:
            continue
        if case.limits.max_bytes != 4 << 30 or case.limits.max_archive_bytes != (4 << 30) + (
            1 << 20
        ):
            continue
        if case.limits.max_tensors != AdapterLimits().max_tensors or case.id in ("pickle-file",):
            continue
        chosen[case.code] = case
    return chosen


def test_each_bad_adapter_class_ends_rejected_with_its_reason_code(
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
    expected: dict[str, str] = {}
    cases = _one_case_per_code()
    for code, case in cases.items():
        work = tmp_path / case.id
        work.mkdir()
        name = f"bad-{case.id}"[:63]
        cluster.create(
            "loraadapters", TENANT, adapter_body(name, upload_source(s3, case.build(work)))
        )
        expected[name] = code.value
    # the pool allows rank 16: a rank-32 adapter is too large for it
    name = "bad-rank-over-pool"
    uri = upload_source(s3, good_adapter(tmp_path, r=32))
    cluster.create("loraadapters", TENANT, adapter_body(name, uri))
    expected[name] = ReasonCode.RANK_TOO_LARGE.value
    assert set(expected.values()) == {c.value for c in ReasonCode if c not in SIGNATURE_CODES}

    for name, code in expected.items():
        status = cluster.wait_phase(name, "Rejected", "Ready", "Failed")["status"]
        assert (status["phase"], status["reason"]) == ("Rejected", code), (name, status)
        conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
        assert conditions["Validated"] == ("False", code)
        assert conditions["Ready"] == ("False", code)
        assert "version" not in status
    wait_for(
        lambda: (
            set(expected.values())
            <= {e["reason"] for e in cluster.events() if e["type"] == "Warning"}
        ),
        what="a Warning event per reason code",
    )
    assert LocalStore(tmp_path / "store").list_keys("adapters/") == []


def test_adapter_for_unknown_base_model_waits_pending_until_a_pool_appears(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    s3: S3Client,
    s3_secret: str,
    base_model_dir: Path,
    tmp_path: Path,
) -> None:
    start_operator()
    uri = upload_source(s3, good_adapter(tmp_path))
    cluster.create("loraadapters", TENANT, adapter_body("early-bot", uri))
    status = cluster.wait_phase("early-bot", "Pending")["status"]
    assert status["reason"] == "NoServingPool"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "False"

    cluster.create("servingpools", PLATFORM, pool_body("tiny-pool", base_model_dir))
    status = cluster.wait_phase("early-bot", "Ready")["status"]
    assert status["version"] == 1


def test_adapter_for_a_volume_pool_waits_for_its_replicas_to_report_the_base_model(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    s3: S3Client,
    s3_secret: str,
    tmp_path: Path,
) -> None:
    """The model is only on the pool's PVC: neither the operator nor the control plane can read
    its config.json; the first pressure report of a replica brings it."""
    start_operator()
    base_model = {"name": BASE_NAME, "uri": "/models/on-the-pvc", "volumeClaim": "weights"}
    cluster.create("servingpools", PLATFORM, pool_body("vol-pool", tmp_path, baseModel=base_model))
    pool = wait_for(
        lambda: (
            (r := controlplane.admin.get("/v1/pools/vol-pool", params={"namespace": PLATFORM}))
            .status_code == 200 and r.json()
        ),
        what="the catalog's pool",
    )  # fmt: skip
    assert pool["base_model_config"] is None  # pending, and the uri was never read
    cluster.create("loraadapters", TENANT,
                   adapter_body("vol-bot", upload_source(s3, good_adapter(tmp_path))))  # fmt: skip
    status = cluster.wait_phase("vol-bot", "Pending")["status"]
    assert status["reason"] == "BaseModelPending" and f"{PLATFORM}/vol-pool" in status["message"]

    report = {"namespace": PLATFORM, "pool": "vol-pool", "replica": "vol-pool-0",
              "base_model_config": BASE_CONFIG}  # fmt: skip
    r = httpx.post(f"{controlplane.url}/internal/v1/pressure", json=report,
                   headers={"Authorization": f"Bearer {SERVICE}"})  # fmt: skip
    assert r.status_code == 200 and r.json()["base_model_config_known"], r.text
    status = cluster.wait_phase("vol-bot", "Ready", "Rejected", "Failed")["status"]
    assert status["phase"] == "Ready", status
    assert [v["version"] for v in controlplane.versions(TENANT, "vol-bot")] == [1]


class BlockingStore(LocalStore):
    """A LocalStore whose first weights write hangs until released, then dies (a kill)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.entered = threading.Event()
        self.release = threading.Event()

    def put_file(self, key: str, path: Path) -> None:
        if key.endswith(WEIGHTS_NAME) and not self.release.is_set():
            self.entered.set()
            self.release.wait(60)
            raise SystemExit("operator killed mid-ingest")
        super().put_file(key, path)


def test_operator_killed_mid_ingest_and_restarted_ends_ready_with_one_version(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    s3: S3Client,
    s3_secret: str,
    base_model_dir: Path,
    tmp_path: Path,
) -> None:
    blocking = BlockingStore(tmp_path / "store")
    first = start_operator(store=blocking)
    cluster.create("servingpools", PLATFORM, pool_body("tiny-pool", base_model_dir))
    uri = upload_source(s3, good_adapter(tmp_path))
    cluster.create("loraadapters", TENANT, adapter_body("crashy", uri))
    assert blocking.entered.wait(20), "the ingest never reached the store"
    assert cluster.phase("crashy") == "Validating"
    first.stop(before_join=blocking.release.set)  # Kopf is gone; then the stuck write dies

    start_operator()
    status = cluster.wait_phase("crashy", "Ready", "Rejected", "Failed")["status"]
    assert status["phase"] == "Ready", status
    store = LocalStore(tmp_path / "store")
    versions = list_versions(store, TENANT, "crashy")
    assert [v.version for v in versions] == [1]
    assert store.list_keys(f"adapters/{TENANT}/crashy/versions/") == [
        f"adapters/{TENANT}/crashy/versions/v1.json"
    ]
    assert [v["version"] for v in controlplane.versions(TENANT, "crashy")] == [1]


def test_source_change_reingests_and_delete_releases_the_finalizer(
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
        "loraadapters", TENANT, adapter_body("bot", upload_source(s3, good_adapter(tmp_path)))
    )
    first = cluster.wait_phase("bot", "Ready")
    assert "loraplane.io/finalizer" in first["metadata"]["finalizers"]

    new_uri = upload_source(s3, good_adapter(tmp_path, seed=7))
    cluster.patch("loraadapters", TENANT, "bot", {"spec": {"source": {"uri": new_uri}}})
    obj = wait_for(
        lambda: (o := cluster.adapter("bot")).get("status", {}).get("version") == 2 and o,
        what="version 2",
    )
    assert obj["status"]["phase"] == "Ready"
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"] == 2
    assert obj["spec"]["source"]["uri"] == new_uri

    cluster.custom.delete_namespaced_custom_object(
        "loraplane.io", "v1alpha1", TENANT, "loraadapters", "bot"
    )
    wait_for(lambda: not cluster.emulator.objects("loraadapters"), what="the adapter to go")
    # the catalog stops serving it; its two versions stay in the store
    assert controlplane.versions(TENANT, "bot") == []
    stored = list_versions(LocalStore(tmp_path / "store"), TENANT, "bot")
    assert [v.version for v in stored] == [1, 2]


def test_unreachable_control_plane_is_failed_and_retried_never_ready(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    s3: S3Client,
    s3_secret: str,
    base_model_dir: Path,
    tmp_path: Path,
) -> None:
    from tests.operator.harness import free_port

    broken = start_operator(controlplane_url=f"http://127.0.0.1:{free_port()}")
    cluster.create("servingpools", PLATFORM, pool_body("tiny-pool", base_model_dir))
    cluster.create(
        "loraadapters", TENANT, adapter_body("bot", upload_source(s3, good_adapter(tmp_path)))
    )
    status = cluster.wait_phase("bot", "Failed")["status"]
    assert status["reason"] == "ControlPlaneUnavailable"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Ready"] == "False"
    broken.stop()

    start_operator()  # the control plane is back (the same operator, restarted)
    status = cluster.wait_phase("bot", "Ready")["status"]
    assert status["version"] == 1
    assert [v["version"] for v in controlplane.versions(TENANT, "bot")] == [1]


def test_ingests_run_on_their_own_threads_not_the_loops_default_executor(
    cluster: Cluster,
    controlplane: ControlPlane,
    start_operator: StartOperator,
    s3: S3Client,
    s3_secret: str,
    base_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slow download must not hold the threads the pools' timers use for their API calls."""
    from loraplane.operator import ingestion

    threads: list[str] = []
    real = ingestion.fetch_and_ingest

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(ingestion, "fetch_and_ingest", recording)
    start_operator()
    cluster.create("servingpools", PLATFORM, pool_body("tiny-pool", base_model_dir))
    uri = upload_source(s3, good_adapter(tmp_path, seed=3))
    cluster.create("loraadapters", TENANT, adapter_body("threaded", uri))
    obj = cluster.wait_phase("threaded", "Ready", "Rejected", "Failed")
    assert obj["status"]["phase"] == "Ready"
    assert threads and all(name.startswith("ingest") for name in threads)
