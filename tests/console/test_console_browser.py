"""The tenant console in a real browser: Debian's Chromium, headless, driven by Selenium,
against a control plane served over real HTTP (SQLite catalog, local store).

Two tenants (acme, globex) and a pool; uploads below BACKGROUND bytes answer at once, bigger
ones become background jobs the page follows. A screenshot of each view is written to
`<pytest's base temp>/console-screenshots/`. Skipped, with the reason, where /usr/bin/chromium
or /usr/bin/chromedriver is missing (`.ci/install-chromium.sh` installs both).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

from loraplane.adapters.errors import EXPLANATIONS, ReasonCode
from loraplane.controlplane.crud.usage import add_usage
from loraplane.controlplane.main import create_app
from loraplane.controlplane.schemas.internal import AdapterUsage
from tests.adapters.crafting import TINY_BASE, TINY_BASE_NAME, lora_config, lora_tensors
from tests.adapters.crafting import write_adapter as craft
from tests.controlplane.conftest import ADMIN, SERVICE, make_settings
from tests.servers import serve_in_thread

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
        reason="needs Debian's chromium and chromium-driver (/usr/bin/chromium, "
        "/usr/bin/chromedriver): apt-get install -y chromium chromium-driver, or run "
        ".ci/install-chromium.sh",
    ),
]

POOL = "pool-a"
BACKGROUND = 32 << 10  # a rank-32 adapter of the tiny base is over it, a rank-8 one under
MARKUP = "<img src=x onerror=window.__pwned=1>"
DAYS = 7


@dataclass
class Stack:
    """The served control plane, the tenants' keys, and where test files are written."""

    url: str
    keys: dict[str, str]
    work: Path

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        return httpx.request(method, self.url + path, headers=headers, **kw)

    def adapter(self, name: str, r: int, seed: int, **config: Any) -> Path:
        """An adapter folder of the tiny base model."""
        out = self.work / name
        return craft(out, lora_config(r=r, **config), lora_tensors(TINY_BASE, r, seed=seed))

    def upload(self, tenant: str, name: str, folder: Path) -> httpx.Response:
        files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
        return httpx.post(
            self.url + "/v1/adapters",
            data={"name": name, "base_model": TINY_BASE_NAME},
            files=files,
            headers={"Authorization": f"Bearer {self.keys[tenant]}"},
        )


def usage_rows(tenant: str, adapters: list[str]) -> list[AdapterUsage]:
    """A day's usage: 10, 20, ... requests for the adapters in order (100, 30 tokens each)."""
    rows = []
    for i, a in enumerate(adapters, 1):
        tokens = {"prompt_tokens": 100 * i, "completion_tokens": 30 * i}
        rows.append(AdapterUsage(tenant=tenant, adapter=a, requests=10 * i, **tokens))
    return rows


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, base_model_dir: Path) -> Iterator[Stack]:
    """A control plane with a pool, acme and globex with a key and an adapter each, a week of
    usage for both, and a replica's pressure report."""
    tmp = tmp_path_factory.mktemp("console")
    settings = make_settings(
        tmp, f"sqlite:///{tmp / 'catalog.db'}", background_ingest_bytes=BACKGROUND,
        console_dataplane_url="http://dataplane.example:8000",
    )  # fmt: skip
    app = create_app(settings)
    try:
        with serve_in_thread(app) as url:
            work = tmp / "work"
            work.mkdir()
            s = Stack(url, {}, work)
            pool = {
                "name": POOL,
                "base_model": {"name": TINY_BASE_NAME, "uri": str(base_model_dir)},
            }
            assert s.admin("POST", "/v1/pools", json=pool).status_code == 201
            for tenant in ("acme", "globex"):
                assert s.admin("POST", "/v1/tenants", json={"name": tenant}).status_code == 201
                r = s.admin("POST", f"/v1/tenants/{tenant}/keys", json={"name": "console"})
                s.keys[tenant] = r.json()["key"]
            assert s.upload("acme", "faq", s.adapter("faq", 8, 1)).status_code == 201
            assert s.upload("globex", "globex-secret", s.adapter("gs", 8, 2)).status_code == 201
            with app.state.ctx.sessions() as session:
                for back in range(DAYS):
                    day = datetime.now(UTC).date() - timedelta(days=back)
                    add_usage(session, rows=usage_rows("acme", ["faq", ""]), day=day)
                    add_usage(session, rows=usage_rows("globex", ["globex-secret"]), day=day)
                session.commit()
            report = {
                "pool": POOL, "replica": "replica-0", "slots_used": 5, "running_adapters": 3,
                "waiting_adapters": 1, "deferred": 2, "gpu_bytes": 48 << 20,
                "gpu_bytes_capacity": 128 << 20, "kv_usage": 0.42,
            }  # fmt: skip
            r = httpx.post(
                url + "/internal/v1/pressure", json=report,
                headers={"Authorization": f"Bearer {SERVICE}"},
            )  # fmt: skip
            assert r.status_code == 200, r.text
            yield s
    finally:
        app.state.ctx.close()


