"""The console's pins view, in a real headless Chromium at 1280 px and 390 px against a control
plane over real HTTP: the tenant's pins with their pool and k, how many replicas hold each and
which refused it with the reason (from the replicas' pressure reports), and Unpin, asked first;
the REST API says the unpin happened."""

from __future__ import annotations

from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.console.test_console_actions import (
    Stack,
    browser,
    chrome,
    closed,
    confirmed,
    dialog,
    press,
    pytestmark,
    stack,
    text_of,
    width,
)
from tests.console.test_console_browser import sign_in, unlabelled, wait

__all__ = ["browser", "chrome", "pytestmark", "stack"]  # the fixtures and marks, shared

WHY = "pinning bot would pin 2 adapters on this replica, more than its cap of 1"


def test_the_pins_view_shows_held_and_refused_replicas_and_unpins_after_asking(
    browser: WebDriver, stack: Stack
) -> None:
    name = f"pinned-{width(browser)}"
    stack.push(name, 1)
    stack.report(replica="replica-0")
    stack.report(replica="replica-1")
    pin = f"/v1/tenants/acme/adapters/{name}/versions/1/pin"
    r = stack.admin("PUT", pin, json={"pool": stack.pool["name"], "replicas": 2})
    assert r.status_code == 200, r.text
    state = {"tenant": "acme", "adapter": name, "digest": r.json()["digest"]}
    stack.report(replica="replica-0", pin_states=[{**state, "state": "resident"}])
    stack.report(replica="replica-1", pin_states=[{**state, "state": f"refused: {WHY}"}])

    assert sign_in(browser, stack.url, stack.key, "#/pins") == "Pins"
    row = wait(browser, lambda d: d.find_element(By.XPATH, f"//tr[td/a[text()='{name}']]"))
    cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    assert cells[1:5] == ["v1", f"default/{stack.pool['name']}", "2", "1 of 2"]
    assert cells[5] == f"replica-1: {WHY}"
    assert unlabelled(browser) == []

    press(browser, "Unpin")
    box = dialog(browser)
    assert f"Unpin {name} v1 on default/{stack.pool['name']}?" in box.text
    box.find_element(By.ID, "confirm-cancel").click()
    closed(browser)
    assert len(stack.tenant("GET", "/v1/pins").json()) == 1  # cancelled: still pinned
    confirmed(browser, "Unpin")
    wait(browser, lambda d: "No pins." in text_of(d, "pins"))
    assert stack.tenant("GET", "/v1/pins").json() == []
