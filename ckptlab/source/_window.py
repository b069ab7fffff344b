"""A window on a binary file object: bytes ``[start, start + nbytes)`` as a seekable file."""

from __future__ import annotations

import io
import os
from typing import Any, BinaryIO

__all__ = ["FileWindow", "PositionalFile"]


class _PositionedFile(io.RawIOBase):
    """A seekable, read-only binary file of ``_nbytes`` bytes; ``_read_at`` reads them."""

    _nbytes: int
    _pos: int

    def _read_at(self, pos: int, n: int) -> bytes:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._nbytes}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        n = self._nbytes - self._pos if n is None or n < 0 else min(n, self._nbytes - self._pos)
        if n <= 0:
            return b""
        data = self._read_at(self._pos, n)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


class FileWindow(_PositionedFile):
    """Bytes ``[start, start + nbytes)`` of a file object, as a seekable file object.

    Without ``nbytes`` the window runs to the end of the file: a checkpoint that starts at a
    file object's current position (``torch.load`` reads from there) is read through one.
    """

    def __init__(self, f: BinaryIO, start: int, nbytes: int | None = None,
                 name: str | None = None) -> None:
        if nbytes is None:
            end = f.seek(0, os.SEEK_END)
            nbytes = max(0, end - start)
        self._f, self._start, self._nbytes, self._pos = f, start, nbytes, 0
        self.name = name if name is not None else str(getattr(f, "name", "<file object>"))

    def _read_at(self, pos: int, n: int) -> bytes:
        self._f.seek(self._start + pos)
        return self._f.read(n)


class PositionalFile(_PositionedFile):
    """A seekable binary file object over a positional reader (a :class:`ByteSource`, a
    remote source): anything with ``read(offset, nbytes, what=...)``, ``nbytes`` and
    ``name``. Each ``read`` is one positional read of the source; nothing is read ahead, so
    APIs that take a file object (a :class:`FileWindow`, ``storage_offsets``) cost exactly the
    reads they make."""

    def __init__(self, source: Any, *, what: str = "data") -> None:
        self._src, self._what = source, what
        self._nbytes, self._pos = source.nbytes, 0
        self.name = source.name

    def _read_at(self, pos: int, n: int) -> bytes:
        return self._src.read(pos, n, what=self._what)
