"""A window on a binary file object: bytes ``[start, start + nbytes)`` as a seekable file."""

from __future__ import annotations

import io
import os
from typing import BinaryIO

__all__ = ["FileWindow"]


class FileWindow(io.RawIOBase):
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
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data
