"""The console's actions that delete or change what production serves, in a real headless
Chromium at 1280 px and at 390 px, against a control plane served over real HTTP (SQLite,
local store): Serve vN, Roll back, Follow latest, Delete and a key's Revoke each ask first in a
<dialog> that names what will happen, with Cancel focused; Cancel, Escape and Enter change
nothing (the REST API says so), the dialog's own button does it. Also: the upload form's base
models come from GET /v1/base-models (none: a message), an upload's ignored files are listed,
the pools view draws its slots bar from what runs (not from what is cached), and an error
shows the API's reason first. And a new tenant's tour, at both widths: key, upload (a Trainer
checkpoint folder), the quota's refusal, roll back, follow latest, delete, upload again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select

from loraplane.controlplane.main import create_app
from tests.adapters.crafting import TINY_BASE, TINY_BASE_NAME, lora_config, lora_tensors
from tests.adapters.crafting import write_adapter as craft
from tests.console.test_console_browser import (
    CHROMEDRIVER,
    CHROMIUM,
    drop_files,
    go,
    heading,
    logged,
    sign_in,
    unlabelled,
    view_text,
    wait,
)
from tests.console.test_console_phone import HEIGHT, overflow, reach, resize
from tests.controlplane.conftest import ADMIN, SERVICE, make_settings
from tests.servers import serve_in_thread

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
WIDTHS = [390, 1280]


@dataclass
class Stack:
    """The served control plane, acme's key, the pool's body, and a folder for test files."""

    url: str
    key: str
    pool: dict[str, Any]
    work: Path
    seeds: list[int] = field(default_factory=lambda: [100])

    def tenant(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}"}
        return httpx.request(method, self.url + path, headers=headers, **kw)

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        return httpx.request(method, self.url + path, headers=headers, **kw)

    def folder(self, name: str, *extra: str) -> Path:
        """A new adapter folder of the tiny base (new weights each call), with `extra` files
        beside it (a Trainer's artefacts: bytes that are no adapter)."""
        self.seeds[0] += 1
        out = self.work / f"{name}-{self.seeds[0]}"
        craft(out, lora_config(r=8), lora_tensors(TINY_BASE, 8, seed=self.seeds[0]))
        for n in extra:
            (out / n).write_bytes(b"\x80\x04\x95not an adapter")
        return out

    def push(self, name: str, versions: int = 1) -> None:
        """Upload `versions` new versions of `name` through the REST API."""
        for _ in range(versions):
            folder = self.folder(name)
            files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
            r = self.tenant(
                "POST", "/v1/adapters", data={"name": name, "base_model": TINY_BASE_NAME},
                files=files,
            )  # fmt: skip
            assert r.status_code == 201, r.text

    def adapter(self, name: str) -> dict[str, Any]:
        r = self.tenant("GET", f"/v1/adapters/{name}")
        assert r.status_code == 200, r.text
        found: dict[str, Any] = r.json()
        return found

    def report(self, **pressure: Any) -> None:
        body = {"pool": POOL, "replica": "replica-0", **pressure}
        r = httpx.post(
            self.url + "/internal/v1/pressure", json=body,
            headers={"Authorization": f"Bearer {SERVICE}"},
        )  # fmt: skip
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, base_model_dir: Path) -> Iterator[Stack]:
    """A pool of 2 adapter slots and tenant acme with a key."""
    tmp = tmp_path_factory.mktemp("console-actions")
    app = create_app(make_settings(tmp, f"sqlite:///{tmp / 'catalog.db'}"))
    try:
        with serve_in_thread(app) as url:
            pool = {
                "name": POOL,
                "base_model": {"name": TINY_BASE_NAME, "uri": str(base_model_dir)},
                "max_loras": 2,
            }
            (tmp / "work").mkdir()
            s = Stack(url, "", pool, tmp / "work")
            assert s.admin("POST", "/v1/pools", json=pool).status_code == 201
            assert s.admin("POST", "/v1/tenants", json={"name": "acme"}).status_code == 201
            r = s.admin("POST", "/v1/tenants/acme/keys", json={"name": "console"})
            s.key = r.json()["key"]
            yield s
    finally:
        app.state.ctx.close()


