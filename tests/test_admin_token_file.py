"""The admin token's file, `.loraplane/admin-token` (mode 0600): `loraplane demo` writes its
token there (or uses the one it finds), and the tenant CLI reads it when neither
`--admin-token` nor `LORAPLANE_ADMIN_TOKEN` is given, as its help says."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from loraplane import tokenfile
from loraplane.cli import main
from loraplane.controlplane.main import create_app
from loraplane.demo.run import _admin_token as demo_admin_token
from tests.controlplane.conftest import make_settings
from tests.servers import serve_in_thread


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh folder to run commands from, with no token in the environment."""
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    for var in ("LORAPLANE_ADMIN_TOKEN", "LORAPLANE_DATA_DIR", "LORAPLANE_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    return folder


@pytest.fixture
def controlplane_with(tmp_path: Path) -> Iterator[Any]:
    started: list[Any] = []

    def start(token: str) -> str:
        app = create_app(make_settings(tmp_path / "cp", f"sqlite:///{tmp_path / 'cp.db'}",
                                       admin_token=SecretStr(token)))  # fmt: skip
        ctx = serve_in_thread(app)
        url = ctx.__enter__()
        started.append((ctx, app))
        return url

    yield start
    for ctx, app in started:
        ctx.__exit__(None, None, None)
        app.state.ctx.close()


def test_the_demo_writes_its_token_there_with_mode_0600_and_never_prints_it(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token, path = demo_admin_token()
    assert path == here / ".loraplane" / "admin-token"
    assert path.read_text() == token + "\n" and mode(path) == 0o600
    out = capsys.readouterr().out
    assert f"admin token: written to {path} (mode 0600" in out and token not in out
    again, _ = demo_admin_token()  # a later run uses the same token: the CLI's file stays true
    assert again == token and "read from" in capsys.readouterr().out


def test_a_token_file_found_keeps_its_token_and_loses_wider_modes(here: Path) -> None:
    path = here / ".loraplane" / "admin-token"
    path.parent.mkdir()
    path.write_text("  mine-0123456789abcdef \n")
    path.chmod(0o644)
    token, found, written = tokenfile.ensure_admin_token()
    assert (token, found, written) == ("mine-0123456789abcdef", Path(".loraplane/admin-token"),
                                       False)  # fmt: skip
    assert mode(path) == 0o600


def test_the_data_dir_variable_moves_the_file(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_DATA_DIR", str(here / "state"))
    _, path, written = tokenfile.ensure_admin_token()
    assert written and path == here / "state" / "admin-token" and mode(path) == 0o600


def test_the_cli_reads_the_demos_file_when_no_flag_or_variable_is_given(
    here: Path, controlplane_with: Any, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    token, path = demo_admin_token()
    monkeypatch.setenv("LORAPLANE_URL", controlplane_with(token))
    capsys.readouterr()
    assert main(["tenants", "list", "--json"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip().startswith("[")
    # the variable and the flag still win over the file
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", "another-token-0123456789")
    assert main(["tenants", "list"]) == 1
    assert "Unauthorized" in capsys.readouterr().err
    assert main(["tenants", "list", "--admin-token", token]) == 0
    capsys.readouterr()
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN")
    path.unlink()
    assert main(["tenants", "list"]) == 2
    err = capsys.readouterr().err
    assert "no admin token" in err and ".loraplane/admin-token" in err and "demo" in err


def test_a_file_with_whitespace_inside_the_token_is_refused_naming_the_file(
    here: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = here / ".loraplane" / "admin-token"
    tokenfile.write_admin_token(path, "half-of-a-token other-half-0123")
    monkeypatch.setenv("LORAPLANE_URL", "http://127.0.0.1:9")  # never reached
    assert main(["tenants", "list"]) == 1
    err = capsys.readouterr().err
    assert ".loraplane/admin-token has a space inside it" in err
    assert "other-half" not in err
