"""The one reader of a base model's config.json (control plane and operator): local folders
and files, s3:// prefixes and objects over a real S3 API, and what cannot be read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.adapters.base_model import (
    BaseModelError,
    BaseModelUnavailable,
    read_config,
)
from tests import s3server

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with s3server.moto_s3_server() as url:
        client = s3server.s3_client(url)
        client.create_bucket(Bucket="models")
        client.put_object(Bucket="models", Key="tiny/config.json", Body=json.dumps(CONFIG))
        client.put_object(Bucket="models", Key="odd.json", Body=json.dumps(CONFIG))
        client.put_object(Bucket="models", Key="list/config.json", Body=b"[1, 2]")
        yield url


@pytest.fixture(autouse=True)
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment's credentials, as a service reading its own buckets has them."""
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        monkeypatch.setenv(name, value)


def test_a_folder_or_the_file_itself(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert read_config(str(tmp_path)) == CONFIG
    assert read_config(str(tmp_path / "config.json")) == CONFIG


def test_an_s3_prefix_or_json_object(endpoint: str) -> None:
    for uri in ("s3://models/tiny", "s3://models/tiny/", "s3://models/odd.json"):
        assert read_config(uri, s3_endpoint_url=endpoint) == CONFIG


@pytest.mark.parametrize("uri", ["s3://models/none", "s3://nobucket/x", "s3://"])
def test_an_s3_config_that_is_not_there_is_unavailable(endpoint: str, uri: str) -> None:
    with pytest.raises(BaseModelUnavailable):
        read_config(uri, s3_endpoint_url=endpoint)


def test_what_cannot_be_read_or_used_is_refused_with_the_reason(
    tmp_path: Path, endpoint: str
) -> None:
    with pytest.raises(BaseModelUnavailable, match="not a regular file"):
        read_config(str(tmp_path / "missing"))
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(" " * 100 + json.dumps(CONFIG))
    with pytest.raises(BaseModelUnavailable, match="larger than 50 bytes"):
        read_config(str(big), max_bytes=50)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{nope")
    with pytest.raises(BaseModelError, match="not JSON"):
        read_config(str(bad))
    with pytest.raises(BaseModelError, match="not a JSON object"):
        read_config("s3://models/list", s3_endpoint_url=endpoint)
