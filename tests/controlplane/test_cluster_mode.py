"""Cluster mode (`LORAPLANE_KUBERNETES=1`): a REST upload is validated, staged in the store and
handed to the operator as the tenant's LoRAAdapter (`upload://<id>`); the operator ingests it
and records the version. Against kmock's emulated API server, with the real operator (Kopf)
in a thread and the control plane under uvicorn."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client
from pydantic import SecretStr

from loraplane.adapters.ingest import ingest
from loraplane.adapters.limits import AdapterLimits
from loraplane.adapters.store import LocalStore
from loraplane.controlplane.main import create_app
from loraplane.controlplane.settings import Settings, StartupError
from loraplane.operator.context import OperatorContext
from loraplane.operator.settings import OperatorSettings
from loraplane.operator.sources import fetch_upload
from tests.adapters.crafting import lora_config, lora_tensors, write_adapter
from tests.controlplane.conftest import ADMIN, BASE, BASE_NAME, SERVICE, bearer
from tests.factories import TRAINER_EXTRAS, build_trainer_checkpoint
from tests.operator.conftest import (  # `cluster` is a fixture: pytest finds it here
    PLATFORM,
    TENANT,
    Cluster,
    cluster,
    pool_body,
)
from tests.operator.harness import OperatorThread, UvicornThread, wait_for

pytestmark = pytest.mark.k8s

IMPORT_BUCKET = "tenant-imports"


@dataclass
class ClusterPlane:
    """The control plane in cluster mode, its store, and a tenant key."""

    url: str
    admin: httpx.Client
    tenant: httpx.Client
    store: LocalStore

    def upload(self, name: str, source: Path, base_model: str = BASE_NAME) -> httpx.Response:
        paths = sorted(source.iterdir()) if source.is_dir() else [source]
        files = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in paths]
        return self.tenant.post(
            "/v1/adapters", data={"name": name, "base_model": base_model}, files=files
        )

    def staged(self) -> list[str]:
        return self.store.list_keys("uploads/")


@pytest.fixture
def plane(
    cluster: Cluster,
    tmp_path: Path,
    sqlite_template: Path,
    base_model_dir: Path,
    request: pytest.FixtureRequest,
) -> Iterator[ClusterPlane]:
    """The control plane in cluster mode with the tenant registered: its namespace is TENANT,
    and so is its name unless the test asks for another name (indirect parameter)."""
    tenant_name = getattr(request, "param", TENANT)
    catalog = tmp_path / "catalog.db"
    catalog.write_bytes(sqlite_template.read_bytes())
    settings = Settings(
        data_dir=tmp_path / "cp-state",
        database_url=f"sqlite:///{catalog}",
        store=str(tmp_path / "store"),
        admin_token=SecretStr(ADMIN),
        service_token=SecretStr(SERVICE),
        kubernetes=True,
        import_buckets=[IMPORT_BUCKET],
        retry_after_seconds=7,
    )
    configuration = client.Configuration()
    configuration.host = cluster.emulator.url
    app = create_app(settings, kube_configuration=configuration)
    server = UvicornThread(app)
    server.start()
    admin = httpx.Client(base_url=server.url, headers=bearer(ADMIN), timeout=30)
    try:
        created = admin.post("/v1/tenants", json={"name": tenant_name, "namespace": TENANT})
        assert created.status_code == 201, created.text
        key = admin.post(f"/v1/tenants/{tenant_name}/keys", json={"name": "k"}).json()["key"]
        tenant = httpx.Client(base_url=server.url, headers=bearer(key), timeout=30)
        yield ClusterPlane(server.url, admin, tenant, LocalStore(tmp_path / "store"))
        tenant.close()
    finally:
        admin.close()
        server.stop()
        app.state.ctx.close()
        app.state.ctx.cluster.close()


def register_pool(plane: ClusterPlane, base_model_dir: Path, **limits: Any) -> None:
    """A pool in the catalog (what the operator mirrors from a ServingPool)."""
    body = {
        "name": "tiny-pool",
        "base_model": {"name": BASE_NAME, "uri": str(base_model_dir)},
        **limits,
    }
    assert plane.admin.post("/v1/pools", json=body).status_code == 201


@pytest.fixture
def operator(cluster: Cluster, plane: ClusterPlane, tmp_path: Path) -> Iterator[OperatorThread]:
    """The operator on the same store as the control plane, recording into it."""
    settings = OperatorSettings(
        controlplane_url=plane.url,
        service_token=SERVICE,
        store=str(tmp_path / "store"),
        pool_interval_seconds=0.5,
        pool_wait_seconds=0.5,
        retry_base_seconds=0.3,
        retry_max_seconds=1.0,
    )
    configuration = client.Configuration()
    configuration.host = cluster.emulator.url
    ctx = OperatorContext.create(
        settings, kube_configuration=configuration, store=LocalStore(settings.store)
    )
    op = OperatorThread(ctx, cluster.emulator.url, pool_interval=0.5)
    op.start()
    yield op
    if not op.finished.is_set():
        op.stop()
    ctx.close()


def good_adapter(tmp: Path, seed: int = 0, r: int = 8) -> Path:
    return write_adapter(
        tmp / f"good-{seed}-{r}", lora_config(r=r), lora_tensors(BASE, r, seed=seed)
    )


def direct_digest(source: Path, tmp: Path) -> str:
    """The digest the adapter core gives the same files when ingested directly."""
    return ingest(source, "direct", "x", BASE, AdapterLimits(), LocalStore(tmp / "direct")).digest


# The tenant named as its namespace, and named otherwise (the operator finds it by namespace).
@pytest.mark.parametrize("plane", [TENANT, "acme"], indirect=True)
def test_upload_is_staged_as_a_loraadapter_the_operator_makes_ready(
    cluster: Cluster,
    plane: ClusterPlane,
    operator: OperatorThread,
    base_model_dir: Path,
    tmp_path: Path,
) -> None:
    cluster.create("servingpools", PLATFORM, pool_body("tiny-pool", base_model_dir))
    in_platform = {"namespace": PLATFORM}
    wait_for(
        lambda: plane.admin.get("/v1/pools/tiny-pool", params=in_platform).status_code == 200,
        what="pool",
    )
    source = good_adapter(tmp_path)

    r = plane.upload("support-bot", source)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["name"] == "support-bot"
    assert body["state"] == "staged"
    assert body["resource"] == f"{TENANT}/support-bot"
    uri = body["source_uri"]
    assert uri.startswith("upload://")
    obj = cluster.adapter("support-bot", TENANT)
    assert obj["spec"] == {"baseModel": BASE_NAME, "source": {"uri": uri}}
    upload_id = uri.removeprefix("upload://")
    assert sorted(k.rsplit("/", 1)[1] for k in plane.staged()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert all(k.startswith(f"uploads/{upload_id}/") for k in plane.staged())

    ready = cluster.wait_phase("support-bot", "Ready", "Rejected", "Failed", timeout=30)
    assert ready["status"]["phase"] == "Ready", ready["status"]
    digest = direct_digest(source, tmp_path)
    shown = plane.tenant.get("/v1/adapters/support-bot")
    assert shown.status_code == 200, shown.text
    assert shown.json()["current_version"] == 1
    assert shown.json()["current"]["digest"] == digest == ready["status"]["digest"]

    # Identical content again: 202, a new staging, the operator records the same version.
    again = plane.upload("support-bot", source)
    assert again.status_code == 202, again.text
    assert again.json()["source_uri"] != uri
    generation = cluster.adapter("support-bot", TENANT)["metadata"]["generation"]
    assert generation == 2

    def reingested() -> dict[str, Any] | None:
        status: dict[str, Any] = cluster.adapter("support-bot", TENANT).get("status", {})
        done = status.get("observedGeneration") == generation and status.get("phase") == "Ready"
        return status if done else None

    status = wait_for(reingested, timeout=30, what="re-ingest of identical content")
    assert status["version"] == 1 and status["digest"] == digest
    versions = plane.tenant.get("/v1/adapters/support-bot/versions").json()
    assert [v["version"] for v in versions] == [1]

    # Delete: the resource goes (the operator's finalizer marks the catalog).
    assert plane.tenant.delete("/v1/adapters/support-bot").status_code == 204
    wait_for(
        lambda: plane.tenant.get("/v1/adapters/support-bot").status_code == 404,
        timeout=30,
        what="catalog marks the adapter deleted",
    )
    # the catalog is marked before the finalizer comes off the resource: until it has, a
    # second delete still finds it terminating
    wait_for(
        lambda: plane.tenant.delete("/v1/adapters/support-bot").status_code == 404,
        timeout=30,
        what="a second delete answers 404 once the resource is gone",
    )


def test_staged_files_are_what_the_operator_fetches(
    cluster: Cluster, plane: ClusterPlane, base_model_dir: Path, tmp_path: Path
) -> None:
    register_pool(plane, base_model_dir)
    source = good_adapter(tmp_path, seed=3)
    archive = tmp_path / "bundle.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for f in sorted(source.iterdir()):
            tar.add(f, arcname=f.name)
    r = plane.upload("from-archive", archive)
    assert r.status_code == 202, r.text
    uri = r.json()["source_uri"]
    assert cluster.adapter("from-archive", TENANT)["spec"]["source"]["uri"] == uri
    fetched = fetch_upload(uri, tmp_path / "work", plane.store, max_bytes=1 << 30)
    assert fetched.name == "adapter.tar"
    assert direct_digest(fetched, tmp_path) == direct_digest(source, tmp_path)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (lora_config(r=8, bias="all"), "BiasNotSupported"),
        (lora_config(r=8, use_dora=True), "ShapeMismatch"),  # DoRA with no magnitude vectors
        (lora_config(r=64), "RankTooLarge"),
    ],
)
def test_bad_adapter_is_422_with_nothing_staged_and_no_resource(
    cluster: Cluster,
    plane: ClusterPlane,
    base_model_dir: Path,
    tmp_path: Path,
    config: dict[str, Any],
    reason: str,
) -> None:
    register_pool(plane, base_model_dir, max_lora_rank=16)
    source = write_adapter(tmp_path / "bad", config, lora_tensors(BASE, config["r"], seed=1))
    r = plane.upload("bad-bot", source)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == reason
    assert cluster.emulator.objects("loraadapters") == []
    assert plane.staged() == []


def test_unknown_base_model_is_422_with_no_resource(
    cluster: Cluster, plane: ClusterPlane, tmp_path: Path
) -> None:
    r = plane.upload("orphan", good_adapter(tmp_path))
    assert r.status_code == 422, r.text
    assert cluster.emulator.objects("loraadapters") == []
    assert plane.staged() == []


def test_json_import_points_the_loraadapter_at_an_allowlisted_bucket(
    cluster: Cluster, plane: ClusterPlane, base_model_dir: Path
) -> None:
    register_pool(plane, base_model_dir)
    uri = f"s3://{IMPORT_BUCKET}/team-a/bot"
    body = {"name": "imported", "base_model": BASE_NAME, "source_uri": uri}
    r = plane.tenant.post("/v1/adapters", json=body)
    assert r.status_code == 202, r.text
    assert r.json() == {
        "name": "imported",
        "state": "staged",
        "source_uri": uri,
        "resource": f"{TENANT}/imported",
        "ignored": [],
    }
    assert cluster.adapter("imported", TENANT)["spec"]["source"]["uri"] == uri

    denied = dict(body, name="elsewhere", source_uri="s3://other-bucket/x")
    r = plane.tenant.post("/v1/adapters", json=denied)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "SourceNotAllowed"
    assert [o["metadata"]["name"] for o in cluster.emulator.objects("loraadapters")] == ["imported"]


def test_repoint_patches_only_the_source_and_another_base_model_conflicts(
    cluster: Cluster, plane: ClusterPlane, base_model_dir: Path, tmp_path: Path
) -> None:
    register_pool(plane, base_model_dir)
    assert plane.upload("bot", good_adapter(tmp_path, seed=1)).status_code == 202
    cluster.patch("loraadapters", TENANT, "bot", {"spec": {"servedName": "kept"}})
    r = plane.upload("bot", good_adapter(tmp_path, seed=2))
    assert r.status_code == 202, r.text
    spec = cluster.adapter("bot", TENANT)["spec"]
    assert spec == {
        "baseModel": BASE_NAME,
        "servedName": "kept",
        "source": {"uri": r.json()["source_uri"]},
    }
    cluster.patch("loraadapters", TENANT, "bot", {"spec": {"baseModel": "other"}})
    r = plane.upload("bot", good_adapter(tmp_path, seed=4))
    assert r.status_code == 409, r.text


def test_kubernetes_api_down_is_503_with_retry_after_and_nothing_left_staged(
    cluster: Cluster, plane: ClusterPlane, base_model_dir: Path, tmp_path: Path
) -> None:
    register_pool(plane, base_model_dir)
    cluster.emulator.stop()
    r = plane.upload("bot", good_adapter(tmp_path))
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "7"
    assert r.json()["error"]["code"] == "KubernetesUnavailable"
    assert plane.staged() == []
    body = {"name": "imp", "base_model": BASE_NAME, "source_uri": f"s3://{IMPORT_BUCKET}/k"}
    r = plane.tenant.post("/v1/adapters", json=body)
    assert r.status_code == 503 and r.headers["Retry-After"] == "7"
    r = plane.tenant.delete("/v1/adapters/bot")
    assert r.status_code == 503 and r.headers["Retry-After"] == "7"


def test_cluster_mode_without_credentials_fails_at_start_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    settings = Settings(
        data_dir=tmp_path / "state",
        database_url=f"sqlite:///{tmp_path}/x.db",
        store=str(tmp_path / "store"),
        admin_token=SecretStr(ADMIN),
        service_token=SecretStr(SERVICE),
        kubernetes=True,
    )
    with pytest.raises(StartupError, match="LORAPLANE_KUBERNETES"):
        create_app(settings)


def test_a_trainer_checkpoint_is_staged_without_its_artefacts_and_lists_them(
    cluster: Cluster,
    plane: ClusterPlane,
    base_model_dir: Path,
    tiny_llama_dir: Path,
    tmp_path: Path,
) -> None:
    register_pool(plane, base_model_dir)
    checkpoint = build_trainer_checkpoint(tiny_llama_dir, tmp_path / "trainer")
    r = plane.upload("trained", checkpoint)
    assert r.status_code == 202, r.text
    assert r.json()["ignored"] == list(TRAINER_EXTRAS)
    staged = sorted(k.rsplit("/", 1)[1] for k in plane.staged())
    assert staged == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_config_without_weights_names_the_upload_not_the_staging_folder(
    cluster: Cluster, plane: ClusterPlane, base_model_dir: Path, tmp_path: Path
) -> None:
    register_pool(plane, base_model_dir)
    folder = write_adapter(tmp_path / "half", lora_config(r=4), lora_tensors(BASE, 4, seed=1))
    (folder / "adapter_model.safetensors").unlink()
    (folder / "README.md").write_text("no weights here\n")
    r = plane.upload("half", folder)
    assert r.status_code == 422, r.text
    assert r.json()["error"] == {
        "code": "UnsupportedFormat",
        "message": "the upload has no adapter_model.safetensors beside adapter_config.json",
    }
    assert cluster.emulator.objects("loraadapters") == [] and plane.staged() == []


def test_signed_upload_carries_its_signature_to_the_loraadapter_and_the_operator_checks_it(
    cluster: Cluster,
    plane: ClusterPlane,
    operator: OperatorThread,
    base_model_dir: Path,
    tmp_path: Path,
) -> None:
    """Cluster mode: the upload's signature is checked before staging and goes into
    `spec.source`; the operator checks it again and the version records its key; a later
    unsigned re-point drops the old signature fields."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from loraplane.adapters import signing
    from loraplane.adapters.canonical import digest_of_source

    cluster.create("servingpools", PLATFORM, pool_body("tiny-pool", base_model_dir))
    wait_for(
        lambda: plane.admin.get("/v1/pools/tiny-pool", params={"namespace": PLATFORM}).is_success,
        what="pool",
    )
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    key_id = plane.tenant.post("/v1/signing-keys", json={"public_key": pem.decode()}).json()[
        "key_id"
    ]
    assert plane.admin.patch(f"/v1/tenants/{TENANT}", json={"require_signature": True}).is_success
    source = good_adapter(tmp_path, seed=5)
    refused = plane.upload("signed", source)
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "SignatureRequired"
    assert plane.staged() == [] and cluster.emulator.objects("loraadapters") == []

    signature = signing.sign_digest(key, digest_of_source(source))
    paths = sorted(source.iterdir())
    files = [("files", (p.name, p.read_bytes(), "application/octet-stream")) for p in paths]
    fields = {"name": "signed", "base_model": BASE_NAME, "signature": signature}
    r = plane.tenant.post("/v1/adapters", data=fields, files=files)
    assert r.status_code == 202, r.text
    spec = cluster.adapter("signed", TENANT)["spec"]["source"]
    assert spec == {"uri": r.json()["source_uri"], "signature": signature}
    ready = cluster.wait_phase("signed", "Ready", "Rejected", "Failed", timeout=30)
    assert ready["status"]["phase"] == "Ready", ready["status"]
    (version,) = plane.tenant.get("/v1/adapters/signed/versions").json()
    assert version["signing_key_id"] == key_id

    assert plane.admin.patch(f"/v1/tenants/{TENANT}", json={"require_signature": False}).is_success
    r = plane.upload("signed", good_adapter(tmp_path, seed=6))
    assert r.status_code == 202, r.text
    assert cluster.adapter("signed", TENANT)["spec"]["source"] == {"uri": r.json()["source_uri"]}
