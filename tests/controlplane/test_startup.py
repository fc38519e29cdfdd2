"""Start-up: settings read once, tokens checked (or generated in embedded mode), schema
migrated on SQLite and checked elsewhere, and the CLI commands."""

from __future__ import annotations

import argparse
import stat
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy import inspect

from loraplane.controlplane import db
from loraplane.controlplane.cli import add_commands
from loraplane.controlplane.main import create_app
from loraplane.controlplane.settings import Settings, StartupError
from tests.controlplane import pg
from tests.controlplane.conftest import make_settings

STRONG = "Zq8#pL2@vN5!rT9$wK4%yB7^cM1&xF6*"


def test_embedded_defaults_generate_tokens_in_0600_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(data_dir=tmp_path / "state")
    assert settings.embedded and settings.is_sqlite
    app = create_app(settings)
    try:
        token_file = tmp_path / "state" / "admin-token"
        assert token_file.exists()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        err = capsys.readouterr().err
        assert str(token_file) in err and token not in err
        assert app.state.ctx.admin_token == token
        # migrated at start: the catalog has its tables
        assert "tenants" in inspect(app.state.ctx.engine).get_table_names()
    finally:
        app.state.ctx.close()
    again = create_app(Settings(data_dir=tmp_path / "state"))  # the same token on restart
    assert again.state.ctx.admin_token == token
    again.state.ctx.close()


def test_settings_come_from_LORAPLANE_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_DATABASE_URL", "postgresql://u@h/db")
    monkeypatch.setenv("LORAPLANE_IMPORT_BUCKETS", "a, b")
    monkeypatch.setenv("LORAPLANE_MAX_UPLOAD_BYTES", "1000")
    s = Settings()
    assert s.database_url == "postgresql+psycopg://u@h/db"
    assert s.import_buckets == ["a", "b"] and s.max_upload_bytes == 1000
    assert not s.embedded


@pytest.mark.parametrize(
    ("overrides", "variable"),
    [
        ({"admin_token": None}, "LORAPLANE_ADMIN_TOKEN"),
        ({"admin_token": SecretStr("short")}, "LORAPLANE_ADMIN_TOKEN"),
        ({"admin_token": SecretStr("a" * 40)}, "LORAPLANE_ADMIN_TOKEN"),
        ({"admin_token": SecretStr(STRONG), "service_token": None}, "LORAPLANE_SERVICE_TOKEN"),
    ],
)
def test_deployment_with_missing_or_weak_token_fails_naming_the_variable(
    tmp_path: Path, overrides: dict[str, object], variable: str
) -> None:
    settings = make_settings(tmp_path, "postgresql+psycopg://u@127.0.0.1:1/x", **overrides)
    with pytest.raises(StartupError, match=variable):
        create_app(settings)


def test_unreachable_database_fails_at_start(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://u@127.0.0.1:{pg.free_port()}/x"
    settings = make_settings(tmp_path, url, admin_token=SecretStr(STRONG))
    with pytest.raises(StartupError, match="LORAPLANE_DATABASE_URL"):
        create_app(settings)


@pytest.mark.postgres
def test_outdated_postgres_schema_refuses_to_start_until_migrated(
    tmp_path: Path, pg_admin_url: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url = pg.create_database(pg_admin_url, f"old_{uuid.uuid4().hex[:8]}")
    settings = make_settings(tmp_path, url)
    with pytest.raises(StartupError, match="loraplane controlplane migrate"):
        create_app(settings)  # never migrated
    engine = db.make_engine(url)
    db.upgrade(engine, "0001")  # migrated by an older release
    engine.dispose()
    with pytest.raises(StartupError, match=r"at revision 0001 .* run `loraplane controlplane"):
        create_app(settings)
    monkeypatch.setenv("LORAPLANE_DATABASE_URL", url)
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["controlplane", "migrate"])
    assert args.func(args) == 0
    assert f"0001 -> {db.head_revision()}" in capsys.readouterr().out
    app = create_app(settings)
    app.state.ctx.close()
    engine = db.make_engine(url)
    assert db.current_revision(engine) == db.head_revision()
    engine.dispose()


def test_cli_registers_serve_options(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["controlplane", "--host", "0.0.0.0", "--port", "9000"])
    assert (args.host, args.port, args.func.__name__) == ("0.0.0.0", 9000, "_serve")
    args = parser.parse_args(["controlplane"])
    assert (args.host, args.port) == ("127.0.0.1", 8080)
