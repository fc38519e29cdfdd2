"""Fixtures for the adapter core: a LocalStore in a temp folder, an S3Store on a fresh bucket of
a moto S3 server (real HTTP), and `store`, parametrised over both backends."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from loraplane.adapters.store import LocalStore, ObjectStore, S3Store
from tests import s3server

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MiB = 1 << 20
# S3's smallest legal part: tests send files of a few MiB through the multipart path.
SMALL_MULTIPART = 5 * MiB


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The URL of one moto S3 server shared by the whole test session."""
    with s3server.moto_s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_client(s3_endpoint: str) -> S3Client:
    """A boto3 client for the moto server."""
    return s3server.s3_client(s3_endpoint)


@pytest.fixture
def s3_bucket(s3_client: S3Client) -> Iterator[str]:
    """A new, empty bucket for one test, emptied and removed afterwards."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_client.create_bucket(Bucket=name)
    yield name
    s3server.empty_bucket(s3_client, name)


@pytest.fixture
def s3_store(s3_client: S3Client, s3_bucket: str) -> S3Store:
    """An S3Store under a prefix, with multipart uploads from 5 MiB up."""
    return S3Store(
        s3_bucket,
        prefix="store-root",
        client=s3_client,
        multipart_threshold=SMALL_MULTIPART,
        part_size=SMALL_MULTIPART,
    )


@pytest.fixture
def local_store(tmp_path: Path) -> LocalStore:
    """A LocalStore rooted in a folder that does not exist yet."""
    return LocalStore(tmp_path / "store")


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest) -> ObjectStore:
    """Each backend in turn, for the behaviour every ObjectStore promises."""
    backend: ObjectStore = request.getfixturevalue(f"{request.param}_store")
    return backend
