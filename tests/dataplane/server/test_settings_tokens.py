"""The data plane's own tokens (`--api-key`, `--admin-token`, the service token) from flags or
`LORAPLANE_*` variables: whitespace around them (an env file, a Secret made from a file with
its newline) is trimmed; whitespace inside is refused by name, and the value never printed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loraplane.cli import main
from loraplane.dataplane.server.settings import ServerSettings, SettingsError

SECRET = "tok-2f9c81e0d4b7a6"


@pytest.mark.parametrize("field", ["api_key", "admin_token", "service_token"])
def test_whitespace_around_a_token_from_the_environment_is_trimmed(
    field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(f"LORAPLANE_{field.upper()}", f"  {SECRET}\n")
    assert getattr(ServerSettings.load(model="m"), field) == SECRET


def test_whitespace_around_a_flag_is_trimmed_and_an_empty_value_left_alone() -> None:
    settings = ServerSettings.load(model="m", admin_token=f"{SECRET}\r\n", api_key="")
    assert settings.admin_token == SECRET
    assert settings.api_key == ""


def test_whitespace_inside_is_refused_naming_the_setting_never_the_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAPLANE_SERVICE_TOKEN", f"{SECRET} {SECRET}")
    with pytest.raises(SettingsError) as refused:
        ServerSettings.load(model="m")
    text = str(refused.value)
    assert text.startswith("LORAPLANE_SERVICE_TOKEN / --service-token: ")
    assert "a space inside it" in text and SECRET not in text
    with pytest.raises(ValidationError) as direct:  # built without load(): still not echoed
        ServerSettings(model="m")
    assert SECRET not in str(direct.value)


def test_serve_refuses_such_a_flag_with_exit_2_and_no_secret_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--model", "m", "--admin-token", f"{SECRET}\n{SECRET}"]) == 2
    err = capsys.readouterr().err
    assert "--admin-token" in err and "a line break inside it" in err
    assert SECRET not in err
