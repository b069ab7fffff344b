"""Checkpoints behind URLs: exact ranged reads, every request counted.

Each read a checkpoint needs from a remote file is a round trip, so this module is written
around the requests, not around a file object:

- **HTTP(S)** goes through fsspec's aiohttp session with requests ckptlab writes itself: a
  suffix request (``Range: bytes=-N``) gives the file's size (``Content-Range``) and its tail in
  one round trip, a ``Range: bytes=0-(N-1)`` request gives the size and the head; every later
  read is one ``GET`` of exactly the bytes asked (``Range: bytes=a-b``). No ``HEAD``, no
  ``info``, no read-ahead: fsspec's file objects would make a ``HEAD`` for the size and read
  blocks ahead of every seek.
- **Other fsspec URLs** (``s3://``, ``hf://``, ``gs://``, ``memory://``...) go through the
  filesystem's ``size`` (one request, an ``info`` call these stores need for the size) and
  ``cat_file(path, start, end)``, one request per read.
- ``file://`` URLs are not remote: :func:`ckptlab.open` reads them as local paths.

Over HTTP, the strong ``ETag`` of a file's first answer is sent as ``If-Match`` with every
later request of it: a file replaced on the server after it was first read is an
:class:`~ckptlab.errors.ArchiveError`, never bytes of two versions put together. (A 412 is
asked again without the condition, in case a server in front compared it with an ETag of its
own: only a different ETag of the file is the error. Bytes already kept are not asked again:
they are of the version first read.)

A :class:`RemoteSource` is a :class:`~ckptlab.source.ByteSource` over one URL: the
bytes of each request are kept, and a later read inside kept bytes costs nothing (that is all
it caches). ``reads`` counts the requests made through it and ``bytes_read`` the bytes they
moved; a :class:`RemoteStats` shared by every file of one checkpoint adds them up.

fsspec (and aiohttp for HTTP) is imported on first use: installing the ``remote`` extra
(``pip install 'ckptlab[remote]'``) is only needed to open URLs.
"""

from __future__ import annotations

import posixpath
import re
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ckptlab.errors import ArchiveError, TruncatedArchiveError, UnsupportedFormatError
from ckptlab.source._bytes import ByteSource, IsDirectoryError, NotFoundError
from ckptlab.source._window import PositionalFile

__all__ = [
    "DEFAULT_HEAD_NBYTES",
    "DEFAULT_WINDOW_NBYTES",
    "RemoteFileObject",
    "RemoteNotFoundError",
    "RemoteSource",
    "RemoteStats",
    "RemoteStore",
    "join_url",
]

# The first request of a file asks for this many bytes of its tail (zip archives: trailer and
# central directory of ~15,000 records; a file this small arrives whole in that request) ...
DEFAULT_WINDOW_NBYTES = 1 << 20
# ... or of its head (safetensors: a header of ~2,500 tensors; a longer one costs one more)
DEFAULT_HEAD_NBYTES = 1 << 18

_CONTENT_RANGE = re.compile(r"bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)")


#: the URL names nothing (HTTP 404/410, or the store has no such key)
RemoteNotFoundError = NotFoundError


@dataclass
class RemoteStats:
    """Requests made and bytes moved, over every file of one opened checkpoint."""

    requests: int = 0
    bytes_moved: int = 0
    log: list[tuple[str, str]] = field(default_factory=list)  # (url, range) per request

    def add(self, url: str, what: str, nbytes: int) -> None:
        self.requests += 1
        self.bytes_moved += nbytes
        self.log.append((url, what))


def join_url(base: str, name: str) -> str:
    """``name`` (a relative path inside a directory) under the directory URL ``base``."""
    if name.startswith("/") or "://" in name or any(p == ".." for p in name.split("/")):
        raise ArchiveError(f"a file name that leaves the directory: {name!r}", path=base)
    return base.rstrip("/") + "/" + name


def _directory_form(url: str, final: str) -> bool:
    """Whether ``final`` (where redirects led) is ``url`` with a ``/`` added to its path."""
    asked, got = urlsplit(url), urlsplit(final)
    return not asked.path.endswith("/") and got.path == asked.path + "/"


