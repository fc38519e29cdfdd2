"""Fixtures for the operator: a Kubernetes API (kmock's emulator over HTTP), moto's S3 server,
the control plane on SQLite (uvicorn on a free port), and a Kopf operator started on demand."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from kubernetes import client
from pydantic import SecretStr

from loraplane.adapters.store import LocalStore, ObjectStore
from loraplane.controlplane.main import create_app
from loraplane.controlplane.settings import Settings
from loraplane.operator.context import OperatorContext
from loraplane.operator.settings import OperatorSettings
from loraplane.operator.specs import API_VERSION, GROUP, VERSION
from tests import s3server
from tests.adapters.crafting import TINY_BASE, TINY_BASE_CONFIG, TINY_BASE_NAME
from tests.operator.emulator import EmulatorThread, running_emulator
from tests.operator.harness import OperatorThread, UvicornThread, wait_for

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

ADMIN = "admin-" + "a1b2c3d4e5f6g7h8i9j0" * 2
SERVICE = "service-" + "k1l2m3n4o5p6q7r8s9t0" * 2
TENANT = "team-a"
PLATFORM = "loraplane-system"
BASE_NAME, BASE_CONFIG, BASE = TINY_BASE_NAME, TINY_BASE_CONFIG, TINY_BASE
BUCKET = "tenant-sources"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server for the session, with the tenants' source bucket."""
    with s3server.moto_s3_server() as endpoint:
        s3server.s3_client(endpoint).create_bucket(Bucket=BUCKET)
        yield endpoint


@pytest.fixture(scope="session")
def s3(s3_endpoint: str) -> S3Client:
    """A boto3 client of the moto server."""
    return s3server.s3_client(s3_endpoint)


@dataclass
class ControlPlane:
    """The running control plane and an admin client."""

    url: str
    admin: httpx.Client

    def versions(self, tenant: str, name: str) -> list[dict[str, Any]]:
        """The catalog's versions of an adapter, via a fresh tenant key."""
        r = self.admin.post(f"/v1/tenants/{tenant}/keys", json={"name": "t"})
        key = r.json()["key"]
        r = httpx.get(
            f"{self.url}/v1/adapters/{name}/versions",
            headers={"Authorization": f"Bearer {key}"},
        )
        if r.status_code == 404:
            return []
        assert r.status_code == 200, r.text
        versions: list[dict[str, Any]] = r.json()
        return versions


@pytest.fixture
def controlplane(tmp_path: Path, sqlite_template: Path) -> Iterator[ControlPlane]:
    """The control plane on a fresh SQLite catalog, with the tenant registered."""
    catalog = tmp_path / "catalog.db"
    shutil.copy(sqlite_template, catalog)
    settings = Settings(
        data_dir=tmp_path / "cp-state",
        database_url=f"sqlite:///{catalog}",
        store=str(tmp_path / "store"),
        admin_token=SecretStr(ADMIN),
        service_token=SecretStr(SERVICE),
    )
    app = create_app(settings)
    server = UvicornThread(app)
    server.start()
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"})
    try:
        assert admin.post("/v1/tenants", json={"name": TENANT}).status_code == 201
        yield ControlPlane(server.url, admin)
    finally:
        admin.close()
        server.stop()
        app.state.ctx.close()


