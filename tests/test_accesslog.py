"""Access logs (loraplane/accesslog.py): one JSON line per request from each service, on stderr
by default; never a key, a token, a header, a body or prompt text; 5xx answers and exceptions
with their reason, masked. The processes are run as a user runs them (`loraplane serve`,
`loraplane controlplane`), the demo's stack in this process."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from loraplane.accesslog import (
    AccessLogError,
    AccessLogSettings,
    add_arguments,
    chosen,
    make_logger,
    settings_from,
    wrap,
)
from tests.dataplane.server.conftest import spawn, wait_ready
from tests.servers import free_port, serve_in_thread

REPO = Path(__file__).resolve().parents[1]
API_KEY = "sk-access-9f3b2c71d0e4a85b"  # the data plane's standalone key
OTHER_KEY = "lp_" + "Q" * 43  # a tenant-shaped key nobody issued
QUERY_TOKEN = "qs-token-6d1e0b9a7c"
PROMPT = "PROMPT-MARKER-never-logged"


def lines_of(text: str, service: str) -> list[dict[str, Any]]:
    """The access-log lines of `service` in a process's stderr (other log lines skipped)."""
    found = []
    for raw in text.splitlines():
        if raw.startswith("{"):
            line = json.loads(raw)
            if line.get("service") == service:
                found.append(line)
    return found


def one(lines: list[dict[str, Any]], method: str, path: str, status: int) -> dict[str, Any]:
    matching = [x for x in lines if (x["method"], x["path"], x["status"]) == (method, path, status)]
    assert len(matching) == 1, (method, path, status, lines)
    return matching[0]


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return err


# -- the data plane, as `loraplane serve` ----------------------------------------------------


def test_the_data_plane_logs_each_request_as_json_without_keys_or_prompts(
    tiny_llama_dir: Path,
) -> None:
    port = free_port()
    proc = spawn(["--model", str(tiny_llama_dir), "--port", str(port), "--api-key", API_KEY],
                 env={"LORAPLANE_NUM_KV_BLOCKS": "64"})  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc=proc)
        auth = {"Authorization": f"Bearer {API_KEY}"}
        model = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
        ok = httpx.post(url + "/v1/completions", json=body,
                        headers={**auth, "X-Request-ID": "req-42"})  # fmt: skip
        assert ok.status_code == 200 and ok.headers["x-request-id"] == "req-42"
        wrong = httpx.post(url + "/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {OTHER_KEY}"})  # fmt: skip
        assert wrong.status_code == 401
        # a bad request that carries the key in its body and a token in its query string
        bad = httpx.post(f"{url}/v1/completions?api_token={QUERY_TOKEN}", headers=auth,
                         json={"model": model, "prompt": API_KEY, "max_tokens": -1})  # fmt: skip
        assert bad.status_code == 400
        err = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = lines_of(err, "dataplane")
    served = one(lines, "POST", "/v1/completions", 200)
    assert served["route"] == "/v1/completions" and served["tenant"] == "default"
    assert served["request_id"] == "req-42" and served["level"] == "info"
    assert served["duration_ms"] > 0 and served["bytes_in"] > 0 and served["bytes_out"] > 0
    assert one(lines, "POST", "/v1/completions", 401)["level"] == "warning"
    refused = one(lines, "POST", "/v1/completions", 400)
    assert refused["query"] == "api_token=***"
    assert one(lines, "GET", "/v1/models", 200)["tenant"] in (None, "default")
    assert not [x for x in lines if x["path"] in ("/ready", "/health")]  # probes: quiet
    for secret in (API_KEY, OTHER_KEY, QUERY_TOKEN, PROMPT):
        assert secret not in err, secret


# -- the control plane, as `loraplane controlplane` ------------------------------------------


