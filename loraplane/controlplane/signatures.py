"""An upload's signature, checked against its tenant's keys and policy when its canonical
digest is known and before anything is stored (the ingest pipeline's `check_digest`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from sqlalchemy.orm import Session

from loraplane.adapters import signing
from loraplane.controlplane.crud.signing_keys import Policy, policy_for
from loraplane.controlplane.errors import InvalidRequest
from loraplane.controlplane.models import Tenant


@dataclass(frozen=True, slots=True)
class SignatureClaim:
    """What an upload says about its signature: the base64 signature and, optionally, the id
    of the key that made it (without one every live key of the tenant is tried)."""

    signature: str | None = None
    key_id: str | None = None

    @classmethod
    def of(cls, signature: str | None, key_id: str | None) -> SignatureClaim:
        """A claim from request fields (blank is absent); InvalidRequest for a malformed
        key id or an over-long signature."""
        signature = (signature or "").strip() or None
        key_id = (key_id or "").strip() or None
        if signature is not None and len(signature) > signing.MAX_SIGNATURE_CHARS:
            raise InvalidRequest(
                f"signature: must be base64 of at most {signing.MAX_SIGNATURE_CHARS} characters "
                f"(got {len(signature)})"
            )
        if key_id is not None:
            try:
                signing.check_key_id(key_id)
            except ValueError as exc:
                raise InvalidRequest(f"signature_key_id: {exc}") from None
        return cls(signature, key_id)


@dataclass(slots=True)
class SignatureCheck:
    """The check an ingest runs on the canonical digest; `verified` holds the outcome."""

    claim: SignatureClaim
    policy: Policy
    verified: signing.Verified | None = None

    def __call__(self, digest: str) -> None:
        """Raise AdapterRejected (SignatureRequired / SignatureInvalid) or record the signer."""
        self.verified = signing.verify(
            digest,
            self.claim.signature,
            self.claim.key_id,
            self.policy.keys,
            required=self.policy.required,
            policy=self.policy.reason,
        )


def signature_check(
    session: Session, *, tenant: Tenant, base_model: str, claim: SignatureClaim | None
) -> SignatureCheck:
    """The check for one upload: the tenant's and the pools' policy and the tenant's keys."""
    policy = policy_for(session, tenant=tenant, base_model=base_model)
    return SignatureCheck(claim or SignatureClaim(), policy)


class SignerFields(TypedDict):
    """A version row's signer columns."""

    signing_key_id: str | None
    signed_digest: str | None
    signature: str | None


def signed_fields(verified: signing.Verified | None) -> SignerFields:
    """A version row's signer fields for a verified signature (all None: unsigned)."""
    if verified is None:
        return {"signing_key_id": None, "signed_digest": None, "signature": None}
    return {
        "signing_key_id": verified.key_id,
        "signed_digest": verified.signed_digest,
        "signature": verified.signature,
    }
