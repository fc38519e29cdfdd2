"""S3Store specifics: layout under the prefix, multipart uploads, error mapping, conflicts."""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from botocore.stub import Stubber

from loraplane.adapters.errors import ObjectExists, ObjectNotFound, StoreError
from loraplane.adapters.store import S3Store, open_store
from loraplane.adapters.store import s3 as s3_module
from tests import s3server
from tests.adapters.conftest import SMALL_MULTIPART

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


def _pending_uploads(client: S3Client, bucket: str) -> list[Any]:
    return list(client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
def unreachable_store() -> S3Store:
    """An S3Store whose endpoint refuses connections, failing fast (no retries)."""
    client = s3server.s3_client(
        f"http://127.0.0.1:{_closed_port()}",
        connect_timeout=1,
        read_timeout=1,
        retries={"max_attempts": 1},
    )
    return S3Store("some-bucket", prefix="p", client=client)


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_module, "_CONFLICT_BACKOFF_S", 0.0)


def test_objects_are_stored_under_the_store_prefix(
    s3_store: S3Store, s3_client: S3Client, s3_bucket: str
) -> None:
    s3_store.put_bytes("t1/adapter.json", b"{}")

    raw = s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert [o["Key"] for o in raw] == ["store-root/t1/adapter.json"]
    assert s3_store.list_keys("t1/") == ["t1/adapter.json"]


def test_stores_with_different_prefixes_in_one_bucket_do_not_see_each_other(
    s3_client: S3Client, s3_bucket: str
) -> None:
    one = S3Store(s3_bucket, prefix="one", client=s3_client)
    two = S3Store(s3_bucket, prefix="one-two/", client=s3_client)
    bare = S3Store(s3_bucket, client=s3_client)

    one.put_bytes("k", b"1")
    two.put_bytes("k", b"2")

    assert one.list_keys("") == ["k"]
    assert two.list_keys("") == ["k"]
    assert bare.list_keys("") == ["one-two/k", "one/k"]
    assert one.get_bytes("k") == b"1"


def test_a_large_file_goes_up_in_parts_and_leaves_no_pending_upload(
    s3_store: S3Store, s3_client: S3Client, s3_bucket: str, tmp_path: Path
) -> None:
    data = os.urandom(2 * SMALL_MULTIPART + 1)
    (tmp_path / "big").write_bytes(data)

    s3_store.put_file("big", tmp_path / "big")

    head = s3_client.head_object(Bucket=s3_bucket, Key="store-root/big")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart ETag: three parts
    assert head["ContentLength"] == len(data)
    assert _pending_uploads(s3_client, s3_bucket) == []


def test_a_file_at_the_threshold_goes_up_in_one_put(
    s3_store: S3Store, s3_client: S3Client, s3_bucket: str, tmp_path: Path
) -> None:
    (tmp_path / "f").write_bytes(b"x" * SMALL_MULTIPART)

    s3_store.put_file("f", tmp_path / "f")

    head = s3_client.head_object(Bucket=s3_bucket, Key="store-root/f")
    assert "-" not in head["ETag"]


def test_a_multipart_upload_losing_the_race_at_completion_raises_ObjectExists_and_aborts(
    s3_store: S3Store, s3_client: S3Client, s3_bucket: str, tmp_path: Path
) -> None:
    (tmp_path / "big").write_bytes(os.urandom(SMALL_MULTIPART + 1))
    rival = S3Store(s3_bucket, prefix="store-root", client=s3server.s3_client(_endpoint(s3_client)))

    def rival_wins(**_: Any) -> None:
        rival.put_bytes("big", b"rival")

    s3_client.meta.events.register("provide-client-params.s3.CompleteMultipartUpload", rival_wins)

    with pytest.raises(ObjectExists):
        s3_store.put_file("big", tmp_path / "big")

    assert s3_store.get_bytes("big") == b"rival"
    assert _pending_uploads(s3_client, s3_bucket) == []


def test_a_failure_during_a_multipart_upload_aborts_it(
    s3_store: S3Store, s3_client: S3Client, s3_bucket: str, tmp_path: Path
) -> None:
    (tmp_path / "big").write_bytes(os.urandom(2 * SMALL_MULTIPART + 1))

    def fail_second_part(params: dict[str, Any], **_: Any) -> None:
        if params["PartNumber"] == 2:
            raise RuntimeError("disk vanished")

    s3_client.meta.events.register("provide-client-params.s3.UploadPart", fail_second_part)

    with pytest.raises(RuntimeError, match="disk vanished"):
        s3_store.put_file("big", tmp_path / "big")

    assert _pending_uploads(s3_client, s3_bucket) == []
    assert not s3_store.exists("big")


