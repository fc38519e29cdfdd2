"""`/docs` (Swagger UI) of both services works offline: the page names only this server's
URLs, those URLs serve the assets, and in headless Chromium, with every host name but 127.0.0.1
unresolvable, Swagger UI draws each service's operations. `/redoc` (its page loads a logo from
a CDN) is off.
Both services over real HTTP (the control plane on SQLite, the data plane in standalone mode)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplane.controlplane.main import create_app as create_controlplane
from tests.controlplane.conftest import make_settings
from tests.dataplane.server.conftest import server_settings, start_server
from tests.servers import serve_in_thread

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# one operation each service's Swagger UI must draw
OPERATIONS = {"controlplane": "/v1/base-models", "dataplane": "/v1/chat/completions"}
URL_ATTR = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|url:\s*'([^']+)'""")


@pytest.fixture(scope="module")
def services(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path
) -> Iterator[dict[str, str]]:
    """Both services' base URLs."""
    tmp = tmp_path_factory.mktemp("docs")
    app = create_controlplane(make_settings(tmp, f"sqlite:///{tmp / 'catalog.db'}"))
    try:
        with (
            serve_in_thread(app) as cp,
            start_server(server_settings(tiny_llama_dir, {})) as (dp, _),
        ):
            yield {"controlplane": cp, "dataplane": dp}
    finally:
        app.state.ctx.close()


def _referenced(html: str) -> list[str]:
    urls = [a or b for a, b in URL_ATTR.findall(html)]
    assert urls, html
    return urls


@pytest.mark.parametrize("service", sorted(OPERATIONS))
def test_docs_page_names_only_local_urls_that_serve(services: dict[str, str], service: str) -> None:
    base, page = services[service], "/docs"
    r = httpx.get(base + page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "cdn" not in r.text.lower() and "googleapis" not in r.text
    for url in _referenced(r.text):
        assert url.startswith("/") and not url.startswith("//"), f"{page} loads {url}"
        asset = httpx.get(base + url)
        assert asset.status_code == 200, url
        assert len(asset.content) > 100, url
        if url.endswith(".js"):
            assert "javascript" in asset.headers["content-type"]
        elif url.endswith(".css"):
            assert asset.headers["content-type"].startswith("text/css")
    spec = httpx.get(base + "/openapi.json").json()
    assert not any(p.startswith(("/docs", "/redoc")) for p in spec["paths"])
    assert httpx.get(base + "/redoc").status_code == 404
    missing = httpx.get(base + "/docs/static/redoc.standalone.js")
    assert missing.status_code == 404 and "error" in missing.json()


def test_swagger_ui_is_swagger_ui_5_which_renders_openapi_3_1(services: dict[str, str]) -> None:
    """FastAPI writes OpenAPI 3.1; Swagger UI 4 answers it with 'Unable to render this
    definition'."""
    base = services["dataplane"]
    assert httpx.get(base + "/openapi.json").json()["openapi"].startswith("3.1")
    bundle = httpx.get(base + "/docs/static/swagger-ui-bundle.js").text
    assert re.search(r'"5\.\d+\.\d+"', bundle)


@pytest.fixture(scope="module")
def offline_browser() -> Iterator[Any]:
    """Headless Chromium that resolves no host name but 127.0.0.1 (as a machine offline)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(
            "needs Debian's chromium and chromium-driver (/usr/bin/chromium, "
            "/usr/bin/chromedriver): apt-get install -y chromium chromium-driver, or run "
            ".ci/install-chromium.sh"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1200,800",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield chrome
    finally:
        chrome.quit()


@pytest.mark.slow
@pytest.mark.parametrize("service", sorted(OPERATIONS))
def test_swagger_ui_renders_offline(
    services: dict[str, str], offline_browser: Any, service: str
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser, base = offline_browser, services[service]
    browser.get(base + "/docs")
    wait = WebDriverWait(browser, 20)
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"))
    paths = {e.text.replace("\u200b", "") for e in browser.find_elements(
        By.CSS_SELECTOR, ".opblock-summary-path")}  # fmt: skip
    assert OPERATIONS[service] in paths
    title = browser.find_element(By.CSS_SELECTOR, ".info .title").text
    assert f"loraplane {service.replace('plane', ' plane')}" in title
    assert "Unable to render" not in browser.page_source
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
