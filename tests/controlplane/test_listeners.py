"""The control plane's public and internal ports (`loraplane controlplane --internal-port`):
the internal routes and /metrics answer on the internal port only, and on the public port
exactly as an unknown path does; every other route answers on both."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from loraplane.cli import build_parser
from loraplane.controlplane.main import create_app
from loraplane.sockets import listen, port_of
from tests.controlplane.conftest import ADMIN, SERVICE, make_settings, start_command
from tests.servers import free_port, serve_sockets_in_thread

ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
SERVICE_H = {"Authorization": f"Bearer {SERVICE}"}


def test_internal_routes_and_metrics_answer_on_the_internal_port_only(tmp_path: Path) -> None:
    sockets = [listen("127.0.0.1", 0), listen("127.0.0.1", 0)]
    app = create_app(
        make_settings(tmp_path, f"sqlite:///{tmp_path / 'c.db'}"),
        internal_port=port_of(sockets[1]),
    )
    try:
        with serve_sockets_in_thread(app, sockets) as (public, internal):
            assert httpx.post(public + "/v1/tenants", json={"name": "acme"},
                              headers=ADMIN_H).status_code == 201  # fmt: skip
            key = httpx.post(public + "/v1/tenants/acme/keys", json={}, headers=ADMIN_H).json()
            tenant_h = {"Authorization": f"Bearer {key['key']}"}
            unknown = httpx.get(public + "/no-such-route")
            assert unknown.status_code == 404
            resolve = {"params": {"model": "x"}, "headers": {**SERVICE_H, "X-Tenant-Key": "k"}}
            for method, path, kw in (
                ("GET", "/metrics", {}),
                ("GET", "/internal/v1/resolve", resolve),
                ("POST", "/internal/v1/pressure", {"json": {}, "headers": SERVICE_H}),
                ("GET", "/internal/v1/pools/p", {"headers": SERVICE_H}),
            ):
                r = httpx.request(method, public + path, **kw)  # type: ignore[arg-type]
                assert (r.status_code, r.json()) == (404, unknown.json()), path
                assert "loraplane_controlplane" not in r.text
            # the internal port: metrics, the internal routes (with the service token), and
            # the public routes the data plane calls on a tenant's behalf
            assert "loraplane_controlplane_requests_total" in httpx.get(internal + "/metrics").text
            r = httpx.get(internal + "/internal/v1/resolve", params={"model": "x"})
            assert r.status_code == 401
            for url in (public, internal):
                assert httpx.get(url + "/healthz").status_code == 200
                assert httpx.get(url + "/v1/adapters", headers=tenant_h).status_code == 200
    finally:
        app.state.ctx.close()


def test_without_an_internal_port_everything_answers_on_the_one_port(tmp_path: Path) -> None:
    sockets = [listen("127.0.0.1", 0)]
    app = create_app(make_settings(tmp_path, f"sqlite:///{tmp_path / 'c.db'}"))
    try:
        with serve_sockets_in_thread(app, sockets) as (url,):
            assert httpx.get(url + "/metrics").status_code == 200
            assert httpx.get(url + "/internal/v1/resolve", params={"model": "x"}).status_code == 401
    finally:
        app.state.ctx.close()


def test_the_command_serves_both_ports(tmp_path: Path) -> None:
    port, internal = free_port(), free_port()
    args = ["controlplane", "--port", str(port), "--internal-port", str(internal)]
    assert build_parser().parse_args(args).internal_port == internal
    proc = start_command(tmp_path, port, "--internal-port", str(internal))
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 404
        assert httpx.get(f"http://127.0.0.1:{internal}/metrics").status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("internal", ["8080"])
def test_the_internal_port_must_differ_from_the_public_one(internal: str) -> None:
    args = build_parser().parse_args(
        ["controlplane", "--port", "8080", "--internal-port", internal]
    )
    assert args.func(args) == 2