@pytest.fixture(scope="module")
def driver() -> Iterator[webdriver.Chrome]:
    """Headless Chromium at 1200x800; the paths are given, so Selenium downloads nothing."""
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1200,800"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    # the page itself 1200x800 (the window's size includes the browser's own parts)
    chrome.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": 1200, "height": 800, "deviceScaleFactor": 1, "mobile": False},
    )
    try:
        yield chrome
    finally:
        chrome.quit()


def logged(driver: webdriver.Chrome) -> list[str]:
    """What the pages wrote to the browser's console since the last call."""
    get_log: Callable[[str], list[dict[str, Any]]] = driver.get_log  # untyped in Selenium
    return [str(entry["message"]) for entry in get_log("browser")]


@pytest.fixture
def browser(driver: webdriver.Chrome) -> Iterator[webdriver.Chrome]:
    """The browser, signed out; afterwards, no script error and no CSP violation was logged."""
    driver.get("about:blank")
    logged(driver)  # drop what earlier tests left
    yield driver
    problems = [m for m in logged(driver) if "Content Security Policy" in m or "Uncaught" in m]
    assert not problems, problems


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Callable[[WebDriver, str], Path]:
    """Save a screenshot of the page as console-screenshots/<name>.png."""
    folder = tmp_path_factory.getbasetemp() / "console-screenshots"
    folder.mkdir(exist_ok=True)

    def shot(driver: WebDriver, name: str) -> Path:
        path = folder / f"{name}.png"
        assert driver.save_screenshot(str(path)), path
        return path

    return shot


# -- helpers ------------------------------------------------------------------------------------


def wait(driver: WebDriver, until: Callable[[WebDriver], Any], timeout: float = 15) -> Any:
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(until)
    except TimeoutException:
        raise AssertionError(
            f"timed out; the page says: {driver.find_element(By.TAG_NAME, 'body').text!r}"
        ) from None


def heading(driver: WebDriver) -> str:
    """The current view's h1, once it has one (signed in) and is not loading."""

    def ready(d: WebDriver) -> str | bool:
        view = d.find_element(By.ID, "view")
        if not view.is_displayed() or view.get_attribute("aria-busy"):
            return False
        found = view.find_elements(By.TAG_NAME, "h1")
        return found[0].text if found else False

    result: str = wait(driver, ready)
    return result


def open_console(driver: WebDriver, url: str, route: str = "") -> None:
    """The console freshly loaded, signed out (this tab's session storage emptied)."""
    driver.get(f"{url}/console/")
    driver.execute_script("sessionStorage.clear()")
    driver.get("about:blank")  # a new load even where only the #route would differ
    driver.get(f"{url}/console/{route}")
    wait(driver, lambda d: d.find_element(By.ID, "token").is_displayed())


def sign_in(driver: WebDriver, url: str, token: str, route: str = "") -> str:
    """Sign in with the form; the first view's heading."""
    open_console(driver, url, route)
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "sign-in-submit").click()
    return heading(driver)


def go(driver: WebDriver, route: str) -> str:
    """Follow a route of the signed-in console (as a link would); its heading."""
    driver.execute_script(
        """
        document.getElementById("view").setAttribute("aria-busy", "true");
        if (window.location.hash !== arguments[0]) window.location.hash = arguments[0];
        else window.dispatchEvent(new HashChangeEvent("hashchange"));
        """,
        route,
    )
    return heading(driver)


def active(driver: WebDriver) -> WebElement:
    element: WebElement = driver.switch_to.active_element
    return element


