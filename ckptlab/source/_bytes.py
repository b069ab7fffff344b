"""Random-access reads over a path, a bytes-like object or a binary file object, counted.

:class:`ByteSource` is the one interface every reader takes. A source behind a URL
(:class:`ckptlab.source.RemoteSource`) is the same class with another transport: what differs
is said by the source, never asked by a reader:

- :attr:`ByteSource.costly_reads`: each read is a round trip off the host (a request), so a
  reader may derive bytes it can predict rather than read them, and plan its reads ahead;
- :meth:`ByteSource.prefetch`: move ranges the reader will want (one request each behind a
  URL; nothing for a local file, whose page cache does that job);
- :meth:`ByteSource.kept`, :meth:`~ByteSource.keep`, :meth:`~ByteSource.forget`: bytes held in
  memory (every read behind a URL, or with ``cache=True``; explicit ones otherwise), served
  again without a read;
- :meth:`ByteSource.fetch`: one read that is not kept.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import os
import re
from itertools import accumulate, chain
from typing import BinaryIO, Union

from ckptlab.errors import ArchiveError, TruncatedArchiveError
from ckptlab.source._paths import (  # noqa: F401  (the errors: re-exported)
    IsDirectoryError,
    NotFoundError,
    check_regular,
    open_regular,
)

Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]

GATHER_GAP = 64 * 1024  # local file: a gap up to this is read into a scratch buffer, same call
READ_GAP = 4096  # other sources (a request each): a gap up to this is read through

try:  # the most buffers one preadv call takes
    _IOV_MAX = max(2, min(os.sysconf("SC_IOV_MAX"), 1024))
except (AttributeError, OSError, ValueError):
    _IOV_MAX = 16

# a scheme of two or more letters then "://": "C://x" (a drive letter) stays a path
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://")


def is_url(source: object) -> bool:
    """Whether ``source`` is a URL string (``https://``, ``s3://``, ``file://``...), not a path.

    Decided on the text alone (no import of fsspec, no file system call), so plain paths cost
    nothing more than before.
    """
    return isinstance(source, str) and _URL.match(source) is not None


def file_url_path(url: str) -> str | None:
    """The local path a ``file://`` URL names (``file:///a/b`` -> ``/a/b``), else None."""
    if not url[:7].lower() == "file://":
        return None
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        return None  # file://host/share: not this machine's path
    return unquote(parts.path) or "/"


class ByteSource:
    """Positional reads with a count of calls and bytes, so callers can report their I/O.

    With ``cache=True`` every read is kept and later reads inside a kept range are served from
    memory (for the few large reads of :func:`storage_offsets`).

    A path is opened once and read with ``os.pread``; a file object is read with
    ``seek`` + ``read`` (one read call per request, which is what costs on object storage),
    from the position it stands at when handed over (offsets count from there, as
    ``torch.load`` reads a file object); a bytes-like object is sliced. ``name`` is what
    errors show (default: the path, the file object's name, ``<bytes>``).
    """

    #: each read is a round trip off the host (a request): readers derive what they can
    #: predict instead of reading it, and plan their reads (False: a local file, a buffer)
    costly_reads = False

    def __init__(self, source: Source, *, cache: bool = False, name: str | None = None) -> None:
        self._init(cache)
        if isinstance(source, (bytes, bytearray, memoryview)):
            self._buffer = memoryview(source).cast("B")
            self.name = name or "<bytes>"
            self.nbytes = len(self._buffer)
        elif isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            self.name = name or path
            # regular files only: a FIFO would block the open (or the reads) forever, a device
            # like /dev/zero never ends; open_regular refuses both without blocking
            self._fd = open_regular(path, name=self.name)
            self.nbytes = os.fstat(self._fd).st_size
        elif hasattr(source, "read") and hasattr(source, "seek"):
            self._file = source
            self.name = name or str(getattr(source, "name", None) or
                                    f"<{type(source).__name__}>")
            raw = getattr(source, "raw", source)
            if isinstance(raw, io.FileIO):  # over a pipe or a device: refuse it as a path is
                try:
                    mode = os.fstat(raw.fileno()).st_mode
                except (OSError, ValueError):
                    mode = None
                if mode is not None:
                    check_regular(mode, self.name)
            try:
                # a checkpoint in a file object starts where the object stands, as torch.load
                # reads it: offsets are relative to that position
                self._base = source.tell()
                self.nbytes = source.seek(0, os.SEEK_END) - self._base
                source.seek(self._base)
            except (OSError, ValueError) as exc:
                raise ArchiveError(f"cannot seek in the file object: {exc}",
                                   path=self.name) from None
        else:
            raise TypeError(
                "expected a path, a bytes-like object or a binary file object with read() and "
                f"seek(), got {type(source).__name__}"
            )

    @classmethod
    def from_fd(cls, fd: int, name: str) -> ByteSource:
        """A source over the open descriptor ``fd`` of a regular file (the source owns it and
        closes it), shown as ``name``."""
        self = cls.__new__(cls)
        self._init(False)
        self.name = name
        self._fd = fd
        self.nbytes = os.fstat(fd).st_size
        return self

    def _init(self, keep_reads: bool) -> None:
        self.reads = 0
        self.bytes_read = 0
        self._fd: int | None = None
        self._file: BinaryIO | None = None
        self._buffer: memoryview | None = None
        self._base = 0  # file objects: their position when handed over
        self._keeps = keep_reads  # every read is kept (cache=True; behind a URL)
        self._starts: list[int] = []  # kept byte ranges, sorted, disjoint, not touching
        self._chunks: list[bytes] = []

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
        if self._starts:
            data = self.kept(offset, nbytes)
            if data is not None:
                return data
        data = self._transfer(offset, nbytes)
        if self._keeps:
            self._keep(offset, data)
        if len(data) != nbytes:
            raise self._short_read(what, record, offset, nbytes, len(data))
        return data

    def _transfer(self, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` at ``offset`` from the file itself (fewer where it ends early),
        counted in :attr:`reads` and :attr:`bytes_read`."""
        fd = self._fd
        if fd is not None:  # the common case first: one pread that gives it all
            self.reads += 1
            data = os.pread(fd, nbytes, offset)
            if len(data) != nbytes and data:  # pread may return less: read on until EOF
                parts, got = [data], len(data)
                while got < nbytes:
                    self.reads += 1
                    part = os.pread(fd, nbytes - got, offset + got)
                    if not part:
                        break
                    parts.append(part)
                    got += len(part)
                data = b"".join(parts)
        elif self._buffer is not None:
            self.reads += 1
            data = bytes(self._buffer[offset : offset + nbytes])
        else:  # a raw file object may return less than asked: loop until EOF
            assert self._file is not None
            parts, got = [], 0
            self._file.seek(self._base + offset)
            while got < nbytes:
                self.reads += 1  # every call counts: each one is a round trip off-host
                part = self._file.read(nbytes - got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
            data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.bytes_read += len(data)
        return data

    def read_into(self, offset: int, out: memoryview, *, what: str = "data",
                  record: str | None = None) -> None:
        """:meth:`read` of ``len(out)`` bytes at ``offset``, into ``out`` (a writable byte
        view): from a file, straight into it (``os.preadv``), with the same checks, counts and
        errors as :meth:`read`."""
        nbytes = len(out)
        if self._fd is None or self._keeps or self._starts or not hasattr(os, "preadv") or \
                offset < 0 or offset + nbytes > self.nbytes or nbytes == 0:
            out[:] = self.read(offset, nbytes, what=what, record=record)
            return
        got = 0
        while got < nbytes:  # pread may return less than asked: loop until EOF
            self.reads += 1
            n = os.preadv(self._fd, [out[got:]], offset + got)
            if not n:
                break
            got += n
        self.bytes_read += got
        if got != nbytes:
            raise self._short_read(what, record, offset, nbytes, got)

    def gather_into(self, starts: list[int], lengths: list[int], out: memoryview, *,
                    what: str = "data") -> None:
        """Read the spans ``starts[i]``, ``lengths[i]`` (sorted, not overlapping) back to
        back into ``out`` (a writable byte view of their total length), with the errors of
        :meth:`read` (a span past the end: the first or the last span is checked, which bound
        the others; a file cut meanwhile: span by span, at the one cut short).

        From a file, many spans take one ``os.preadv`` call: the gaps between them (up to
        :data:`GATHER_GAP` each) are read into one small scratch buffer, so neither a call
        per span nor a buffer the size of the file is paid. From other sources (where each
        call is a request), spans less than :data:`READ_GAP` apart are read as one request.
        """
        if not starts:
            return
        last = len(starts) - 1
        for i in (0, last):  # sorted: the first and the last span bound all the others
            if starts[i] < 0 or starts[i] + lengths[i] > self.nbytes:
                self.read(starts[i], lengths[i], what=what)  # raises what read() raises
        if self._fd is not None and not self._keeps and not self._starts and \
                hasattr(os, "preadv"):
            self._gather_fd(starts, lengths, out, what)
            return
        i, pos = 0, 0
        while i <= last:  # clusters of spans less than READ_GAP apart, a read each
            first, lo, end = i, starts[i], starts[i] + lengths[i]
            i += 1
            while i <= last and starts[i] - end <= READ_GAP:
                end = starts[i] + lengths[i]
                i += 1
            chunk = memoryview(self.read(lo, end - lo, what=what))
            for j in range(first, i):
                at = starts[j] - lo
                out[pos:pos + lengths[j]] = chunk[at:at + lengths[j]]
                pos += lengths[j]

    def _gather_fd(self, starts: list[int], lengths: list[int], out: memoryview,
                   what: str) -> None:
        fd = self._fd
        assert fd is not None
        scratch = memoryview(bytearray(GATHER_GAP))
        ends = list(map(int.__add__, starts, lengths))
        gaps = [0, *map(int.__sub__, starts[1:], ends[:-1])]
        bases = list(accumulate(lengths, initial=0))
        # the buffers of every span, each after the scratch buffer its gap is read into
        spans = list(map(out.__getitem__, map(slice, bases[:-1], bases[1:])))
        views = {gap: scratch[:gap] for gap in set(gaps) if gap <= GATHER_GAP}  # a few sizes
        fills = list(map(views.get, gaps))  # (None past GATHER_GAP: such a gap starts a call)
        n = len(starts)
        i = 0
        while i < n:  # a call per run of spans no more than GATHER_GAP apart, up to _IOV_MAX
            first = i
            i += 1
            stop = min(n, first + _IOV_MAX // 2)
            while i < stop and gaps[i] <= GATHER_GAP:
                i += 1
            iovs = list(chain.from_iterable(zip(fills[first + 1:i], spans[first + 1:i])))
            iovs.insert(0, spans[first])
            self.reads += 1
            got = os.preadv(fd, iovs, starts[first])
            self.bytes_read += got
            if got != ends[i - 1] - starts[first]:  # cut short (did the file shrink?):
                for j in range(first, i):  # span by span, which says where
                    self.read_into(starts[j], spans[j], what=what)

    def _short_read(self, what: str, record: str | None, offset: int, nbytes: int,
                    got: int) -> TruncatedArchiveError:
        """The error of a read that ended early (the file shrank after it was opened)."""
        return TruncatedArchiveError(f"short read of the {what}", path=self.name, record=record,
                                     offset=offset, expected=f"{nbytes} bytes",
                                     actual=f"{got} bytes")

    @property
    def holds_descriptor(self) -> bool:
        """Whether the source holds an open file descriptor (a path) until it is closed."""
        return self._fd is not None

    # -- what a reader may hint or ask (no-ops or cheap for a local file) ----------------------
    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        """Move the ``(start, end)`` ranges a reader will want, so that its reads inside them
        cost nothing more: nothing here (a local read is as cheap as a kept one); one request
        per missing range behind a URL."""

    def fetch(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` in one read, not kept (kept ones when they are all here);
        a short file gives fewer."""
        data = self.kept(start, end - start) if self._starts else None
        return data if data is not None else self._transfer(start, end - start)

    def kept(self, offset: int, nbytes: int) -> bytes | None:
        """The bytes ``[offset, offset + nbytes)`` if they are held in memory, else None."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i >= 0 and offset + nbytes <= self._starts[i] + len(self._chunks[i]):
            s = self._starts[i]
            return self._chunks[i][offset - s: offset - s + nbytes]
        return None

    def kept_ranges(self) -> list[tuple[int, int]]:
        """The byte ranges held in memory, as ``(start, end)``, sorted."""
        return [(s, s + len(c)) for s, c in zip(self._starts, self._chunks)]

    def keep(self, start: int, data: bytes) -> None:
        """Hold ``data``, bytes of the file at ``start`` read by the caller: reads inside
        them are served from memory until :meth:`forget`."""
        self._keep(start, data)

    def _keep(self, start: int, data: bytes) -> None:
        """Keep ``data`` at ``start``, merged with kept ranges it overlaps or touches."""
        if not data:
            return
        end = start + len(data)
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0 and self._starts[i] + len(self._chunks[i]) >= start:
            s = self._starts[i]
            merged = self._chunks[i][: start - s] + data
            tail = self._chunks[i][end - s:] if s + len(self._chunks[i]) > end else b""
            start, data = s, merged + tail
            del self._starts[i], self._chunks[i]
            end = start + len(data)
        else:
            i += 1
        while i < len(self._starts) and self._starts[i] <= end:
            s, c = self._starts[i], self._chunks[i]
            if s + len(c) > end:
                data = data + c[end - s:]
                end = start + len(data)
            del self._starts[i], self._chunks[i]
        self._starts.insert(i, start)
        self._chunks.insert(i, data)

    def forget(self, lo: int = 0, hi: int | None = None) -> None:
        """Drop the kept bytes inside ``[lo, hi)`` (default: all of them); kept bytes on
        either side stay."""
        hi = self.nbytes if hi is None else hi
        starts: list[int] = []
        chunks: list[bytes] = []
        for s, c in zip(self._starts, self._chunks):
            e = s + len(c)
            if e <= lo or s >= hi:
                starts.append(s)
                chunks.append(c)
                continue
            if s < lo:
                starts.append(s)
                chunks.append(c[:lo - s])
            if e > hi:
                starts.append(hi)
                chunks.append(c[hi - s:])
        self._starts, self._chunks = starts, chunks

    def close(self) -> None:
        self._starts, self._chunks = [], []
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._file is not None:  # hand the file object back where it stood
            with contextlib.suppress(OSError, ValueError):
                self._file.seek(self._base)
            self._file = None

    def __enter__(self) -> ByteSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
