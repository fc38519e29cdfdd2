"""The tenant CLI's commands: `adapters push|list|versions`, `keys create|list|revoke`,
`tenants create|update|list` (`lifecycle`: what an adapter serves and deleting it; `admin`:
`tenants delete`, `pools`).

Each command prints for people, or with `--json` one JSON document on stdout and nothing else
there; errors are `{"error": {"code", "message"}}` in that mode. Exit codes follow
`adapters validate`: 0 done, 1 refused, 2 usage error or no answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplane.exit_codes import EXIT_OK, EXIT_REJECTED, EXIT_USAGE
from loraplane.sizes import format_bytes
from loraplane.tenant_cli.progress import Progress

if TYPE_CHECKING:
    from loraplane.tenant_cli.client import RestClient

URL_ENV, KEY_ENV, ADMIN_ENV = "LORAPLANE_URL", "LORAPLANE_API_KEY", "LORAPLANE_ADMIN_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8080"
WAIT_S = 3600.0

EXIT_HELP = """\
Exit 0: done.
Exit 1: refused: the control plane refused the request, or (push) the adapter is invalid
        (checked here, nothing sent), or the key or token has whitespace inside
        (InvalidCredential), or a change was not confirmed (ConfirmationRequired, Cancelled);
        prints '<Code>: <message>' (e.g. 'Unauthorized: invalid or revoked API key',
        'rejected: RankTooLarge: ...'). Do not retry: fix the input.
Exit 2: usage error, or the control plane could not be reached or could not answer (retry).
Keys and tokens are never printed (at most 'lp_abc…'); spaces and line breaks around them
(an env file, a paste) are ignored.
With --json, stdout holds one JSON document: the answer, or {"error": {"code", "message"}}."""

TENANT_ENV_HELP = f"""\
environment:
  {URL_ENV}      the control plane (default {DEFAULT_URL}); or --url
  {KEY_ENV}  a tenant API key (lp_...); or --api-key (the variable keeps it out of
                     the process list)"""

ADMIN_ENV_HELP = f"""\
environment:
  {URL_ENV}          the control plane (default {DEFAULT_URL}); or --url
  {ADMIN_ENV}  the control plane's admin token; or --admin-token; with neither,
                         read from .loraplane/admin-token (in $LORAPLANE_DATA_DIR when set),
                         which the embedded control plane and `loraplane demo` write"""


class UsageError(Exception):
    """The command line cannot work (a missing credential, a path that does not exist)."""


# -- plumbing -------------------------------------------------------------------------------------


def _credential(flag: str | None, flag_name: str, var: str) -> str | None:
    """The credential from the flag, else the variable: trimmed; CredentialError (naming
    where it came from) if whitespace or control characters are inside it."""
    from loraplane.redact import clean_credential

    if flag is not None:
        return clean_credential(flag, flag_name)
    value = os.environ.get(var)
    return clean_credential(value, var) if value else None


def _admin_token(flag: str | None) -> str:
    """--admin-token, else the variable, else the file the embedded control plane and the
    demo write (`.loraplane/admin-token`, or in $LORAPLANE_DATA_DIR); UsageError if none."""
    from loraplane import tokenfile

    token = _credential(flag, "--admin-token", ADMIN_ENV)
    if token:
        return token
    path = tokenfile.admin_token_path()
    try:
        token = tokenfile.read_admin_token(path)
    except OSError as e:
        raise UsageError(f"no admin token: {ADMIN_ENV} is not set and {e}") from e
    if not token:
        raise UsageError(
            f"no admin token: set {ADMIN_ENV}, pass --admin-token, or run where {path} is"
            " (the embedded control plane and `loraplane demo` write it)"
        )
    return token


def _connect(args: argparse.Namespace, *, admin: bool) -> RestClient:
    from loraplane.tenant_cli.client import RestClient

    url = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    if admin:
        return RestClient(url, _admin_token(args.admin_token))
    token = _credential(args.api_key, "--api-key", KEY_ENV)
    if not token:
        raise UsageError(f"no API key: set {KEY_ENV} or pass --api-key")
    return RestClient(url, token)


def _secrets(args: argparse.Namespace) -> list[str | None]:
    """Every credential this command may have sent: never printed."""
    return [
        getattr(args, "api_key", None),
        getattr(args, "admin_token", None),
        os.environ.get(KEY_ENV),
        os.environ.get(ADMIN_ENV),
    ]


def _emit(args: argparse.Namespace, document: Any, lines: Sequence[str]) -> int:
    """Print the answer: the JSON document with --json, else the lines."""
    if args.json:
        print(json.dumps(document))
    else:
        for line in lines:
            print(line)
    return EXIT_OK


def _fail(args: argparse.Namespace, code: str, message: str, exit_code: int, word: str) -> int:
    from loraplane.redact import redact

    message = redact(message, _secrets(args))  # a key or token never reaches the output
    if args.json:
        print(json.dumps({"error": {"code": code, "message": message}}))
    else:
        print(f"{word}: {code}: {message}", file=sys.stderr)
    return exit_code


def command(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run a handler; turn every failure into its message and exit code."""

    def run(args: argparse.Namespace) -> int:
        from loraplane.adapters.errors import AdapterRejected, ReasonCode
        from loraplane.redact import CredentialError
        from loraplane.tenant_cli.confirm import NotConfirmed

        try:
            from loraplane.tenant_cli.client import ApiError
        except ImportError as exc:
            message = f"the tenant CLI needs httpx ({exc}): pip install 'loraplane[client]'"
            return _fail(args, "MissingDependency", message, EXIT_USAGE, "error")
        try:
            return handler(args)
        except UsageError as exc:
            return _fail(args, "InvalidUsage", str(exc), EXIT_USAGE, "error")
        except CredentialError as exc:  # not a retry: the key or token must be fixed
            return _fail(args, "InvalidCredential", str(exc), EXIT_REJECTED, "error")
        except NotConfirmed as exc:  # nothing was changed
            return _fail(args, exc.code, exc.message, EXIT_REJECTED, "error")
        except AdapterRejected as exc:
            return _fail(args, exc.code.value, exc.message, EXIT_REJECTED, "rejected")
        except ApiError as exc:
            code = EXIT_REJECTED if exc.refused else EXIT_USAGE
            verdict = exc.code in {c.value for c in ReasonCode}  # the server's check of the adapter
            return _fail(args, exc.code, exc.message, code, "rejected" if verdict else "error")
        except Exception as exc:  # a bug here or in a library: its words, never a secret
            message = f"{type(exc).__name__}: {exc}"
            return _fail(args, "InternalError", message, EXIT_USAGE, "error")

    return run


