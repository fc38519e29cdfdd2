"""The console's weighted rollouts, in a real headless Chromium at 1280 px and 390 px against
a control plane over real HTTP: the adapter page shows the split ("Rollout"), starts one with a
canary version and weight, promotes its canary and rolls it back, each asked first in the
confirmation dialog; the REST API says each change happened."""

from __future__ import annotations

from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select

from tests.console.test_console_actions import (
    Stack,
    browser,
    chrome,
    closed,
    confirmed,
    dialog,
    pytestmark,
    stack,
    text_of,
    width,
)
from tests.console.test_console_browser import sign_in, wait

__all__ = ["browser", "chrome", "pytestmark", "stack"]  # the fixtures and marks, shared


def test_a_rollout_is_started_shown_promoted_and_rolled_back(
    browser: WebDriver, stack: Stack
) -> None:
    name = f"canary-{width(browser)}"
    stack.push(name, 2)
    assert stack.tenant("PATCH", f"/v1/adapters/{name}", json={"current_version": 1}).is_success
    assert sign_in(browser, stack.url, stack.key, f"#/adapters/{name}") == name
    assert text_of(browser, "rollout").startswith("none")

    assert Select(browser.find_element(By.ID, "rollout-version")).first_selected_option.text == "v2"
    weight = browser.find_element(By.ID, "rollout-weight")
    weight.clear()
    weight.send_keys("20")
    browser.find_element(By.ID, "rollout-start").click()
    box = dialog(browser)
    assert f"Send 20% of {name}'s requests to v2?" in box.text
    assert "v1 keeps 80% and is what a rollback serves" in box.text
    box.find_element(By.ID, "confirm-cancel").click()
    closed(browser)
    assert stack.adapter(name)["rollout"] is None  # cancelled: nothing changed
    browser.find_element(By.ID, "rollout-start").click()
    dialog(browser).find_element(By.ID, "confirm-ok").click()
    closed(browser)
    wait(browser, lambda d: "v1 80%, v2 20%" in text_of(d, "rollout"))
    assert "rolling back serves v1" in text_of(browser, "rollout")
    answer = stack.adapter(name)
    assert answer["rollout"] == [{"version": 1, "weight": 80}, {"version": 2, "weight": 20}]

    confirmed(browser, "Promote v2")
    wait(browser, lambda d: text_of(d, "rollout").startswith("none"))
    answer = stack.adapter(name)
    assert (answer["current_version"], answer["rollout"]) == (2, None)

    browser.find_element(By.ID, "rollout-start").click()  # the canary now: v1, at 10%
    dialog(browser).find_element(By.ID, "confirm-ok").click()
    closed(browser)
    wait(browser, lambda d: "v1 10%, v2 90%" in text_of(d, "rollout"))
    confirmed(browser, "Roll back to v2")
    wait(browser, lambda d: text_of(d, "rollout").startswith("none"))
    answer = stack.adapter(name)
    assert (answer["current_version"], answer["rollout"]) == (2, None)
