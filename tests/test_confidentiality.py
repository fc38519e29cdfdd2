"""Tenant confidentiality (issue 17): nothing about one tenant is visible to another on any
port a tenant can reach.

The system runs as the chart runs it, over real HTTP: the control plane with its public and
internal ports, a data plane in catalog mode calling the internal port, its metrics on a port
of their own. Two tenants each upload adapters and use them, so per-tenant series, usage rows
and resident adapters exist. Then every route of the data plane's API port and of the control
plane's public port (enumerated from the apps, not listed by hand) is called with every method
it takes, with tenant A's key and with no key, and each answer's status, headers and body are
searched for tenant B's name, adapter names, key, key prefix, digests and usage figures.

A negative control keeps the search honest: the metrics port, which only Prometheus may reach,
must show B's name, adapters and figures, and the same search must find them there.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from loraplane.dataplane.server.app import create_app as create_dataplane
from loraplane.dataplane.server.settings import ServerSettings
from tests.controlplane.conftest import SERVICE
from tests.dataplane.server.conftest import serve_metrics, wait_ready
from tests.servers import serve_in_thread
from tests.test_e2e_catalog import admin, split_controlplane

POOL, BASE = "pool-c", "tiny-base"
A, B = "alphaco", "zyxqcorp"
A_ADAPTERS = {"alpha-helper": "r8-qv"}  # name -> fixture adapter
B_ADAPTERS = {"zyxq-support": "r16", "zyxq-legal": "r4"}
# B's requests per adapter and tokens each: its usage figures come out above the tiny model's
# vocabulary (384), so no token id in A's own answers can be mistaken for one of them
B_REQUESTS = {"zyxq-support": 5, "zyxq-legal": 4}
B_MAX_TOKENS = 97
A_MAX_TOKENS = 5
# 83 tokens: no figure of B's comes out round (512 would also be a limit in openapi.json)
PROMPT = "Many tenants share one base model and each brings its own small adapter. " * 2 + (
    "Quietly, a third waits."
)
VOCAB = 384


@dataclass
class Secrets:
    """What A must never see of B: strings (case-insensitive) and usage figures."""

    strings: set[str] = field(default_factory=set)
    figures: set[int] = field(default_factory=set)

    def found(self, text: str) -> list[str]:
        """The secrets `text` shows."""
        lower = text.lower()
        hits = sorted(s for s in self.strings if s.lower() in lower)
        for figure in sorted(self.figures):
            if re.search(rf"(?<![\w.]){figure}(?:\.0)?(?![\w.])", text):
                hits.append(str(figure))
        return hits


@dataclass(frozen=True)
class Call:
    method: str
    url: str
    kwargs: dict[str, Any]

    def fetch(self) -> str:
        """Status, headers and body of the answer, as one text to search."""
        r = httpx.request(self.method, self.url, timeout=60, **self.kwargs)
        headers = "\n".join(f"{k}: {v}" for k, v in r.headers.items())
        return f"{r.status_code}\n{headers}\n\n{r.text}"

    def __str__(self) -> str:
        auth = "A's key" if "headers" in self.kwargs else "no key"
        extra = self.kwargs.get("json", self.kwargs.get("params", ""))
        return f"{self.method} {self.url} ({auth}) {extra}"


def routes(app: FastAPI) -> list[tuple[str, set[str] | None]]:
    """(path template, methods) of every route of `app`, a mount's inner routes as GETs of
    their own. Routers included into the app are flattened (FastAPI keeps them nested in
    `app.routes`)."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # older FastAPI: app.routes is flat already
        items: list[Any] = list(app.routes)
    else:
        items = list(iter_route_contexts(app.routes))
    out: list[tuple[str, set[str] | None]] = []
    for item in items:
        methods = getattr(item, "methods", None)
        if methods:
            path = re.sub(r"\{(\w+):\w+\}", r"{\1}", str(item.path))  # {model:path} as documented
            out.append((path, set(methods) - {"HEAD", "OPTIONS"}))
            continue
        # a mount (the console's static pages): its root, its inner routes and its files
        mount = getattr(item, "original_route", item)
        inner = [str(getattr(r, "path", "/")) for r in getattr(mount, "routes", None) or []]
        files = mount_files(str(item.path))
        out += [(str(item.path) + sub, {"GET"}) for sub in ("", "/", *inner, *files)]
    paths = {p for p, _ in out}
    documented = set(app.openapi()["paths"])
    assert documented <= paths, f"routes the enumeration missed: {documented - paths}"
    return out


