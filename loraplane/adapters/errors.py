"""Reason codes and the one exception the adapter core raises for a bad adapter.

Every rejection carries a machine-readable code (used verbatim in HTTP errors and in a
LoRAAdapter's status) and a message for humans that names the field or tensor and the numbers.
"""

from __future__ import annotations

from enum import StrEnum


class ReasonCode(StrEnum):
    """Why an adapter was rejected (DESIGN.md section 3)."""

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
