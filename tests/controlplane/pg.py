"""A private, throwaway PostgreSQL cluster for tests and benchmarks (initdb + pg_ctl from
Debian's PostgreSQL server package, which .ci/run installs).

`initdb` and `pg_ctl` run as the `postgres` user in a temp folder owned by it, listening on
127.0.0.1 at a free port with fsync off. Start, stop and restart it (the outage test does).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg

from tests.servers import free_port


def find_bin() -> Path | None:
    """The newest PostgreSQL server binaries on this machine, if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


class PgCluster:
    """One throwaway cluster: `start()`, `url(db)`, `create_database(name)`, `stop()`."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="loraplane-pg-"))
        self.data = self.root / "data"
        self._as_postgres = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")

    def _run(self, tool: str, *args: str) -> None:
        cmd = [*self._as_postgres, str(self.bindir / tool), *args]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.data} -c fsync=off"
        log = str(self.root / "server.log")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", log, "-w", "start")

    def stop(self) -> None:
        """Stop the server at once (in-flight connections are cut)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL of a database in this cluster."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create a database and return its URL."""
        dsn = f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def destroy(self) -> None:
        """Stop (if running) and remove everything."""
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def create_database(admin_url: str, name: str) -> str:
    """Create database `name` on the server of `admin_url` (any SQLAlchemy PG URL); its URL."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        engine.dispose()
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)
