"""cosign's encrypted private key files (`cosign generate-key-pair` writes `cosign.key`), read
so `loraplane adapters sign --key cosign.key` signs with the key a tenant already has.

The file is one PEM block, `ENCRYPTED SIGSTORE PRIVATE KEY` (cosign 2) or `ENCRYPTED COSIGN
PRIVATE KEY` (cosign 1), whose body is JSON in go-securesystemslib's `encrypted` format:

    {"kdf": {"name": "scrypt", "params": {"N": 32768, "r": 8, "p": 1}, "salt": <base64>},
     "cipher": {"name": "nacl/secretbox", "nonce": <base64, 24 bytes>},
     "ciphertext": <base64: Poly1305 tag (16 bytes) then the sealed bytes>}

The password (cosign's `COSIGN_PASSWORD`) gives a 32-byte key through scrypt with one of
the three parameter sets that format writes (N = 2^15, 2^16 or 2^17, r = 8, p = 1; anything
else is refused, as there, so a crafted file cannot ask for gigabytes); NaCl's secretbox
(XSalsa20 and Poly1305) opens the sealed bytes, a PKCS#8 DER private key. Poly1305 is
`cryptography`'s; XSalsa20, which `cryptography` lacks, is written out below (a key file is
about a hundred bytes, so pure Python costs nothing that matters).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import struct

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.poly1305 import Poly1305

PEM_TYPES = ("ENCRYPTED SIGSTORE PRIVATE KEY", "ENCRYPTED COSIGN PRIVATE KEY")
SCRYPT_PARAMS = ((1 << 15, 8, 1), (1 << 16, 8, 1), (1 << 17, 8, 1))
MAX_FILE_BYTES = 16_384
_SIGMA = struct.unpack("<4I", b"expand 32-byte k")
_MASK = 0xFFFFFFFF


class CosignKeyError(ValueError):
    """An encrypted cosign key that cannot be opened, with the reason."""


def is_cosign_key(data: bytes) -> bool:
    """Whether `data` is a PEM block of cosign's encrypted key types."""
    head = data.lstrip()[:64]
    return any(head.startswith(f"-----BEGIN {t}-----".encode()) for t in PEM_TYPES)


def _rotl(v: int, n: int) -> int:
    return ((v << n) | (v >> (32 - n))) & _MASK


def _rounds(x: list[int]) -> list[int]:
    """Salsa20's 20 rounds (ten double rounds) on a copy of the 16-word state."""
    x = list(x)
    for _ in range(10):
        for a, b, c, d in (
            (0, 4, 8, 12), (5, 9, 13, 1), (10, 14, 2, 6), (15, 3, 7, 11),  # columns
            (0, 1, 2, 3), (5, 6, 7, 4), (10, 11, 8, 9), (15, 12, 13, 14),  # rows
        ):  # fmt: skip
            x[b] ^= _rotl((x[a] + x[d]) & _MASK, 7)
            x[c] ^= _rotl((x[b] + x[a]) & _MASK, 9)
            x[d] ^= _rotl((x[c] + x[b]) & _MASK, 13)
            x[a] ^= _rotl((x[d] + x[c]) & _MASK, 18)
    return x


def _state(key: bytes, middle: tuple[int, int, int, int]) -> list[int]:
    k = struct.unpack("<8I", key)
    s0, s1, s2, s3 = _SIGMA
    return [s0, *k[:4], s1, *middle, s2, *k[4:], s3]


def _hsalsa20(key: bytes, nonce16: bytes) -> bytes:
    x = _rounds(_state(key, struct.unpack("<4I", nonce16)))
    return struct.pack("<8I", *(x[i] for i in (0, 5, 10, 15, 6, 7, 8, 9)))


