"""`loraplane controlplane [--host H] [--port 8080] [--internal-port N]` and
`loraplane controlplane migrate`.

With `--internal-port`, the internal routes (the operator's and the data plane's calls) and
/metrics answer only on that port, every other route on both (`listeners.py`).

`add_commands` registers both on the `loraplane` command's sub-parsers. Settings are read
when a command runs, never at import.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from loraplane.accesslog import AccessLogError, make_logger, settings_from, wrap
from loraplane.accesslog import add_arguments as add_access_log
from loraplane.redact import env_secrets, install_log_redaction, redact


def _error(message: str) -> None:
    """An error on stderr, with every key, token and URL password masked."""
    print("error: " + redact(message, env_secrets()), file=sys.stderr)


def _tokens(app: Any) -> list[str | None]:
    """The tokens a control plane checks (generated ones too) and those of the environment:
    never in its logs."""
    ctx = getattr(app.state, "ctx", None)
    mine = [getattr(ctx, "admin_token", None), getattr(ctx, "service_token", None)]
    return [t for t in mine if isinstance(t, str)] + env_secrets()


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from loraplane.controlplane.main import create_app
    from loraplane.controlplane.settings import Settings, StartupError
    from loraplane.graceful import GracefulServer

    if args.internal_port is None:
        try:
            access = settings_from(args)
            app = create_app(Settings())
            requests_log = make_logger(access, "controlplane", _tokens(app))
        except (StartupError, AccessLogError) as exc:
            _error(str(exc))
            return 2
        config = uvicorn.Config(
            wrap(app, "controlplane", requests_log),  # one JSON line per request (accesslog.py)
            host=args.host, port=args.port, log_level=args.log_level, access_log=False,
        )  # fmt: skip
        install_log_redaction(_tokens(app))  # after Config: it sets the log handlers up
        GracefulServer(config).run()  # SIGINT, SIGTERM: a graceful stop, exit 0
        return 0
    return _serve_two_ports(args)


def _serve_two_ports(args: argparse.Namespace) -> int:
    """The public and the internal port, one app and one server over two sockets."""
    import logging

    import uvicorn

    from loraplane.controlplane.main import create_app
    from loraplane.controlplane.settings import Settings, StartupError
    from loraplane.graceful import GracefulServer
    from loraplane.sockets import listen, port_of

    if args.internal_port == args.port:
        _error("--internal-port must differ from --port")
        return 2
    sockets = []
    for flag, port in (("--port", args.port), ("--internal-port", args.internal_port)):
        try:
            sockets.append(listen(args.host, port))
        except OSError as exc:
            _error(f"cannot listen on {args.host}:{port} ({flag}): {exc}")
            return 1
    try:
        access = settings_from(args)
        app = create_app(Settings(), internal_port=port_of(sockets[1]))
        requests_log = make_logger(access, "controlplane", _tokens(app))
    except (StartupError, AccessLogError) as exc:
        _error(str(exc))
        return 2
    config = uvicorn.Config(wrap(app, "controlplane", requests_log), host=args.host,
                            port=port_of(sockets[0]), log_level=args.log_level,
                            access_log=False)  # fmt: skip
    install_log_redaction(_tokens(app))
    logging.getLogger("uvicorn.error").info(
        "internal routes and /metrics on %s:%d only", args.host, port_of(sockets[1])
    )
    GracefulServer(config).run(sockets=sockets)
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from loraplane.controlplane import db
    from loraplane.controlplane.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        _error(str(exc))
        return 2
    try:
        engine = db.make_engine(settings.effective_database_url)
    except OSError as exc:  # e.g. the SQLite file's folder: fileaccess.AccessDenied
        _error(f"LORAPLANE_DATABASE_URL: {exc}")
        return 1
    try:
        before = db.current_revision(engine)
        db.upgrade(engine, args.revision)
        after = db.current_revision(engine)
    except Exception as exc:
        _error(f"migration failed: {type(exc).__name__}: {exc}")
        return 1
    finally:
        engine.dispose()
    print(f"database schema: {before or 'empty'} -> {after}")
    return 0


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `controlplane` (serve) and `controlplane migrate` on `subparsers`."""
    from loraplane.controlplane.settings import settings_help

    cp = subparsers.add_parser(
        "controlplane",
        help="run the control plane (REST API, catalog)",
        description="Serve the control plane's REST API. Settings come from LORAPLANE_* "
        "variables; every default serves the embedded mode (SQLite and a local store under "
        "./.loraplane/).",
        epilog=settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cp.add_argument("--host", default="127.0.0.1", help="address to listen on")
    cp.add_argument("--port", type=int, default=8080, help="port to listen on")
    cp.add_argument(
        "--internal-port",
        type=int,
        metavar="N",
        help="serve the internal routes (/internal/v1/..., for the operator and the data"
        " plane) and /metrics on this port only; every other route answers on both (default:"
        " everything on --port)",
    )
    cp.add_argument("--log-level", default="info", help="uvicorn log level")
    add_access_log(cp)
    cp.set_defaults(func=_serve)
    actions = cp.add_subparsers(dest="controlplane_command", metavar="ACTION")
    migrate = actions.add_parser(
        "migrate",
        help="migrate the catalog database to the latest schema (alembic upgrade head)",
    )
    migrate.add_argument("--revision", default="head", help="target revision")
    migrate.set_defaults(func=_migrate)
