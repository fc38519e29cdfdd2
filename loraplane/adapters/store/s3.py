"""S3Store: objects in an S3 bucket under a prefix, created with conditional writes."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from botocore.exceptions import BotoCoreError, ClientError, ConnectionError

from loraplane.adapters import s3read
from loraplane.adapters.errors import ObjectExists, ObjectNotFound, StoreError
from loraplane.adapters.store.base import ObjectStore, check_key
from loraplane.adapters.store.local import check_prefix, write_atomically

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

MiB = 1 << 20
# S3's limits on multipart uploads: every part but the last at least 5 MiB, at most 10,000 parts.
_MIN_PART = 5 * MiB
_MAX_PARTS = 10_000
# A 409 ConditionalRequestConflict means another conditional write to the key is in flight;
# it settles quickly, so a few short waits are enough.
_CONFLICT_RETRIES = 4
_CONFLICT_BACKOFF_S = 0.05
_DOWNLOAD_CHUNK = MiB
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})


class S3Store(ObjectStore):
    """Objects at `s3://bucket/prefix/key`, each written once with `If-None-Match: *`.

    S3 itself refuses a second create (412 PreconditionFailed), so racing writers on any
    number of machines cannot overwrite each other. Files above `multipart_threshold` go up
    in `part_size` parts, and the multipart completion is conditional too.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        client: S3Client | None = None,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 16 * MiB,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"bucket: invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            try:
                check_key(prefix)
            except ValueError:
                raise ValueError(f"prefix: unsafe S3 key prefix {prefix!r}") from None
        if part_size < _MIN_PART:
            raise ValueError(f"part_size: {part_size} is below S3's minimum part of {_MIN_PART}")
        if multipart_threshold < 1:
            raise ValueError(f"multipart_threshold: {multipart_threshold} must be positive")
        self._bucket = bucket
        self._prefix = prefix
        # the project's one client configuration (short timeouts, few retries) by default
        self._client: S3Client = client if client is not None else s3read.make_client()
        self._multipart_threshold = multipart_threshold
        self._part_size = part_size
        self._staging: Path | None = None
        self._staging_lock = threading.Lock()

    # -- writes ------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        """Create the object `key` holding `data`; ObjectExists if it is already there."""
        full = self._full(key)

        def attempt() -> None:
            self._client.put_object(Bucket=self._bucket, Key=full, Body=data, IfNoneMatch="*")

        self._create(key, attempt)

    def put_file(self, key: str, path: Path) -> None:
        """Create the object `key` from the file `path` (left in place); large files go up in
        parts, read one part at a time."""
        full = self._full(key)
        path = Path(path)
        size = path.stat().st_size  # a missing source is the caller's FileNotFoundError
        if size <= self._multipart_threshold:

            def attempt() -> None:
                with path.open("rb") as fh:
                    self._client.put_object(Bucket=self._bucket, Key=full, Body=fh, IfNoneMatch="*")

            self._create(key, attempt)
            return
        # Don't send gigabytes only to be refused at the end; the conditional completion
        # still decides any race.
        if self.exists(key):
            raise ObjectExists(key)
        part_size = max(self._part_size, -(-size // _MAX_PARTS))
        self._create(key, lambda: self._multipart(full, path, part_size))

    def delete(self, key: str) -> None:
        """Remove the object `key`; a missing object is not an error (as in S3 itself)."""
        full = self._full(key)
        try:
            self._client.delete_object(Bucket=self._bucket, Key=full)
        except (ClientError, BotoCoreError) as exc:
            raise self._error("delete", key, exc) from exc

    # -- reads -------------------------------------------------------------------------------

    def get_bytes(self, key: str) -> bytes:
        """Return the whole object `key`; ObjectNotFound if there is none."""
        full = self._full(key)
        try:
            response = self._client.get_object(Bucket=self._bucket, Key=full)
            return response["Body"].read()
        except ClientError as exc:
            if _is_missing_key(exc):
                raise ObjectNotFound(key) from None
            raise self._error("get", key, exc) from exc
        except BotoCoreError as exc:
            raise self._error("get", key, exc) from exc

    def download(self, key: str, dest: Path) -> None:
        """Stream the object `key` into a temp file beside `dest`, then `os.replace` it."""
        full = self._full(key)
        dest = Path(dest)
        try:
            body = self._client.get_object(Bucket=self._bucket, Key=full)["Body"]
        except ClientError as exc:
            if _is_missing_key(exc):
                raise ObjectNotFound(key) from None
            raise self._error("get", key, exc) from exc
        except BotoCoreError as exc:
            raise self._error("get", key, exc) from exc

        def fill(out: BinaryIO) -> None:
            for chunk in body.iter_chunks(_DOWNLOAD_CHUNK):
                out.write(chunk)

        try:
            with body:
                write_atomically(dest, fill)
        except BotoCoreError as exc:
            raise self._error("download", key, exc) from exc
        except OSError as exc:
            raise StoreError(f"cannot write {self._where(key)} to {dest}: {exc}") from exc

    def exists(self, key: str) -> bool:
        """Whether the object `key` exists (a HEAD request)."""
        full = self._full(key)
        try:
            self._client.head_object(Bucket=self._bucket, Key=full)
        except ClientError as exc:
            if _status(exc) == 404:
                return False
            raise self._error("head", key, exc) from exc
        except BotoCoreError as exc:
            raise self._error("head", key, exc) from exc
        return True

    def list_keys(self, prefix: str) -> list[str]:
        """All keys starting with `prefix`, sorted, without the store's own prefix."""
        check_prefix(prefix)
        base = self._prefix + "/" if self._prefix else ""
        keys: list[str] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self._bucket, Prefix=base + prefix
            )
            for page in pages:
                keys.extend(obj["Key"][len(base) :] for obj in page.get("Contents", []))
        except (ClientError, BotoCoreError) as exc:
            raise StoreError(
                f"S3 list of s3://{self._bucket}/{base}{prefix} failed: {_describe(exc)}"
            ) from exc
        return sorted(keys)

    # -- locations ---------------------------------------------------------------------------

    def staging_dir(self) -> Path:
        """A private local temp folder, made on first use and removed with this store."""
        with self._staging_lock:
            if self._staging is None:
                self._staging = Path(tempfile.mkdtemp(prefix="loraplane-s3-staging-"))
                weakref.finalize(self, shutil.rmtree, self._staging, ignore_errors=True)
            return self._staging

    def url(self) -> str:
        """`s3://bucket/prefix` (`s3://bucket` without a prefix)."""
        return f"s3://{self._bucket}/{self._prefix}" if self._prefix else f"s3://{self._bucket}"

    # -- helpers -----------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self._prefix}/{key}" if self._prefix else key

    def _where(self, key: str) -> str:
        return f"s3://{self._bucket}/{self._full(key)}"

    def _create(self, key: str, attempt: Callable[[], None]) -> None:
        """Run a conditional write; map 412 to ObjectExists and retry 409 conflicts."""
        for n in range(_CONFLICT_RETRIES):
            try:
                attempt()
                return
            except ClientError as exc:
                if _status(exc) == 412 or _code(exc) == "PreconditionFailed":
                    raise ObjectExists(key) from None
                if _code(exc) != "ConditionalRequestConflict":
                    raise self._error("put", key, exc) from exc
            except BotoCoreError as exc:
                raise self._error("put", key, exc) from exc
            time.sleep(_CONFLICT_BACKOFF_S * 2**n)
            # The write in flight usually lands; then this one has lost the race.
            if self.exists(key):
                raise ObjectExists(key)
        raise StoreError(
            f"S3 put of {self._where(key)} kept meeting ConditionalRequestConflict "
            f"({_CONFLICT_RETRIES} tries)"
        )

    def _multipart(self, full: str, path: Path, part_size: int) -> None:
        """One whole multipart upload; aborted on any failure so no parts linger (a 409 on
        completion asks for a fresh upload, which `_create` starts)."""
        upload_id = self._client.create_multipart_upload(
            Bucket=self._bucket, Key=full, ChecksumAlgorithm="CRC32"
        )["UploadId"]
        try:
            parts: list[CompletedPartTypeDef] = []
            with path.open("rb") as fh:
                while chunk := fh.read(part_size):
                    number = len(parts) + 1
                    response = self._client.upload_part(
                        Bucket=self._bucket,
                        Key=full,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=chunk,
                        ChecksumAlgorithm="CRC32",
                    )
                    parts.append(
                        {
                            "ETag": response["ETag"],
                            "PartNumber": number,
                            "ChecksumCRC32": response["ChecksumCRC32"],
                        }
                    )
            self._client.complete_multipart_upload(
                Bucket=self._bucket,
                Key=full,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except BaseException:
            # The original failure matters more; a bucket lifecycle rule reaps any leftover.
            with contextlib.suppress(ClientError, BotoCoreError):
                self._client.abort_multipart_upload(
                    Bucket=self._bucket, Key=full, UploadId=upload_id
                )
            raise

    def _error(self, action: str, key: str, exc: ClientError | BotoCoreError) -> StoreError:
        return StoreError(f"S3 {action} of {self._where(key)} failed: {_describe(exc)}")


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: ClientError) -> int | None:
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _is_missing_key(exc: ClientError) -> bool:
    # A missing bucket is also a 404, but it is a broken store, not a missing object.
    return _code(exc) in _NOT_FOUND_CODES


def _describe(exc: ClientError | BotoCoreError) -> str:
    if isinstance(exc, ClientError):
        message = exc.response.get("Error", {}).get("Message", "")
        return f"{_code(exc) or 'error'} (HTTP {_status(exc)}): {message}".rstrip(": ")
    if isinstance(exc, ConnectionError):
        return f"cannot reach the S3 endpoint: {exc}"
    return str(exc)