@pytest.fixture(scope="module")
def chrome() -> Iterator[webdriver.Chrome]:
    """Headless Chromium; each test sets the page's width."""
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                f"--window-size=1280,{HEIGHT}"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(params=WIDTHS, ids=lambda w: f"{w}px")
def browser(chrome: webdriver.Chrome, request: pytest.FixtureRequest) -> Iterator[WebDriver]:
    """The browser at the width, signed out; afterwards, no script error or CSP violation."""
    resize(chrome, request.param)
    chrome.get("about:blank")
    logged(chrome)
    yield chrome
    problems = [m for m in logged(chrome) if "Content Security Policy" in m or "Uncaught" in m]
    assert not problems, problems


@pytest.fixture(scope="module")
def shot(tmp_path_factory: pytest.TempPathFactory) -> Callable[[WebDriver, str], None]:
    """Save a screenshot as console-screenshots/actions-<name>.png."""
    folder = tmp_path_factory.getbasetemp() / "console-screenshots"
    folder.mkdir(exist_ok=True)

    def save(driver: WebDriver, name: str) -> None:
        assert driver.save_screenshot(str(folder / f"actions-{name}.png"))

    return save


def width(driver: WebDriver) -> int:
    inner: int = driver.execute_script("return window.innerWidth")
    return inner


def text_of(driver: WebDriver, element_id: str) -> str:
    """An element's text, read in one script (the view may be replaced between two calls)."""
    found: str = driver.execute_script(
        "return document.getElementById(arguments[0])?.innerText || ''", element_id
    )
    return found


def press(driver: WebDriver, text: str) -> None:
    """Press the view's button whose text is `text`, reached as a keyboard user would."""
    button = driver.find_element(By.XPATH, f"//main//button[normalize-space()='{text}']")
    assert reach(driver, button), f"{text} is out of reach"
    button.click()


def dialog(driver: WebDriver) -> WebElement:
    """The open confirmation: on the screen, modal, Cancel focused, the page not overflowing."""
    box: WebElement = wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "dialog[open]"))
    assert driver.execute_script("return arguments[0].matches(':modal')", box)
    assert driver.switch_to.active_element.get_attribute("id") == "confirm-cancel"
    found = overflow(driver)
    assert found["scroll"] <= found["inner"] == width(driver), found
    assert found["sticking"] == [], found
    edges = driver.execute_script(
        "const b = arguments[0].getBoundingClientRect(); return [b.left, b.right]", box
    )
    assert edges[0] >= 0 and edges[1] <= width(driver), edges
    assert unlabelled(driver) == []
    return box


def closed(driver: WebDriver) -> None:
    wait(driver, lambda d: not d.find_elements(By.CSS_SELECTOR, "dialog"))


def refused_three_ways(driver: WebDriver, text: str, said: list[str]) -> None:
    """Open the dialog with the button `text` and leave it by Cancel, Escape and Enter (on the
    focused Cancel); each time the dialog says every part of `said`."""
    for leave in ("cancel", "escape", "enter"):
        press(driver, text)
        box = dialog(driver)
        for part in said:
            assert part in box.text, (part, box.text)
        if leave == "cancel":
            box.find_element(By.ID, "confirm-cancel").click()
        else:
            driver.switch_to.active_element.send_keys(
                Keys.ESCAPE if leave == "escape" else Keys.ENTER
            )
        closed(driver)
        # the focus is back on the button that asked
        assert driver.switch_to.active_element.text == text, leave


def confirmed(driver: WebDriver, text: str) -> None:
    press(driver, text)
    dialog(driver).find_element(By.ID, "confirm-ok").click()
    closed(driver)


def test_serve_a_version_asks_first_and_holds_that_version(
    browser: WebDriver, stack: Stack, shot: Callable[[WebDriver, str], None]
) -> None:
    name = f"serve-{width(browser)}"
    stack.push(name, 2)
    assert sign_in(browser, stack.url, stack.key, f"#/adapters/{name}") == name
    refused_three_ways(
        browser, "Serve v1",
        [f"Serve v1 of {name}?", f"Requests to {name} will use v1 until you choose again."],
    )  # fmt: skip
    assert stack.adapter(name)["current_version"] == 2  # nothing changed

    press(browser, "Serve v1")
    shot(browser, f"{width(browser)}-serve-dialog")
    dialog(browser).find_element(By.ID, "confirm-ok").click()
    closed(browser)
    wait(browser, lambda d: "held (latest v2)" in text_of(d, "serving"))
    shot(browser, f"{width(browser)}-held")
    answer = stack.adapter(name)
    assert answer["current_version"] == 1
    assert answer.get("follow_latest", False) is False
    assert f"{name} now serves v1, held" in browser.find_element(By.ID, "notice").text
    assert go(browser, "#/adapters") == "Adapters"
    row = browser.find_element(By.XPATH, f"//table//tr[td/a[text()='{name}']]")
    assert "held at v1 (latest v2)" in row.text


