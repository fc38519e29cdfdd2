"""The console at a phone's width (390 px) in a real headless Chromium, and the usage chart over
ranges longer than a year, against a control plane served over real HTTP (SQLite, local store).

At 390 px (and at 1280 px) no view may scroll the page sideways (tables scroll inside their own
boxes), the header wraps with Sign out on the screen, the row buttons (Serve, Revoke) can be
reached and the chart's tick labels stay readable (12 px, none over another). Screenshots are
written to `<pytest's base temp>/console-screenshots/phone-*.png`.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement

from loraplane.controlplane.crud.usage import add_usage
from loraplane.controlplane.main import create_app
from loraplane.controlplane.schemas.internal import AdapterUsage
from tests.adapters.crafting import TINY_BASE, TINY_BASE_NAME, lora_config, lora_tensors
from tests.adapters.crafting import write_adapter as craft
from tests.console.test_console_browser import (
    CHROMEDRIVER,
    CHROMIUM,
    go,
    logged,
    open_console,
    sign_in,
    wait,
)
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

WIDTH, HEIGHT = 390, 844  # a phone's CSS pixels
POOL = "pool-a"
# a tenant's usage on fixed days over two years, and on the last week (the default range)
FIXED_DAYS = [date(2025, 1, 1), date(2025, 6, 15), date(2026, 11, 30), date(2026, 12, 1)]
LAST = date(2026, 12, 2)
RECENT = 7


@dataclass
class Stack:
    url: str
    key: str

    def usage(self, start: str, end: str) -> list[dict[str, Any]]:
        r = httpx.get(
            f"{self.url}/v1/usage",
            params={"start": start, "end": end},
            headers={"Authorization": f"Bearer {self.key}"},
        )
        assert r.status_code == 200, r.text
        rows: list[dict[str, Any]] = r.json()
        return rows


def _rows(requests: int) -> list[AdapterUsage]:
    return [
        AdapterUsage(tenant="acme", adapter="faq", requests=requests, prompt_tokens=10 * requests,
                     completion_tokens=3 * requests),
        AdapterUsage(tenant="acme", adapter="", requests=2 * requests,
                     prompt_tokens=20 * requests, completion_tokens=6 * requests),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, base_model_dir: Path) -> Iterator[Stack]:
    """A pool, tenant acme with a key and two versions of `faq` (so "Serve v1" is offered), a
    second key (so a Revoke button is), usage on FIXED_DAYS, LAST and the last RECENT days,
    and a replica's pressure report (the pools view's table)."""
    tmp = tmp_path_factory.mktemp("console-phone")
    app = create_app(make_settings(tmp, f"sqlite:///{tmp / 'catalog.db'}"))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        with serve_in_thread(app) as url:
            pool = {
                "name": POOL,
                "base_model": {"name": TINY_BASE_NAME, "uri": str(base_model_dir)},
            }
            assert httpx.post(url + "/v1/pools", json=pool, headers=admin).status_code == 201
            r = httpx.post(url + "/v1/tenants", json={"name": "acme"}, headers=admin)
            assert r.status_code == 201, r.text
            keys = [
                httpx.post(url + "/v1/tenants/acme/keys", json={"name": n}, headers=admin)
                for n in ("console", "a-rather-long-label-for-the-ci-runner-key")
            ]
            key = keys[0].json()["key"]
            for seed in (1, 2):
                folder = craft(
                    tmp / f"faq{seed}", lora_config(r=8), lora_tensors(TINY_BASE, 8, seed=seed)
                )
                files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
                r = httpx.post(
                    url + "/v1/adapters", data={"name": "faq", "base_model": TINY_BASE_NAME},
                    files=files, headers={"Authorization": f"Bearer {key}"},
                )  # fmt: skip
                assert r.status_code == 201, r.text
            today = datetime.now(UTC).date()
            days = {*FIXED_DAYS, LAST, *(today - timedelta(days=b) for b in range(RECENT))}
            with app.state.ctx.sessions() as session:
                for i, day in enumerate(sorted(days), 1):
                    add_usage(session, rows=_rows(i), day=day)
                session.commit()
            report = {
                "pool": POOL, "replica": "replica-0-with-a-long-pod-name-abcdef", "slots_used": 3,
                "running_adapters": 3, "waiting_adapters": 1, "deferred": 2,
                "gpu_bytes": 48 << 20, "gpu_bytes_capacity": 128 << 20, "kv_usage": 0.42,
            }  # fmt: skip
            r = httpx.post(
                url + "/internal/v1/pressure", json=report,
                headers={"Authorization": f"Bearer {SERVICE}"},
            )  # fmt: skip
            assert r.status_code == 200, r.text
            yield Stack(url, key)
    finally:
        app.state.ctx.close()


@pytest.fixture(scope="module")
def phone() -> Iterator[webdriver.Chrome]:
    """Headless Chromium whose page is 390 x 844 CSS pixels."""
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                f"--window-size={WIDTH},{HEIGHT}"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    chrome.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
    )
    try:
        yield chrome
    finally:
        chrome.quit()


@pytest.fixture
def browser(phone: webdriver.Chrome) -> Iterator[webdriver.Chrome]:
    """The phone, signed out; afterwards, no script error and no CSP violation was logged."""
    phone.get("about:blank")
    logged(phone)
    yield phone
    problems = [m for m in logged(phone) if "Content Security Policy" in m or "Uncaught" in m]
    assert not problems, problems


def shot(driver: WebDriver, tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    folder = tmp_path_factory.getbasetemp() / "console-screenshots"
    folder.mkdir(exist_ok=True)
    assert driver.save_screenshot(str(folder / f"phone-{name}.png"))


def overflow(driver: WebDriver) -> dict[str, Any]:
    """The page's width, the window's, and the elements that stick out on the right."""
    found: dict[str, Any] = driver.execute_script(
        """
        const inner = window.innerWidth;
        const out = [];
        for (const el of document.querySelectorAll("body *")) {
          const box = el.getBoundingClientRect();
          if (!box.width || box.right <= inner + 0.5) continue;
          // inside a box that scrolls sideways on its own: not the page's overflow
          let p = el.parentElement, clipped = false;
          for (; p && p !== document.body; p = p.parentElement) {
            if (["auto", "scroll", "hidden"].includes(getComputedStyle(p).overflowX)) {
              clipped = true;
              break;
            }
          }
          if (!clipped) out.push(`${el.tagName.toLowerCase()}.${el.className} right=${box.right}`);
        }
        return {scroll: document.documentElement.scrollWidth, inner, sticking: out.slice(0, 8)};
        """
    )
    return found


def in_viewport(driver: WebDriver, element: WebElement) -> bool:
    """Whether the element lies wholly on the screen and is what a tap at its middle hits."""
    inside: bool = driver.execute_script(
        """
        const el = arguments[0];
        const box = el.getBoundingClientRect();
        if (!box.width || box.left < 0 || box.top < 0 || box.right > innerWidth
            || box.bottom > innerHeight) return false;
        const hit = document.elementFromPoint(box.left + box.width / 2, box.top + box.height / 2);
        return hit === el || el.contains(hit);
        """,
        element,
    )
    return inside


def reach(driver: WebDriver, element: WebElement) -> bool:
    """Scrolled to as focusing it from the keyboard does: then it is on the screen."""
    driver.execute_script(
        "arguments[0].focus(); arguments[0].scrollIntoView({block: 'center'})", element
    )
    return in_viewport(driver, element)


def resize(driver: WebDriver, width: int) -> None:
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
    )


def assert_fits(
    driver: WebDriver, tmp_path_factory: pytest.TempPathFactory, name: str, width: int
) -> None:
    shot(driver, tmp_path_factory, f"{width}-{name}")
    found = overflow(driver)
    assert found["inner"] == width, found
    assert found["scroll"] <= found["inner"], f"{name}: the page scrolls sideways: {found}"
    assert found["sticking"] == [], name
    sign_out = driver.find_element(By.ID, "sign-out")
    driver.execute_script("window.scrollTo(0, 0)")
    assert in_viewport(driver, sign_out), f"{name}: Sign out is off the screen"


@pytest.mark.parametrize("width", [WIDTH, 1280])
def test_every_view_fits_the_width_with_sign_out_and_the_row_buttons_on_screen(
    browser: WebDriver, stack: Stack, tmp_path_factory: pytest.TempPathFactory, width: int
) -> None:
    resize(browser, width)
    try:
        open_console(browser, stack.url)
        found = overflow(browser)
        assert found["scroll"] <= found["inner"] == width, f"sign in: {found}"
        assert in_viewport(browser, browser.find_element(By.ID, "sign-in-submit"))
        assert sign_in(browser, stack.url, stack.key) == "Adapters"
        assert_fits(browser, tmp_path_factory, "adapters", width)
        for route, name in (
            ("#/upload", "upload"),
            ("#/usage", "usage"),
            ("#/adapters/faq", "adapter"),
        ):
            go(browser, route)
            assert_fits(browser, tmp_path_factory, name, width)
        serve = browser.find_element(By.XPATH, "//button[contains(., 'Serve')]")
        assert reach(browser, serve), "Serve is out of reach"

        assert sign_in(browser, stack.url, ADMIN) == "Tenants"
        assert_fits(browser, tmp_path_factory, "tenants", width)
        for route, name in (("#/tenants/acme", "tenant"), ("#/pools", "pools")):
            go(browser, route)
            assert_fits(browser, tmp_path_factory, name, width)
        go(browser, "#/tenants/acme")
        revoke = browser.find_element(By.XPATH, "//table[@id='keys']//button[text()='Revoke']")
        assert reach(browser, revoke), "Revoke is out of reach"
        # the keys table scrolls in its own box: the page still does not
        assert overflow(browser)["scroll"] <= width
    finally:
        resize(browser, WIDTH)


def ticks(driver: WebDriver) -> list[dict[str, Any]]:
    """The chart's tick labels (the texts of the bars' groups): text and the box each takes on
    the screen."""
    found: list[dict[str, Any]] = driver.execute_script(
        """
        return [...document.querySelectorAll("svg.chart > g:not(.grid) > text")].map((t) => {
          const b = t.getBoundingClientRect();
          return {text: t.textContent, left: b.left, right: b.right, height: b.height};
        });
        """
    )
    return found


def test_the_usage_chart_at_a_phones_width_has_readable_ticks_that_do_not_overlap(
    browser: WebDriver, stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    sign_in(browser, stack.url, stack.key, "#/usage")
    found = ticks(browser)
    assert len(found) >= 2, found
    assert all(t["height"] >= 12 for t in found), found  # 12 px text, not a scaled-down 960 px
    for a, b in itertools.pairwise(found):
        assert a["right"] <= b["left"], f"tick labels overlap: {a} {b}"
    assert all(t["left"] >= 0 and t["right"] <= WIDTH for t in found), found


def test_the_chart_is_redrawn_for_the_new_width_when_the_window_changes(
    browser: WebDriver, stack: Stack
) -> None:
    def drawn(d: WebDriver) -> int:
        # in one script: the chart may be replaced between two WebDriver calls
        found = d.execute_script('return document.querySelector("svg.chart").getAttribute("width")')
        return int(found or 0)

    sign_in(browser, stack.url, stack.key, "#/usage")
    narrow = drawn(browser)
    assert narrow < WIDTH
    try:
        resize(browser, 1200)  # a phone turned, a window widened: the full-size chart
        wait(browser, lambda d: drawn(d) == 960)
        assert browser.find_elements(By.CSS_SELECTOR, "svg.chart rect.bar")
    finally:
        resize(browser, WIDTH)
    wait(browser, lambda d: drawn(d) == narrow)
    assert all(t["height"] >= 12 and t["right"] <= WIDTH for t in ticks(browser))


def show(driver: WebDriver, start: str, end: str) -> WebElement:
    """Ask the usage view for a range; the chart it draws."""
    driver.execute_script(
        """
        document.getElementById("usage-start").value = arguments[0];
        document.getElementById("usage-end").value = arguments[1];
        document.getElementById("usage-out").replaceChildren();
        """,
        start,
        end,
    )
    driver.find_element(By.CSS_SELECTOR, "#usage-form button[type=submit]").click()
    chart: WebElement = wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "svg.chart"))
    return chart


def test_a_two_year_range_shows_its_latest_days_per_month_with_years_matching_the_totals(
    browser: WebDriver, stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    sign_in(browser, stack.url, stack.key, "#/usage")
    chart = show(browser, "2025-01-01", "2026-12-02")
    shot(browser, tmp_path_factory, "usage-two-years")
    label = str(chart.get_attribute("aria-label"))
    assert label.endswith("per month and adapter, 2025-01-01 to 2026-12-02"), label
    caption = browser.find_element(By.CSS_SELECTOR, "#usage-out caption").text
    assert caption == "Totals, 2025-01-01 to 2026-12-02"

    # one bar per month of the range, each segment the sum of the API's rows of its month
    want: dict[tuple[str, str], int] = defaultdict(int)
    for row in stack.usage("2025-01-01", "2026-12-02"):
        want[(row["day"][:7], row["adapter"])] += row["requests"]
    bars = chart.find_elements(By.CSS_SELECTOR, "rect.bar")
    got = {}
    for bar in bars:
        title = str(bar.find_element(By.TAG_NAME, "title").get_attribute("textContent"))
        requests = int(title.split(": ")[1].split(" requests")[0].replace(",", ""))
        got[(str(bar.get_attribute("data-day")), str(bar.get_attribute("data-adapter")))] = requests
    assert got == dict(want)
    # the latest days are there: December 2026, clipped to the range's end
    december = [b for b in bars if b.get_attribute("data-day") == "2026-12"]
    assert december, "no bar for the range's last month"
    title = str(december[0].find_element(By.TAG_NAME, "title").get_attribute("textContent"))
    assert "from 2026-12-01 to 2026-12-02:" in title, title
    first = chart.find_element(By.CSS_SELECTOR, "rect.bar[data-day='2025-01'] title")
    assert "from 2025-01-01 to 2025-01-31:" in str(first.get_attribute("textContent"))
    # ticks carry the year (YYYY-MM), readable and apart
    found = ticks(browser)
    assert len(found) >= 2 and all(t["text"][:4] in ("2025", "2026") for t in found), found
    assert found[0]["text"] == "2025-01"
    for a, b in itertools.pairwise(found):
        assert a["right"] <= b["left"], f"tick labels overlap: {a} {b}"
    totals = browser.find_element(By.XPATH, "//table[caption[starts-with(., 'Totals')]]").text
    faq = sum(n for (_, adapter), n in want.items() if adapter == "faq")
    assert f"faq {faq:,} " in totals, totals


def test_a_range_over_new_year_shorter_than_a_year_is_per_day_with_years_in_the_ticks(
    browser: WebDriver, stack: Stack
) -> None:
    sign_in(browser, stack.url, stack.key, "#/usage")
    chart = show(browser, "2026-11-25", "2027-01-10")
    assert str(chart.get_attribute("aria-label")).endswith(
        "per day and adapter, 2026-11-25 to 2027-01-10"
    )
    found = ticks(browser)
    assert found and all(t["text"][:4] in ("2026", "2027") and len(t["text"]) == 10 for t in found)
    day = chart.find_element(By.CSS_SELECTOR, "rect.bar[data-day='2026-12-01'][data-adapter='faq']")
    assert "faq on 2026-12-01: " in str(
        day.find_element(By.TAG_NAME, "title").get_attribute("textContent")
    )
    # within one year the ticks stay short (MM-DD)
    chart = show(browser, "2026-11-25", "2026-12-02")
    assert all(len(t["text"]) == 5 for t in ticks(browser)), ticks(browser)