def unlabelled(driver: WebDriver) -> list[str]:
    """Visible form controls without a label, and buttons or links without a name."""
    found: list[str] = driver.execute_script(
        """
        const bad = [];
        for (const el of document.querySelectorAll("input, select, textarea, button, a[href]")) {
          if (!el.getClientRects().length || el.type === "hidden") continue;
          const named = el.getAttribute("aria-label") || el.getAttribute("aria-labelledby");
          const text = el.textContent.trim();
          const ok = el.matches("button, a") ? (named || text) : (named || el.labels.length);
          if (!ok) bad.push(el.outerHTML.slice(0, 120));
        }
        return bad;
        """
    )
    return found


def view_text(driver: WebDriver) -> str:
    return str(driver.find_element(By.ID, "view").text)


def drop_files(driver: WebDriver, zone_id: str, folder: Path) -> None:
    """Drop a folder's files on an element, as a drag from the desktop does (a DataTransfer
    with File objects, then dragenter, dragover and drop)."""
    files = [(p.name, base64.b64encode(p.read_bytes()).decode()) for p in sorted(folder.iterdir())]
    driver.execute_script(
        """
        const [zoneId, files] = arguments;
        const transfer = new DataTransfer();
        for (const [name, b64] of files) {
          const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
          transfer.items.add(new File([bytes], name));
        }
        const zone = document.getElementById(zoneId);
        for (const type of ["dragenter", "dragover", "drop"]) {
          const init = {dataTransfer: transfer, bubbles: true, cancelable: true};
          zone.dispatchEvent(new DragEvent(type, init));
        }
        """,
        zone_id,
        files,
    )


def fill_upload(driver: WebDriver, name: str, base_model: str = TINY_BASE_NAME) -> None:
    element = driver.find_element(By.ID, "up-name")
    element.clear()
    element.send_keys(name)
    Select(driver.find_element(By.ID, "up-base")).select_by_value(base_model)


# -- the tests ----------------------------------------------------------------------------------


def test_sign_in_and_navigation_work_from_the_keyboard_with_labelled_controls(
    browser: WebDriver, stack: Stack, shots: Callable[[WebDriver, str], Path]
) -> None:
    open_console(browser, stack.url)
    shots(browser, "01-sign-in")
    assert unlabelled(browser) == []
    ActionChains(browser).send_keys(Keys.TAB).perform()
    assert active(browser).get_attribute("class") == "skip"
    ActionChains(browser).send_keys(Keys.TAB).perform()
    assert active(browser).get_attribute("id") == "token"
    ActionChains(browser).send_keys(stack.keys["acme"], Keys.TAB).perform()
    assert active(browser).get_attribute("id") == "sign-in-submit"
    ActionChains(browser).send_keys(Keys.ENTER).perform()
    assert heading(browser) == "Adapters"
    assert active(browser).tag_name == "h1"  # focus moves to the new view's heading
    assert unlabelled(browser) == []

    # from the header, Tab reaches the sections; Enter follows one
    browser.find_element(By.CLASS_NAME, "brand").click()
    for _ in range(6):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        if active(browser).text == "Upload":
            break
    assert active(browser).text == "Upload", "Tab never reached the Upload section"
    ActionChains(browser).send_keys(Keys.ENTER).perform()
    assert heading(browser) == "Upload an adapter"
    assert unlabelled(browser) == []
    # the form's controls, in order, by keyboard
    browser.find_element(By.ID, "up-name").click()
    order = ["up-name"]
    for _ in range(3):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        order.append(str(active(browser).get_attribute("id")))
    assert order == ["up-name", "up-base", "up-files", "upload-submit"]
    for route in ("#/usage", "#/adapters/faq"):
        go(browser, route)
        assert unlabelled(browser) == [], route


