"""The tenant CLI's sub-commands on the `loraplane` command line: what each does, its
environment variables, an example, and the exit codes."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from loraplane.sizes import parse_bytes
from loraplane.tenant_cli import admin, confirm, lifecycle, pins, rollouts, signing
from loraplane.tenant_cli import commands as cmd

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not positive")
    return value


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (0, 1, 2, ...)")
    return int(text)


def _size(text: str) -> int:
    try:
        return parse_bytes(text, "the size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size_or_none(text: str) -> int | str:
    """A size, or `none`: no limit (`admin.NO_LIMIT`, sent as null)."""
    if text.strip().lower() == admin.NO_LIMIT:
        return admin.NO_LIMIT
    try:
        return parse_bytes(text, "the size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}, or none for no limit") from None


def _quota_flags(parser: argparse.ArgumentParser, *, creating: bool) -> None:
    """`--weight` and the integer quotas; the control plane checks their ranges."""
    parser.add_argument(
        "--weight",
        type=_weight,
        metavar="W",
        help="share of a busy replica's seats and tokens, relative to other tenants' "
        + ("(default 1; at most 1000)" if creating else "(at most 1000)"),
    )
    for flag, meaning in (
        ("max-adapters", "adapters the tenant may have (at least 1)"),
        ("max-rank", "the highest LoRA rank of its adapters (at least 1)"),
        ("max-bytes", "bytes of one adapter's weights (at least 1)"),
        ("requests-per-minute", "requests per minute, over all replicas (0: unlimited)"),
        ("tokens-per-minute", "tokens per minute, over all replicas (0: unlimited)"),
        ("max-pinned-bytes", "adapter memory its pins may take, size x replicas (0: admin only)"),
    ):
        parser.add_argument(f"--{flag}", type=_count, metavar="N", help=meaning)
    parser.add_argument(
        "--require-signature",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every upload must be signed by one of the tenant's signing keys "
        + ("(default: no)" if creating else ""),
    )
    parser.add_argument(
        "--signing-keys-by-admin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="only the admin registers the tenant's signing keys, so a stolen tenant API key "
        "cannot add one " + ("(default: no)" if creating else ""),
    )


def _version(text: str) -> int:
    number = text.removeprefix("v")
    if not number.isdigit() or int(number) < 1:
        hint = ""
        if text.lower() in ("latest", "newest", "head", "null", "none"):
            hint = (
                "; to serve the newest version and follow pushes: loraplane adapters "
                "follow-latest NAME"
            )
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a version (1, 2, ... or v1, v2, ...){hint}"
        )
    return int(number)


def _key_id(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a key id (1, 2, ...)")
    return int(text)


def _common(admin: bool) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--url", help=f"the control plane (default: ${cmd.URL_ENV})")
    if admin:
        parent.add_argument(
            "--admin-token",
            metavar="TOKEN",
            help=f"admin token (default: ${cmd.ADMIN_ENV}, else .loraplane/admin-token)",
        )
    else:
        parent.add_argument(
            "--api-key", metavar="KEY", help=f"tenant API key (default: ${cmd.KEY_ENV})"
        )
    parent.add_argument("--json", action="store_true", help="print one JSON document")
    return parent


def _add(
    sub: SubParsers,
    name: str,
    handler: Callable[[argparse.Namespace], int],
    *,
    admin: bool,
    summary: str,
    example: str,
) -> argparse.ArgumentParser:
    env = cmd.ADMIN_ENV_HELP if admin else cmd.TENANT_ENV_HELP
    parser = sub.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ".",
        epilog=f"{env}\n\nexample:\n  {example}\n\n{cmd.EXIT_HELP}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_common(admin)],
    )
    parser.set_defaults(func=cmd.command(handler))
    return parser


def add_adapter_commands(adapters: SubParsers) -> None:
    """Register `push`, `list`, `base-models` and `versions` under `loraplane adapters`."""
    push = _add(
        adapters,
        "push",
        cmd.push,
        admin=False,
        summary="validate an adapter here, upload it, and print its version and digest",
        example="loraplane adapters push ./my-adapter --name support-bot --base-model llama-3-8b",
    )
    push.description = (
        "Validate a PEFT LoRA adapter (a folder, or a .tar.gz/.zip) with the same checks as\n"
        "the control plane, upload it with a progress bar (on a terminal), wait for the\n"
        "control plane's background ingest if it uses one, and print the version and digest.\n"
        "Identical content answers the stored version. Shapes, ranks and quotas are checked\n"
        "by the control plane against the pool's base model and the tenant."
    )
    push.add_argument("path", metavar="PATH", help="adapter folder or archive")
    push.add_argument("--name", required=True, help="the adapter's name (what clients call)")
    push.add_argument(
        "--base-model", required=True, metavar="BASE", help="the base model a pool serves"
    )
    push.add_argument(
        "--timeout",
        type=_seconds,
        default=cmd.WAIT_S,
        metavar="S",
        help=f"how long to wait for a background ingest (default {cmd.WAIT_S:g})",
    )
    push.add_argument(
        "--key",
        metavar="KEY.pem",
        help="sign the adapter's digest here with this private key and send the signature",
    )
    push.add_argument(
        "--signature",
        metavar="SIG",
        help="a signature made elsewhere (base64, or @FILE: cosign sign-blob's output)",
    )
    push.add_argument(
        "--signature-key-id", metavar="ID", help="the id of the key that made --signature"
    )
    _add_signing_commands(adapters)
    _add(
        adapters,
        "list",
        cmd.list_adapters,
        admin=False,
        summary="list your adapters and the version each serves",
        example="loraplane adapters list --json",
    )
    _add(
        adapters,
        "base-models",
        cmd.list_base_models,
        admin=False,
        summary="list the base models you can push adapters for, with your limits",
        example="loraplane adapters base-models",
    )
    versions = _add(
        adapters,
        "versions",
        cmd.list_versions,
        admin=False,
        summary="list every version of one of your adapters, oldest first",
        example="loraplane adapters versions support-bot",
    )
    versions.add_argument("name", metavar="NAME", help="the adapter's name")
    _add_lifecycle_commands(adapters)
    _add_rollout_commands(adapters)
    _add_pin_commands(adapters)


def _add_signing_commands(adapters: SubParsers) -> None:
    """`digest` and `sign` under `loraplane adapters` (local: no control plane is called)."""
    digest = _add(
        adapters,
        "digest",
        signing.digest,
        admin=False,
        summary="print an adapter's canonical digest, the message a signature signs",
        example="loraplane adapters digest ./my-adapter -o adapter.digest && "
        "cosign sign-blob --key cosign.key adapter.digest",
    )
    digest.add_argument("path", metavar="PATH", help="adapter folder, weights file or archive")
    digest.add_argument(
        "-o", "--output", metavar="FILE", help="write the message (no newline) to FILE"
    )
    sign = _add(
        adapters,
        "sign",
        signing.sign,
        admin=False,
        summary="sign an adapter's digest with a private key file and print the signature",
        example="loraplane adapters sign --key key.pem ./my-adapter",
    )
    sign.description = (
        "Sign sha256:<canonical digest> of an adapter with a PEM private key (ECDSA P-256 or\n"
        "Ed25519) or cosign's encrypted cosign.key, as cosign sign-blob would, and print\n"
        "the base64 signature and the key id. An encrypted key's password comes from\n"
        "$LORAPLANE_SIGNING_KEY_PASSWORD, else $COSIGN_PASSWORD. Send the signature with\n"
        "`adapters push --signature`, or push with --key to sign and send at once."
    )
    sign.add_argument("path", metavar="PATH", nargs="?", help="adapter folder or archive")
    sign.add_argument("--key", required=True, metavar="KEY.pem", help="the private key file")
    sign.add_argument(
        "--digest", metavar="sha256:HEX", help="sign this digest instead of computing one"
    )
    sign.add_argument("-o", "--output", metavar="FILE", help="write the signature to FILE")


def add_signing_key_commands(sub: SubParsers) -> None:
    """`loraplane signing-keys add|list|revoke`: the caller tenant's public keys."""
    keys = sub.add_parser(
        "signing-keys", help="register, list and revoke your adapter signing keys (tenant)"
    )
    ksub = keys.add_subparsers(dest="signing_keys_command", metavar="ACTION", required=True)
    add = _add(
        ksub,
        "add",
        signing.add_key,
        admin=False,
        summary="register a public key (PEM, P-256 or Ed25519) to sign adapters with",
        example="loraplane signing-keys add cosign.pub --label ci",
    )
    add.add_argument("public_key", metavar="PUBLIC_KEY.pem", help="the public key file")
    add.add_argument("--label", default="", help="a name for people (e.g. ci, alice)")
    _add(
        ksub,
        "list",
        signing.list_keys,
        admin=False,
        summary="list your signing keys (ids, algorithms, states)",
        example="loraplane signing-keys list",
    )
    revoke = _add(
        ksub,
        "revoke",
        signing.revoke_key,
        admin=False,
        summary="revoke a signing key: uploads signed with it are refused from now on",
        example="loraplane signing-keys revoke 3f2a9c0d1e4b5a67 --yes",
    )
    revoke.add_argument("key_id", metavar="KEY_ID", help="from `signing-keys list`")
    _confirmed(revoke)