def test_roll_back_asks_first_and_serves_the_version_before_the_current_one(
    browser: WebDriver, stack: Stack
) -> None:
    name = f"rollback-{width(browser)}"
    stack.push(name, 3)
    assert sign_in(browser, stack.url, stack.key, f"#/adapters/{name}") == name
    refused_three_ways(
        browser, "Roll back to v2",
        [f"Roll back {name} to v2?", f"Requests to {name} will use v2 until you choose again"],
    )  # fmt: skip
    assert stack.adapter(name)["current_version"] == 3

    confirmed(browser, "Roll back to v2")
    wait(browser, lambda d: d.find_elements(By.XPATH, "//button[text()='Roll back to v1']"))
    assert stack.adapter(name)["current_version"] == 2
    confirmed(browser, "Roll back to v1")  # and again: the version before v2
    wait(browser, lambda d: "v1, held" in text_of(d, "serving"))
    assert stack.adapter(name)["current_version"] == 1
    # nothing older: no Roll back button
    assert not browser.find_elements(By.XPATH, "//button[starts-with(., 'Roll back')]")


def test_follow_latest_asks_first_and_serves_the_latest_again(
    browser: WebDriver, stack: Stack
) -> None:
    name = f"follow-{width(browser)}"
    stack.push(name, 2)
    assert sign_in(browser, stack.url, stack.key) == "Adapters"
    row = browser.find_element(By.XPATH, f"//table//tr[td/a[text()='{name}']]")
    assert "follows latest" in row.text
    r = stack.tenant("PATCH", f"/v1/adapters/{name}", json={"current_version": 1})
    assert r.status_code == 200, r.text
    assert go(browser, f"#/adapters/{name}") == name
    refused_three_ways(
        browser, "Follow latest",
        [f"Follow the latest version of {name}?", f"Requests to {name} will use v2 now"],
    )  # fmt: skip
    assert stack.adapter(name)["current_version"] == 1
    # leaving the view with the question open (Back) answers no
    press(browser, "Follow latest")
    dialog(browser)
    browser.back()
    assert heading(browser) == "Adapters"
    closed(browser)
    assert go(browser, f"#/adapters/{name}") == name
    assert stack.adapter(name)["current_version"] == 1

    confirmed(browser, "Follow latest")
    wait(browser, lambda d: "following the latest" in text_of(d, "serving"))
    answer = stack.adapter(name)
    assert (answer["current_version"], answer["follow_latest"]) == (2, True)
    assert not browser.find_elements(By.XPATH, "//button[text()='Follow latest']")
    assert go(browser, "#/adapters") == "Adapters"
    row = browser.find_element(By.XPATH, f"//table//tr[td/a[text()='{name}']]")
    assert "follows latest" in row.text


def test_delete_asks_first_and_then_the_adapter_is_gone(browser: WebDriver, stack: Stack) -> None:
    name = f"delete-{width(browser)}"
    stack.push(name, 2)
    assert sign_in(browser, stack.url, stack.key, f"#/adapters/{name}") == name
    refused_three_ways(
        browser, f"Delete {name}",
        [f"Delete {name}?", f"Requests to {name} will be refused from now on",
         "Its 2 stored versions are kept"],
    )  # fmt: skip
    assert stack.tenant("GET", f"/v1/adapters/{name}").status_code == 200

    confirmed(browser, f"Delete {name}")
    assert heading(browser) == "Adapters"
    wait(browser, lambda d: f"{name} deleted" in d.find_element(By.ID, "notice").text)
    assert stack.tenant("GET", f"/v1/adapters/{name}").status_code == 404
    assert name not in [a.text for a in browser.find_elements(By.CSS_SELECTOR, "table a")]


