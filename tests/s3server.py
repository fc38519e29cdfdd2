"""A real S3 API over HTTP for tests: moto's threaded server on a free local port.

Import from any test folder: `with moto_s3_server() as endpoint: client = s3_client(endpoint)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from moto.server import ThreadedMotoServer

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

REGION = "us-east-1"


@contextmanager
def moto_s3_server() -> Iterator[str]:
    """Run moto's S3 server on 127.0.0.1 (a free port) and yield its endpoint URL."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def s3_client(endpoint_url: str, **config: Any) -> S3Client:
    """A boto3 S3 client for `endpoint_url` with test credentials; `config` goes to botocore."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=REGION,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        config=Config(**config),
    )


def empty_bucket(client: S3Client, bucket: str) -> None:
    """Delete every object, pending multipart upload and then the bucket itself."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
    for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    client.delete_bucket(Bucket=bucket)