def test_a_good_adapter_dropped_on_the_page_is_ingested_in_the_background_and_listed(
    browser: WebDriver, stack: Stack, shots: Callable[[WebDriver, str], Path]
) -> None:
    sign_in(browser, stack.url, stack.keys["acme"])
    assert go(browser, "#/upload") == "Upload an adapter"
    fill_upload(browser, "support")
    folder = stack.adapter("support", 32, 7)  # over BACKGROUND: a background job
    (folder / "trainer_state.json").write_text("{}")  # a Trainer's: ignored, and said so
    drop_files(browser, "dropzone", folder)
    chosen = browser.find_element(By.ID, "chosen").text
    assert "adapter_config.json" in chosen and "adapter_model.safetensors" in chosen
    browser.execute_script(
        """
        const result = document.getElementById("upload-result");
        window.seen = [];  // each state the page shows while it follows the upload
        new MutationObserver(() => window.seen.push(result.textContent))
          .observe(result, {childList: true, subtree: true, characterData: true});
        """
    )
    browser.find_element(By.ID, "upload-submit").click()
    result = browser.find_element(By.ID, "upload-result")
    wait(browser, lambda d: "Stored support v1" in result.text)
    assert "ignored: trainer_state.json" in result.text
    assert browser.find_element(By.ID, "upload-progress").get_attribute("value") == "100"
    seen = browser.execute_script("return window.seen")
    assert any(t.startswith("Background ingest of support: ") for t in seen), seen
    shots(browser, "02-upload-done")

    api = httpx.get(
        stack.url + "/v1/adapters/support",
        headers={"Authorization": f"Bearer {stack.keys['acme']}"},
    ).json()
    assert go(browser, "#/adapters") == "Adapters"
    row = browser.find_element(By.XPATH, "//table//tr[td/a[text()='support']]")
    cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    assert cells[:4] == ["support", TINY_BASE_NAME, "v1 of 1", "32"]
    assert cells[4].endswith(" KiB")
    assert cells[5] == api["current"]["digest"][:12] and cells[6] == "follows latest"
    recent = browser.find_element(By.XPATH, "//section[h2='Recent uploads']").text
    assert re.search(r"support background stored as v1; ignored: trainer_state.json", recent)
    shots(browser, "03-adapters")

    browser.find_element(By.LINK_TEXT, "support").click()
    assert heading(browser) == "support"
    text = view_text(browser)
    assert 'model="support"' in text and 'model="support@1"' in text
    assert api["current"]["digest"] in text  # the full digest of each version
    snippets = [p.text for p in browser.find_elements(By.CSS_SELECTOR, ".copyable pre")]
    assert snippets[0].startswith("curl -s http://dataplane.example:8000/v1/chat/completions")
    assert '"model":"support"' in snippets[0] and "$LORAPLANE_API_KEY" in snippets[0]
    assert 'model="support"' in snippets[1] and 'os.environ["LORAPLANE_API_KEY"]' in snippets[1]
    assert stack.keys["acme"] not in browser.page_source  # the snippets never carry the key
    browser.find_element(By.CSS_SELECTOR, "#call-model option[value='support@1']").click()
    snippets = [p.text for p in browser.find_elements(By.CSS_SELECTOR, ".copyable pre")]
    assert '"model":"support@1"' in snippets[0] and 'model="support@1"' in snippets[1]
    shots(browser, "04-adapter")


def test_a_bias_adapter_is_refused_with_BiasNotSupported_explained(
    browser: WebDriver, stack: Stack, shots: Callable[[WebDriver, str], Path]
) -> None:
    sign_in(browser, stack.url, stack.keys["acme"], "#/upload")
    assert heading(browser) == "Upload an adapter"
    fill_upload(browser, "bias-try")
    folder = stack.adapter("bias", 8, 3, bias="all")
    paths = "\n".join(str(p) for p in sorted(folder.iterdir()))
    browser.find_element(By.ID, "up-files").send_keys(paths)  # chosen, not dropped
    browser.find_element(By.ID, "upload-submit").click()
    alert = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#upload-result [role=alert]"))
    text = alert.text
    assert "BiasNotSupported" in text
    assert EXPLANATIONS[ReasonCode.BIAS_NOT_SUPPORTED] in text
    assert "bias is 'all'" in text  # the API's own message, below the explanation
    shots(browser, "05-upload-refused")

    assert go(browser, "#/adapters") == "Adapters"
    names = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "table a")]
    assert "bias-try" not in names
    recent = browser.find_element(By.XPATH, "//section[h2='Recent uploads']").text
    assert "bias-try" in recent and EXPLANATIONS[ReasonCode.BIAS_NOT_SUPPORTED] in recent
    shots(browser, "06-adapters-with-a-refusal")


