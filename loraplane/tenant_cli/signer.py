"""Signing for the tenant CLI, without the CLI's plumbing (so `commands.push` can use it
with no import cycle): the local digest, signing with a key file, and the signature fields
`adapters push` sends. Errors are `SignerInputError`s, which the commands report as usage
errors."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


class SignerInputError(ValueError):
    """A key file, signature file or flag combination that cannot be used."""


PASSWORD_ENV = "LORAPLANE_SIGNING_KEY_PASSWORD"  # noqa: S105  (the variable's name)
COSIGN_PASSWORD_ENV = "COSIGN_PASSWORD"  # noqa: S105  (cosign's own, for its cosign.key)


def local_digest(path: Path) -> str:
    """`sha256:<hex>`: the canonical digest of the adapter at `path`, as the control plane
    will compute it (AdapterRejected for an adapter it would refuse anyway)."""
    from loraplane.adapters.canonical import digest_of_source

    return f"sha256:{digest_of_source(path)}"


def sign_with(key_file: Path, digest: str) -> tuple[str, str]:
    """(signature, key id) of `digest` by the private key in `key_file` (PEM, P-256 or
    Ed25519; or cosign's encrypted cosign.key; encrypted ones opened with
    $LORAPLANE_SIGNING_KEY_PASSWORD, else $COSIGN_PASSWORD)."""
    from loraplane.adapters import signing

    try:
        data = key_file.read_bytes()
    except OSError as exc:
        raise SignerInputError(f"cannot read the key file: {exc}") from None
    password = os.environ.get(PASSWORD_ENV) or os.environ.get(COSIGN_PASSWORD_ENV)
    try:
        key = signing.load_private_key(data, password.encode() if password else None)
        return signing.sign_digest(key, digest), signing.public_key_id(key)
    except (signing.KeyFormatError, ValueError) as exc:
        raise SignerInputError(f"{key_file}: {exc}") from None


def push_signature(args: argparse.Namespace, path: Path) -> dict[str, str]:
    """The form fields `adapters push` sends: signed here with --key, or --signature (text or
    @FILE, as `cosign sign-blob --output-signature` writes) with --signature-key-id."""
    fields: dict[str, str] = {}
    if getattr(args, "key", None):
        if args.signature:
            raise SignerInputError("give --key (sign here) or --signature, not both")
        signature, key_id = sign_with(Path(args.key), local_digest(path))
        return {"signature": signature, "signature_key_id": key_id}
    if getattr(args, "signature", None):
        text = args.signature
        if text.startswith("@"):
            try:
                text = Path(text[1:]).read_text(encoding="ascii")
            except (OSError, UnicodeDecodeError) as exc:
                raise SignerInputError(f"cannot read the signature file: {exc}") from None
        fields["signature"] = "".join(text.split())
    if getattr(args, "signature_key_id", None):
        fields["signature_key_id"] = args.signature_key_id
    return fields
