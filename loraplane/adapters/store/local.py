"""LocalStore: objects as files under one folder, created by hard links, never overwritten."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from loraplane import fileaccess
from loraplane.adapters.errors import ObjectExists, ObjectNotFound, StoreError
from loraplane.adapters.store.base import ObjectStore, check_key

_STAGING = ".staging"
_COPY_CHUNK = 1 << 20


def check_prefix(prefix: str) -> str:
    """Return `prefix` if it is a safe listing prefix, else raise ValueError.

    A prefix is `""`, a folder (`"a/b/"`) or a folder plus the start of a part (`"a/b/ten"`):
    everything before its last '/' must be a safe key, so a listing never leaves the store.
    """
    folder, _, _ = prefix.rpartition("/")
    if "/" in prefix:
        try:
            check_key(folder)
        except ValueError:
            raise ValueError(f"unsafe object prefix {prefix!r}") from None
    return prefix


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries to disk, so a new link in it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(ObjectStore):
    """Objects are files under `root`; each write is a temp file in `<root>/.staging` made
    durable (fsync) and then hard-linked into place.

    `os.link` refuses an existing target, so two writers racing for one key cannot both win
    and an object, once there, is never replaced. Directories are created on the first write.
    """

    def __init__(self, root: Path | str) -> None:
        # Absolute once, so a later chdir cannot move the store.
        self._root = Path(root).expanduser().absolute()

    # -- writes ------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        """Create the object `key` holding `data`; ObjectExists if it is already there."""
        final = self._path(key)
        with self._staged_temp(key) as (tmp, fh):
            try:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            except OSError as exc:
                raise self._error("write", key, exc) from exc
            fh.close()
            self._link(tmp, final, key)

    def put_file(self, key: str, path: Path) -> None:
        """Create the object `key` from the file `path`, which stays where it is.

        A file already inside `staging_dir()` is linked as it is (no copy); the object then
        shares that file's inode, so the caller must not modify it afterwards.
        """
        final = self._path(key)
        source = Path(path)
        if self._in_staging(source):
            # A missing source is the caller's mistake: FileNotFoundError, as for a copy.
            with source.open("rb") as fh:
                try:
                    os.fsync(fh.fileno())
                except OSError as exc:
                    raise self._error("sync the staged file for", key, exc) from exc
            self._link(source, final, key)
            return
        with source.open("rb") as src, self._staged_temp(key) as (tmp, fh):
            try:
                shutil.copyfileobj(src, fh, _COPY_CHUNK)
                fh.flush()
                os.fsync(fh.fileno())
            except OSError as exc:
                raise self._error("copy into", key, exc) from exc
            fh.close()
            self._link(tmp, final, key)

    def delete(self, key: str) -> None:
        """Remove the object `key`; a missing object is not an error (retention may race)."""
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise self._error("delete", key, exc) from exc

    # -- reads -------------------------------------------------------------------------------

    def get_bytes(self, key: str) -> bytes:
        """Return the whole object `key`; ObjectNotFound if there is none."""
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(key) from None
        except OSError as exc:
            raise self._error("read", key, exc) from exc

    def download(self, key: str, dest: Path) -> None:
        """Copy the object `key` to `dest` through a temp file beside it and `os.replace`."""
        path = self._path(key)
        dest = Path(dest)
        try:
            src = path.open("rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(key) from None
        except OSError as exc:
            raise self._error("read", key, exc) from exc
        with src:
            try:
                write_atomically(dest, lambda out: shutil.copyfileobj(src, out, _COPY_CHUNK))
            except OSError as exc:
                raise self._error(f"download to {dest} from", key, exc) from exc

    def exists(self, key: str) -> bool:
        """Whether the object `key` exists."""
        return self._path(key).is_file()

    def list_keys(self, prefix: str) -> list[str]:
        """All keys starting with `prefix`, sorted; the walk starts at the prefix's folder."""
        check_prefix(prefix)
        folder, _, _ = prefix.rpartition("/")
        start = self._root / folder if folder else self._root
        keys: list[str] = []
        try:
            for dirpath, dirnames, filenames in os.walk(start):
                # Keys never start with '.', so this skips `.staging` and stray temp files.
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                rel = Path(dirpath).relative_to(self._root).as_posix()
                base = "" if rel == "." else rel + "/"
                keys.extend(
                    base + name
                    for name in filenames
                    if not name.startswith(".") and (base + name).startswith(prefix)
                )
        except OSError as exc:
            raise StoreError(f"cannot list {prefix!r} under {self._root}: {exc}") from exc
        return sorted(keys)

    # -- locations ---------------------------------------------------------------------------

    def staging_dir(self) -> Path:
        """`<root>/.staging`, created if needed: files put from here are linked, not copied."""
        staging = self._root / _STAGING
        try:
            staging.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create staging folder {staging}: {exc}") from exc
        return staging

    def url(self) -> str:
        """The store's absolute root path."""
        return str(self._root)

    # -- helpers -----------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self._root / check_key(key)

    def _in_staging(self, path: Path) -> bool:
        staging = (self._root / _STAGING).resolve()
        return path.resolve().is_relative_to(staging)

    @contextlib.contextmanager
    def _staged_temp(self, key: str) -> Iterator[tuple[Path, BinaryIO]]:
        """A new temp file in the staging folder, removed on exit whatever happened."""
        staging = self._root / _STAGING
        try:
            staging.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=staging, prefix=".put-")
        except OSError as exc:
            raise self._error("stage", key, exc) from exc
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as fh:
                yield tmp, fh
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _link(self, source: Path, final: Path, key: str) -> None:
        """Hard-link `source` to `final`, refusing an existing target, and sync the folder."""
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._error("create the folder for", key, exc) from exc
        try:
            os.link(source, final)
        except FileExistsError:
            if final.is_dir():
                raise StoreError(
                    f"cannot create object {key!r} in {self._root}: a folder of objects has "
                    "that name"
                ) from None
            raise ObjectExists(key) from None
        except OSError as exc:
            raise self._error("create", key, exc) from exc
        try:
            fsync_dir(final.parent)
        except OSError as exc:
            raise self._error("sync the folder of", key, exc) from exc

    def _error(self, action: str, key: str, exc: OSError) -> StoreError:
        reason = fileaccess.message(exc, "read" if action == "read" else "write")
        return StoreError(f"cannot {action} object {key!r} in {self._root}: {reason}")


def write_atomically(dest: Path, fill: Callable[[BinaryIO], object]) -> None:
    """Write `dest` by `fill`ing a temp file beside it, fsyncing, then `os.replace`.

    Readers of `dest` see the old file or the whole new one, never a part.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            fill(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