def test_another_tenants_adapters_never_appear(
    browser: WebDriver, stack: Stack, shots: Callable[[WebDriver, str], Path]
) -> None:
    sign_in(browser, stack.url, stack.keys["acme"])
    assert "faq" in view_text(browser)
    for route in ("#/adapters", "#/usage", "#/upload"):
        go(browser, route)
        assert "globex" not in browser.page_source, route
    # another tenant's adapter is exactly as absent as a name nobody has
    assert go(browser, "#/adapters/globex-secret") == "Not found"
    theirs = view_text(browser).replace("globex-secret", "NAME")
    shots(browser, "07-not-found")
    assert go(browser, "#/adapters/no-such-adapter") == "Not found"
    assert view_text(browser).replace("no-such-adapter", "NAME") == theirs

    assert sign_in(browser, stack.url, stack.keys["globex"]) == "Adapters"
    text = view_text(browser)
    assert "globex-secret" in text and "faq" not in text
    go(browser, "#/usage")
    assert "faq" not in browser.page_source


def test_markup_in_an_error_message_or_a_key_label_is_shown_as_text(
    browser: WebDriver, stack: Stack, shots: Callable[[WebDriver, str], Path]
) -> None:
    # the API's message echoes the refused name: the page shows it, it does not parse it
    sign_in(browser, stack.url, stack.keys["acme"], "#/upload")
    assert heading(browser) == "Upload an adapter"
    fill_upload(browser, MARKUP)
    folder = stack.adapter("plain", 8, 4)
    browser.find_element(By.ID, "up-files").send_keys(
        "\n".join(str(p) for p in sorted(folder.iterdir()))
    )
    browser.find_element(By.ID, "upload-submit").click()
    alert = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#upload-result [role=alert]"))
    assert "InvalidRequest" in alert.text and MARKUP in alert.text
    assert browser.find_elements(By.CSS_SELECTOR, "#view img") == []
    go(browser, "#/adapters")  # the recent uploads list shows it too
    assert MARKUP in view_text(browser)
    assert browser.find_elements(By.CSS_SELECTOR, "#view img") == []
    assert browser.execute_script("return window.__pwned") is None

    # an admin-written key label
    assert sign_in(browser, stack.url, ADMIN, "#/tenants/acme") == "acme"
    browser.find_element(By.ID, "key-label").send_keys("<b>ops</b>")
    browser.find_element(By.XPATH, "//button[text()='Create key']").click()
    wait(browser, lambda d: "<b>ops</b>" in d.find_element(By.ID, "new-key").text)
    cells = browser.find_elements(By.XPATH, "//table[@id='keys']//td[2]")
    assert "<b>ops</b>" in [c.text for c in cells]
    assert browser.find_elements(By.CSS_SELECTOR, "#view b") == []
    shots(browser, "08-markup-as-text")


def test_usage_is_a_chart_per_adapter_with_the_numbers_on_hover(
    browser: WebDriver, stack: Stack, shots: Callable[[WebDriver, str], Path]
) -> None:
    sign_in(browser, stack.url, stack.keys["acme"], "#/usage")
    assert heading(browser) == "Usage"
    bars = browser.find_elements(By.CSS_SELECTOR, "svg.chart rect.bar")
    assert len(bars) == 2 * DAYS  # faq and the base model, each day
    titles = [b.find_element(By.TAG_NAME, "title").get_attribute("textContent") for b in bars]
    today = datetime.now(UTC).date().isoformat()
    assert f"faq on {today}: 10 requests, 100 prompt + 30 completion tokens" in titles
    assert f"(base model) on {today}: 20 requests, 200 prompt + 60 completion tokens" in titles
    target = next(b for b in bars if b.get_attribute("data-day") == today)
    ActionChains(browser).move_to_element(target).perform()
    tip = browser.find_element(By.ID, "tooltip")
    wait(browser, lambda d: tip.is_displayed())
    assert tip.text == target.find_element(By.TAG_NAME, "title").get_attribute("textContent")
    totals = browser.find_element(By.XPATH, "//table[caption[starts-with(., 'Totals')]]").text
    assert f"faq {10 * DAYS} {100 * DAYS} {30 * DAYS}" in totals
    shots(browser, "09-usage")
    # the same numbers reach the keyboard: a bar takes focus and shows its tooltip
    browser.execute_script("arguments[0].focus()", bars[0])
    wait(browser, lambda d: tip.text == bars[0].get_attribute("aria-label"))