def _add_pin_commands(adapters: SubParsers) -> None:
    """`pin`, `unpin` and `pins` under `loraplane adapters`."""
    pin = _add(
        adapters,
        "pin",
        pins.pin,
        admin=False,
        summary="keep a version resident on K replicas of a pool (within max_pinned_bytes)",
        example="loraplane adapters pin support-bot 2 --pool pool-a --replicas 2",
    )
    unpin = _add(
        adapters,
        "unpin",
        pins.unpin,
        admin=False,
        summary="stop keeping a version resident (replicas evict it like any other again)",
        example="loraplane adapters unpin support-bot 2 --pool pool-a",
    )
    for parser in (pin, unpin):
        parser.add_argument("name", metavar="NAME", help="the adapter's name")
        parser.add_argument("version", metavar="VERSION", type=_version, help="e.g. 2 or v2")
        parser.add_argument("--pool", required=True, metavar="POOL", help="the pool's name")
        parser.add_argument(
            "--namespace", default="default", metavar="NS", help="the pool's namespace"
        )
    pin.add_argument(
        "--replicas", type=int, default=1, metavar="K", help="replicas to keep it on (default 1)"
    )
    _add(
        adapters,
        "pins",
        pins.list_pins,
        admin=False,
        summary="list your pinned versions: pool, replicas and the bytes each counts",
        example="loraplane adapters pins",
    )


