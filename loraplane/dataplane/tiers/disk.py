"""The local disk tier: stored adapter versions copied next to the data plane, LRU by bytes.

A LocalStore already is a local disk, so its versions are read in place. For a remote store
(S3) each version is downloaded once into `<root>/<digest>/` (through a temp folder, renamed
when complete) and kept while the byte budget allows, least recently used out first. Reads
verify the digest (the host loader hashes while it copies); a copy that fails the check is
discarded and fetched again. A failed download is tried once more after a short backoff (the
S3 client already retries each request once, with short timeouts: `adapters/s3read.py`), then
StoreError, which fails only the requests that need this adapter: a silent store costs a load
about a minute at most, not the many minutes boto3's defaults and more retries would.

Readers hold a folder with `reading(store_path, digest)`: while it is held the folder is never
evicted, replaced or deleted (two tenants with identical content share a digest, and two loader
threads may read it at once); two readers that miss the same digest at the same store path
share one download. Readers of one digest at different store paths (two tenants' copies of
the same bytes) download each their own, the first to finish installs the folder and the
other's copy is dropped: one tenant's objects that hang never hold another tenant's read.
Store paths from the catalog and digests are checked (`check_key`) before they touch a path.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from pathlib import Path

from loraplane.adapters.errors import StoreError
from loraplane.adapters.source import CONFIG_NAME, WEIGHTS_NAME
from loraplane.adapters.store.base import ObjectStore, check_key
from loraplane.adapters.store.local import LocalStore

log = logging.getLogger(__name__)
FILES = (CONFIG_NAME, WEIGHTS_NAME)


class DiskTier:
    """Local folders of stored adapter versions, within `budget_bytes` (remote stores only)."""

    def __init__(
        self,
        store: ObjectStore,
        root: Path | str | None = None,
        budget_bytes: int = 20 << 30,
        retries: int = 1,  # a download's retries after its first try (body reads included)
        backoff_s: float = 0.2,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.store = store
        self.local = isinstance(store, LocalStore)
        if root:
            self.root = Path(root)
        elif self.local:  # reads go to the store's own files: no folder of copies to make
            self.root = Path(store.url())
        else:
            self.root = Path(tempfile.mkdtemp(prefix="loraplane-disk-"))
        self.budget_bytes = budget_bytes
        self.retries = retries
        self.backoff_s = backoff_s
        self._lru: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, oldest first
        self._pins: Counter[str] = Counter()  # digest -> readers holding its folder
        self._doomed: set[str] = set()  # failed their digest check, deleted at the last release
        # (digest, store path) -> set when that download ends
        self._downloads: dict[tuple[str, str], threading.Event] = {}
        self._lock = threading.Lock()
        self.hits_total = self.loads_total = self.evictions_total = self.failures_total = 0
        if not self.local:
            self.root.mkdir(parents=True, exist_ok=True)
            for folder in sorted(self.root.iterdir(), key=lambda p: p.stat().st_mtime):
                if folder.is_dir() and all((folder / f).is_file() for f in FILES):
                    self._lru[folder.name] = sum((folder / f).stat().st_size for f in FILES)

    @property
    def bytes_used(self) -> int:
        return sum(self._lru.values())

    @contextlib.contextmanager
    def reading(self, store_path: str, digest: str) -> Iterator[Path]:
        """A local folder holding the version's two files (downloaded if needed), kept in
        place until the block exits. ValueError for an unsafe store path or digest."""
        folder = self._acquire(store_path, digest)
        try:
            yield folder
        finally:
            self._release(digest)

    def _acquire(self, store_path: str, digest: str) -> Path:
        check_key(store_path.rstrip("/"))
        check_key(digest)
        if self.local:
            self.hits_total += 1
            return Path(self.store.url()) / store_path
        target = self.root / digest
        while True:
            with self._lock:
                if digest in self._doomed:
                    raise StoreError(f"the local copy of {digest[:12]} failed its digest check"
                                     " and is still being read; try again")  # fmt: skip
                if digest in self._lru and all((target / f).is_file() for f in FILES):
                    self._lru.move_to_end(digest)
                    self._pins[digest] += 1
                    self.hits_total += 1
                    return target
                running = self._downloads.get((digest, store_path))
                if running is None:  # this reader downloads; others of this path wait for it
                    running = self._downloads[(digest, store_path)] = threading.Event()
                    break
            running.wait()
        try:
            self._download(store_path, digest, target)
            return target
        finally:
            with self._lock:
                self._downloads.pop((digest, store_path)).set()

    def _release(self, digest: str) -> None:
        if self.local:
            return
        with self._lock:
            self._pins[digest] -= 1
            if self._pins[digest] > 0:
                return
            del self._pins[digest]
            if digest in self._doomed:  # discarded while it was read: delete it now
                self._doomed.discard(digest)
                shutil.rmtree(self.root / digest, ignore_errors=True)

    def discard(self, digest: str) -> None:
        """Drop a local copy that failed its digest check (the next read downloads it again);
        a copy other readers still hold is deleted when the last one lets go."""
        if self.local:
            return
        check_key(digest)
        with self._lock:
            self._lru.pop(digest, None)
            if self._pins[digest] > 0:
                self._doomed.add(digest)
                return
        shutil.rmtree(self.root / digest, ignore_errors=True)

    def _download(self, store_path: str, digest: str, target: Path) -> None:
        """Fetch the version into a temp folder and install it as `target`, held by this
        reader (when another reader's copy of the same digest got there first, that one)."""
        last: StoreError | None = None
        for attempt in range(self.retries + 1):
            tmp = Path(tempfile.mkdtemp(prefix=".dl-", dir=self.root))
            try:
                try:
                    for name in FILES:
                        self.store.download(store_path + name, tmp / name)
                except StoreError as e:
                    last = e
                    self.failures_total += 1
                    log.warning("fetching %s failed (attempt %d): %s", store_path, attempt + 1, e)
                    if attempt < self.retries:  # no wait after the last try: tell the caller now
                        time.sleep(self.backoff_s * 2**attempt)
                    continue
                if not self._install(digest, tmp, target):
                    raise StoreError(f"the local copy of {digest[:12]} failed its digest check"
                                     " and is still being read; try again")  # fmt: skip
                return
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        raise StoreError(f"cannot fetch {store_path} after {self.retries + 1} attempts: {last}")

    def _install(self, digest: str, tmp: Path, target: Path) -> bool:
        """Make the complete copy in `tmp` the digest's folder and hold it, or hold the folder
        another reader's copy installed first; False while a discarded copy is still read."""
        size = sum((tmp / f).stat().st_size for f in FILES)
        with self._lock:
            if digest in self._doomed:
                return False
            if digest not in self._lru or not all((target / f).is_file() for f in FILES):
                # not in the LRU: nobody holds this digest's folder
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
                self._lru[digest] = size
                self.loads_total += 1
            self._lru.move_to_end(digest)
            self._pins[digest] += 1
            self._evict()
        return True

    def _evict(self) -> None:
        """Drop least recently used copies over the budget, never one a reader holds
        (under the lock)."""
        for digest in list(self._lru):
            if self.bytes_used <= self.budget_bytes:
                break
            if self._pins[digest] > 0:
                continue
            del self._lru[digest]
            self._pins.pop(digest, None)
            shutil.rmtree(self.root / digest, ignore_errors=True)
            self.evictions_total += 1