def test_revoke_asks_first_and_then_the_key_is_refused(browser: WebDriver, stack: Stack) -> None:
    label = f"ci-{width(browser)}"
    made = stack.admin("POST", "/v1/tenants/acme/keys", json={"name": label}).json()
    key, prefix = made["key"], made["prefix"]

    def works() -> int:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.get(stack.url + "/v1/adapters", headers=headers).status_code

    assert sign_in(browser, stack.url, ADMIN, "#/tenants/acme") == "acme"
    row = f"//table[@id='keys']//tr[td[2]='{label}']"
    for leave in ("cancel", "escape", "enter"):
        button = browser.find_element(By.XPATH, f"{row}//button[text()='Revoke']")
        assert reach(browser, button)
        button.click()
        box = dialog(browser)
        assert f"Revoke key {prefix}… (“{label}”) of acme?" in box.text
        assert "Every request with this key is refused from now on" in box.text
        if leave == "cancel":
            box.find_element(By.ID, "confirm-cancel").click()
        else:
            key_name = Keys.ESCAPE if leave == "escape" else Keys.ENTER
            browser.switch_to.active_element.send_keys(key_name)
        closed(browser)
        assert works() == 200
    browser.find_element(By.XPATH, f"{row}//button[text()='Revoke']").click()
    dialog(browser).find_element(By.ID, "confirm-ok").click()
    # in one script: the table's rows are replaced once the key is revoked
    find = "return document.evaluate(arguments[0], document).iterateNext()?.textContent || ''"
    wait(browser, lambda d: "revoked" in d.execute_script(find, row))
    assert works() == 401


# -- the upload form, the pools view, errors (one width each: the phone file checks the fit) --


@pytest.mark.parametrize("browser", [1280], indirect=True, ids=["1280px"])
def test_the_base_model_is_chosen_from_the_tenants_list_with_its_limits(
    browser: WebDriver, stack: Stack
) -> None:
    pending = {
        "name": "pool-pending",
        "base_model": {"name": "other-model", "uri": "/models/other", "config_from_replicas": True},
    }
    assert stack.admin("POST", "/v1/pools", json=pending).status_code == 201
    try:
        offers = stack.tenant("GET", "/v1/base-models").json()
        assert sign_in(browser, stack.url, stack.key, "#/upload") == "Upload an adapter"
        select = Select(browser.find_element(By.ID, "up-base"))
        values = [o.get_attribute("value") for o in select.options]
        assert values == [o["name"] for o in offers] == ["other-model", TINY_BASE_NAME]
        # the first ready one is chosen, not the first in the list
        assert select.first_selected_option.get_attribute("value") == TINY_BASE_NAME
        tiny = next(o for o in offers if o["name"] == TINY_BASE_NAME)
        limits = browser.find_element(By.ID, "up-base-limits").text
        assert f"rank up to {tiny['max_lora_rank']}" in limits
        assert "other-model (not ready" in select.options[0].text
        select.select_by_value("other-model")
        assert "refused until then" in browser.find_element(By.ID, "up-base-limits").text
    finally:
        assert stack.admin("DELETE", "/v1/pools/pool-pending").status_code == 204


@pytest.mark.parametrize("browser", [390], indirect=True, ids=["390px"])
def test_with_no_pool_the_upload_form_says_the_admin_has_none_yet(
    browser: WebDriver, stack: Stack
) -> None:
    assert stack.admin("DELETE", f"/v1/pools/{POOL}").status_code == 204
    try:
        assert stack.tenant("GET", "/v1/base-models").json() == []
        assert sign_in(browser, stack.url, stack.key, "#/upload") == "Upload an adapter"
        text = browser.find_element(By.ID, "up-base-none").text
        assert "the admin has not registered a pool" in text
        assert not browser.find_elements(By.ID, "up-base")
        assert browser.find_element(By.ID, "upload-submit").get_attribute("disabled")
        assert overflow(browser)["scroll"] <= 390
    finally:
        assert stack.admin("POST", "/v1/pools", json=stack.pool).status_code == 201


@pytest.mark.parametrize("browser", [1280], indirect=True, ids=["1280px"])
def test_an_uploads_ignored_files_are_listed(browser: WebDriver, stack: Stack) -> None:
    folder = stack.folder("trainer", "training_args.bin", "optimizer.pt")
    assert sign_in(browser, stack.url, stack.key, "#/upload") == "Upload an adapter"
    browser.find_element(By.ID, "up-name").send_keys("trainer")
    drop_files(browser, "dropzone", folder)
    browser.find_element(By.ID, "upload-submit").click()
    note = wait(browser, lambda d: d.find_element(By.ID, "upload-ignored"))
    assert note.text == "ignored: optimizer.pt, training_args.bin"
    assert "Stored trainer v1" in browser.find_element(By.ID, "upload-result").text
    assert stack.adapter("trainer")["current_version"] == 1
    assert go(browser, "#/adapters") == "Adapters"  # the recent uploads say it too
    recent = browser.find_element(By.XPATH, "//section[h2='Recent uploads']").text
    assert "stored as v1; ignored: optimizer.pt, training_args.bin" in recent