def test_the_control_plane_logs_routes_tenants_and_refusals_without_secrets(
    tmp_path: Path,
) -> None:
    admin_token = "cp-admin-" + "7c4e1a9b2d8f0e35" * 3
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "LORAPLANE_DATA_DIR": str(tmp_path),
           "LORAPLANE_ADMIN_TOKEN": admin_token}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplane", "controlplane", "--port", str(port)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "did not start"
            try:
                if httpx.get(url + "/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        admin = {"Authorization": f"Bearer {admin_token}"}
        assert httpx.post(url + "/v1/tenants", json={"name": "acme"}, headers=admin).is_success
        key = httpx.post(url + "/v1/tenants/acme/keys", json={"name": "k"}, headers=admin)
        tenant_key = key.json()["key"]
        mine = {"Authorization": f"Bearer {tenant_key}"}
        assert httpx.get(url + "/v1/adapters", headers=mine).status_code == 200
        assert httpx.get(url + "/v1/adapters/nothing-here", headers=mine).status_code == 404
        other = {"Authorization": f"Bearer {OTHER_KEY}"}
        assert httpx.get(url + "/v1/adapters", headers=other).status_code == 401
        # a bad request with the tenant's key as a value
        bad = httpx.post(url + "/v1/tenants", json={"name": tenant_key}, headers=admin)
        assert bad.status_code == 400
        err = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = lines_of(err, "controlplane")
    created = one(lines, "POST", "/v1/tenants", 201)
    assert created["route"] == "/v1/tenants" and created["bytes_in"] > 0
    assert one(lines, "GET", "/v1/adapters", 200)["tenant"] == "acme"
    missing = one(lines, "GET", "/v1/adapters/nothing-here", 404)
    assert missing["route"] == "/v1/adapters/{name}" and missing["tenant"] == "acme"
    assert one(lines, "GET", "/v1/adapters", 401)["tenant"] is None
    assert one(lines, "POST", "/v1/tenants", 400)["level"] == "warning"
    assert "uvicorn.access" not in err and '"GET /v1/adapters HTTP/1.1"' not in err
    for secret in (admin_token, tenant_key, OTHER_KEY, tenant_key[3:20]):
        assert secret not in err, secret


# -- errors, settings, the demo: in this process ---------------------------------------------


def broken_app() -> FastAPI:
    app = FastAPI()

    @app.get("/boom/{item}")
    async def boom(item: str) -> None:
        raise RuntimeError(f"store failed for {item} with key {OTHER_KEY}")

    @app.get("/unavailable")
    async def unavailable() -> JSONResponse:
        return JSONResponse({"error": {"code": "Unavailable", "message": "database down"}}, 503)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def test_exceptions_and_5xx_are_logged_with_their_reason_masked(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    logger = make_logger(AccessLogSettings(access_log_file=log), "test", [])
    with serve_in_thread(wrap(broken_app(), "test", logger)) as url:
        assert httpx.get(url + "/boom/a1").status_code == 500
        unavailable = httpx.get(url + "/unavailable", headers={"X-Request-ID": "bad id {}"})
        assert unavailable.status_code == 503
        assert httpx.get(url + "/healthz").status_code == 200
    text = log.read_text()
    lines = lines_of(text, "test")
    boom = one(lines, "GET", "/boom/a1", 500)
    assert boom["route"] == "/boom/{item}" and boom["level"] == "error"
    assert boom["error"].startswith("RuntimeError: store failed for a1 with key lp_QQQ…")
    down = one(lines, "GET", "/unavailable", 503)
    assert down["error"] == "Unavailable: database down"
    # a client's request id that is not a plain token is replaced, in the line and the answer
    assert down["request_id"] == unavailable.headers["x-request-id"] != "bad id {}"
    assert len(down["request_id"]) == 32
    assert not [x for x in lines if x["path"] == "/healthz"]
    assert OTHER_KEY not in text


def test_off_logs_nothing_and_the_flag_wins_over_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("LORAPLANE_ACCESS_LOG", "off")
    assert make_logger(settings_from(parser.parse_args([])), "x") is None
    assert settings_from(parser.parse_args(["--access-log", "on"])).access_log is True
    monkeypatch.setenv("LORAPLANE_ACCESS_LOG", "on")
    off = settings_from(parser.parse_args(["--access-log", "off"]))
    assert make_logger(off, "x") is None
    app = broken_app()
    assert wrap(app, "x", None) is app


def test_a_bad_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("LORAPLANE_ACCESS_LOG", "sometimes")
    with pytest.raises(AccessLogError, match=r"^LORAPLANE_ACCESS_LOG: "):
        settings_from(parser.parse_args([]))
    monkeypatch.delenv("LORAPLANE_ACCESS_LOG")
    args = parser.parse_args(["--access-log-file", str(tmp_path / "no-dir" / "x.log")])
    with pytest.raises(AccessLogError, match="--access-log-file / LORAPLANE_ACCESS_LOG_FILE"):
        make_logger(settings_from(args), "x")


def test_the_services_tokens_are_masked_wherever_they_would_appear(tmp_path: Path) -> None:
    token = "svc-token-1b2c3d4e5f6a"
    log = tmp_path / "access.log"
    logger = make_logger(AccessLogSettings(access_log_file=log), "test", [token])
    assert logger is not None
    with serve_in_thread(wrap(broken_app(), "test", logger)) as url:
        httpx.get(f"{url}/boom/{token}")  # a token in a path: never written out
    text = log.read_text()
    assert token not in text and "svc-to…" in text


def test_the_demo_stack_logs_both_services_on_stderr_by_default(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from loraplane.demo.stack import running

    with running(tmp_path, "127.0.0.1", 0, 0) as stack:
        admin = {"Authorization": f"Bearer {stack.admin_token}"}
        assert httpx.get(stack.controlplane.url + "/v1/pools", headers=admin).is_success
    err = capfd.readouterr().err
    pools = one(lines_of(err, "controlplane"), "GET", "/v1/pools", 200)
    assert pools["route"] == "/v1/pools"
    assert stack.admin_token not in err
    logging.getLogger("loraplane.access.controlplane").handlers.clear()


def test_an_exception_behind_the_control_planes_error_handlers_keeps_its_reason(
    tmp_path: Path,
) -> None:
    """The service answers its generic 500 (no reason for the client); the log line has it."""
    from loraplane.controlplane.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app, retry_after=1)

    @app.get("/v1/things/{thing}")
    async def thing(thing: str) -> None:
        raise RuntimeError(f"catalog lost {thing}; key {OTHER_KEY}")

    log = tmp_path / "access.log"
    logger = make_logger(AccessLogSettings(access_log_file=log), "controlplane", [])
    with serve_in_thread(wrap(app, "controlplane", logger)) as url:
        answer = httpx.get(url + "/v1/things/t1")
    assert answer.status_code == 500 and "catalog lost" not in answer.text
    line = one(lines_of(log.read_text(), "controlplane"), "GET", "/v1/things/t1", 500)
    assert line["route"] == "/v1/things/{thing}"
    assert line["error"] == "RuntimeError: catalog lost t1; key lp_QQQ…"


def test_chosen_says_whether_a_flag_or_a_variable_set_the_access_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The demo's default (a file in its run folder) holds only where nothing was chosen."""
    for name in ("LORAPLANE_ACCESS_LOG", "LORAPLANE_ACCESS_LOG_FILE"):
        monkeypatch.delenv(name, raising=False)
    bare = argparse.Namespace(access_log=None, access_log_file=None)
    assert not chosen(bare)
    assert chosen(argparse.Namespace(access_log="on", access_log_file=None))
    assert chosen(argparse.Namespace(access_log=None, access_log_file="x.log"))
    monkeypatch.setenv("loraplane_access_log_file", "x.log")  # read as pydantic reads it
    assert chosen(bare)
