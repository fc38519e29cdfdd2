"""Find an adapter's two files in a directory, a `.tar(.gz)` or a `.zip`, safely.

Archives come from tenants: members are checked before anything is written (no absolute or
`..` paths, no links, devices or FIFOs, bounded entry count and sizes) and only the two files
loraplane reads are extracted, with the bytes counted as they stream, not trusted from headers.
Pickled weights are refused by name, never opened. A Trainer's checkpoint folder is accepted:
its known artefacts (training_args.bin, optimizer.pt, scheduler.pt, rng_state*.pth, ...; see
TRAINER_PICKLES) and every other extra file are ignored, never opened, and listed as ignored.
"""

from __future__ import annotations

import posixpath
import re
import stat
import tarfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import IO

from loraplane import fileaccess
from loraplane.adapters.errors import AdapterRejected, ReasonCode
from loraplane.adapters.limits import AdapterLimits

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# What transformers.Trainer saves beside the adapter in a checkpoint-* folder that is pickled
# but holds no weights (the training arguments, optimizer, LR scheduler, AMP scaler and RNG
# states, one rng_state_<rank>.pth per process): ignored, never unpickled. Any other pickle may
# be weights (adapter_model.bin, pytorch_model.bin) and is refused by name.
TRAINER_PICKLES = re.compile(
    r"^(training_args\.bin|optimizer\.(pt|bin)|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth)$"
)


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """The two files of a PEFT LoRA adapter, on local disk."""

    config_path: Path
    weights_path: Path
    origin: str
    # the other files beside them (paths inside the folder or archive), never opened
    ignored: tuple[str, ...] = ()


def _unsafe(message: str) -> AdapterRejected:
    return AdapterRejected(ReasonCode.UNSAFE_ARCHIVE, message)


def _check_member_name(name: str) -> str:
    if not name or len(name) > 1024 or "\x00" in name or "\\" in name:
        raise _unsafe(f"archive entry name {name[:80]!r} is not allowed")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise _unsafe(f"archive entry {name!r} has an absolute path")
    norm = posixpath.normpath(name)
    if norm == ".." or norm.startswith("../") or "/../" in f"/{name}/":
        raise _unsafe(f"archive entry {name!r} escapes the archive with '..'")
    return norm


def _is_weights_pickle(name: str) -> bool:
    """A pickle that may hold weights: any pickle but the Trainer's known artefacts."""
    base = posixpath.basename(name)
    return base.lower().endswith(PICKLE_SUFFIXES) and not TRAINER_PICKLES.match(base)


def _pick(names: dict[str, str], origin: str) -> tuple[str, str, tuple[str, ...]]:
    """From normalised member paths, choose the config and weights (root or one folder).

    Returns them and the sorted names of every other file, which are ignored.
    """
    pickles = [n for n in sorted(names) if _is_weights_pickle(n)]
    if pickles:
        beside = any(posixpath.basename(n) == WEIGHTS_NAME for n in names)
        advice = (
            f"remove it (the {WEIGHTS_NAME} beside it is what is served)"
            if beside
            else f"save the adapter as {WEIGHTS_NAME} (safetensors)"
        )
        raise AdapterRejected(
            ReasonCode.UNSUPPORTED_FORMAT,
            f"{pickles[0]!r} is a pickle file: pickled weights are never loaded; {advice}",
        )
    dirs = {posixpath.dirname(n) for n in names if posixpath.basename(n) == CONFIG_NAME}
    if len(dirs) > 1:
        raise AdapterRejected(
            ReasonCode.UNSUPPORTED_FORMAT, f"{origin} holds more than one {CONFIG_NAME}"
        )
    if not dirs:
        raise AdapterRejected(ReasonCode.INVALID_CONFIG, f"{origin} has no {CONFIG_NAME}")
    (folder,) = dirs
    if folder.count("/") > 0:
        raise AdapterRejected(
            ReasonCode.UNSUPPORTED_FORMAT,
            f"{CONFIG_NAME} must be at the top of {origin} or in one folder, not in {folder!r}",
        )
    config = posixpath.join(folder, CONFIG_NAME)
    weights = posixpath.join(folder, WEIGHTS_NAME)
    if weights not in names:
        raise AdapterRejected(
            ReasonCode.UNSUPPORTED_FORMAT, f"{origin} has no {WEIGHTS_NAME} beside {CONFIG_NAME}"
        )
    ignored = tuple(sorted(n for n in names if n not in (config, weights)))
    return names[config], names[weights], ignored


def _copy_capped(src: IO[bytes], dest: Path, cap: int, what: str) -> None:
    written = 0
    with open(dest, "wb") as out:
        while chunk := src.read(1 << 20):
            written += len(chunk)
            if written > cap:
                raise AdapterRejected(ReasonCode.TOO_LARGE, f"{what} is larger than {cap} bytes")
            out.write(chunk)


def _caps(limits: AdapterLimits) -> dict[str, int]:
    from loraplane.adapters.peft_config import MAX_CONFIG_BYTES

    return {CONFIG_NAME: MAX_CONFIG_BYTES, WEIGHTS_NAME: limits.max_bytes}


