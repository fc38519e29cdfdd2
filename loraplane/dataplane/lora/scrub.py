"""Load failures as a tenant's clients may read them: without this replica's paths and URLs."""

from __future__ import annotations

import re

_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s/:'\"]+/)+([^\s/:'\"]+)")
# s3://bucket/key, and the endpoint URLs botocore names in its errors
_URL = re.compile(r"\b[a-zA-Z][\w+.-]*://[^\s'\"]*[^\s'\".,;:)]")


def _last_component(match: re.Match[str]) -> str:
    path = match.group(0).partition("://")[2].partition("/")[2]
    return path.rstrip("/").rpartition("/")[2] or "the store"


def without_paths(message: str) -> str:
    """`message` with each absolute path and URL cut to its last component: a load failure is
    told to the tenant's clients, and where this replica keeps its files (folders, buckets,
    store endpoints) is none of their business."""
    return _PATH.sub(r"\1", _URL.sub(_last_component, message))