def _add_lifecycle_commands(adapters: SubParsers) -> None:
    """`serve`, `rollback`, `follow-latest` and `delete` under `loraplane adapters`."""
    serve = _add(
        adapters,
        "serve",
        lifecycle.serve,
        admin=False,
        summary="serve one version of an adapter and hold it: later pushes do not change it",
        example="loraplane adapters serve support-bot 2",
    )
    serve.add_argument("name", metavar="NAME", help="the adapter's name")
    serve.add_argument("version", metavar="VERSION", type=_version, help="e.g. 2 or v2")
    rollback = _add(
        adapters,
        "rollback",
        lifecycle.rollback,
        admin=False,
        summary="serve the version before the one served now, and hold it",
        example="loraplane adapters rollback support-bot",
    )
    rollback.add_argument("name", metavar="NAME", help="the adapter's name")
    follow = _add(
        adapters,
        "follow-latest",
        lifecycle.follow_latest,
        admin=False,
        summary="serve an adapter's newest version, and each new version when it is pushed",
        example="loraplane adapters follow-latest support-bot",
    )
    follow.add_argument("name", metavar="NAME", help="the adapter's name")
    delete = _add(
        adapters,
        "delete",
        lifecycle.delete,
        admin=False,
        summary="stop serving an adapter (its versions stay stored; frees a max_adapters place)",
        example="loraplane adapters delete support-bot --yes",
    )
    delete.add_argument("name", metavar="NAME", help="the adapter's name")
    for parser in (serve, rollback, follow, delete):
        _confirmed(parser)


