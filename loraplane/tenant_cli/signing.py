"""The tenant CLI's signing commands: `adapters digest` and `adapters sign` (local, no
server), `signing-keys add|list|revoke` (the tenant's public keys in the control plane), and
what `adapters push --key/--signature` sends (docs/security.md, "Signed adapters").

What is signed is the text `sha256:<canonical digest>` (loraplane/adapters/signing.py):
`adapters digest PATH -o FILE` writes exactly those bytes, so `cosign sign-blob --key
cosign.key FILE` signs the same message `adapters sign --key key.pem PATH` does.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from loraplane.tenant_cli.commands import UsageError, _connect, _emit, _table
from loraplane.tenant_cli.signer import SignerInputError, local_digest, sign_with


def _adapter_path(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    return path


def digest(args: argparse.Namespace) -> int:
    """`adapters digest PATH [-o FILE]`: the message to sign (for cosign sign-blob)."""
    text = local_digest(_adapter_path(args.path))
    if args.output:
        Path(args.output).write_bytes(text.encode("ascii"))  # no newline: the exact message
    note = [f"(written to {args.output}: sign it with `cosign sign-blob --key cosign.key "
            f"{args.output}`)"] if args.output else []  # fmt: skip
    return _emit(args, {"digest": text, "output": args.output}, [text, *note])


def sign(args: argparse.Namespace) -> int:
    """`adapters sign --key KEY PATH`: sign an adapter's digest here; print the signature."""
    if args.digest:
        from loraplane.adapters import signing

        try:
            text = signing.signed_message(args.digest).decode("ascii")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    else:
        if not args.path:
            raise UsageError("give the adapter's PATH or --digest sha256:<hex>")
        text = local_digest(_adapter_path(args.path))
    try:
        signature, key_id = sign_with(Path(args.key), text)
    except SignerInputError as exc:
        raise UsageError(str(exc)) from None
    if args.output:
        Path(args.output).write_text(signature + "\n", encoding="ascii")
    document = {"digest": text, "signature": signature, "key_id": key_id}
    lines = [signature] if not args.output else [f"signature written to {args.output}"]
    return _emit(args, document, [*lines, f"(key id {key_id}, over {text})"])


def add_key(args: argparse.Namespace) -> int:
    """`signing-keys add PUBLIC_KEY_PEM`: register a public key; print its id."""
    try:
        pem = Path(args.public_key).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the public key: {exc}") from None
    with _connect(args, admin=False) as client:
        key: dict[str, Any] = client.json(
            "POST", "/v1/signing-keys", json={"public_key": pem, "name": args.label}
        )
    return _emit(args, key, [f"signing key {key['key_id']} ({key['algorithm']}) registered"])


def list_keys(args: argparse.Namespace) -> int:
    """`signing-keys list`: the tenant's signing keys, revoked ones included."""
    with _connect(args, admin=False) as client:
        keys: list[dict[str, Any]] = client.json("GET", "/v1/signing-keys")
    rows = [
        [
            k["key_id"],
            k["algorithm"],
            k["name"] or "-",
            k["created_at"][:19].replace("T", " "),
            "revoked" if k["revoked_at"] else "live",
        ]
        for k in keys
    ]
    header = ["KEY ID", "ALGORITHM", "NAME", "CREATED", "STATE"]
    return _emit(args, keys, _table(header, rows, "no signing keys"))


def revoke_key(args: argparse.Namespace) -> int:
    """`signing-keys revoke KEY_ID`: signatures by it are refused from now on (confirmed)."""
    from loraplane.tenant_cli import confirm

    confirm.require(args)
    with _connect(args, admin=False) as client:
        keys = {k["key_id"]: k for k in client.json("GET", "/v1/signing-keys")}
        key = keys.get(args.key_id)
        if key is not None and not key["revoked_at"]:
            confirm.ask(
                args,
                f"Revoke signing key {args.key_id}? Uploads signed with it are refused from "
                "now on; it cannot be registered again.",
            )
        client.call("DELETE", f"/v1/signing-keys/{args.key_id}")
    document = {"key_id": args.key_id, "revoked": True}
    return _emit(args, document, [f"revoked: signing key {args.key_id}"])
