"""Multipart uploads streamed straight to files in a work folder, under a size cap.

Nothing is held in memory beyond one chunk: each file part is written as it arrives, the
byte count is checked on every chunk (PayloadTooLarge past the cap), and part names, counts
and file names are checked before a byte of them is written.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from loraplane.controlplane.errors import InvalidRequest, PayloadTooLarge

TEXT_FIELDS = ("name", "base_model", "signature", "signature_key_id")
FILE_FIELD = "files"
MAX_FILES = 64  # a Trainer's checkpoint-* folder holds a dozen; the extra ones are ignored
MAX_TEXT_BYTES = 1024
_FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


@dataclass
class Upload:
    """What a multipart upload held: its text fields and the files written to `folder`."""

    folder: Path
    fields: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)

    def source(self) -> Path:
        """What the adapter core should read: the single file (an archive) or the folder."""
        if not self.files:
            raise InvalidRequest(f"no file parts: send the adapter as {FILE_FIELD!r} parts")
        return self.files[0] if len(self.files) == 1 else self.folder


def boundary_of(content_type: str) -> bytes:
    """The boundary of a `multipart/form-data` content type; InvalidRequest otherwise."""
    kind, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise InvalidRequest("expected multipart/form-data with a boundary")
    return boundary


def safe_filename(raw: str) -> str:
    """The last path component of a client's file name, if it is a plain, safe name."""
    name = re.split(r"[/\\]", raw)[-1]
    if not _FILENAME.match(name):
        raise InvalidRequest(f"file name {raw[:80]!r} is not allowed (letters, digits, ._-)")
    return name


class _Collector:
    """Parser callbacks: route each part to a file or a bounded text buffer."""

    def __init__(self, upload: Upload) -> None:
        self.upload = upload
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[str, bytes] = {}
        self._file: BinaryIO | None = None
        self._text: bytearray | None = None
        self._text_name = ""

    def on_part_begin(self) -> None:
        self._headers = {}

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        self._headers[self._header_field.decode("latin-1").lower()] = bytes(self._header_value)
        self._header_field.clear()
        self._header_value.clear()

    def on_headers_finished(self) -> None:
        disposition = self._headers.get("content-disposition")
        _, params = parse_options_header(disposition)
        name = params.get(b"name", b"").decode("utf-8", "replace")
        filename = params.get(b"filename")
        if filename is not None:
            if name != FILE_FIELD:
                raise InvalidRequest(f"file part {name!r}: files go in {FILE_FIELD!r} parts")
            if len(self.upload.files) >= MAX_FILES:
                raise InvalidRequest(f"more than {MAX_FILES} file parts")
            path = self.upload.folder / safe_filename(filename.decode("utf-8", "replace"))
            if path in self.upload.files:
                raise InvalidRequest(f"two file parts named {path.name!r}")
            self.upload.files.append(path)
            self._file = path.open("xb")
            return
        if name not in TEXT_FIELDS:
            raise InvalidRequest(f"unknown form field {name!r}; expected {', '.join(TEXT_FIELDS)}")
        if name in self.upload.fields:
            raise InvalidRequest(f"form field {name!r} given twice")
        self._text, self._text_name = bytearray(), name

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._file is not None:
            # A plain write: it lands in the page cache; the store fsyncs what it keeps.
            self._file.write(data[start:end])
        elif self._text is not None:
            self._text += data[start:end]
            if len(self._text) > MAX_TEXT_BYTES:
                raise InvalidRequest(f"form field {self._text_name!r} is too long")

    def on_part_end(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._text is not None:
            try:
                self.upload.fields[self._text_name] = self._text.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidRequest(f"form field {self._text_name!r} is not UTF-8") from None
            self._text = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


async def receive_multipart(
    chunks: AsyncIterator[bytes], content_type: str, folder: Path, *, max_bytes: int
) -> Upload:
    """Parse a multipart body from `chunks`, writing file parts into `folder`."""
    upload = Upload(folder)
    collector = _Collector(upload)
    parser = MultipartParser(
        boundary_of(content_type),
        {
            "on_part_begin": collector.on_part_begin,
            "on_header_field": collector.on_header_field,
            "on_header_value": collector.on_header_value,
            "on_header_end": collector.on_header_end,
            "on_headers_finished": collector.on_headers_finished,
            "on_part_data": collector.on_part_data,
            "on_part_end": collector.on_part_end,
        },
    )
    received = 0
    try:
        async for chunk in chunks:
            received += len(chunk)
            if received > max_bytes:
                raise PayloadTooLarge(f"the upload is larger than the limit of {max_bytes} bytes")
            parser.write(chunk)
        parser.finalize()
    except MultipartParseError as exc:
        raise InvalidRequest(f"malformed multipart body: {exc}") from exc
    finally:
        collector.close()
    return upload
