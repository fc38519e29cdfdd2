"""The console without a browser: the security headers on every `/console` answer, shipped
files free of inline script, inline handlers, HTML parsing of data and other origins, every
file in the folder served, and a sentence for every error code the API can answer."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from loraplane.adapters.errors import ReasonCode
from loraplane.controlplane.console import app as console
from loraplane.controlplane.errors import STATUS
from loraplane.controlplane.main import create_app
from tests.controlplane.conftest import ADMIN, make_settings

FOLDER = Path(console.__file__).parent
SHIPPED = sorted(p for p in FOLDER.iterdir() if p.suffix in (".html", ".css", ".js"))
SCRIPTS = [p for p in SHIPPED if p.suffix == ".js"]
EXPECTED = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'self'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


@pytest.fixture
def client(tmp_path: Path, sqlite_template: Path) -> Iterator[TestClient]:
    shutil.copy(sqlite_template, tmp_path / "catalog.db")
    settings = make_settings(
        tmp_path, f"sqlite:///{tmp_path / 'catalog.db'}",
        console_dataplane_url="https://api.example.com",
    )  # fmt: skip
    app = create_app(settings)
    with TestClient(app) as c:
        yield c
    app.state.ctx.close()


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/console/", 200),
        ("GET", "/console/console.js", 200),
        ("GET", "/console/console.css", 200),
        ("GET", "/console/reasons.json", 200),
        ("GET", "/console/config.json", 200),
        ("GET", "/console", 308),
        ("GET", "/console/missing.js", 404),
        ("GET", "/console/a/b.js", 404),
        ("GET", "/console/%2e%2e/main.py", 404),
        ("GET", "/console/__init__.py", 404),
        ("POST", "/console/", 405),
        ("HEAD", "/console/index.html", 200),
    ],
)
def test_every_console_answer_carries_the_security_headers(
    client: TestClient, method: str, path: str, status: int
) -> None:
    r = client.request(method, path, follow_redirects=False)
    assert r.status_code == status
    for name, value in EXPECTED.items():
        assert r.headers[name] == value, name
    assert "unsafe" not in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"
    if status == 308:
        assert r.headers["location"] == "/console/"


def test_the_console_loads_without_a_key_and_its_data_needs_one(client: TestClient) -> None:
    page = client.get("/console/")
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert 'id="sign-in"' in page.text and '<script type="module" src="console.js">' in page.text
    assert client.get("/console/console.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/console/config.json").json() == {"dataplane_url": "https://api.example.com"}
    # the data behind it answers only to a key, as before
    assert client.get("/v1/adapters").status_code == 401
    assert client.get("/v1/tenants").status_code == 401
    assert (
        client.get("/v1/tenants", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    )
    # not part of the REST API's description
    assert not [p for p in client.get("/openapi.json").json()["paths"] if "console" in p]


def test_every_shipped_file_is_served_and_nothing_else(client: TestClient) -> None:
    assert sorted(console.FILES) == [p.name for p in SHIPPED]
    for path in SHIPPED:
        r = client.get(f"/console/{path.name}")
        assert r.status_code == 200 and r.content == path.read_bytes(), path.name
        assert r.headers["content-type"] == console.FILES[path.name]


def test_the_page_has_no_inline_script_style_or_handlers() -> None:
    html = (FOLDER / "index.html").read_text()
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S | re.I)
    assert scripts and all('src="' in attrs and not body.strip() for attrs, body in scripts)
    assert not re.search(r"<[^>]*\son[a-z]+\s*=", html, re.I), "an inline event handler"
    assert not re.search(r"<[^>]*\sstyle\s*=", html, re.I) and "<style" not in html
    assert "javascript:" not in html.lower()
    # the key input has no name: a form sent without the script carries no key
    token = re.search(r"<input[^>]*id=\"token\"[^>]*>", html, re.S)
    assert token and " name=" not in token.group(0) and 'type="password"' in token.group(0)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_scripts_never_parse_data_as_html_or_code(path: Path) -> None:
    source = path.read_text()
    for banned in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                   "new Function", "srcdoc"):  # fmt: skip
        assert banned not in source, f"{path.name} uses {banned}"
    # the key goes nowhere but sessionStorage
    assert not re.search(r"localStorage\s*[.\[]|document\.cookie|indexedDB", source)
    assert not re.search(r"setTimeout\(\s*[\"'`]", source), "setTimeout with a string"
    assert not re.search(r"\.on[a-z]+\s*=", source), "a handler set as a property"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_nothing_comes_from_another_origin(path: Path) -> None:
    source = path.read_text()
    urls = set(re.findall(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}[^\s\"'`)]*", source, re.I))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls  # SVG's namespace name, not a fetch
    assert not re.search(r"@import|url\(\s*['\"]?(?!data:)", source)
    imports = re.findall(r"\bfrom\s+\"([^\"]+)\"|import\(\s*\"([^\"]+)\"", source)
    assert all(
        (a or b).startswith("./") and (a or b).removeprefix("./") in console.FILES
        for a, b in imports
    ), imports


def test_every_error_code_has_a_sentence_for_people(client: TestClient) -> None:
    reasons = client.get("/console/reasons.json").json()
    codes = {c.value for c in ReasonCode} | {c.code for c in STATUS if "code" in vars(c)}
    codes |= {"StoreUnavailable", "InternalError", "Interrupted"}
    missing = {c for c in codes if len(reasons.get(c, "")) < 20}
    assert not missing, missing
    assert all(text.endswith(".") for text in reasons.values()), reasons
    assert "use_dora" in reasons["DoRANotSupported"]


@pytest.mark.parametrize("url", ["javascript:alert(1)", 'http://x/"><script>', "ftp://host"])
def test_the_console_dataplane_url_must_be_a_plain_http_url(tmp_path: Path, url: str) -> None:
    with pytest.raises(ValidationError, match="console_dataplane_url"):
        make_settings(tmp_path, "sqlite://", console_dataplane_url=url)