def url_name(url: str) -> str:
    """The last path component of a URL (``https://h/a/b.pt?x=1`` -> ``b.pt``)."""
    return posixpath.basename(urlsplit(url).path.rstrip("/")) or url


class RemoteStore:
    """Ranged requests against URLs of one scheme, counted into :attr:`stats`.

    Parameters
    ----------
    url
        Any URL of the store (it picks the transport: HTTP(S) or the fsspec filesystem of the
        URL's protocol).
    storage_options
        Passed to ``fsspec.url_to_fs`` (credentials, endpoints) for non-HTTP URLs, and as
        client keyword arguments (``headers``...) to fsspec's HTTP filesystem.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        try:
            import fsspec
        except ImportError as exc:
            raise UnsupportedFormatError(
                f"opening a URL needs fsspec ({exc.name} is missing): install ckptlab's "
                "'remote' extra (pip install 'ckptlab[remote]')", path=url) from None
        self.stats = RemoteStats()
        self._lock = threading.Lock()
        # url -> the strong ETag of its first HTTP answer: later requests send it as
        # If-Match, so bytes of two versions of a file are never put together
        self.etags: dict[str, str] = {}
        scheme = urlsplit(url).scheme.lower()
        self.http = scheme in ("http", "https")
        options = dict(storage_options or {})
        try:
            if self.http:
                from fsspec.implementations.http import HTTPFileSystem

                self._fs = HTTPFileSystem(**options)
            else:
                self._fs, _ = fsspec.url_to_fs(url, **options)
        except ImportError as exc:
            raise UnsupportedFormatError(
                f"opening {scheme}:// URLs needs {exc.name or 'a missing module'}: install "
                "ckptlab's 'remote' extra (pip install 'ckptlab[remote]'), and for this "
                f"protocol its fsspec backend", path=url) from None
        except ValueError as exc:  # an unknown protocol
            raise UnsupportedFormatError(f"no fsspec filesystem for this URL: {exc}",
                                         path=url) from None

    # -- the requests -----------------------------------------------------------------------
    def _http(self, url: str, range_header: str | None, *, if_match: bool = True
              ) -> tuple[int, dict[str, str], bytes]:
        from fsspec.asyn import sync

        etag = self.etags.get(url) if if_match else None

        async def get() -> tuple[int, dict[str, str], bytes, int, str]:
            session = await self._fs.set_session()
            headers = {"Accept-Encoding": "identity"}
            if range_header is not None:
                headers["Range"] = range_header
            if etag is not None:  # the file as it was when first read, or 412
                headers["If-Match"] = etag
            async with session.get(self._fs.encode_url(url), headers=headers) as r:
                body = await r.read()
                return (r.status, {k.lower(): v for k, v in r.headers.items()}, body,
                        len(r.history), str(r.url))

        try:
            status, headers, body, hops, final = sync(self._fs.loop, get)
        except OSError as exc:
            raise ArchiveError(f"request failed: {exc}", path=url) from None
        except Exception as exc:  # aiohttp's ClientError and friends
            if type(exc).__module__.startswith("aiohttp"):
                raise ArchiveError(f"request failed: {type(exc).__name__}: {exc}",
                                   path=url) from None
            raise
        for _ in range(hops):  # each redirect the client followed was a request too
            self.stats.add(url, "redirect", 0)
        self.stats.add(url, range_header or "whole", len(body))
        if hops and _directory_form(url, final):
            # "dir" answered by a redirect to "dir/" (nginx: 301, then 403 without a listing)
            raise IsDirectoryError("a directory: the server redirects it to its URL with '/'",
                                   path=url)
        if status in (404, 410):
            raise RemoteNotFoundError(f"no such file (HTTP {status})", path=url)
        if status == 412 and etag is not None:
            # asked again without the condition: a server in front (a redirect to a CDN) may
            # have compared it with an ETag of its own; the file's own must still be the same
            status, headers, body = self._http(url, range_header, if_match=False)
            if headers.get("etag") != etag:
                raise ArchiveError("the file changed on the server since it was first read; "
                                   "open it again", path=url, expected=f"ETag {etag}",
                                   actual=f"ETag {headers.get('etag')}")
            return status, headers, body
        tag = headers.get("etag")
        if if_match and etag is None and tag and not tag.startswith("W/") and \
                status in (200, 206):
            self.etags[url] = tag  # a strong ETag: every later request of url must match it
        if status not in (200, 206, 416):
            raise ArchiveError(f"HTTP {status} for a read", path=url,
                               expected="200 or 206", actual=status)
        return status, headers, body

    @staticmethod
    def _content_range(url: str, headers: dict[str, str]) -> tuple[int | None, int]:
        """(first byte or None, total bytes) from a ``Content-Range`` header."""
        m = _CONTENT_RANGE.fullmatch(headers.get("content-range", "").strip())
        if m is None or m.group(3) == "*":
            raise ArchiveError("the server answered a Range request without the file's size "
                               "in Content-Range", path=url, expected="bytes a-b/size",
                               actual=headers.get("content-range"))
        return (None if m.group(1) is None else int(m.group(1))), int(m.group(3))

    def _fs_path(self, url: str) -> str:
        return self._fs._strip_protocol(url)

    def _fs_call(self, url: str, what: str, call: Any) -> Any:
        try:
            out = call()
        except FileNotFoundError:
            self.stats.add(url, what, 0)
            raise RemoteNotFoundError("no such file", path=url) from None
        except OSError as exc:
            self.stats.add(url, what, 0)
            raise ArchiveError(f"request failed: {exc}", path=url) from None
        self.stats.add(url, what, len(out) if isinstance(out, (bytes, bytearray)) else 0)
        return out

    def _size(self, url: str) -> int:
        """The file's size (one ``info`` call); a directory is an :class:`IsDirectoryError`."""
        info = self._fs_call(url, "size", lambda: self._fs.info(self._fs_path(url)))
        if info.get("type") == "directory":
            raise IsDirectoryError("a directory, not a file", path=url)
        return int(info["size"])

    def tail(self, url: str, nbytes: int) -> tuple[int, int, bytes]:
        """(file size, offset of the bytes, the last ``nbytes`` bytes or the whole file)."""
        if self.http:
            status, headers, body = self._http(url, f"bytes=-{nbytes}")
            if status == 200:  # the server ignored the Range: that is the whole file
                return len(body), 0, body
            start, total = self._content_range(url, headers)
            if status == 416 or start is None:  # an empty file
                return total, total, b""
            return total, start, body
        total = self._size(url)
        start = max(0, total - nbytes)
        return total, start, self.range(url, start, total)

    def head(self, url: str, nbytes: int) -> tuple[int, bytes]:
        """(file size, the first ``nbytes`` bytes or the whole file)."""
        if self.http:
            status, headers, body = self._http(url, f"bytes=0-{max(nbytes, 1) - 1}")
            if status == 200:
                return len(body), body
            _, total = self._content_range(url, headers)
            return total, (b"" if status == 416 else body)
        total = self._size(url)
        return total, self.range(url, 0, min(nbytes, total))

    def range(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``url`` in one request."""
        if end <= start:
            return b""
        if self.http:
            status, headers, body = self._http(url, f"bytes={start}-{end - 1}")
            if status == 200:  # the server ignored the Range
                return body[start:end]
            first, _ = self._content_range(url, headers)
            if status == 416 or first != start:
                raise TruncatedArchiveError("the server did not return the bytes asked for",
                                            path=url, offset=start,
                                            expected=f"bytes {start}-{end - 1}",
                                            actual=headers.get("content-range"))
            return body
        path = self._fs_path(url)
        return self._fs_call(url, f"bytes={start}-{end - 1}",
                             lambda: self._fs.cat_file(path, start, end))

    def whole(self, url: str) -> bytes:
        """The whole file in one request (a JSON index, ``.metadata``)."""
        if self.http:
            _, _, body = self._http(url, None)
            return body
        path = self._fs_path(url)
        return self._fs_call(url, "whole", lambda: self._fs.cat_file(path))

    def stream_to(self, url: str, target: Any) -> int:
        """The whole file written to the binary file object ``target``, in one request."""
        if not self.http:
            data = self.whole(url)
            target.write(data)
            return len(data)
        from fsspec.asyn import sync

        etag = self.etags.get(url)
        seen: list[str | None] = []

        async def get() -> tuple[int, int]:
            session = await self._fs.set_session()
            async with session.get(self._fs.encode_url(url),
                                   headers={"Accept-Encoding": "identity"}) as r:
                seen.append(r.headers.get("etag"))
                n = 0
                if r.status == 200:
                    async for chunk in r.content.iter_chunked(1 << 20):
                        target.write(chunk)
                        n += len(chunk)
                return r.status, n

        status, n = sync(self._fs.loop, get)
        self.stats.add(url, "whole", n)
        if status in (404, 410):
            raise RemoteNotFoundError(f"no such file (HTTP {status})", path=url)
        if status == 200 and etag is not None and seen and seen[0] != etag:
            raise ArchiveError("the file changed on the server since it was first read; open "
                               "it again", path=url, expected=f"ETag {etag}",
                               actual=f"ETag {seen[0]}")
        if status != 200:
            raise ArchiveError(f"HTTP {status} for a download", path=url, expected=200,
                               actual=status)
        return n


class RemoteSource(ByteSource):
    """A :class:`ByteSource` over one URL: the first request learns the size, then exact
    ranged reads, each kept so that reads inside bytes already moved cost nothing.

    Parameters
    ----------
    store
        The :class:`RemoteStore` that makes (and counts) the requests.
    url
        The file.
    first
        ``"tail"`` (a suffix request: zip archives keep their directory at the end) or
        ``"head"`` (safetensors keep their header at the start); default: ``"head"`` for a
        ``.safetensors`` name, else ``"tail"``.
    window_nbytes
        How many bytes the first request asks for (default: :data:`DEFAULT_WINDOW_NBYTES`
        for the tail, :data:`DEFAULT_HEAD_NBYTES` for the head).
    """

    costly_reads = True

    def __init__(self, store: RemoteStore, url: str, *, first: str | None = None,
                 window_nbytes: int | None = None) -> None:
        self._init(False)  # every read is kept by _transfer itself
        self._store = store
        self.url = self.name = url
        if first is None:
            first = "head" if url_name(url).endswith(".safetensors") else "tail"
        before = store.stats.requests, store.stats.bytes_moved
        if first == "tail":
            self.nbytes, start, data = store.tail(url, window_nbytes or DEFAULT_WINDOW_NBYTES)
        else:
            self.nbytes, data = store.head(url, window_nbytes or DEFAULT_HEAD_NBYTES)
            start = 0
        self._count(before)
        self._keep(start, data)

    def _count(self, before: tuple[int, int]) -> None:
        self.reads += self._store.stats.requests - before[0]
        self.bytes_read += self._store.stats.bytes_moved - before[1]

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        """Move the parts of ``ranges`` not kept yet, one request per missing range."""
        for lo, hi in ranges:
            lo, hi = max(0, lo), min(hi, self.nbytes)
            for a, b in _missing(self.kept_ranges(), lo, hi):
                before = self._store.stats.requests, self._store.stats.bytes_moved
                self._keep(a, self._store.range(self.url, a, b))
                self._count(before)

    def _transfer(self, offset: int, nbytes: int) -> bytes:
        """The missing parts of the range moved (a request each) and kept; the range from
        the kept bytes (empty when the server gave fewer)."""
        self.prefetch([(offset, offset + nbytes)])
        return self.kept(offset, nbytes) or b""

    def fetch(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``: kept ones, else one request, counted, not kept (safe beside
        other threads' reads: nothing of this source changes but its counts)."""
        data = self.kept(start, end - start) if self._starts else None
        if data is not None:
            return data
        before = self._store.stats.requests, self._store.stats.bytes_moved
        data = self._store.range(self.url, start, end)
        self._count(before)
        return data


def _missing(kept: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of ``[lo, hi)`` outside the sorted disjoint ``kept`` ranges."""
    out = []
    cursor = lo
    for a, b in kept:
        if b <= cursor:
            continue
        if a >= hi:
            break
        if a > cursor:
            out.append((cursor, min(a, hi)))
        cursor = max(cursor, b)
        if cursor >= hi:
            break
    if cursor < hi:
        out.append((cursor, hi))
    return out


#: a seekable file object over a :class:`RemoteSource` (for APIs that take one, such as
#: :func:`ckptlab.format.storage_offsets`): each ``read`` is served from kept bytes or by one
#: exact ranged request; nothing is read ahead
RemoteFileObject = PositionalFile
