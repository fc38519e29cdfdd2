"""A `multipart/form-data` body streamed from files on disk, with its exact length known up
front (the control plane refuses an over-cap upload from its Content-Length at once)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

CHUNK = 1 << 20


class MultipartBody:
    """Text fields, then file parts named `file_field`; iterate to get the body's bytes.

    `on_bytes` hears how many file bytes each chunk carried (for a progress bar).
    """

    def __init__(
        self,
        fields: dict[str, str],
        file_field: str,
        files: list[Path],
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.boundary = "loraplane-" + secrets.token_hex(16)
        self.fields = fields
        self.file_field = file_field
        self.files = files
        self.on_bytes = on_bytes
        self.file_bytes = sum(p.stat().st_size for p in files)

    @property
    def content_type(self) -> str:
        return f"multipart/form-data; boundary={self.boundary}"

    def _field_head(self, name: str) -> bytes:
        return (
            f'--{self.boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
        ).encode()

    def _file_head(self, path: Path) -> bytes:
        return (
            f"--{self.boundary}\r\nContent-Disposition: form-data; "
            f'name="{self.file_field}"; filename="{path.name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()

    def _tail(self) -> bytes:
        return f"--{self.boundary}--\r\n".encode()

    def __len__(self) -> int:
        text = sum(len(self._field_head(k)) + len(v.encode()) + 2 for k, v in self.fields.items())
        heads = sum(len(self._file_head(p)) + 2 for p in self.files)
        return text + heads + self.file_bytes + len(self._tail())

    def __iter__(self) -> Iterator[bytes]:
        for name, value in self.fields.items():
            yield self._field_head(name) + value.encode() + b"\r\n"
        for path in self.files:
            yield self._file_head(path)
            with path.open("rb") as f:
                while chunk := f.read(CHUNK):
                    yield chunk
                    if self.on_bytes is not None:
                        self.on_bytes(len(chunk))
            yield b"\r\n"
        yield self._tail()
