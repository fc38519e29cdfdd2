"""Usage not yet delivered to the control plane, kept on local disk so a crash does not lose it.

One JSON file per replica name in LORAPLANE_USAGE_SPOOL_DIR (`usage-<replica>-<hash>.json`),
replaced atomically (a temp file in the same folder, fsync, rename, fsync of the folder) by the
pressure reporter: before a batch is first sent (so the file names its batch id before the control
plane can count it), after a report is accepted (before the next one can go), and, debounced,
whenever new usage is counted. Read back at start: the batch that was in flight goes again with
its id (the control plane counts a replica's batch once: it keeps the last one per replica), the
rest waits for the next batch. Hence one file per replica name: a batch id is deduplicated only
under the replica that sent it.

The file is bounded (`max_bytes`): past it, the least recently counted rows are left out of the
file with a warning (they are still delivered from memory; only a crash would lose them) and
counted in `rows_left_out`. A file that cannot be read or does not parse as a whole (truncated,
corrupt, another format) is logged and ignored, never half-used: no row is ever counted twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplane import fileaccess

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (tenant, adapter name; "" for the base model)
Rows = dict[Key, list[int]]  # key -> [requests, prompt tokens, completion tokens]
FORMAT = 1
MAX_BYTES = 4 << 20
BATCH_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # the control plane's usage_batch pattern
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(slots=True)
class Spooled:
    """What a spool file held: the batch in flight (its id and rows) and usage not yet sent."""

    pending: tuple[str, Rows] | None = None
    rows: Rows = field(default_factory=dict)


class UsageSpool:
    """The spool file of one replica in `directory`, at most `max_bytes` long."""

    def __init__(self, directory: Path | str, replica: str, max_bytes: int = MAX_BYTES) -> None:
        if max_bytes < 1024:
            raise ValueError(f"max_bytes must be at least 1024, got {max_bytes}")
        self.directory = Path(directory)
        self.replica = replica
        self.max_bytes = max_bytes
        # a name the file system takes whatever the replica is called ("host:port", a pod)
        # (the hash keeps two names that differ only in odd characters apart)
        digest = hashlib.sha256(replica.encode()).hexdigest()[:8]
        self.path = self.directory / f"usage-{_UNSAFE.sub('_', replica)[:100]}-{digest}.json"
        self.rows_left_out = 0  # rows the last write could not fit
        self.writes = self.write_failures = 0

    def load(self) -> Spooled:
        """The spooled usage (empty when there is no file, or a bad one: logged, ignored)."""
        for stale in self.directory.glob(f".{self.path.name}.*.tmp"):
            stale.unlink(missing_ok=True)  # a write the process did not finish
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return Spooled()
        except OSError as e:
            log.error("usage spool %s cannot be read (%s): ignored", self.path,
                      fileaccess.message(e))  # fmt: skip
            return Spooled()
        try:
            return _parse(json.loads(data), self.replica)
        except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
            log.error("usage spool %s is damaged (%s): ignored, its usage is lost", self.path,
                      str(e)[:200])  # fmt: skip
            return Spooled()

    def save(self, pending: tuple[str, Rows] | None, rows: Rows) -> None:
        """Replace the file with this state atomically (remove it when there is nothing).
        Raises OSError (the caller logs it; serving goes on)."""
        entries = [("pending", k, v) for k, v in (pending[1] if pending else {}).items()]
        entries += [("rows", k, v) for k, v in rows.items()]
        if not entries:
            self.rows_left_out = 0
            if self.path.exists():
                self.path.unlink()
                _fsync_dir(self.directory)
            return
        kept, left_out = _fit(entries, self.max_bytes)
        if left_out and left_out != self.rows_left_out:
            log.warning("usage spool over %d bytes: the %d least recent rows of undelivered usage"
                        " are not on disk (a crash now would lose them)", self.max_bytes,
                        left_out)  # fmt: skip
        self.rows_left_out = left_out
        doc = {
            "format": FORMAT,
            "replica": self.replica,
            "pending": None if pending is None else pending[0],
            "pending_usage": [_row(k, v) for s, k, v in kept if s == "pending"],
            "usage": [_row(k, v) for s, k, v in kept if s == "rows"],
        }
        self._replace(json.dumps(doc, separators=(",", ":")).encode())
        self.writes += 1

    def _replace(self, data: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)


def _row(key: Key, counts: list[int]) -> list[Any]:
    return [key[0], key[1], *counts]


def _fit(entries: list[tuple[str, Key, list[int]]], max_bytes: int) -> tuple[list[Any], int]:
    """The entries that fit in `max_bytes` (the oldest, first in the list, go first) and how
    many did not."""
    sizes = [len(json.dumps(_row(k, v), separators=(",", ":"))) + 1 for _, k, v in entries]
    total = 256 + sum(sizes)  # 256: the document's own keys, the replica name, the batch id
    first = 0
    while total > max_bytes and first < len(entries):
        total -= sizes[first]
        first += 1
    return entries[first:], first


def _parse(doc: Any, replica: str) -> Spooled:
    """A spool document as Spooled; ValueError for anything but a whole, valid one."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError("not a usage spool of this format")
    if doc.get("replica") != replica:
        raise ValueError(f"written for replica {str(doc.get('replica'))[:100]!r}")
    batch = doc.get("pending")
    if batch is not None and not (isinstance(batch, str) and BATCH_ID.match(batch)):
        raise ValueError("bad batch id")
    pending_rows = _rows(doc["pending_usage"])
    rows = _rows(doc["usage"])
    if batch is None:
        if pending_rows:
            raise ValueError("rows of a batch without an id")
        return Spooled(None, rows)
    return Spooled((batch, pending_rows), rows)


def _rows(items: Iterable[Any]) -> Rows:
    if not isinstance(items, list):
        raise ValueError("rows are not a list")
    rows: Rows = {}
    for item in items:
        if not (isinstance(item, list) and len(item) == 5):
            raise ValueError("a row is not [tenant, adapter, requests, prompt, completion]")
        tenant, adapter, *counts = item
        if not (isinstance(tenant, str) and tenant and isinstance(adapter, str)):
            raise ValueError("a row's tenant or adapter is not a name")
        if not all(type(c) is int and c >= 0 for c in counts):
            raise ValueError("a row's counts are not non-negative integers")
        if (tenant, adapter) in rows:
            raise ValueError("a row appears twice")
        rows[(tenant, adapter)] = counts
    return rows


def _fsync_dir(directory: Path) -> None:
    """Make a rename or removal in `directory` durable (where the platform allows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
