"""Secrets in text that people or logs see: tenant keys and tokens never printed, and what is
wrong with a credential said without echoing it.

`redact(text, secrets)` replaces each secret given (an admin token, a key the caller sent) and
anything shaped like a tenant key (`lp_...`) or an `Authorization: Bearer ...` value by a short
prefix and `…` (`lp_abc…`): enough to tell keys apart, never enough to use one; a URL's
password becomes `***`. Every error path of the CLIs passes its message through it; the
services' logs can too (`env_secrets()`: the tokens the process was given).

`clean_credential(value, source)` trims the whitespace an env file or a paste leaves around a
key or token and refuses one with whitespace or control characters inside, naming `source`
(the flag or variable), never the value. `key_problem(value)` says how a would-be tenant key
differs from the form `lp_` + 43 URL-safe characters.

`install_log_redaction()` puts a `RedactFilter` on the handlers a service logs through (root,
uvicorn's, loraplane's): each record's message, arguments and traceback text masked.
"""

from __future__ import annotations

import logging
import os
import re
import string
from collections.abc import Iterable
from typing import Any

KEY_MARKER = "lp_"
KEY_BODY_LEN = 43  # secrets.token_urlsafe(32)
KEY_LEN = len(KEY_MARKER) + KEY_BODY_LEN
SHOWN = 6  # characters of a secret shown: "lp_abc…"
ELLIPSIS = "…"
_URLSAFE = frozenset(string.ascii_letters + string.digits + "-_")
# A tenant key, or what is left of one: `lp_` and at least 4 key characters.
_KEY_LIKE = re.compile(r"(?<![A-Za-z0-9_\-])lp_[A-Za-z0-9_\-]{4,}")
# The value of a bearer credential, in a header, a repr of one, or a message about one.
_BEARER = re.compile(r"(?i)(bearer\s+)([^\s'\"\\,;<>]+)")
# The password of a URL's user part: postgresql://user:PASSWORD@host/db
_URL_PASSWORD = re.compile(r"(\w+://[^\s:/@]*:)([^\s@/]+)(@)")
_MIN_SECRET = 8  # shorter "secrets" (an empty or test value) are not searched for


class CredentialError(ValueError):
    """A key or token that cannot be sent as it is; the message names where it came from."""


def mask(secret: str) -> str:
    """The shown form of a secret: its first characters and `…`."""
    return secret[:SHOWN] + ELLIPSIS


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with the secrets given, tenant keys and bearer values masked."""
    for secret in sorted({s.strip() for s in secrets if s}, key=len, reverse=True):
        if len(secret) >= _MIN_SECRET:
            text = text.replace(secret, mask(secret))
    text = _BEARER.sub(lambda m: m.group(1) + _masked(m.group(2)), text)
    text = _URL_PASSWORD.sub(lambda m: m.group(1) + "***" + m.group(3), text)
    return _KEY_LIKE.sub(lambda m: _masked(m.group(0)), text)


SECRET_ENV = ("LORAPLANE_ADMIN_TOKEN", "LORAPLANE_SERVICE_TOKEN", "LORAPLANE_API_KEY")


def env_secrets() -> list[str | None]:
    """The keys and tokens this process's environment holds."""
    return [os.environ.get(var) for var in SECRET_ENV]


def _masked(value: str) -> str:
    return value if value.endswith(ELLIPSIS) else mask(value)


def _describe(char: str) -> str:
    if char in " \t":
        return "a space" if char == " " else "a tab"
    if char in "\r\n":
        return "a line break"
    return f"a control character (U+{ord(char):04X})"


def clean_credential(value: str, source: str) -> str:
    """`value` without surrounding whitespace; CredentialError if it is empty or has
    whitespace or control characters inside (the message names `source`, not the value)."""
    cleaned = value.strip()
    if not cleaned:
        raise CredentialError(f"{source} is empty (only whitespace)")
    for char in cleaned:
        if char.isspace() or not char.isprintable():
            raise CredentialError(
                f"{source} has {_describe(char)} inside it: a key or token is one word "
                "(copy it again, without the surrounding text)"
            )
    return cleaned


def key_problem(value: str) -> str | None:
    """How `value` differs from a tenant key's form, without echoing it; None if it has it."""
    if not value.startswith(KEY_MARKER):
        return f"a tenant API key starts with {KEY_MARKER!r}"
    bad = sorted({c for c in value[len(KEY_MARKER) :] if c not in _URLSAFE})
    if bad:
        which = (
            "whitespace or control characters"
            if any(c.isspace() or not c.isprintable() for c in bad)
            else "characters other than A-Z, a-z, 0-9, '-' and '_'"
        )
        return f"it has {which} after {KEY_MARKER!r}"
    if len(value) != KEY_LEN:
        return (
            f"it is {len(value)} characters long; a tenant API key is {KEY_LEN} "
            f"({KEY_MARKER!r} and {KEY_BODY_LEN} more)"
        )
    return None


class RedactFilter(logging.Filter):
    """Masks secrets in each record a handler emits: the message, its arguments (each on its
    own, so formatters that read them, as uvicorn's access log does, still work) and the
    traceback's text."""

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def _clean(self, value: Any) -> Any:
        if isinstance(value, (int, float, bool)) or value is None:
            return value
        text = value if isinstance(value, str) else str(value)
        clean = redact(text, self.secrets)
        return value if clean == text else clean

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg, self.secrets)
        if isinstance(record.args, tuple):
            record.args = tuple(self._clean(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: self._clean(v) for k, v in record.args.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, self.secrets)
        return True


LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "loraplane")


def install_log_redaction(
    secrets: Iterable[str | None] | None = None, loggers: Iterable[str] = LOGGERS
) -> RedactFilter:
    """A RedactFilter (the environment's keys and tokens, unless `secrets`) on every handler
    of `loggers` that has none yet; call it once logging is configured."""
    found = RedactFilter(env_secrets() if secrets is None else secrets)
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactFilter) for f in handler.filters):
                handler.addFilter(found)
    return found
