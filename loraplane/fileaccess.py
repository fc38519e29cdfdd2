"""Errors about files that a pod's operator can act on.

A pod runs as an unprivileged user (the chart: uid 10001) on a read-only root file system, and
the files it is given are often someone else's: `save_pretrained` leaves weights at mode 0600,
a mounted Secret or volume may belong to root. Libraries then say little or the wrong thing
(safetensors reports an unreadable file as "No such file or directory"). Every file the data
plane, control plane and operator open goes through `check_readable` / `check_writable_dir`
first, or has its `PermissionError` turned into `AccessDenied` by `explain`, so the message
names the file (or the folder that blocks the way), its mode and owner, who this process runs
as, and what to change.

Only the standard library: the control plane and operator import this without torch.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
import tempfile
from pathlib import Path
from typing import Literal

Action = Literal["read", "write"]

_READ_HINT = (
    "make it readable by the pod's user: chmod a+r, or group-readable with the pod's fsGroup"
)
_ENTER_HINT = "make it enterable by the pod's user: chmod a+rx, or the pod's fsGroup"
_WRITE_HINT = (
    "make it writable by the pod's user (chown, or group-writable with the pod's fsGroup), "
    "or mount a writable volume there"
)
_ROFS_HINT = (
    "mount a writable volume there (an emptyDir or a PersistentVolume: the pods' root file "
    "system is read-only)"
)


class AccessDenied(PermissionError):
    """A file or folder this process may not read, enter or write in. Its `str` is one line:
    the path, its mode and owner, the user this process runs as, and a hint. A PermissionError
    (an OSError), so code that handles OSError handles it."""

    def __init__(self, path: str | os.PathLike[str], message: str, code: int = errno.EACCES):
        super().__init__(code, os.strerror(code), os.fspath(path))
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[type[AccessDenied], tuple[str, str, int]]:
        # pickles whole (OSError's own reduce would call __init__ with errno, strerror,
        # filename): it crosses from the engine process to the server's routes as itself
        return AccessDenied, (str(self.filename), self.message, self.errno or errno.EACCES)


def whoami() -> str:
    """'this process runs as uid 10001 (no name), gid 10001', plus its supplementary groups
    (a pod's fsGroup is one)."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = "no name"
    groups = sorted(set(os.getgroups()) - {gid})
    extra = f", groups {', '.join(map(str, groups))}" if groups else ""
    return f"this process runs as uid {uid} ({name}), gid {gid}{extra}"


def _owner(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid} gid {st.st_gid}"


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _blocking_folder(path: str) -> tuple[str, os.stat_result] | None:
    """The first folder on the way to `path` that exists but this process cannot enter."""
    parts = Path(os.path.abspath(path)).parents
    for folder in reversed(parts):  # from / down
        st = _stat(str(folder))
        if st is None:
            return None  # missing (or unreachable): nothing further down can be judged
        if stat.S_ISDIR(st.st_mode) and not os.access(folder, os.X_OK):
            return str(folder), st
    return None


def _deepest_existing(path: str) -> str:
    current = os.path.abspath(path)
    while not os.path.exists(current) and os.path.dirname(current) != current:
        current = os.path.dirname(current)
    return current


def denied(path: str | os.PathLike[str], action: Action = "read") -> AccessDenied:
    """The AccessDenied for `path`, which this process failed to `action` (read: open, list or
    enter it; write: create or change it, or a file in it). Finds what blocks: a folder on the
    way without the x bit, the file's own mode, or the folder a new file would go in."""
    target = os.path.abspath(os.fspath(path))
    who = whoami()
    blocking = _blocking_folder(target)
    if blocking is not None:
        folder, folder_st = blocking
        return AccessDenied(
            folder,
            f"permission denied: {folder} (a folder this process cannot enter, on the way to "
            f"{target}: {_owner(folder_st)}; {who}); {_ENTER_HINT}",
        )
    st = _stat(target)
    if st is None and action == "write":  # creating it: the folder it goes in decides
        target = _deepest_existing(target)
        st = _stat(target)
    if st is None:
        return AccessDenied(target, f"permission denied: {target} ({who})")
    is_dir = stat.S_ISDIR(st.st_mode)
    if action == "write":
        what = "cannot write in this folder" if is_dir else "cannot write this file"
        hint = _WRITE_HINT
    elif is_dir:
        can_list = os.access(target, os.R_OK)
        what = "a folder this process cannot list" if not can_list else "a folder"
        hint = _ENTER_HINT
    else:
        what, hint = "cannot read this file", _READ_HINT
    return AccessDenied(
        target, f"permission denied: {target} ({what}: {_owner(st)}; {who}); {hint}"
    )


def read_only_fs(path: str | os.PathLike[str]) -> AccessDenied:
    """The AccessDenied for writing in `path` on a read-only file system (EROFS)."""
    target = _deepest_existing(os.fspath(path))
    return AccessDenied(
        target,
        f"read-only file system: cannot write in {target} ({whoami()}); {_ROFS_HINT}",
        errno.EROFS,
    )


def explain(
    exc: OSError, action: Action = "read", path: str | os.PathLike[str] | None = None
) -> OSError:
    """`exc` as an AccessDenied when it is a permission error (EACCES, EPERM) or a read-only
    file system (EROFS), else `exc` itself: `raise fileaccess.explain(e) from e`. `path`
    stands in when the error names no file."""
    if isinstance(exc, AccessDenied):
        return exc
    where = exc.filename if exc.filename is not None else path
    if where is None:
        return exc
    if exc.errno == errno.EROFS:
        return read_only_fs(where)
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM):
        return denied(where, action)
    return exc


def message(exc: BaseException, action: Action = "read") -> str:
    """One line for `exc`: the AccessDenied line for a permission error, else `str(exc)`."""
    if isinstance(exc, OSError):
        return str(explain(exc, action))
    return str(exc)


def check_readable(path: str | os.PathLike[str]) -> None:
    """Raise AccessDenied when this process cannot open `path` (a file, or a folder: list it)
    for reading; a missing path raises FileNotFoundError as usual. For files that a library
    opens and then misreports (safetensors, tokenizers)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise explain(exc, "read", path) from exc
    os.close(fd)


def check_writable_dir(path: str | os.PathLike[str]) -> None:
    """Create the folder `path` if missing and check that this process can create a file in
    it; raise AccessDenied (a read-only file system included) naming what stops it."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".loraplane-probe-")
    except OSError as exc:
        raise explain(exc, "write", path) from exc
    os.close(fd)
    os.unlink(probe)


def check_writable_file(path: str | os.PathLike[str]) -> None:
    """Raise AccessDenied when this process cannot open the existing file `path` for
    writing (a database file); a missing file raises FileNotFoundError."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise explain(exc, "write", path) from exc
    os.close(fd)
