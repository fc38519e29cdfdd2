"""Reason codes and the one exception the adapter core raises for a bad adapter.

Every rejection carries a machine-readable code (used verbatim in HTTP errors and in a
LoRAAdapter's status) and a message for humans that names the field or tensor and the numbers.
"""

from __future__ import annotations

from enum import StrEnum


class ReasonCode(StrEnum):
    """Why an adapter was rejected (docs/architecture.md, "Reason codes")."""

    INVALID_CONFIG = "InvalidConfig"
    UNSUPPORTED_FORMAT = "UnsupportedFormat"
    RANK_TOO_LARGE = "RankTooLarge"
    BIAS_NOT_SUPPORTED = "BiasNotSupported"
    DORA_NOT_SUPPORTED = "DoRANotSupported"
    UNSUPPORTED_TARGET_MODULE = "UnsupportedTargetModule"
    SHAPE_MISMATCH = "ShapeMismatch"
    BASE_MODEL_MISMATCH = "BaseModelMismatch"
    INVALID_SAFETENSORS = "InvalidSafetensors"
    NON_FINITE_WEIGHTS = "NonFiniteWeights"
    TOO_LARGE = "TooLarge"
    MODULES_TO_SAVE_NOT_SUPPORTED = "ModulesToSaveNotSupported"
    UNSAFE_ARCHIVE = "UnsafeArchive"
    # signature policy (adapters/signing.py), not the adapter's content
    SIGNATURE_REQUIRED = "SignatureRequired"
    SIGNATURE_INVALID = "SignatureInvalid"


# the codes a policy gives rather than the files (no bad-adapter corpus entry can show them)
SIGNATURE_CODES = frozenset({ReasonCode.SIGNATURE_REQUIRED, ReasonCode.SIGNATURE_INVALID})


# What each code means, for the people who upload adapters (the tenant console shows these
# beside the message; a test checks that every code has one).
EXPLANATIONS: dict[ReasonCode, str] = {
    ReasonCode.INVALID_CONFIG: "adapter_config.json is missing, is not a JSON object, or has a "
    "field whose value cannot be used (the message names the field).",
    ReasonCode.UNSUPPORTED_FORMAT: "This is not a PEFT LoRA adapter that can be served: pickle "
    "weights (.bin, .pt), another PEFT method than LoRA, or an option that changes how the "
    "adapter computes.",
    ReasonCode.RANK_TOO_LARGE: "The adapter's rank r is above the serving pool's maximum rank or "
    "your tenant's rank quota: train it again with a smaller r. On a base that fuses q/k/v "
    "or gate/up (Phi-3), an adapter of the split projections is served at the sum of their "
    "ranks.",
    ReasonCode.BIAS_NOT_SUPPORTED: 'The adapter trains bias terms (bias other than "none", '
    "lora_bias, or bias tensors); only bias-free LoRA adapters are served.",
    ReasonCode.DORA_NOT_SUPPORTED: "This DoRA adapter cannot be served here: DoRA is served on "
    "the attention and MLP projections (of full-precision, FP8 or 4-bit bases, split or not), "
    "not on mixture-of-experts experts or modules of the other layout (Phi-3's fused ones); "
    "magnitude vectors need use_dora: true. Train it again without use_dora to serve it as "
    "plain LoRA.",
    ReasonCode.UNSUPPORTED_TARGET_MODULE: "The adapter targets a module that the base model "
    "lacks or that cannot be adapted; only the q, k, v, o, gate, up and down projections of "
    "the decoder layers can be.",
    ReasonCode.SHAPE_MISMATCH: "A weight's shape does not fit the base model (lora_A is r x in, "
    "lora_B is out x r): the adapter was probably trained for another model.",
    ReasonCode.BASE_MODEL_MISMATCH: "The adapter has weights for layers the base model does not "
    "have: it was trained for another base model.",
    ReasonCode.INVALID_SAFETENSORS: "adapter_model.safetensors is damaged or not a safetensors "
    "file (its header, offsets or data types are wrong, or it is cut short).",
    ReasonCode.NON_FINITE_WEIGHTS: "Some weights are NaN or infinite, usually a sign that the "
    "training diverged.",
    ReasonCode.TOO_LARGE: "The adapter is over a size limit: its bytes, its number of tensors, "
    "or your tenant's byte quota.",
    ReasonCode.MODULES_TO_SAVE_NOT_SUPPORTED: "The adapter carries full copies of base model "
    "weights (modules_to_save); only low-rank LoRA weights are served.",
    ReasonCode.UNSAFE_ARCHIVE: "The archive is unsafe to unpack: absolute or '..' paths, links "
    "or devices, or too many or too large entries.",
    ReasonCode.SIGNATURE_REQUIRED: "Your tenant or the serving pool requires signed adapters "
    "and none was sent: sign the adapter's digest with a registered key (`loraplane adapters "
    "sign`, or cosign sign-blob) and send the signature with it.",
    ReasonCode.SIGNATURE_INVALID: "The signature does not verify: wrong key, another "
    "adapter's digest, a revoked or unknown key id, or not base64 (the message names the key "
    "id).",
}


class AdapterRejected(Exception):
    """An adapter failed validation; nothing about it was stored."""

    def __init__(self, code: ReasonCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class StoreError(Exception):
    """The object store failed (unreachable, permission denied): a transient fault, not a
    verdict on the adapter."""


class ObjectExists(StoreError):
    """A create-only write found the key already present (objects are never overwritten)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"object already exists: {key}")
        self.key = key


class ObjectNotFound(StoreError):
    """A read asked for a key the store does not hold."""

    def __init__(self, key: str) -> None:
        super().__init__(f"object not found: {key}")
        self.key = key


class IntegrityError(StoreError):
    """Stored or cached bytes do not hash to the digest they are filed under."""

    def __init__(self, what: str, expected: str, actual: str) -> None:
        super().__init__(f"{what}: digest {actual[:16]}... does not match {expected[:16]}...")
        self.expected = expected
        self.actual = actual
