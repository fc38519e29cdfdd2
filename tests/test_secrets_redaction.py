"""No key or token in what a user sees, and key errors that name their cause.

The tenant CLI and the admin commands against a real control plane (uvicorn, SQLite) and
against a stdlib HTTP server that echoes the caller's Authorization header in every error it
answers (401, 403, 404, 500, a non-JSON 502, a 200 without JSON, a dropped connection), and
with no server at all: the secret never reaches stdout or stderr, and the exit code tells a
refusal (1) from no answer (2). Keys and tokens with a trailing newline or space work; one with
whitespace inside is refused by the variable's name. Malformed and unknown keys get different
answers from the control plane and from the data plane (catalog mode) over real HTTP.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest

from loraplane.controlplane.cli import _error
from loraplane.dataplane.server.settings import ServerSettings
from loraplane.redact import (
    KEY_LEN,
    CredentialError,
    RedactFilter,
    clean_credential,
    install_log_redaction,
    key_problem,
    mask,
    redact,
)
from tests.controlplane.conftest import ADMIN, SERVICE
from tests.dataplane.server.conftest import start_server
from tests.servers import free_port
from tests.test_e2e_catalog import controlplane as controlplane_at
from tests.test_tenant_cli import Run, cli, new_tenant
from tests.test_tenant_cli import controlplane as controlplane
from tests.test_tenant_cli import env as env

KEY = "lp_" + "Zq9" * 14 + "x"  # a tenant key's form; no control plane knows it
TOKEN = "admin-" + "S3cr3tT0k3n" * 3


def assert_hidden(run: Run, *secrets: str) -> None:
    """No 8 consecutive characters of a secret are printed: at most its masked prefix."""
    text = run.out + run.err
    for secret in secrets:
        leaks = [secret[i : i + 8] for i in range(len(secret) - 7) if secret[i : i + 8] in text]
        assert not leaks, (secret, text)


# -- the redaction rule ---------------------------------------------------------------------------


def test_redact_masks_keys_bearer_values_given_secrets_and_url_passwords() -> None:
    issue = f"ConnectionFailed: cannot reach ...: Illegal header value b'Bearer {KEY}\\n'"
    assert (
        redact(issue)
        == "ConnectionFailed: cannot reach ...: Illegal header value b'Bearer lp_Zq9…\\n'"
    )
    assert redact(f"Authorization: Bearer {TOKEN}") == "Authorization: Bearer admin-…"
    assert redact(f"token {TOKEN} refused", [TOKEN + "\n"]) == "token admin-… refused"
    assert redact(f"a key {KEY[:20]} cut short") == "a key lp_Zq9… cut short"
    url = "postgresql+psycopg://app:hunter2pass@db:5432/catalog"
    assert (
        redact(f"cannot connect to {url}")
        == "cannot connect to postgresql+psycopg://app:***@db:5432/catalog"
    )
    # what is not a secret stays as it is
    plain = "send Authorization: Bearer <token>; help_text, lp_ and lp_ab, v1 sha256:abc"
    assert redact(plain) == plain
    assert mask(KEY) == "lp_Zq9…" and len(KEY) == KEY_LEN


def test_clean_credential_trims_and_refuses_inner_whitespace_by_name() -> None:
    assert clean_credential(f"  {KEY}\r\n", "LORAPLANE_API_KEY") == KEY
    for inner, word in ((" ", "a space"), ("\t", "a tab"), ("\n", "a line break"),
                        ("\x00", "a control character (U+0000)")):  # fmt: skip
        with pytest.raises(CredentialError) as err:
            clean_credential(KEY[:10] + inner + KEY[10:], "LORAPLANE_API_KEY")
        assert str(err.value).startswith(f"LORAPLANE_API_KEY has {word} inside it")
        assert KEY[3:11] not in str(err.value)
    with pytest.raises(CredentialError, match=r"^--api-key is empty"):
        clean_credential(" \n", "--api-key")


def test_key_problem_says_what_is_wrong_without_the_key() -> None:
    assert key_problem(KEY) is None
    assert key_problem("LP_" + KEY[3:]) == "a tenant API key starts with 'lp_'"
    assert (
        key_problem(KEY[:-1])
        == "it is 45 characters long; a tenant API key is 46 ('lp_' and 43 more)"
    )
    assert key_problem(KEY[:-1] + "!") == (
        "it has characters other than A-Z, a-z, 0-9, '-' and '_' after 'lp_'"
    )


def test_the_control_plane_commands_mask_tokens_and_url_passwords(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", TOKEN)
    _error(f"settings: admin_token {TOKEN!r} and postgresql://u:pw12345@h/db are invalid")
    err = capsys.readouterr().err
    assert err == "error: settings: admin_token 'admin-…' and postgresql://u:***@h/db are invalid\n"


# -- whitespace around and inside a credential, over real HTTP ------------------------------------


def test_a_key_or_token_with_a_trailing_newline_or_space_works(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env.setenv("LORAPLANE_ADMIN_TOKEN", ADMIN + "\n")  # an env file's line, a paste
    key = new_tenant(capsys, "spacey")
    env.setenv("LORAPLANE_API_KEY", key + "\n")
    run = cli(capsys, "adapters", "list", "--json")
    assert (run.code, run.json(), run.err) == (0, [], "")
    run = cli(capsys, "adapters", "list", "--api-key", f" {key} ", "--json")
    assert (run.code, run.json()) == (0, [])
    run = cli(capsys, "tenants", "list", "--admin-token", ADMIN + " ", "--json")
    assert run.code == 0 and "spacey" in {t["name"] for t in run.json()}


def test_a_credential_with_whitespace_inside_is_refused_by_name_and_not_printed(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = KEY[:20] + "\n" + KEY[20:]
    env.setenv("LORAPLANE_API_KEY", broken)
    run = cli(capsys, "adapters", "list")
    assert (run.code, run.out) == (1, "")  # not the "retry" code
    assert run.err.startswith(
        "error: InvalidCredential: LORAPLANE_API_KEY has a line break inside it"
    )
    assert_hidden(run, KEY[:20], KEY[20:])
    run = cli(capsys, "tenants", "list", "--admin-token", "admin token", "--json")
    assert run.code == 1
    assert run.json()["error"] == {
        "code": "InvalidCredential",
        "message": "--admin-token has a space inside it: a key or token is one word "
        "(copy it again, without the surrounding text)",
    }


# -- every error path: the secret is never printed -----------------------------------------------


class EchoServer(ThreadingHTTPServer):
    """Answers every request with `status` and a body that repeats its Authorization header."""

    status = 500
    body = "json"  # "json": the control plane's error shape; "text": plain text; "drop"


class _Echo(BaseHTTPRequestHandler):
    server: EchoServer

    def _answer(self) -> None:
        if self.server.body == "drop":
            self.close_connection = True
            self.connection.close()
            return
        auth = self.headers.get("Authorization", "")
        if self.server.body == "json":
            error = {"code": "Echo", "message": f"refused {auth!r} for {self.path}"}
            data = json.dumps({"error": error}).encode()
            kind = "application/json"
        else:
            data = f"<html>bad gateway for {auth}</html>".encode()
            kind = "text/html"
        self.send_response(self.server.status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def echo() -> Iterator[EchoServer]:
    server = EchoServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


COMMANDS = {
    "tenant": (["adapters", "list"], "LORAPLANE_API_KEY", KEY),
    "admin": (["tenants", "list"], "LORAPLANE_ADMIN_TOKEN", TOKEN),
}


@pytest.mark.parametrize(
    ("status", "body", "exit_code"),
    [
        (401, "json", 1), (403, "json", 1), (404, "json", 1), (500, "json", 2),
        (502, "text", 2), (200, "text", 2), (0, "drop", 2),
    ],
    ids=["401", "403", "404", "500", "502-text", "200-not-json", "dropped"],
)  # fmt: skip
@pytest.mark.parametrize("who", sorted(COMMANDS))
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_no_error_path_prints_the_secret(
    echo: EchoServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    status: int,
    body: str,
    exit_code: int,
    who: str,
    as_json: bool,
) -> None:
    echo.status, echo.body = status, body
    command, var, secret = COMMANDS[who]
    monkeypatch.setenv("LORAPLANE_URL", f"http://127.0.0.1:{echo.server_address[1]}")
    monkeypatch.setenv(var, secret + "\n")
    run = cli(capsys, *command, *(["--json"] if as_json else []))
    assert run.code == exit_code, run
    assert_hidden(run, secret)
    if body == "json":  # the server's words reach the user, its echo of the secret masked
        message = run.json()["error"]["message"] if as_json else run.err
        assert f"refused 'Bearer {mask(secret)}'" in message


@pytest.mark.parametrize("who", sorted(COMMANDS))
def test_an_unreachable_control_plane_is_exit_2_without_the_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], who: str
) -> None:
    command, var, secret = COMMANDS[who]
    monkeypatch.setenv("LORAPLANE_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv(var, f" {secret}\n")
    run = cli(capsys, *command)
    assert run.code == 2
    assert run.err.startswith("error: ConnectionFailed: cannot reach the control plane at ")
    assert_hidden(run, secret)


# -- a malformed key is told apart from an unknown one --------------------------------------------


MALFORMED = {
    "short": (KEY[:-1], "malformed API key: it is 45 characters long; a tenant API key is 46"),
    "long": (KEY + "Q", "malformed API key: it is 47 characters long"),
    "dash": ("lp-" + KEY[3:], "malformed API key: a tenant API key starts with 'lp_'"),
    "char": (KEY[:-1] + ".", "malformed API key: it has characters other than A-Z"),
}


def test_the_control_plane_says_malformed_unknown_or_admin_token(
    env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    controlplane: str,
) -> None:
    for name, (key, message) in MALFORMED.items():
        run = cli(capsys, "adapters", "list", "--api-key", key)
        assert run.code == 1, name
        assert run.err.startswith(f"error: Unauthorized: {message}"), (name, run.err)
        assert_hidden(run, key)
        r = httpx.get(controlplane + "/v1/adapters", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 401 and r.json()["error"]["message"].startswith(message)
    unknown = cli(capsys, "adapters", "list", "--api-key", KEY)
    assert unknown.err == "error: Unauthorized: invalid or revoked API key\n"
    admin = cli(capsys, "adapters", "list", "--api-key", ADMIN)
    assert admin.err == (
        "error: Unauthorized: this route needs a tenant API key, not the admin token\n"
    )
    other = cli(capsys, "adapters", "list", "--api-key", "sk-something-else")
    assert other.err == (
        "error: Unauthorized: this route needs a tenant API key (lp_... as `keys create` "
        "prints it)\n"
    )


def test_the_data_plane_says_malformed_or_unknown(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with controlplane_at(tmp_path) as cp:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        pool = {"name": "pool-a", "base_model": {"name": "tiny-base", "uri": str(tiny_llama_dir)}}
        assert httpx.post(cp + "/v1/pools", json=pool, headers=admin).status_code == 201
        settings = ServerSettings(
            model=str(tiny_llama_dir), served_model_name="tiny-base", controlplane_url=cp,
            service_token=SERVICE, store=str(tmp_path / "store"), pool="pool-a",
            num_kv_blocks=64,
        )  # fmt: skip
        with start_server(settings) as (url, _):
            for name, (key, message) in MALFORMED.items():
                client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
                with pytest.raises(openai.AuthenticationError) as err:
                    client.models.list()
                said = str(err.value.body["message"])  # type: ignore[index]
                assert said.startswith(message), (name, said)
                assert key[3:12] not in said
            client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as err:
                client.completions.create(model="tiny-base", prompt="hi", max_tokens=1)
            assert "malformed" not in str(err.value.body["message"])  # type: ignore[index]


def test_the_internal_api_client_never_repeats_its_token_in_an_error(echo: EchoServer) -> None:
    """A service token with a line break (an env file) fails in httpx before any request:
    the error the operator and the data plane log has the token masked."""
    from loraplane.internal_api import InternalAPIClient, InternalAPIError

    secret = "service-" + "Wq7Lm2Xz" * 5
    client = InternalAPIClient(f"http://127.0.0.1:{echo.server_address[1]}", secret + "\n")
    try:
        with pytest.raises(InternalAPIError) as err:
            client.request("GET", "/internal/v1/pools")
    finally:
        client.close()
    text = f"{err.value} {err.value.message}"
    assert f"Bearer {mask(secret)}" in text and secret[6:20] not in text


def test_the_control_plane_trims_its_tokens(tmp_path: Path) -> None:
    from loraplane.controlplane.settings import Settings

    settings = Settings(admin_token=f" {TOKEN}\n", service_token=f"{SERVICE}\r\n")
    assert settings.admin_token is not None and settings.service_token is not None
    assert settings.admin_token.get_secret_value() == TOKEN
    assert settings.service_token.get_secret_value() == SERVICE


# -- logs -----------------------------------------------------------------------------------------


def test_the_log_filter_masks_messages_arguments_and_tracebacks() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("tests.redaction")
    log.addHandler(handler)
    log.propagate = False
    try:
        found = install_log_redaction([TOKEN], loggers=["tests.redaction"])
        assert install_log_redaction([TOKEN], loggers=["tests.redaction"]) is not found
        assert [type(f) for f in handler.filters] == [RedactFilter]  # once per handler
        log.warning("header %s from %s", f"Bearer {TOKEN}", "10.0.0.1")
        log.warning("GET /v1/adapters?key=%s %d", KEY, 401)
        try:
            raise RuntimeError(f"token {TOKEN} refused")
        except RuntimeError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "header Bearer admin-… from 10.0.0.1\n" in text
    assert "GET /v1/adapters?key=lp_Zq9… 401\n" in text
    assert "RuntimeError: token admin-… refused" in text
    assert TOKEN[6:14] not in text and KEY[3:11] not in text


def test_the_control_plane_process_logs_no_key_or_token(tmp_path: Path) -> None:
    """`loraplane controlplane`'s access log (accesslog.py's JSON lines) with a key in a query
    string."""
    port = free_port()
    env = {**os.environ, "LORAPLANE_DATA_DIR": str(tmp_path), "LORAPLANE_ADMIN_TOKEN": ADMIN,
           "LORAPLANE_SERVICE_TOKEN": SERVICE}  # fmt: skip
    env.pop("LORAPLANE_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplane", "controlplane", "--port", str(port)], cwd=tmp_path,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the control plane exited"
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the control plane did not start"
            time.sleep(0.1)
        r = httpx.get(url + f"/v1/adapters?api_key={KEY}&token={ADMIN}")
        assert r.status_code == 401
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    logged = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(x["path"], x["query"], x["status"]) for x in logged] == [
        ("/v1/adapters", "api_key=***&token=***", 401)
    ], out
    assert KEY[3:11] not in out and ADMIN[6:14] not in out
