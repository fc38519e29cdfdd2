"""The tenant CLI's signed adapters against a real control plane over HTTP: `signing-keys
add|list|revoke`, `adapters digest` (the blob cosign sign-blob signs), `adapters sign`, and
`adapters push --key` / `--signature`; a tenant that requires signatures refuses the rest."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from loraplane.adapters import signing
from tests.test_tenant_cli import BASE_NAME, cli, controlplane, env, local_digest, new_tenant

__all__ = ["controlplane", "env"]  # fixtures this module uses


def key_files(tmp: Path, key: signing.PrivateKey, stem: str) -> tuple[Path, Path]:
    private = tmp / f"{stem}.pem"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public = tmp / f"{stem}.pub"
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def test_sign_push_list_and_revoke_with_a_tenant_that_requires_signatures(
    env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    peft_adapters: dict[str, Path],
    tmp_path: Path,
) -> None:
    env.setenv("LORAPLANE_API_KEY", new_tenant(capsys, "signer"))
    assert cli(capsys, "tenants", "update", "signer", "--require-signature").code == 0
    p256, p256_pub = key_files(tmp_path, ec.generate_private_key(ec.SECP256R1()), "p256")
    ed, ed_pub = key_files(tmp_path, ed25519.Ed25519PrivateKey.generate(), "ed")
    added = cli(capsys, "signing-keys", "add", str(p256_pub), "--label", "ci", "--json")
    assert added.code == 0, added.err
    p256_id = added.json()["key_id"]
    assert cli(capsys, "signing-keys", "add", str(ed_pub)).code == 0
    src, push = peft_adapters["r16"], ("adapters", "push", "--base-model", BASE_NAME)

    unsigned = cli(capsys, *push, str(src), "--name", "bot")
    assert unsigned.code == 1
    assert unsigned.err.startswith("rejected: SignatureRequired: tenant 'signer' requires")

    # cosign's way: the digest file, signed as sign-blob signs with a P-256 key
    blob = tmp_path / "adapter.digest"
    assert cli(capsys, "adapters", "digest", str(src), "-o", str(blob)).code == 0
    assert blob.read_bytes() == f"sha256:{local_digest(src)}".encode()
    key = serialization.load_pem_private_key(p256.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    sig_file = tmp_path / "adapter.sig"
    sig_file.write_text(
        base64.b64encode(key.sign(blob.read_bytes(), ec.ECDSA(hashes.SHA256()))).decode() + "\n"
    )
    pushed = cli(capsys, *push, str(src), "--name", "bot", "--signature", f"@{sig_file}")
    assert pushed.code == 0, pushed.err
    assert f"  signed by   key {p256_id}\n" in pushed.out

    signed = cli(capsys, "adapters", "sign", "--key", str(ed), str(peft_adapters["r4"]), "--json")
    assert signed.code == 0, signed.err
    doc = signed.json()
    assert doc["digest"] == f"sha256:{local_digest(peft_adapters['r4'])}"
    pushed = cli(capsys, *push, str(peft_adapters["r4"]), "--name", "bot", "--json",
                 "--signature", doc["signature"], "--signature-key-id", doc["key_id"])  # fmt: skip
    assert pushed.code == 0, pushed.err
    assert pushed.json()["version"]["signing_key_id"] == doc["key_id"]

    table = cli(capsys, "adapters", "versions", "bot").out.splitlines()
    assert table[0].split()[-2:] == ["SIGNED", "BY"]
    assert table[1].split()[-1] == p256_id and table[2].split()[-1] == doc["key_id"]

    listed = cli(capsys, "signing-keys", "list", "--json").json()
    assert {k["key_id"] for k in listed} == {p256_id, doc["key_id"]}
    assert cli(capsys, "signing-keys", "revoke", p256_id, "--yes").code == 0
    refused = cli(capsys, *push, str(peft_adapters["r4"]), "--name", "other", "--key", str(p256))
    assert refused.code == 1
    assert refused.err.startswith(
        f"rejected: SignatureInvalid: the signature is by key id {p256_id}, which was revoked"
    )
    auto = cli(capsys, *push, str(peft_adapters["r4"]), "--name", "other", "--key", str(ed))
    assert auto.code == 0, auto.err


def test_signing_usage_errors_exit_2(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    not_a_key = tmp_path / "k.pem"
    not_a_key.write_text("hello")
    run = cli(capsys, "adapters", "sign", "--key", str(not_a_key), "--digest", "ab" * 32)
    assert run.code == 2 and "not a PEM private key" in run.err
    run = cli(capsys, "adapters", "sign", "--key", str(not_a_key), "--digest", "nope")
    assert run.code == 2 and "not a sha256 digest" in run.err
    assert cli(capsys, "adapters", "sign", "--key", str(not_a_key)).code == 2


@pytest.mark.parametrize(
    "command",
    [["adapters", "sign"], ["adapters", "digest"], ["signing-keys", "add"],
     ["signing-keys", "list"], ["signing-keys", "revoke"]],
    ids=lambda c: "-".join(c),
)  # fmt: skip
def test_signing_command_help_says_what_it_does_an_example_and_exit_codes(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    run = cli(capsys, *command, "--help")
    assert run.code == 0
    for text in ("LORAPLANE_API_KEY", f"example:\n  loraplane {' '.join(command)}",
                 "Exit 0: done", "Exit 2: usage error"):  # fmt: skip
        assert text in run.out, text


def test_the_admin_sets_a_pools_signature_policy(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = cli(capsys, "pools", "update", "pool-a", "--require-signed-adapters", "--json")
    assert run.code == 0, run.err
    assert run.json()["require_signed_adapters"] is True
    shown = cli(capsys, "pools", "show", "pool-a").out
    assert "require_signed_adapters  True" in shown
    run = cli(capsys, "pools", "update", "pool-a", "--no-require-signed-adapters", "--json")
    assert run.json()["require_signed_adapters"] is False


def test_adapters_sign_reads_cosigns_encrypted_key_with_its_password(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tests.adapters.test_cosign_key import cosign_key_file

    key = ec.generate_private_key(ec.SECP256R1())
    cosign = tmp_path / "cosign.key"
    cosign.write_bytes(cosign_key_file(key, b"hunter2", "ENCRYPTED SIGSTORE PRIVATE KEY"))
    digest = "sha256:" + "cd" * 32
    sign = ("adapters", "sign", "--key", str(cosign), "--digest", digest, "--json")
    env.delenv("LORAPLANE_SIGNING_KEY_PASSWORD", raising=False)
    env.delenv("COSIGN_PASSWORD", raising=False)
    run = cli(capsys, *sign)
    assert run.code == 2 and "COSIGN_PASSWORD" in run.json()["error"]["message"]
    env.setenv("COSIGN_PASSWORD", "wrong")
    run = cli(capsys, *sign)
    assert run.code == 2 and "wrong password" in run.json()["error"]["message"]
    env.setenv("COSIGN_PASSWORD", "hunter2")
    run = cli(capsys, *sign)
    assert run.code == 0, run.err
    doc = run.json()
    key.public_key().verify(
        base64.b64decode(doc["signature"]), digest.encode(), ec.ECDSA(hashes.SHA256())
    )
    assert doc["key_id"] == signing.public_key_id(key)


def test_the_admin_keeps_a_tenants_key_registration_with_signing_keys_by_admin(
    env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env.setenv("LORAPLANE_API_KEY", new_tenant(capsys, "locked"))
    run = cli(capsys, "tenants", "update", "locked", "--signing-keys-by-admin", "--json")
    assert run.code == 0, run.err
    assert run.json()["signing_keys_by_admin"] is True
    _, public = key_files(tmp_path, ed25519.Ed25519PrivateKey.generate(), "ed")
    refused = cli(capsys, "signing-keys", "add", str(public))
    assert refused.code == 1
    assert refused.err.startswith("error: SigningKeysByAdmin: signing keys of tenant 'locked'")
    assert cli(capsys, "signing-keys", "list", "--json").json() == []
    assert cli(capsys, "tenants", "update", "locked", "--no-signing-keys-by-admin").code == 0
    assert cli(capsys, "signing-keys", "add", str(public)).code == 0