def mount_files(path: str) -> list[str]:
    """The files a mount serves by name (the console's), as paths under it."""
    from loraplane.controlplane.console.app import PATH as CONSOLE_PATH

    if path != CONSOLE_PATH:
        return []
    folder = resources.files("loraplane.controlplane.console")
    names = [p.name for p in folder.iterdir() if p.is_file() and not p.name.endswith(".py")]
    return [f"/{name}" for name in sorted(names)] + ["/config.json"]


def fill(path: str, values: dict[str, str]) -> str:
    """`path` with every {param} replaced (by `values`, else a value nobody has)."""
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: values.get(m.group(1), "1"), path)


def dataplane_calls(url: str, app: FastAPI, model: str, auths: list[dict[str, Any]]) -> list[Call]:
    chat = [{"role": "user", "content": "hello"}]
    bodies: dict[str, list[dict[str, Any]]] = {
        "/v1/completions": [
            {"model": model, "prompt": "hello", "max_tokens": 2},
            {
                "model": model,
                "prompt": "hello",
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            {"model": BASE, "prompt": "hello", "max_tokens": 2},
        ],
        "/v1/chat/completions": [
            {"model": model, "messages": chat, "max_tokens": 2},
            {"model": model, "messages": chat, "max_tokens": 2, "stream": True},
        ],
        "/tokenize": [{"model": model, "prompt": "hello"}],
        "/detokenize": [{"model": model, "tokens": [5, 6, 7]}],
    }
    calls = []
    for path, methods in routes(app):
        for method in sorted(methods or ()):
            for auth in auths:
                if method == "GET":
                    for params in ({}, {"model": model}):
                        calls.append(Call(method, url + path, {**auth, "params": params}))
                    continue
                default = [{"model": model, "lora_name": model}]
                for body in [{}, *bodies.get(path, default)]:
                    calls.append(Call(method, url + path, {**auth, "json": body}))
    return calls


def controlplane_calls(
    url: str, app: FastAPI, values: dict[str, str], auths: list[dict[str, Any]]
) -> list[Call]:
    bodies = [
        {},
        {"name": values["name"], "base_model": BASE, "source_uri": "s3://no-such-bucket/x"},
        {"current_version": 1},
        {"name": values["tenant"]},
    ]
    calls = []
    for path, methods in routes(app):
        target = url + fill(path, values)
        for method in sorted(methods or ()):
            for auth in auths:
                if method in ("GET", "DELETE"):
                    calls.append(Call(method, target, dict(auth)))
                else:
                    calls += [Call(method, target, {**auth, "json": body}) for body in bodies]
    # DELETEs last: A removing its own things must not hide anything from the calls before
    return sorted(calls, key=lambda c: c.method == "DELETE")


def upload(cp: str, key: str, name: str, src: Path) -> dict[str, Any]:
    files = [("files", (p.name, p.read_bytes())) for p in sorted(src.iterdir())]
    r = httpx.post(cp + "/v1/adapters", data={"name": name, "base_model": BASE}, files=files,
                   headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
    assert r.status_code == 201, r.text
    result: dict[str, Any] = r.json()
    return result


def complete(dp: str, key: str, model: str, max_tokens: int) -> dict[str, int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(dp + "/v1/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert r.status_code == 200, r.text
    usage: dict[str, int] = r.json()["usage"]
    assert usage["completion_tokens"] == max_tokens
    return usage


@contextlib.contextmanager
def dataplane(
    settings: ServerSettings,
) -> Iterator[tuple[str, str, FastAPI]]:
    """The data plane's API port and metrics port, and its app."""
    app = create_dataplane(settings)
    with serve_in_thread(app) as url, serve_metrics(app.state.runtime) as metrics:
        wait_ready(url)
        yield url, metrics, app


@pytest.mark.slow
def test_nothing_about_tenant_b_is_reachable_with_tenant_a_key_or_none(
    tiny_llama_dir: Path, peft_adapters: dict[str, Path], tmp_path: Path
) -> None:
    with split_controlplane(tmp_path) as (cp, cp_internal, cp_app):
        pool = {"name": POOL, "base_model": {"name": BASE, "uri": str(tiny_llama_dir)}}
        assert admin(cp, "POST", "/v1/pools", json=pool).status_code == 201
        keys: dict[str, str] = {}
        key_ids: dict[str, str] = {}
        for tenant in (A, B):
            assert admin(cp, "POST", "/v1/tenants", json={"name": tenant}).status_code == 201
            created = admin(cp, "POST", f"/v1/tenants/{tenant}/keys", json={"name": "k"}).json()
            keys[tenant], key_ids[tenant] = created["key"], str(created["id"])
        uploaded = {
            name: upload(cp, keys[tenant], name, peft_adapters[fixture])
            for tenant, adapters in ((A, A_ADAPTERS), (B, B_ADAPTERS))
            for name, fixture in adapters.items()
        }
        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name=BASE, controlplane_url=cp_internal,
            service_token=SERVICE, store=str(tmp_path / "store"), pool=POOL,
            pressure_interval_s=0.3, num_kv_blocks=256, max_loras=4,
        )  # fmt: skip
        with dataplane(settings) as (dp, dp_metrics, dp_app):
            b_usage: dict[str, list[dict[str, int]]] = {name: [] for name in B_ADAPTERS}
            for name, count in B_REQUESTS.items():
                for _ in range(count):
                    b_usage[name].append(complete(dp, keys[B], name, B_MAX_TOKENS))
            for name in A_ADAPTERS:
                for _ in range(2):
                    complete(dp, keys[A], name, A_MAX_TOKENS)
            # B's usage reaches the catalog (so the control plane holds it while A looks)
            b_auth = {"Authorization": f"Bearer {keys[B]}"}
            deadline = time.monotonic() + 30
            while sum(row["completion_tokens"] for row in
                      httpx.get(cp + "/v1/usage", headers=b_auth).json()) < 873:  # fmt: skip
                assert time.monotonic() < deadline, "B's usage was not reported"
                time.sleep(0.3)

            secrets = b_secrets(cp, keys[B], key_ids[B], b_usage, uploaded)
            # the negative control: the metrics port shows B, and the search finds B there
            private = httpx.get(dp_metrics + "/metrics").text
            shown = set(secrets.found(private))
            assert {B, *B_ADAPTERS, "873"} <= shown, shown
            assert f'loraplane_tokens_total{{kind="completion",tenant="{B}"}} 873.0' in private

            a_headers = {"Authorization": f"Bearer {keys[A]}"}
            a_auth: dict[str, Any] = {"headers": a_headers}
            auths: list[dict[str, Any]] = [a_auth, {}]
            (a_model,) = A_ADAPTERS
            values = {"name": a_model, "tenant": A, "pool": POOL, "key_id": key_ids[A],
                      "upload_id": str(uuid.uuid4()), "version": "1"}  # fmt: skip
            calls = dataplane_calls(dp, dp_app, a_model, auths)
            calls += controlplane_calls(cp, cp_app, values, auths)
            leaks = [(str(call), found) for call in calls if (found := secrets.found(call.fetch()))]
            assert not leaks, leaks[:10]
            assert len(calls) > 100  # every route, method and caller was tried

            # what A gets for B's names is what it gets for names nobody has
            for path, body in (
                ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                ("/tokenize", {"prompt": "hi"}),
            ):
                answers = {
                    model: httpx.post(dp + path, json={"model": model, **body}, headers=a_headers)
                    for model in (*B_ADAPTERS, "no-such-adapter-x")
                }
                shapes = {
                    (r.status_code, r.text.replace(model, "<model>"))
                    for model, r in answers.items()
                }
                assert len(shapes) == 1, shapes
            for name in (*B_ADAPTERS, "no-such-adapter-x"):
                r = httpx.get(cp + f"/v1/adapters/{name}", headers=a_headers)
                assert r.status_code == 404 and B not in r.text

            # the internal routes and /metrics: on the internal port only
            for path in ("/metrics", "/internal/v1/resolve"):
                assert httpx.get(cp + path).status_code == 404
            assert (
                "loraplane_controlplane_requests_total" in httpx.get(cp_internal + "/metrics").text
            )


def b_secrets(
    cp: str,
    key: str,
    key_id: str,
    usage: dict[str, list[dict[str, int]]],
    uploaded: dict[str, dict[str, Any]],
) -> Secrets:
    """B's identifiers (as the catalog and B itself see them) and usage figures above the
    vocabulary size."""
    secrets = Secrets({B, *B_ADAPTERS, key, key[:12]})
    listed = admin(cp, "GET", f"/v1/tenants/{B}/keys").json()
    secrets.strings |= {k["prefix"] for k in listed}
    assert any(str(k["id"]) == key_id for k in listed)
    for name in B_ADAPTERS:
        digest = uploaded[name]["version"].get("digest")
        assert digest, uploaded[name]
        secrets.strings |= {digest, digest[:12]}
    per_adapter = {
        name: {kind: sum(u[kind] for u in rows) for kind in ("prompt_tokens", "completion_tokens")}
        for name, rows in usage.items()
    }
    figures = {v for sums in per_adapter.values() for v in sums.values()}
    for kind in ("prompt_tokens", "completion_tokens"):
        figures.add(sum(sums[kind] for sums in per_adapter.values()))
    figures.add(sum(sum(sums.values()) for sums in per_adapter.values()))
    secrets.figures = {f for f in figures if f > VOCAB}
    assert {485, 388, 873} <= secrets.figures
    return secrets
