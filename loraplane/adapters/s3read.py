"""Reading objects from S3 outside the store: base model configs, adapter imports and sources.

The one S3 reader of the control plane and the operator (the store's own reads are
`store.S3Store`'s). Only `s3://` locations are read (boto3 talks to the S3 API alone and
follows no redirects elsewhere); reads are bounded in size and time, and every failure is an
`S3ReadError` that says whether the object is missing or access was denied.

`client_config` is the project's one S3 client configuration: these reads, the store
(`S3Store`, so the data plane's disk tier too) and every client `make_client` makes use it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

_CHUNK = 1 << 20


class S3ReadError(Exception):
    """An S3 object could not be read; `missing` and `denied` tell those from a fault."""

    def __init__(self, message: str, *, missing: bool = False, denied: bool = False) -> None:
        super().__init__(message)
        self.missing = missing
        self.denied = denied


class ObjectTooLarge(S3ReadError):
    """The object is over the size cap."""


def split_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/key` -> (bucket, key); ValueError if it is not an S3 URI with a bucket."""
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri!r} is not an s3:// URI")
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} names no bucket")
    return bucket, key


# boto3's defaults wait 60 s to connect and 60 s for each read, up to 5 attempts: a silent
# endpoint would hold a caller (a data plane loader thread, and the requests waiting for its
# adapter) for many minutes. A healthy S3 connects in milliseconds and sends the first bytes of
# an object within a second or two, so 3 s to connect and 10 s per read still leave a wide
# margin, and one retry rides over a dropped connection. A silent endpoint then costs at most
# MAX_ATTEMPTS * (CONNECT_TIMEOUT_S + READ_TIMEOUT_S) (plus boto3's backoff, under a second)
# per request: the data plane's disk tier, which tries a download twice, gives up on one
# within about 55 s, inside the engine's default adapter load deadline (60 s).
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 10.0
MAX_ATTEMPTS = 2  # in all, the first one included


def client_config(
    *, connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = READ_TIMEOUT_S
) -> Config:
    """The project's one S3 client configuration: short timeouts, MAX_ATTEMPTS attempts (the
    timeouts may be given shorter, e.g. by tests)."""
    return Config(
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        retries={"total_max_attempts": MAX_ATTEMPTS, "mode": "standard"},
    )


def make_client(
    endpoint_url: str | None = None,
    *,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    session_token: str | None = None,
    region_name: str | None = None,
    config: Config | None = None,
) -> S3Client:
    """A client with `client_config()` (or `config`), so a request never hangs on S3; with
    explicit credentials (a tenant's Secret) or the environment's (endpoint, region and
    credentials from boto3's own configuration where not given)."""
    client: S3Client = boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        config=config if config is not None else client_config(),
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key,
        aws_session_token=session_token,
        region_name=region_name,
    )
    return client


def _describe(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        err: dict[str, Any] = dict(exc.response.get("Error", {}))
        return f"{err.get('Code', 'error')}: {err.get('Message', '')}".rstrip(": ")
    return type(exc).__name__


_MISSING = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchBucket"})
_DENIED = frozenset({"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"})


def _error(where: str, exc: Exception) -> S3ReadError:
    code = (
        str(exc.response.get("Error", {}).get("Code", "")) if isinstance(exc, ClientError) else ""
    )
    return S3ReadError(
        f"cannot read {where}: {_describe(exc)}", missing=code in _MISSING, denied=code in _DENIED
    )


def download(client: S3Client, bucket: str, key: str, dest: Path, *, max_bytes: int) -> int:
    """Stream one object into `dest`, refusing more than `max_bytes`; returns its size."""
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
    except (ClientError, BotoCoreError) as exc:
        raise _error(f"s3://{bucket}/{key}", exc) from exc
    size = 0
    try:
        with body, open(dest, "wb") as out:
            for chunk in body.iter_chunks(_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise ObjectTooLarge(f"s3://{bucket}/{key} is larger than {max_bytes} bytes")
                out.write(chunk)
    except (ClientError, BotoCoreError) as exc:
        raise _error(f"s3://{bucket}/{key}", exc) from exc
    return size


def read_bytes(client: S3Client, bucket: str, key: str, *, max_bytes: int) -> bytes:
    """A small object's bytes, refusing more than `max_bytes`."""
    try:
        response = client.get_object(Bucket=bucket, Key=key)
        data = response["Body"].read(max_bytes + 1)
    except (ClientError, BotoCoreError) as exc:
        raise _error(f"s3://{bucket}/{key}", exc) from exc
    if len(data) > max_bytes:
        raise ObjectTooLarge(f"s3://{bucket}/{key} is larger than {max_bytes} bytes")
    return data