def xsalsa20_stream(key: bytes, nonce: bytes, length: int) -> bytes:
    """The first `length` bytes of XSalsa20's key stream (32-byte key, 24-byte nonce)."""
    sub = _hsalsa20(key, nonce[:16])
    n0, n1 = struct.unpack("<2I", nonce[16:24])
    out = bytearray()
    for counter in range((length + 63) // 64):
        start = _state(sub, (n0, n1, counter & _MASK, counter >> 32))
        mixed = _rounds(start)
        out += struct.pack("<16I", *((m + s) & _MASK for m, s in zip(mixed, start, strict=True)))
    return bytes(out[:length])


def secretbox_open(box: bytes, nonce: bytes, key: bytes) -> bytes:
    """NaCl's `crypto_secretbox_open`: the plaintext of `box` (tag, then ciphertext);
    CosignKeyError when the tag does not verify (a wrong password, or a damaged file)."""
    if len(box) < 16:
        raise CosignKeyError("its ciphertext is shorter than a Poly1305 tag")
    tag, sealed = box[:16], box[16:]
    stream = xsalsa20_stream(key, nonce, 32 + len(sealed))
    try:
        Poly1305.verify_tag(stream[:32], sealed, tag)
    except InvalidSignature:
        raise CosignKeyError("wrong password, or the key file is damaged") from None
    return bytes(c ^ k for c, k in zip(sealed, stream[32:], strict=True))


def secretbox_seal(message: bytes, nonce: bytes, key: bytes) -> bytes:
    """NaCl's `crypto_secretbox`: tag, then ciphertext (what cosign writes)."""
    stream = xsalsa20_stream(key, nonce, 32 + len(message))
    sealed = bytes(m ^ k for m, k in zip(message, stream[32:], strict=True))
    return Poly1305.generate_tag(stream[:32], sealed) + sealed


def _b64(value: object, what: str, size: int | None = None) -> bytes:
    if not isinstance(value, str):
        raise CosignKeyError(f"its {what} is not a base64 string")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise CosignKeyError(f"its {what} is not base64") from None
    if size is not None and len(raw) != size:
        raise CosignKeyError(f"its {what} is {len(raw)} bytes, not {size}")
    return raw


def decrypt(document: bytes, password: bytes) -> bytes:
    """The plaintext of go-securesystemslib's `encrypted` JSON `document`."""
    try:
        fields = json.loads(document)
        kdf, cipher = fields["kdf"], fields["cipher"]
        params = kdf["params"]
        n, r, p = int(params["N"]), int(params["r"]), int(params["p"])
        names = (kdf["name"], cipher["name"])
    except (ValueError, KeyError, TypeError):
        raise CosignKeyError("its body is not cosign's encrypted-key JSON") from None
    if names != ("scrypt", "nacl/secretbox"):
        raise CosignKeyError(f"unsupported key derivation or cipher {names[0]!r}, {names[1]!r}")
    if (n, r, p) not in SCRYPT_PARAMS:
        raise CosignKeyError(f"unsupported scrypt parameters N={n}, r={r}, p={p}")
    salt = _b64(kdf.get("salt"), "salt")
    nonce = _b64(cipher.get("nonce"), "nonce", 24)
    box = _b64(fields.get("ciphertext"), "ciphertext")
    key = hashlib.scrypt(password, salt=salt, n=n, r=r, p=p, maxmem=256 << 20, dklen=32)
    return secretbox_open(box, nonce, key)


def encrypt(
    plaintext: bytes, password: bytes, salt: bytes, nonce: bytes, n: int = 1 << 15
) -> bytes:
    """The `encrypted` JSON of `plaintext` (salt and nonce given: tests build files with it)."""
    key = hashlib.scrypt(password, salt=salt, n=n, r=8, p=1, maxmem=256 << 20, dklen=32)
    b64 = base64.b64encode
    return json.dumps({
        "kdf": {"name": "scrypt", "params": {"N": n, "r": 8, "p": 1}, "salt": b64(salt).decode()},
        "cipher": {"name": "nacl/secretbox", "nonce": b64(nonce).decode()},
        "ciphertext": b64(secretbox_seal(plaintext, nonce, key)).decode(),
    }).encode()  # fmt: skip


def private_key_der(data: bytes, password: bytes | None) -> bytes:
    """The PKCS#8 DER private key inside cosign's encrypted key file `data`."""
    if len(data) > MAX_FILE_BYTES:
        raise CosignKeyError(f"the key file is {len(data)} bytes, over {MAX_FILE_BYTES}")
    if password is None:
        raise CosignKeyError(
            "it is encrypted (cosign's format): set $LORAPLANE_SIGNING_KEY_PASSWORD or "
            "$COSIGN_PASSWORD to its password"
        )
    text = data.decode("ascii", errors="replace").strip().splitlines()
    header = next((t for t in PEM_TYPES if text and text[0] == f"-----BEGIN {t}-----"), None)
    if header is None or text[-1] != f"-----END {header}-----":
        raise CosignKeyError("it is not one PEM block of cosign's encrypted key type")
    body = "".join(line.strip() for line in text[1:-1] if ":" not in line)
    return decrypt(_b64(body, "PEM body"), password)