@pytest.mark.parametrize("browser", [1280], indirect=True, ids=["1280px"])
def test_a_pool_whose_slots_are_all_cached_and_nothing_runs_is_not_drawn_saturated(
    browser: WebDriver, stack: Stack
) -> None:
    stack.report(slots_used=2, running_adapters=0, gpu_bytes=1 << 20, gpu_bytes_capacity=8 << 20)
    assert sign_in(browser, stack.url, ADMIN, "#/pools") == "Pools"
    pool = browser.find_element(By.CSS_SELECTOR, "section.pool")
    assert "0 running, 2 cached, of 2 slots" in pool.text
    meter = pool.find_element(By.CSS_SELECTOR, "meter[aria-label^='Adapters running']")
    assert (meter.get_attribute("value"), meter.get_attribute("max")) == ("0", "2")
    # busy: the bar fills with what runs
    stack.report(slots_used=2, running_adapters=2)
    go(browser, "#/pools")
    meter = browser.find_element(By.CSS_SELECTOR, "meter[aria-label^='Adapters running']")
    assert meter.get_attribute("value") == "2"
    assert "2 running, 2 cached, of 2 slots" in view_text(browser)


@pytest.mark.parametrize("browser", [1280], indirect=True, ids=["1280px"])
def test_an_error_shows_the_apis_reason_first(browser: WebDriver, stack: Stack) -> None:
    assert sign_in(browser, stack.url, ADMIN) == "Tenants"
    browser.find_element(By.ID, "tenant-name").send_keys("Not A Name")
    browser.find_element(By.XPATH, "//button[text()='Create tenant']").click()
    box = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#view .reason[role=alert]"))
    answer = stack.admin("POST", "/v1/tenants", json={"name": "Not A Name"}).json()["error"]
    first = box.find_element(By.CSS_SELECTOR, "p.why").text
    assert first == f"{answer['code']}: {answer['message']}"
    # a framework's own error shape ({"detail": ...}) gives its reason too, not a status line
    said = browser.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        import("./api.js").then((api) => done([
          api.reasonOf({detail: [{loc: ["body", "name"], msg: "Field required"}]}, "400"),
          api.reasonOf({detail: "Method Not Allowed"}, "405"),
          api.reasonOf(null, "502 Bad Gateway"),
        ]));
        """
    )
    assert said == ["name: Field required", "Method Not Allowed", "502 Bad Gateway"]


@pytest.mark.parametrize("browser", [1280], indirect=True, ids=["1280px"])
def test_a_rate_limit_of_0_is_saved_and_shown_as_unlimited_and_a_0_quota_is_refused_in_words(
    browser: WebDriver, stack: Stack
) -> None:
    assert stack.admin("POST", "/v1/tenants", json={"name": "quotas"}).status_code == 201
    assert sign_in(browser, stack.url, ADMIN, "#/tenants/quotas") == "quotas"

    def set_value(element_id: str, value: str) -> None:
        element = browser.find_element(By.ID, element_id)
        element.clear()
        element.send_keys(value)

    hint = browser.find_element(By.ID, "quota-tokens_per_minute-hint").text
    assert hint == "0: unlimited"
    set_value("quota-tokens_per_minute", "0")
    browser.find_element(By.XPATH, "//button[text()='Save quotas']").click()
    wait(
        browser, lambda d: stack.admin("GET", "/v1/tenants/quotas").json()["tokens_per_minute"] == 0
    )
    assert go(browser, "#/tenants") == "Tenants"
    row = browser.find_element(By.XPATH, "//table//tr[td/a[text()='quotas']]")
    cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    assert cells[7] == "unlimited" and cells[6] == "600", cells  # tokens, requests per minute

    assert go(browser, "#/tenants/quotas") == "quotas"
    set_value("quota-max_adapters", "0")
    browser.find_element(By.XPATH, "//button[text()='Save quotas']").click()
    box = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#view .reason[role=alert]"))
    said = stack.admin("PATCH", "/v1/tenants/quotas", json={"max_adapters": 0}).json()["error"]
    assert box.find_element(By.CSS_SELECTOR, "p.why").text == f"{said['code']}: {said['message']}"
    assert "max_adapters" in said["message"]
    assert stack.admin("GET", "/v1/tenants/quotas").json()["max_adapters"] == 100


def upload_in_page(driver: WebDriver, name: str, folder: Path) -> WebElement:
    """Fill the upload form (the base model as chosen for us), drop `folder`'s files, send;
    the result box once it holds an answer."""
    element = driver.find_element(By.ID, "up-name")
    element.clear()
    element.send_keys(name)
    drop_files(driver, "dropzone", folder)
    driver.find_element(By.ID, "upload-submit").click()
    result: WebElement = wait(
        driver,
        lambda d: (box := d.find_element(By.ID, "upload-result")).text and box,
    )
    return result


def fits(driver: WebDriver) -> None:
    found = overflow(driver)
    assert found["scroll"] <= found["inner"] == width(driver), found


def test_a_new_tenants_tour_from_key_to_upload_rollback_and_delete(
    browser: WebDriver, stack: Stack
) -> None:
    tenant = f"newbie-{width(browser)}"
    body = {"name": tenant, "max_adapters": 1}
    assert stack.admin("POST", "/v1/tenants", json=body).status_code == 201
    key = stack.admin("POST", f"/v1/tenants/{tenant}/keys", json={"name": "first"}).json()["key"]
    me = {"Authorization": f"Bearer {key}"}

    # the key opens an empty list that points at the upload form
    assert sign_in(browser, stack.url, key) == "Adapters"
    assert "No adapters yet. Upload one." in view_text(browser)
    fits(browser)
    browser.find_element(By.LINK_TEXT, "Upload one").click()
    assert heading(browser) == "Upload an adapter"
    select = Select(browser.find_element(By.ID, "up-base"))
    assert select.first_selected_option.get_attribute("value") == TINY_BASE_NAME
    assert "rank up to" in browser.find_element(By.ID, "up-base-limits").text
    fits(browser)

    # a Trainer's checkpoint folder as it is: stored, its artefacts named as ignored
    trainer = stack.folder("checkpoint-500", "training_args.bin", "optimizer.pt", "scheduler.pt")
    result = upload_in_page(browser, "first", trainer)
    assert "Stored first v1" in result.text, result.text
    assert "ignored: optimizer.pt, scheduler.pt, training_args.bin" in result.text
    result = upload_in_page(browser, "first", stack.folder("first"))
    wait(browser, lambda d: "Stored first v2" in text_of(d, "upload-result"))
    # a second name is over the quota of 1: the reason says what to do, and the console can
    result = upload_in_page(browser, "second", stack.folder("second"))
    alert = wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#upload-result [role=alert]"))
    assert alert.text.startswith("QuotaExceeded: ")
    assert "quota of 1 adapters" in alert.text and "the console's Delete" in alert.text
    fits(browser)

    assert go(browser, "#/adapters") == "Adapters"
    row = browser.find_element(By.XPATH, "//table//tr[td/a[text()='first']]")
    assert "v2 of 2" in row.text and "follows latest" in row.text
    row.find_element(By.LINK_TEXT, "first").click()
    assert heading(browser) == "first"
    confirmed(browser, "Roll back to v1")
    wait(browser, lambda d: "v1, held (latest v2)" in text_of(d, "serving"))
    assert httpx.get(f"{stack.url}/v1/adapters/first", headers=me).json()["current_version"] == 1
    confirmed(browser, "Follow latest")
    wait(browser, lambda d: "v2, following the latest" in text_of(d, "serving"))
    fits(browser)
    confirmed(browser, "Delete first")
    assert heading(browser) == "Adapters"
    assert "No adapters yet." in view_text(browser)
    assert httpx.get(f"{stack.url}/v1/adapters/first", headers=me).status_code == 404

    # the quota is free again: the second name goes in
    assert go(browser, "#/upload") == "Upload an adapter"
    result = upload_in_page(browser, "second", stack.folder("second"))
    wait(browser, lambda d: "Stored second v1" in text_of(d, "upload-result"))
    fits(browser)