def test_an_unreachable_endpoint_raises_StoreError_naming_bucket_and_key(
    unreachable_store: S3Store, tmp_path: Path
) -> None:
    (tmp_path / "src").write_bytes(b"x")
    operations: dict[str, Callable[[], object]] = {
        "put_bytes": lambda: unreachable_store.put_bytes("a/k", b"x"),
        "put_file": lambda: unreachable_store.put_file("a/k", tmp_path / "src"),
        "get_bytes": lambda: unreachable_store.get_bytes("a/k"),
        "download": lambda: unreachable_store.download("a/k", tmp_path / "dest"),
        "exists": lambda: unreachable_store.exists("a/k"),
        "delete": lambda: unreachable_store.delete("a/k"),
    }
    for name, operation in operations.items():
        with pytest.raises(StoreError, match="s3://some-bucket/p/a/k") as info:
            operation()
        assert "cannot reach" in str(info.value), name
        assert type(info.value) is StoreError, name

    with pytest.raises(StoreError, match="s3://some-bucket/p/a/"):
        unreachable_store.list_keys("a/")
    assert not (tmp_path / "dest").exists()


def test_an_unsafe_key_is_rejected_before_any_request(unreachable_store: S3Store) -> None:
    # Were the endpoint contacted first, this would be a StoreError.
    with pytest.raises(ValueError, match="unsafe"):
        unreachable_store.put_bytes("../x", b"x")
    with pytest.raises(ValueError, match="unsafe"):
        unreachable_store.get_bytes("/abs")


def test_a_missing_bucket_is_a_StoreError_not_ObjectNotFound(s3_client: S3Client) -> None:
    store = S3Store("no-such-bucket-here", client=s3_client)

    with pytest.raises(StoreError, match="NoSuchBucket") as info:
        store.get_bytes("k")
    assert not isinstance(info.value, ObjectNotFound)
    with pytest.raises(StoreError, match="NoSuchBucket"):
        store.put_bytes("k", b"x")


def test_a_conflict_then_the_rival_landing_raises_ObjectExists(no_backoff: None) -> None:
    client = s3server.s3_client("http://127.0.0.1:9")
    store = S3Store("bkt", client=client)
    with Stubber(client) as stub:
        stub.add_client_error(
            "put_object", service_error_code="ConditionalRequestConflict", http_status_code=409
        )
        stub.add_response("head_object", {})

        with pytest.raises(ObjectExists):
            store.put_bytes("k", b"x")
        stub.assert_no_pending_responses()


def test_a_conflict_whose_rival_failed_is_retried_and_succeeds(no_backoff: None) -> None:
    client = s3server.s3_client("http://127.0.0.1:9")
    store = S3Store("bkt", client=client)
    with Stubber(client) as stub:
        stub.add_client_error(
            "put_object", service_error_code="ConditionalRequestConflict", http_status_code=409
        )
        stub.add_client_error("head_object", service_error_code="404", http_status_code=404)
        stub.add_response("put_object", {})

        store.put_bytes("k", b"x")
        stub.assert_no_pending_responses()


def test_a_conflict_that_never_settles_raises_StoreError(no_backoff: None) -> None:
    client = s3server.s3_client("http://127.0.0.1:9")
    store = S3Store("bkt", client=client)
    with Stubber(client) as stub:
        for _ in range(s3_module._CONFLICT_RETRIES):
            stub.add_client_error(
                "put_object",
                service_error_code="ConditionalRequestConflict",
                http_status_code=409,
            )
            stub.add_client_error("head_object", service_error_code="404", http_status_code=404)

        with pytest.raises(StoreError, match="ConditionalRequestConflict") as info:
            store.put_bytes("k", b"x")
        assert not isinstance(info.value, ObjectExists)


def test_staging_dir_is_a_private_temp_folder_removed_with_the_store(
    s3_client: S3Client,
) -> None:
    one = S3Store("bkt", client=s3_client)
    two = S3Store("bkt", client=s3_client)

    staging = one.staging_dir()

    assert staging.is_dir()
    assert one.staging_dir() == staging
    assert two.staging_dir() != staging
    del one
    gc.collect()
    assert not staging.exists()


def test_url_names_bucket_and_prefix(s3_client: S3Client) -> None:
    assert S3Store("bkt", prefix="/a/b/", client=s3_client).url() == "s3://bkt/a/b"
    assert S3Store("bkt", client=s3_client).url() == "s3://bkt"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"bucket": ""}, "bucket"),
        ({"prefix": "../up"}, "prefix"),
        ({"part_size": 1 << 20}, "part_size"),
        ({"multipart_threshold": 0}, "multipart_threshold"),
    ],
)
def test_bad_settings_raise_ValueError_naming_the_field(
    s3_client: S3Client, kwargs: dict[str, Any], field: str
) -> None:
    settings: dict[str, Any] = {"bucket": "bkt", "client": s3_client, **kwargs}

    with pytest.raises(ValueError, match=f"^{field}:"):
        S3Store(**settings)


def test_open_store_with_an_s3_url_takes_the_endpoint_from_the_environment(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))

    store = open_store(f"s3://{s3_bucket}/tenants")
    store.put_bytes("k", b"via env")

    assert isinstance(store, S3Store)
    assert store.url() == f"s3://{s3_bucket}/tenants"
    assert S3Store(s3_bucket, prefix="tenants", client=s3server.s3_client(s3_endpoint)).get_bytes(
        "k"
    ) == (b"via env")


def test_open_store_without_a_bucket_raises_ValueError() -> None:
    with pytest.raises(ValueError, match="bucket"):
        open_store("s3:///prefix")


def _endpoint(client: S3Client) -> str:
    return str(client.meta.endpoint_url)