@dataclass
class Cluster:
    """The emulated API server and typed short-hands over the official client."""

    emulator: EmulatorThread
    api: client.ApiClient
    core: client.CoreV1Api = field(init=False)
    apps: client.AppsV1Api = field(init=False)
    custom: client.CustomObjectsApi = field(init=False)

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def create(self, plural: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        obj: dict[str, Any] = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, plural, body
        )
        return obj

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, plural, name
        )
        return obj

    def patch(self, plural: str, namespace: str, name: str, body: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, plural, name, body)

    def adapter(self, name: str, namespace: str = TENANT) -> dict[str, Any]:
        return self.get("loraadapters", namespace, name)

    def phase(self, name: str, namespace: str = TENANT) -> str | None:
        phase: str | None = self.adapter(name, namespace).get("status", {}).get("phase")
        return phase

    def wait_phase(self, name: str, *phases: str, timeout: float = 20.0) -> dict[str, Any]:
        """Wait until the adapter is in one of `phases`; return it."""

        def probe() -> dict[str, Any] | None:
            obj = self.adapter(name)
            return obj if obj.get("status", {}).get("phase") in phases else None

        found: dict[str, Any] = wait_for(probe, timeout=timeout, what=f"{name} in {phases}")
        return found

    def secret(self, namespace: str, name: str, data: dict[str, str]) -> None:
        body = {"metadata": {"name": name, "namespace": namespace}, "stringData": data}
        self.core.create_namespaced_secret(namespace, body)

    def events(self, namespace: str = TENANT) -> list[dict[str, Any]]:
        return [e for e in self.emulator.objects("events", group="", version="v1")
                if e.get("metadata", {}).get("namespace") == namespace]  # fmt: skip


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A fresh emulated Kubernetes API with the tenant's and the platform's namespaces."""
    with running_emulator() as emulator:
        configuration = client.Configuration()
        configuration.host = emulator.url
        api = client.ApiClient(configuration)
        result = Cluster(emulator, api)
        for ns in (TENANT, PLATFORM):
            result.core.create_namespace({"metadata": {"name": ns}})
        yield result
        api.close()


def operator_settings(
    controlplane: ControlPlane, tmp_path: Path, s3_endpoint: str, **overrides: Any
) -> OperatorSettings:
    """Fast retries and timers for tests."""
    values: dict[str, Any] = {
        "controlplane_url": controlplane.url,
        "service_token": SERVICE,
        "store": str(tmp_path / "store"),
        "s3_endpoint_url": s3_endpoint,
        "pool_interval_seconds": 0.5,
        "pool_wait_seconds": 0.5,
        "retry_base_seconds": 0.3,
        "retry_max_seconds": 1.0,
        **overrides,
    }
    return OperatorSettings(**values)


StartOperator = Callable[..., OperatorThread]


@pytest.fixture
def start_operator(
    cluster: Cluster, controlplane: ControlPlane, tmp_path: Path, s3_endpoint: str
) -> Iterator[StartOperator]:
    """Start an operator (optionally with another store); all are stopped afterwards."""
    started: list[OperatorThread] = []

    def start(store: ObjectStore | None = None, **overrides: Any) -> OperatorThread:
        settings = operator_settings(controlplane, tmp_path, s3_endpoint, **overrides)
        configuration = client.Configuration()
        configuration.host = cluster.emulator.url
        ctx = OperatorContext.create(
            settings,
            kube_configuration=configuration,
            store=store or LocalStore(settings.store),
        )
        op = OperatorThread(ctx, cluster.emulator.url, pool_interval=0.5)
        op.start()
        started.append(op)
        return op

    yield start
    for op in started:
        if not op.finished.is_set():
            op.stop()
        op.ctx.close()


# -- resources ------------------------------------------------------------------------------


def pool_body(name: str, base_model_dir: Path, **spec: Any) -> dict[str, Any]:
    """A ServingPool of the tiny base model."""
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "ServingPool",
        "metadata": {"name": name, "namespace": PLATFORM},
        "spec": {
            "baseModel": {"name": BASE_NAME, "uri": str(base_model_dir)},
            "image": "ghcr.io/loraplane/loraplane:0.1.0",
            "device": "cpu",
            "replicas": {"min": 1, "max": 3},
            "lora": {"maxLoras": 4, "maxLoraRank": 16, "maxCpuLoras": 8},
            "serviceTokenSecretRef": {"name": "loraplane-tokens", "key": "service"},
        },
    }
    body["spec"].update(spec)
    return body


def adapter_body(
    name: str, uri: str, *, secret: str | None = "s3-creds", **spec: Any
) -> dict[str, Any]:
    """A LoRAAdapter of the tiny base model in the tenant's namespace."""
    source: dict[str, Any] = {"uri": uri}
    if secret:
        source["secretRef"] = {"name": secret}
    return {
        "apiVersion": API_VERSION,
        "kind": "LoRAAdapter",
        "metadata": {"name": name, "namespace": TENANT},
        "spec": {"baseModel": BASE_NAME, "source": source, **spec},
    }


def upload_source(s3: S3Client, path: Path) -> str:
    """Put an adapter folder or archive into the source bucket; return its s3:// URI."""
    prefix = f"src/{uuid.uuid4().hex[:10]}"
    if path.is_dir():
        for f in sorted(path.iterdir()):
            s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{f.name}", Body=f.read_bytes())
        return f"s3://{BUCKET}/{prefix}"
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.name}", Body=path.read_bytes())
    return f"s3://{BUCKET}/{prefix}/{path.name}"


@pytest.fixture
def s3_secret(cluster: Cluster) -> str:
    """The tenant's Secret with the (moto) S3 credentials."""
    cluster.secret(
        TENANT, "s3-creds", {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    )
    return "s3-creds"
