"""Alembic environment for the catalog.

The connection comes from the caller (`loraplane.controlplane.db.upgrade` passes one in
`config.attributes["connection"]`), else from the `sqlalchemy.url` option, else from the
control plane's settings (LORAPLANE_DATABASE_URL). SQLite runs in batch mode (it cannot
alter tables in place).
"""

from __future__ import annotations

import logging.config

from alembic import context
from sqlalchemy import Connection, create_engine

from loraplane.controlplane.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from loraplane.controlplane.settings import Settings

    return Settings().effective_database_url


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_offline() -> None:
    """Emit SQL for the URL's dialect without connecting (`alembic upgrade --sql`)."""
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    """Migrate through the given connection, or one made from the URL."""
    given = config.attributes.get("connection")
    if given is not None:
        _configure(given)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url())
    with engine.connect() as connection:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if config.config_file_name is not None and config.attributes.get("connection") is None:
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

if context.is_offline_mode():
    run_offline()
else:
    run_online()
