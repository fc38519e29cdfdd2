"""Set the system up the way an operator and tenants would: through the control plane's REST API.

The admin registers the pool (the base model's folder is its URI) and creates the tenants and
their API keys; each tenant uploads its PEFT adapter as a multipart form, so validation,
content addressing and immutable storage run for real.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loraplane.demo.errors import DemoError
from loraplane.demo.stack import MAX_LORA_RANK, MAX_LORAS, POOL

Say = Callable[[str], None]
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class ProvisionError(DemoError):
    """The control plane refused a set-up step the demo relies on."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant the demo created: its API key and its uploaded adapter."""

    name: str
    key: str
    adapter: str
    rank: int
    version: int
    digest: str


def _check(response: httpx.Response, what: str, *ok: int) -> dict[str, Any]:
    """The JSON body, or ProvisionError with the control plane's error."""
    if response.status_code not in ok:
        raise ProvisionError(f"{what}: HTTP {response.status_code}: {response.text[:300]}")
    body: dict[str, Any] = response.json()
    return body


def admin_client(cp_url: str, admin_token: str) -> httpx.Client:
    """An httpx client carrying the admin token."""
    return httpx.Client(base_url=cp_url, headers={"Authorization": f"Bearer {admin_token}"})


def register_pool(admin: httpx.Client, base_name: str, model_dir: Path) -> dict[str, Any]:
    """`POST /v1/pools`: the base model's name and folder, and the pool's LoRA limits."""
    pool = {
        "name": POOL,
        "base_model": {"name": base_name, "uri": str(model_dir)},
        "max_lora_rank": MAX_LORA_RANK,
        "max_loras": MAX_LORAS,
        "max_cpu_loras": 8,
    }
    return _check(admin.post("/v1/pools", json=pool), "register the pool", 201)


def create_tenant(admin: httpx.Client, tenant: str) -> str:
    """`POST /v1/tenants` and `POST /v1/tenants/{tenant}/keys`; the new key (shown once)."""
    _check(admin.post("/v1/tenants", json={"name": tenant}), f"create tenant {tenant}", 201)
    body = _check(
        admin.post(f"/v1/tenants/{tenant}/keys", json={"name": "demo"}), f"key for {tenant}", 201
    )
    return str(body["key"])


def upload(
    cp_url: str,
    key: str,
    name: str,
    base_name: str,
    folder: Path,
    files: dict[str, bytes] | None = None,
) -> httpx.Response:
    """`POST /v1/adapters` as multipart: text fields `name`, `base_model`; file parts `files`.

    `files` (file name -> bytes) replaces what is read from `folder` (to send altered content).
    """
    parts = files or {f: (folder / f).read_bytes() for f in ADAPTER_FILES}
    return httpx.post(
        cp_url + "/v1/adapters",
        data={"name": name, "base_model": base_name},
        files=[("files", (fname, data)) for fname, data in parts.items()],
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def provision(
    cp_url: str,
    admin_token: str,
    base_name: str,
    adapters: dict[str, tuple[str, Path]],
    say: Say,
) -> dict[str, Tenant]:
    """Create each tenant (key) and upload its adapter; `adapters`: tenant -> (name, folder)."""
    tenants: dict[str, Tenant] = {}
    with admin_client(cp_url, admin_token) as admin:
        for tenant, (name, folder) in adapters.items():
            key = create_tenant(admin, tenant)
            body = _check(
                upload(cp_url, key, name, base_name, folder), f"{tenant} uploads {name}", 201
            )
            v = body["version"]
            tenants[tenant] = Tenant(tenant, key, name, v["rank"], v["version"], v["digest"])
            say(
                f"    {tenant:<8} key {key[:10]}...  POST /v1/adapters {name}: 201 created v"
                f"{v['version']}, rank {v['rank']}, {v['size_bytes'] / 1024:.0f} KiB, "
                f"sha256 {v['digest'][:12]}..."
            )
    return tenants