def _from_tar(path: Path, workdir: Path, limits: AdapterLimits) -> AdapterFiles:
    try:
        with tarfile.open(path, mode="r:*") as tar:
            members: dict[str, tarfile.TarInfo] = {}
            total = 0
            for count, m in enumerate(tar, start=1):
                if count > limits.max_archive_entries:
                    raise _unsafe(f"archive has more than {limits.max_archive_entries} entries")
                name = _check_member_name(m.name)
                if m.issym() or m.islnk():
                    raise _unsafe(f"archive entry {m.name!r} is a link")
                if not (m.isfile() or m.isdir()):
                    raise _unsafe(f"archive entry {m.name!r} is a device, FIFO or special file")
                total += m.size
                if total > limits.max_archive_bytes:
                    raise _unsafe(f"archive unpacks to more than {limits.max_archive_bytes} bytes")
                if m.isfile():
                    if name in members:
                        raise _unsafe(f"archive has two entries named {name!r}")
                    members[name] = m
            config, weights, ignored = _pick({n: n for n in members}, path.name)
            caps = _caps(limits)
            for member, target in ((config, CONFIG_NAME), (weights, WEIGHTS_NAME)):
                src = tar.extractfile(members[member])
                if src is None:  # pragma: no cover - regular files always have data
                    raise _unsafe(f"cannot read {member!r}")
                _copy_capped(src, workdir / target, caps[target], member)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise _unsafe(f"{path.name} is not a readable tar archive: {e}") from e
    return AdapterFiles(workdir / CONFIG_NAME, workdir / WEIGHTS_NAME, str(path), ignored)


def _from_zip(path: Path, workdir: Path, limits: AdapterLimits) -> AdapterFiles:
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            if len(infos) > limits.max_archive_entries:
                raise _unsafe(f"archive has more than {limits.max_archive_entries} entries")
            members: dict[str, zipfile.ZipInfo] = {}
            total = 0
            for info in infos:
                name = _check_member_name(info.filename.rstrip("/") or info.filename)
                # Unix file type bits, when the archiver recorded them (often only permissions)
                ftype = stat.S_IFMT(info.external_attr >> 16)
                if ftype == stat.S_IFLNK:
                    raise _unsafe(f"archive entry {info.filename!r} is a symbolic link")
                if ftype not in (0, stat.S_IFREG, stat.S_IFDIR):
                    raise _unsafe(f"archive entry {info.filename!r} is a special file")
                if info.flag_bits & 0x1:
                    raise _unsafe(f"archive entry {info.filename!r} is encrypted")
                total += info.file_size
                if total > limits.max_archive_bytes:
                    raise _unsafe(f"archive unpacks to more than {limits.max_archive_bytes} bytes")
                if not info.is_dir():
                    if name in members:
                        raise _unsafe(f"archive has two entries named {name!r}")
                    members[name] = info
            config, weights, ignored = _pick({n: n for n in members}, path.name)
            caps = _caps(limits)
            for member, target in ((config, CONFIG_NAME), (weights, WEIGHTS_NAME)):
                with zf.open(members[member]) as src:
                    _copy_capped(src, workdir / target, caps[target], member)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError) as e:
        raise _unsafe(f"{path.name} is not a readable zip archive: {e}") from e
    return AdapterFiles(workdir / CONFIG_NAME, workdir / WEIGHTS_NAME, str(path), ignored)


def _from_dir(path: Path) -> AdapterFiles:
    fileaccess.check_readable(path)
    names = {p.name: p.name for p in path.iterdir() if p.is_file()}
    config, weights, ignored = _pick(names, str(path))
    files = AdapterFiles(path / config, path / weights, str(path), ignored)
    fileaccess.check_readable(files.config_path)  # "permission denied", not InvalidSafetensors
    fileaccess.check_readable(files.weights_path)
    return files


def archive_kind(path: Path) -> str | None:
    """'tar', 'zip' or None, from the file's first bytes (never from its name alone)."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if head.startswith(b"\x1f\x8b") or head.startswith(b"BZh") or head.startswith(b"\xfd7zXZ"):
        return "tar"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return None


def _lone_file(name: str) -> tuple[ReasonCode, str]:
    """Why one file that is not an archive is no adapter (the config or weights alone)."""
    both = (
        f"send {CONFIG_NAME} and {WEIGHTS_NAME} together (a folder, both files, or a .tar.gz/.zip)"
    )
    if name == CONFIG_NAME:
        return ReasonCode.UNSUPPORTED_FORMAT, f"{CONFIG_NAME} alone holds no weights: {both}"
    if name == WEIGHTS_NAME:
        return ReasonCode.INVALID_CONFIG, f"{WEIGHTS_NAME} alone has no {CONFIG_NAME}: {both}"
    return (
        ReasonCode.UNSUPPORTED_FORMAT,
        f"{name} is neither an adapter folder nor a .tar.gz/.zip archive",
    )


@contextmanager
def open_adapter_source(path: Path | str, limits: AdapterLimits) -> Iterator[AdapterFiles]:
    """Yield the adapter's files from a directory or archive; extracted files are removed after.

    Raises AdapterRejected (UnsafeArchive, UnsupportedFormat, InvalidConfig, TooLarge), and
    `fileaccess.AccessDenied` (an OSError) when this process may not read them.
    """
    path = Path(path)
    try:
        is_dir = path.is_dir()
    except OSError as e:  # a folder on the way that this process cannot enter
        raise fileaccess.explain(e, path=path) from e
    if is_dir:
        yield _from_dir(path)
        return
    if not path.is_file():
        raise AdapterRejected(ReasonCode.UNSUPPORTED_FORMAT, f"{path} is not a file or folder")
    if path.name.lower().endswith(PICKLE_SUFFIXES):
        _pick({path.name: path.name}, path.name)
    fileaccess.check_readable(path)
    kind = archive_kind(path)
    if kind is None:
        raise AdapterRejected(*_lone_file(path.name))
    with TemporaryDirectory(prefix="loraplane-adapter-") as tmp:
        work = Path(tmp)
        yield (_from_zip if kind == "zip" else _from_tar)(path, work, limits)
