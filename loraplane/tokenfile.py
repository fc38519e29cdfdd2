"""The admin token's file on one machine: `.loraplane/admin-token` in the current folder (in
`$LORAPLANE_DATA_DIR` when that is set), mode 0600.

The embedded control plane generates its admin token there when `LORAPLANE_ADMIN_TOKEN` is
unset (controlplane/settings.py); `loraplane demo` writes its own there (or uses the one it
finds); the tenant CLI reads it when neither `--admin-token` nor `LORAPLANE_ADMIN_TOKEN` is
given. The token is never printed: people are told where the file is.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from loraplane import fileaccess
from loraplane.redact import clean_credential

DATA_DIR_ENV = "LORAPLANE_DATA_DIR"
DEFAULT_DATA_DIR = Path(".loraplane")
NAME = "admin-token"
MODE = 0o600


def admin_token_path() -> Path:
    """Where the admin token's file is for a process started in this folder."""
    return Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR) / NAME


def read_admin_token(path: Path | None = None) -> str | None:
    """The token in the file (trimmed), or None when there is no such file. CredentialError
    (naming the file) if it holds whitespace inside the token; AccessDenied (an OSError)
    naming the file when this user may not read it."""
    path = path or admin_token_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise fileaccess.explain(exc, "read", path) from exc
    return clean_credential(text, str(path))


def ensure_admin_token(path: Path | None = None) -> tuple[str, Path, bool]:
    """The token in the file, or a new one written there (mode 0600, the folder made);
    (token, path, whether it was written now). A file found keeps its token, its mode
    narrowed to 0600 if it was wider."""
    path = path or admin_token_path()
    found = read_admin_token(path)
    if found is not None:
        with contextlib.suppress(OSError):  # not ours to fix if we may not: it still works
            if stat.S_IMODE(path.stat().st_mode) & ~MODE:
                path.chmod(MODE)
        return found, path, False
    token = secrets.token_urlsafe(32)
    write_admin_token(path, token)
    return token, path, True


def write_admin_token(path: Path, token: str) -> None:
    """Write `token` to `path` whole or not at all (a temporary file, mode 0600 from its
    creation, renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(token + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise fileaccess.explain(exc, "write", path) from exc
