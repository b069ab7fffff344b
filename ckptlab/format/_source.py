"""Random-access reads over a path, a bytes-like object or a binary file object, counted."""

from __future__ import annotations

import os
import stat
from typing import BinaryIO, Union

from ckptlab.errors import ArchiveError, TruncatedArchiveError

Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]


class ByteSource:
    """Positional reads with a count of calls and bytes, so callers can report their I/O.

    With ``cache=True`` every read is kept and later reads inside a kept range are served from
    memory (for the few large reads of :func:`storage_offsets`).

    A path is opened once and read with ``os.pread``; a file object is read with
    ``seek`` + ``read`` (one read call per request, which is what costs on object storage);
    a bytes-like object is sliced.
    """

    def __init__(self, source: Source, *, cache: bool = False) -> None:
        self._cache: list[tuple[int, bytes]] | None = [] if cache else None
        self.reads = 0
        self.bytes_read = 0
        self._fd: int | None = None
        self._file: BinaryIO | None = None
        self._buffer: memoryview | None = None
        if isinstance(source, (bytes, bytearray, memoryview)):
            self._buffer = memoryview(source).cast("B")
            self.name = "<bytes>"
            self.nbytes = len(self._buffer)
        elif isinstance(source, (str, os.PathLike)):
            self.name = os.fspath(source)
            try:
                self._fd = os.open(self.name, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            except OSError as exc:
                raise ArchiveError(f"cannot open: {exc.strerror}", path=self.name) from exc
            info = os.fstat(self._fd)
            if stat.S_ISDIR(info.st_mode):  # on Linux os.open of a directory succeeds
                os.close(self._fd)
                self._fd = None
                raise ArchiveError("is a directory, not a checkpoint file", path=self.name)
            self.nbytes = info.st_size
        elif hasattr(source, "read") and hasattr(source, "seek"):
            self._file = source
            self.name = str(getattr(source, "name", None) or f"<{type(source).__name__}>")
            start = source.tell()
            self.nbytes = source.seek(0, os.SEEK_END)
            source.seek(start)
        else:
            raise TypeError(
                "expected a path, a bytes-like object or a binary file object with read() and "
                f"seek(), got {type(source).__name__}"
            )

    def read(self, offset: int, nbytes: int, *, what: str = "data", record: str | None = None) -> bytes:
        """Read exactly ``nbytes`` at ``offset`` or raise :class:`TruncatedArchiveError`."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise TruncatedArchiveError(
                f"file ends before the end of the {what}",
                path=self.name,
                record=record,
                offset=offset,
                expected=f"{nbytes} bytes at [{offset}, {offset + nbytes})",
                actual=f"file of {self.nbytes} bytes",
            )
        if nbytes == 0:
            return b""
        if self._cache is not None:
            for start, chunk in self._cache:
                if start <= offset and offset + nbytes <= start + len(chunk):
                    return chunk[offset - start : offset - start + nbytes]
        if self._buffer is not None:
            self.reads += 1
            data = bytes(self._buffer[offset : offset + nbytes])
        else:  # pread and raw file objects may return less than asked: loop until EOF
            parts, got = [], 0
            if self._file is not None:
                self._file.seek(offset)
            while got < nbytes:
                self.reads += 1  # every call counts: each one is a round trip off-host
                if self._fd is not None:
                    part = os.pread(self._fd, nbytes - got, offset + got)
                else:
                    assert self._file is not None
                    part = self._file.read(nbytes - got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
            data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.bytes_read += len(data)
        if self._cache is not None:
            self._cache.append((offset, data))
        if len(data) != nbytes:
            raise TruncatedArchiveError(
                f"short read of the {what}",
                path=self.name,
                record=record,
                offset=offset,
                expected=f"{nbytes} bytes",
                actual=f"{len(data)} bytes",
            )
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ByteSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