def _table(header: Sequence[str], rows: list[list[str]], empty: str) -> list[str]:
    if not rows:
        return [empty]
    widths = [max(len(r[i]) for r in [list(header), *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [list(header), *rows]
    ]


def _v(version: object) -> str:
    return "-" if version is None else f"v{version}"


# -- adapters -------------------------------------------------------------------------------------


def push(args: argparse.Namespace) -> int:
    """`adapters push`: validate here, upload, wait for a background ingest, print the version."""
    from loraplane.adapters.limits import AdapterLimits
    from loraplane.adapters.source import open_adapter_source
    from loraplane.adapters.validate import validate_adapter

    path = Path(args.path)
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    limits = AdapterLimits()
    from loraplane.tenant_cli.signer import SignerInputError, push_signature

    try:  # signed here with --key, or --signature as given
        signature = push_signature(args, path)
    except SignerInputError as exc:
        raise UsageError(str(exc)) from None
    with _connect(args, admin=False) as client, open_adapter_source(path, limits) as files:
        # The same checks as the control plane's, short of the pool's base model and the
        # tenant's quotas: a bad adapter is refused here, before a byte is sent.
        validate_adapter(files, None, limits).close()
        parts = [files.config_path, files.weights_path]  # the rest (files.ignored) stays here
        ignored = list(files.ignored)
        progress = Progress(f"{args.name}:", sum(p.stat().st_size for p in parts))
        try:
            status, body = client.upload(
                args.name, args.base_model, parts, progress.advance, fields=signature
            )
            if status == 202 and body.get("state") == "staged":
                return _staged(args, body)
            if status == 202:
                progress.status("sent; the control plane is ingesting it in the background")
                body = client.wait_job(
                    str(body["id"]),
                    timeout_s=args.timeout,
                    on_status=lambda job: progress.status(f"sent; ingest {job['status']}"),
                )
        finally:
            progress.close()
    version = body["version"]
    outcome = "new version" if body["created"] else "identical content: the stored version"
    body = {**body, "ignored": ignored}
    return _emit(
        args,
        body,
        [
            f"pushed: {body['name']} v{version['version']} ({outcome})",
            *([f"  ignored     {', '.join(ignored)} (not sent)"] if ignored else []),
            f"  digest      sha256:{version['digest']}",
            *(
                [f"  signed by   key {version['signing_key_id']}"]
                if version.get("signing_key_id")
                else []
            ),
            f"  rank        {version['rank']} (alpha {version['alpha']:g})",
            f"  modules     {', '.join(version['target_modules'])}",
            f"  size        {format_bytes(version['size_bytes'])}",
            f"  base model  {version['base_model']}",
            f"  serving     {_v(body['current_version'])}{_held_note(body)}",
        ],
    )


def _held_note(body: dict[str, Any]) -> str:
    """A new version that does not serve: the adapter is held at another one (`serve`)."""
    new, current, name = body["version"]["version"], body["current_version"], body["name"]
    if not body["created"] or current is None or current >= new:
        return ""
    return (
        f" (held: v{new} is stored, not served; serve it with `loraplane adapters serve "
        f"{name} {new}` or `loraplane adapters follow-latest {name}`)"
    )


def _staged(args: argparse.Namespace, body: dict[str, Any]) -> int:
    """Cluster mode: the operator ingests the staged upload; versions shows the outcome."""
    return _emit(
        args,
        body,
        [
            f"staged: {body['name']} as LoRAAdapter {body['resource']}; the operator validates "
            f"and stores it (see: loraplane adapters versions {body['name']})"
        ],
    )


def list_adapters(args: argparse.Namespace) -> int:
    """`adapters list`: the caller's adapters and the versions they serve."""
    with _connect(args, admin=False) as client:
        adapters = client.list_adapters()
    rows = [
        [
            a["name"],
            _v(a["current_version"]),
            _v(a["latest_version"]),
            str(a["current"]["rank"]) if a["current"] else "-",
            a["base_model"],
            f"sha256:{a['current']['digest'][:12]}" if a["current"] else "-",
            _split(a.get("rollout")) or _mode(a.get("follow_latest")),
        ]
        for a in adapters
    ]
    header = ["NAME", "SERVING", "LATEST", "RANK", "BASE MODEL", "DIGEST", "MODE"]
    return _emit(args, adapters, _table(header, rows, "no adapters"))


def _split(rollout: object) -> str:
    """A running rollout as one word, `rollout:v2=90,v3=10` ("" for none)."""
    if not isinstance(rollout, list) or not rollout:
        return ""
    return "rollout:" + ",".join(f"v{v['version']}={v['weight']}" for v in rollout)


def _mode(follow_latest: object) -> str:
    """follow-latest: each push serves its new version; held: a chosen version keeps serving
    ("-": a control plane from before follow_latest)."""
    if follow_latest is None:
        return "-"
    return "follow-latest" if follow_latest else "held"


def list_base_models(args: argparse.Namespace) -> int:
    """`adapters base-models`: the base models the caller may push for, with its limits."""
    with _connect(args, admin=False) as client:
        offers = client.list_base_models()
    rows = [
        [
            o["name"],
            "yes" if o["ready"] else "pending",
            o["model_type"] or "-",
            str(o["max_lora_rank"]) if o["max_lora_rank"] is not None else "-",
            format_bytes(o["max_adapter_bytes"]) if o["max_adapter_bytes"] is not None else "-",
        ]
        for o in offers
    ]
    header = ["BASE MODEL", "READY", "TYPE", "MAX RANK", "MAX SIZE"]
    return _emit(args, offers, _table(header, rows, "no base models: no pool serves any yet"))


def list_versions(args: argparse.Namespace) -> int:
    """`adapters versions NAME`: every version of one adapter, and which one serves."""
    with _connect(args, admin=False) as client:
        versions = client.list_versions(args.name)
        serving = client.get_adapter(args.name)["current_version"] if versions else None
    rows = [
        [
            _v(v["version"]),
            "yes" if v["version"] == serving else "-",
            f"sha256:{v['digest'][:12]}",
            str(v["rank"]),
            f"{v['alpha']:g}",
            format_bytes(v["size_bytes"]),
            v["created_at"][:19].replace("T", " "),
            v["created_by"],
            v.get("signing_key_id") or "-",
        ]
        for v in versions
    ]
    header = ["VERSION", "SERVING", "DIGEST", "RANK", "ALPHA", "SIZE", "CREATED", "BY", "SIGNED BY"]
    return _emit(args, versions, _table(header, rows, f"{args.name} has no versions"))


# -- admin: keys and tenants ----------------------------------------------------------------------


def create_key(args: argparse.Namespace) -> int:
    """`keys create`: a new key for a tenant, printed once."""
    with _connect(args, admin=True) as client:
        key = client.create_key(args.tenant, args.label)
    return _emit(
        args,
        key,
        [
            key["key"],
            f"(key {key['id']} of {args.tenant}, prefix {key['prefix']}: shown this once, "
            "store it now)",
        ],
    )


def list_keys(args: argparse.Namespace) -> int:
    """`keys list`: a tenant's keys, never the secrets."""
    with _connect(args, admin=True) as client:
        keys = client.list_keys(args.tenant)
    rows = [
        [
            str(k["id"]),
            k["name"] or "-",
            k["prefix"],
            k["created_at"][:19].replace("T", " "),
            (k["last_used_at"] or "-")[:19].replace("T", " "),
            "revoked" if k["revoked_at"] else "live",
        ]
        for k in keys
    ]
    header = ["ID", "NAME", "PREFIX", "CREATED", "LAST USED", "STATE"]
    return _emit(args, keys, _table(header, rows, f"{args.tenant} has no keys"))


def revoke_key(args: argparse.Namespace) -> int:
    """`keys revoke KEY_ID`: the key stops working at once (confirmed first)."""
    from loraplane.tenant_cli import confirm

    confirm.require(args)
    with _connect(args, admin=True) as client:
        keys = {k["id"]: k for k in client.list_keys(args.tenant)}
        key = keys.get(args.key_id)
        if key is not None and not key["revoked_at"]:  # else nothing changes: nothing to ask
            label = f"{key['name']}, " if key["name"] else ""
            confirm.ask(
                args,
                f"Revoke key {args.key_id} ({label}{key['prefix']}…) of {args.tenant}? "
                "Requests with it fail at once; this cannot be undone.",
            )
        client.revoke_key(args.tenant, args.key_id)
    document = {"tenant": args.tenant, "id": args.key_id, "revoked": True}
    return _emit(args, document, [f"revoked: key {args.key_id} of {args.tenant}"])


# The quota flags of `tenants create` and `tenants update`: the API's field names.
QUOTA_FIELDS = (
    "weight", "max_adapters", "max_rank", "max_bytes", "requests_per_minute", "tokens_per_minute",
    "require_signature", "signing_keys_by_admin", "max_pinned_bytes",
)  # fmt: skip


def _quotas(args: argparse.Namespace) -> dict[str, Any]:
    """The quota flags given on the command line, by API field name."""
    return {f: getattr(args, f) for f in QUOTA_FIELDS if getattr(args, f, None) is not None}


RATE_FIELDS = ("requests_per_minute", "tokens_per_minute")  # 0: unlimited


def _quota_value(field: str, value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return "0 (unlimited)" if field in RATE_FIELDS and value == 0 else str(value)


def _quota_lines(tenant: dict[str, Any]) -> list[str]:
    return [
        f"  {field:<20}  {_quota_value(field, value)}"
        for field in QUOTA_FIELDS
        if (value := tenant.get(field)) is not None
    ]


def create_tenant(args: argparse.Namespace) -> int:
    """`tenants create NAME`: a tenant with the quotas given, defaults for the others."""
    with _connect(args, admin=True) as client:
        tenant = client.create_tenant(args.name, _quotas(args))
    return _emit(args, tenant, [f"created: tenant {tenant['name']}", *_quota_lines(tenant)])


def update_tenant(args: argparse.Namespace) -> int:
    """`tenants update NAME`: change the quotas given; the others keep their value."""
    quotas = _quotas(args)
    if not quotas:
        flags = ", ".join("--" + f.replace("_", "-") for f in QUOTA_FIELDS)
        raise UsageError(f"nothing to change: pass at least one of {flags}")
    with _connect(args, admin=True) as client:
        tenant = client.update_tenant(args.name, quotas)
    return _emit(args, tenant, [f"updated: tenant {tenant['name']}", *_quota_lines(tenant)])


def list_tenants(args: argparse.Namespace) -> int:
    """`tenants list`: every tenant and its quotas."""
    with _connect(args, admin=True) as client:
        tenants = client.list_tenants()
    rows = [
        [
            t["name"],
            f"{t['weight']:g}" if "weight" in t else "-",  # "-": a control plane without weights
            str(t["max_adapters"]),
            str(t["max_rank"]),
            format_bytes(t["max_bytes"]),
        ]
        for t in tenants
    ]
    header = ["NAME", "WEIGHT", "MAX ADAPTERS", "MAX RANK", "MAX BYTES"]
    return _emit(args, tenants, _table(header, rows, "no tenants"))