def test_admin_views_show_tenants_a_new_key_once_and_pool_pressure(
    browser: WebDriver, stack: Stack, shots: Callable[[WebDriver, str], Path]
) -> None:
    assert sign_in(browser, stack.url, ADMIN) == "Tenants"
    names = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "table a")]
    assert {"acme", "globex"} <= set(names)
    assert unlabelled(browser) == []
    shots(browser, "10-tenants")

    browser.find_element(By.LINK_TEXT, "globex").click()
    assert heading(browser) == "globex"
    assert unlabelled(browser) == []
    browser.find_element(By.ID, "key-label").send_keys("ci")
    browser.find_element(By.XPATH, "//button[text()='Create key']").click()
    box = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#new-key pre"))
    key = box.text
    assert key.startswith("lp_")
    shots(browser, "11-tenant-new-key")
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(stack.url + "/v1/adapters", headers=headers).status_code == 200
    go(browser, "#/tenants")
    assert go(browser, "#/tenants/globex") == "globex"
    assert key not in browser.page_source  # shown once: gone once the view is left
    row = browser.find_element(By.XPATH, f"//table[@id='keys']//tr[td[3]='{key[:12]}…']")
    row.find_element(By.XPATH, ".//button[text()='Revoke']").click()
    wait(browser, lambda d: d.find_element(By.ID, "confirm-ok")).click()  # asked first
    wait(browser, lambda d: "revoked" in d.find_element(By.ID, "keys").text)
    assert httpx.get(stack.url + "/v1/adapters", headers=headers).status_code == 401

    assert go(browser, "#/pools") == "Pools"
    pool = browser.find_element(By.CSS_SELECTOR, "section.pool").text
    assert f"default/{POOL}" in pool and "replica-0" in pool
    assert "3 running, 5 cached, of 8 slots" in pool
    assert "48 MiB of 128 MiB" in pool and "42%" in pool
    meters = browser.find_elements(By.CSS_SELECTOR, "section.pool meter")
    assert [m.get_attribute("value") for m in meters] == ["3", "50331648", "0.42"]
    assert unlabelled(browser) == []
    shots(browser, "12-pools")


def test_the_admin_sees_each_tenants_weight_and_sets_it_at_create_and_with_the_quotas(
    browser: WebDriver, stack: Stack, shots: Callable[[WebDriver, str], Path]
) -> None:
    def weights() -> dict[str, str]:
        """Tenant name -> the Weight column of the tenants table."""
        headers = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "thead th")]
        column = headers.index("Weight")
        rows = browser.find_elements(By.CSS_SELECTOR, "tbody tr")
        cells = [[td.text for td in r.find_elements(By.TAG_NAME, "td")] for r in rows]
        return {c[0]: c[column] for c in cells}

    def tenant_weight(name: str) -> float:
        value: float = stack.admin("GET", f"/v1/tenants/{name}").json()["weight"]
        return value

    def set_value(element_id: str, value: str) -> None:
        element = browser.find_element(By.ID, element_id)
        element.clear()
        element.send_keys(value)

    assert sign_in(browser, stack.url, ADMIN) == "Tenants"
    assert weights()["acme"] == "1"
    browser.find_element(By.ID, "tenant-name").send_keys("weighted")
    set_value("tenant-weight", "2.5")
    assert unlabelled(browser) == []
    browser.find_element(By.XPATH, "//button[text()='Create tenant']").click()
    assert heading(browser) == "weighted"
    assert tenant_weight("weighted") == 2.5
    assert browser.find_element(By.ID, "quota-weight").get_attribute("value") == "2.5"
    assert unlabelled(browser) == []

    set_value("quota-weight", "0")  # refused by the control plane, which names the field
    browser.find_element(By.XPATH, "//button[text()='Save quotas']").click()
    refusal = "weight: must be a number greater than 0 and at most 1000 (got 0)"
    wait(browser, lambda d: refusal in view_text(d))
    assert tenant_weight("weighted") == 2.5
    set_value("quota-weight", "0.5")
    browser.find_element(By.XPATH, "//button[text()='Save quotas']").click()
    wait(browser, lambda d: tenant_weight("weighted") == 0.5)
    assert stack.admin("GET", "/v1/tenants/weighted").json()["max_adapters"] == 100  # kept
    # the pin quota (issue 33) is edited beside the others; 0 lets only the admin pin
    assert browser.find_element(By.ID, "quota-max_pinned_bytes").get_attribute("value") == "0"
    set_value("quota-max_pinned_bytes", "1048576")
    browser.find_element(By.XPATH, "//button[text()='Save quotas']").click()
    wait(browser, lambda d: stack.admin("GET", "/v1/tenants/weighted").json()["max_pinned_bytes"]
         == 1 << 20)  # fmt: skip
    shots(browser, "13-tenant-weight")
    assert go(browser, "#/tenants") == "Tenants"
    assert (weights()["weighted"], weights()["acme"]) == ("0.5", "1")