def _add_rollout_commands(adapters: SubParsers) -> None:
    """`rollout set|promote|rollback` under `loraplane adapters`."""
    group = adapters.add_parser(
        "rollout", help="split an adapter's requests across versions by weight (a canary)"
    )
    sub = group.add_subparsers(dest="rollout_command", metavar="ACTION", required=True)
    split = _add(
        sub,
        "set",
        rollouts.set_split,
        admin=False,
        summary="split the adapter's requests across versions by weight (summing to 100)",
        example="loraplane adapters rollout set support-bot 2=90 3=10",
    )
    split.add_argument("name", metavar="NAME", help="the adapter's name")
    split.add_argument(
        "weights", metavar="VERSION=WEIGHT", nargs="+", type=rollouts.weight_pair,
        help="e.g. 2=90 3=10 (at most 4 versions; one at 100 promotes it)",
    )  # fmt: skip
    promote = _add(
        sub,
        "promote",
        rollouts.promote,
        admin=False,
        summary="end the rollout by serving one of its versions alone (held)",
        example="loraplane adapters rollout promote support-bot 3",
    )
    promote.add_argument("name", metavar="NAME", help="the adapter's name")
    promote.add_argument(
        "version", metavar="VERSION", type=_version, nargs="?",
        help="a version of the split (default: its one version besides the current)",
    )  # fmt: skip
    back = _add(
        sub,
        "rollback",
        rollouts.rollback,
        admin=False,
        summary="end the rollout: the version served before it serves alone again",
        example="loraplane adapters rollout rollback support-bot",
    )
    back.add_argument("name", metavar="NAME", help="the adapter's name")
    for parser in (split, promote, back):
        _confirmed(parser)


CONFIRM_HELP = """\
confirmation:
  on a terminal the command shows the change and asks [y/N]; --yes confirms without asking.
  With stdin not a terminal (a script, a pipe) and no --yes it changes nothing and exits 1
  (ConfirmationRequired)."""


def add_commands(sub: SubParsers) -> None:
    """Register the admin commands `keys` and `tenants`, and the tenant's `signing-keys`, on
    the `loraplane` command."""
    add_signing_key_commands(sub)
    keys = sub.add_parser("keys", help="create, list and revoke tenants' API keys (admin)")
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    create = _add(
        ksub,
        "create",
        cmd.create_key,
        admin=True,
        summary="create an API key for a tenant; the key is printed once",
        example="loraplane keys create --tenant acme --label ci",
    )
    create.add_argument("--label", default="", help="a name for people (e.g. ci, alice)")
    _add(
        ksub,
        "list",
        cmd.list_keys,
        admin=True,
        summary="list a tenant's keys (ids, prefixes, dates; never the keys)",
        example="loraplane keys list --tenant acme",
    )
    revoke = _add(
        ksub,
        "revoke",
        cmd.revoke_key,
        admin=True,
        summary="revoke a tenant's key: it stops working at once",
        example="loraplane keys revoke --tenant acme 3",
    )
    revoke.add_argument("key_id", metavar="KEY_ID", type=_key_id, help="from `keys list`")
    _confirmed(revoke)
    for parser in ksub.choices.values():
        parser.add_argument("--tenant", required=True, help="the tenant whose keys these are")

    tenants = sub.add_parser("tenants", help="create, update, list and delete tenants (admin)")
    tsub = tenants.add_subparsers(dest="tenants_command", metavar="ACTION", required=True)
    new = _add(
        tsub,
        "create",
        cmd.create_tenant,
        admin=True,
        summary="create a tenant; quotas not given take their defaults",
        example="loraplane tenants create acme --weight 2",
    )
    new.add_argument("name", metavar="NAME", help="a DNS label: a-z, 0-9 and '-'")
    _quota_flags(new, creating=True)
    update = _add(
        tsub,
        "update",
        cmd.update_tenant,
        admin=True,
        summary="change a tenant's weight or quotas; the others keep their value",
        example="loraplane tenants update acme --weight 2",
    )
    update.add_argument("name", metavar="NAME", help="the tenant")
    _quota_flags(update, creating=False)
    _add(
        tsub,
        "list",
        cmd.list_tenants,
        admin=True,
        summary="list the tenants and their quotas",
        example="loraplane tenants list --json",
    )
    gone = _add(
        tsub,
        "delete",
        admin.delete_tenant,
        admin=True,
        summary="delete a tenant: its keys are revoked and its adapters stop serving, for good",
        example="loraplane tenants delete acme",
    )
    gone.add_argument("name", metavar="NAME", help="the tenant")
    _confirmed(gone)
    _add_pool_commands(sub)


