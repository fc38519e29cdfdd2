"""The catalog database: engine, sessions, and the schema's migration state.

Connections are checked before use (`pool_pre_ping`), so after a database outage the service
recovers by itself; while the database is away, queries raise and the error registry answers
503. On SQLite (embedded) the service migrates to the latest schema at start; elsewhere the
schema is migrated by `loraplane controlplane migrate` and the service refuses an outdated one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from loraplane import fileaccess
from loraplane.controlplane.settings import StartupError

# Shipped inside the package, so an installed wheel (the container image) can migrate.
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
THREADPOOL_TOKENS = 40  # anyio's default thread limit, which Starlette's threadpool uses


def make_engine(
    url: str,
    *,
    pool_size: int = 10,
    connect_timeout: int = 3,
    echo: bool = False,
    pre_ping: bool = True,
    max_overflow: int | None = None,
) -> Engine:
    """An engine for `url`, by default with pre-ping; SQLite gets WAL and a busy timeout.

    `pre_ping=False, max_overflow=0` is the resolve path's engine: no ping round trip per
    checkout (its caller retries once on a connection the database dropped instead), and a
    fixed set of connections, never opened and closed per request under load.
    """
    if url.startswith("sqlite"):
        db_path = make_url(url).database
        if db_path and db_path != ":memory:":
            # sqlite3 says only "unable to open database file": name the file and the user
            # (SQLite writes its WAL and lock files beside the database, so the folder too)
            fileaccess.check_writable_dir(Path(db_path).parent)
            if Path(db_path).exists():
                fileaccess.check_writable_file(db_path)
        engine = create_engine(
            url,
            echo=echo,
            pool_pre_ping=pre_ping,
            connect_args={"check_same_thread": False, "timeout": 30},
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(
        url,
        echo=echo,
        pool_pre_ping=pre_ping,
        pool_size=pool_size,
        # Sync routes run on a threadpool of THREADPOOL_TOKENS threads, and a request gives its
        # connection back in a teardown that needs a thread too: with fewer connections than
        # threads, every thread can end up waiting for a connection no one can return.
        max_overflow=max(pool_size, THREADPOOL_TOKENS) if max_overflow is None else max_overflow,
        pool_timeout=10,
        connect_args={"connect_timeout": connect_timeout},
    )


def _sqlite_pragmas(dbapi_connection: Any, _: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit (routes serialise them after)."""
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that is rolled back if left with uncommitted work, and always closed."""
    session = factory()
    try:
        yield session
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def alembic_config(url: str) -> Config:
    """Alembic configuration for `url`, independent of the working directory."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str | None:
    """The newest migration in MIGRATIONS_DIR."""
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return script.get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (None: never migrated)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


@contextmanager
def _migrating(engine: Engine) -> Iterator[Connection]:
    """A connection in one transaction that holds the migration's DDL too, so a migration
    that fails (a refused downgrade) leaves the schema as it found it.

    pysqlite opens transactions only before DML: an ALTER TABLE outside one commits at once,
    and a failure after it left SQLite with a changed schema under the old revision. Here
    pysqlite is told to keep out (autocommit) and the transaction is begun explicitly.
    """
    with engine.connect() as conn:
        if conn.dialect.name == "sqlite":
            conn.execution_options(isolation_level="AUTOCOMMIT")
            event.listen(conn, "begin", lambda c: c.exec_driver_sql("BEGIN"))
        with conn.begin():
            yield conn


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate the database behind `engine` to `revision` (all or nothing)."""
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with _migrating(engine) as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str = "base") -> None:
    """Migrate the database behind `engine` down to `revision` (all or nothing)."""
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with _migrating(engine) as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def prepare_schema(engine: Engine, *, migrate: bool) -> None:
    """Migrate (embedded SQLite) or check that the schema is at the latest revision.

    Raises StartupError when the schema is outdated and may not be migrated here, or when
    the database cannot be reached at start.
    """
    try:
        if migrate:
            upgrade(engine)
            return
        current = current_revision(engine)
    except StartupError:
        raise
    except Exception as exc:
        raise StartupError(
            f"LORAPLANE_DATABASE_URL: cannot use the database at "
            f"{engine.url.render_as_string(hide_password=True)}: {type(exc).__name__}: {exc}"
        ) from exc
    head = head_revision()
    if current != head:
        raise StartupError(
            f"the database schema is at revision {current or 'none'} but this version of "
            f"loraplane needs {head}: run `loraplane controlplane migrate` first"
        )