def test_the_key_stays_in_session_storage_and_a_revoked_key_meets_the_401_wall(
    browser: WebDriver, stack: Stack
) -> None:
    r = stack.admin("POST", "/v1/tenants/acme/keys", json={"name": "short-lived"})
    key, key_id = r.json()["key"], r.json()["id"]
    sign_in(browser, stack.url, key)
    stored = browser.execute_script("return sessionStorage.getItem('loraplane.console.token')")
    assert stored == key
    assert browser.execute_script("return localStorage.length") == 0
    assert browser.get_cookies() == []
    assert key not in browser.current_url

    assert stack.admin("DELETE", f"/v1/tenants/acme/keys/{key_id}").status_code == 204
    browser.execute_script("window.location.hash = '#/usage'")
    error = wait(browser, lambda d: d.find_element(By.ID, "sign-in-error"))
    wait(browser, lambda d: error.is_displayed())
    assert "no longer accepts this key" in error.text
    assert browser.execute_script("return sessionStorage.length") == 0
    assert not browser.find_element(By.ID, "view").is_displayed()

    # a wrong key is refused at the door, and signing out forgets a good one
    open_console(browser, stack.url)
    browser.find_element(By.ID, "token").send_keys("lp_" + "x" * 43, Keys.ENTER)
    wait(browser, lambda d: "Not accepted" in d.find_element(By.ID, "sign-in-error").text)
    assert "invalid or revoked API key" in browser.find_element(By.ID, "sign-in-error").text
    assert browser.execute_script("return sessionStorage.length") == 0
    # a mistyped key is told apart from an unknown one, whichever way it is mistyped
    for mistyped, said in (
        ("lp_" + "x" * 40, "malformed API key: it is 43 characters long"),
        ("lp-" + "x" * 43, "malformed API key: a tenant API key starts"),
    ):
        field = browser.find_element(By.ID, "token")
        field.clear()
        field.send_keys(mistyped, Keys.ENTER)

        def says(d: WebDriver, s: str = said) -> bool:
            return s in d.find_element(By.ID, "sign-in-error").text

        wait(browser, says)
    sign_in(browser, stack.url, stack.keys["acme"])
    browser.find_element(By.ID, "sign-out").click()
    wait(browser, lambda d: d.find_element(By.ID, "token").is_displayed())
    assert browser.execute_script("return sessionStorage.length") == 0


def test_the_version_view_shows_the_signing_key_of_a_signed_version(
    browser: WebDriver, stack: Stack, shots: Callable[[WebDriver, str], Path]
) -> None:
    """Last in this file: it adds an adapter to the shared stack."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from loraplane.adapters import signing
    from loraplane.adapters.canonical import digest_of_source

    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    r = stack.admin("POST", "/v1/tenants/acme/signing-keys", json={"public_key": pem.decode()})
    assert r.status_code == 201, r.text
    key_id = r.json()["key_id"]
    folder = stack.adapter("signed", 8, 11)
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
    signature = signing.sign_digest(key, digest_of_source(folder))
    r = httpx.post(
        stack.url + "/v1/adapters",
        data={"name": "signed-bot", "base_model": TINY_BASE_NAME, "signature": signature},
        files=files,
        headers={"Authorization": f"Bearer {stack.keys['acme']}"},
    )
    assert r.status_code == 201, r.text
    sign_in(browser, stack.url, stack.keys["acme"])
    assert go(browser, "#/adapters/signed-bot") == "signed-bot"
    assert browser.find_element(By.ID, "signed-by").text == key_id
    row = browser.find_element(By.XPATH, "//section[h2='Versions']//tbody/tr")
    assert key_id in [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    shots(browser, "20-signed-version")
    assert go(browser, "#/adapters/faq") == "faq"
    assert browser.find_element(By.ID, "signed-by").text == "unsigned"