def _confirmed(parser: argparse.ArgumentParser) -> None:
    confirm.add_flag(parser)
    parser.epilog = f"{CONFIRM_HELP}\n\n{parser.epilog}"


def _pool_flags(parser: argparse.ArgumentParser, *, creating: bool) -> None:
    for flag, meaning in (
        ("max-lora-rank", "the highest LoRA rank its replicas load (default 64)"),
        ("max-loras", "adapters in one batch on a replica (default 8)"),
        ("max-cpu-loras", "adapters a replica keeps in CPU memory (default 32)"),
    ):
        parser.add_argument(f"--{flag}", type=_count, metavar="N", help=meaning)
    parser.add_argument(
        "--max-cpu-lora-bytes",
        type=_size_or_none,
        metavar="SIZE|none",
        help="host memory a replica's adapters in CPU memory may take: 8GiB, 512MiB or bytes; "
        + ("none: no byte limit (the default)" if creating else "none clears it (no byte limit)"),
    )
    parser.add_argument(
        "--require-signed-adapters",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="uploads for the pool's base model must be signed by a key of their tenant",
    )


def _add_pool_commands(sub: SubParsers) -> None:
    """`loraplane pools list|show|create|update|delete` (admin)."""
    pools = sub.add_parser("pools", help="list, show, create, update and delete pools (admin)")
    psub = pools.add_subparsers(dest="pools_command", metavar="ACTION", required=True)
    _add(
        psub,
        "list",
        admin.list_pools,
        admin=True,
        summary="list the serving pools: base model, limits, replicas that reported",
        example="loraplane pools list",
    )
    _add(
        psub,
        "show",
        admin.show_pool,
        admin=True,
        summary="show one pool, with its replicas' last pressure reports",
        example="loraplane pools show pool-a",
    )
    create = _add(
        psub,
        "create",
        admin.create_pool,
        admin=True,
        summary="register a pool: the base model it serves and its LoRA limits",
        example="loraplane pools create pool-a --base-model llama-3-8b "
        "--base-model-uri /models/llama-3-8b",
    )
    create.add_argument(
        "--base-model", required=True, metavar="NAME", help="the base model's served name"
    )
    create.add_argument(
        "--base-model-uri",
        required=True,
        metavar="URI",
        help="where its config.json is (an absolute path or s3://...): uploads are checked "
        "against its shapes",
    )
    create.add_argument(
        "--config-from-replicas",
        action="store_true",
        help="the model is only on the replicas' volume: take config.json from their first "
        "report (uploads wait until then)",
    )
    _pool_flags(create, creating=True)
    update = _add(
        psub,
        "update",
        admin.update_pool,
        admin=True,
        summary="change a pool's LoRA limits; the others keep their value",
        example="loraplane pools update pool-a --max-loras 16",
    )
    _pool_flags(update, creating=False)
    delete = _add(
        psub,
        "delete",
        admin.delete_pool,
        admin=True,
        summary="forget a pool (stored adapters are kept)",
        example="loraplane pools delete pool-a",
    )
    _confirmed(delete)
    for parser in psub.choices.values():
        if parser is not psub.choices["list"]:
            parser.add_argument("name", metavar="NAME", help="the pool's name")
            parser.add_argument(
                "--namespace",
                default="default",
                metavar="NS",
                help="the pool's namespace (its ServingPool's; default: default)",
            )
