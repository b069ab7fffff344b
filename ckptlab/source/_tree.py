"""A directory of checkpoint files, on this machine or behind a URL, and where a name points.

The open code reaches files by name through a :class:`Tree` and never asks which kind it has:

- :meth:`Tree.list` gives the directory's files, or None where it cannot be listed (HTTP has
  no listing: the reader then opens the names a checkpoint directory has, in order, a miss
  costing one request);
- :meth:`Tree.source` opens one file as a :class:`~ckptlab.source.ByteSource` (``head``: how
  many bytes of its head the reader wants first; a URL's first request asks for them, a
  local file ignores it); :meth:`Tree.read_bytes` moves a whole file (one request);
- :meth:`Tree.name_of` is the name errors and ``FileEntry.full_path`` show, :meth:`Tree.fetch`
  one read by that name (``ck.read``);
- :meth:`Tree.mapped` and :meth:`Tree.again` hold a file's bytes (a local file is mapped and
  read again when needed, refused if it changed; a URL's bytes are kept), and
  :meth:`Tree.on_disk` gives a local directory with named files (a local tree is its own; a URL
  tree copies them into a temporary directory for the time of a scan, its errors naming URLs).

A local tree refuses every name that leaves it (``..``, absolute names, symlinks out of it:
:mod:`ckptlab.source._paths`); a URL tree refuses names that climb out of its URL.

:func:`locate` turns what a user gives (a path, a ``file://`` URL, an fsspec URL, bytes, a
file object) into a :class:`Location`: a tree and the file in it, the tree alone, or an
object to read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptlab.errors import ArchiveError, CorruptArchiveError
from ckptlab.source._bytes import ByteSource, file_url_path, is_url
from ckptlab.source._paths import (
    NotFoundError,
    check_regular,
    open_inside,
    open_inside_fd,
    resolve_inside,
)

__all__ = ["LocalTree", "Location", "RemoteTree", "Tree", "check_unchanged", "file_identity",
           "locate"]

# a whole file read into memory (a JSON index, .metadata) is refused past this
MAX_WHOLE_NBYTES = 1 << 30


class Tree:
    """A directory of checkpoint files (see the module docstring): the interface."""

    #: the directory as ``Checkpoint.path`` and errors show it (a URL: without its ``/``)
    name: str
    #: what counts the requests (:class:`~ckptlab.source.RemoteStats` in ``store.stats``),
    #: None for a local directory
    store: Any = None

    def list(self) -> list[str] | None:
        """The regular files directly inside (sorted), or None where nothing can be listed."""
        raise NotImplementedError

    def name_of(self, rel: str) -> str:
        """The name of ``rel`` that errors and ``FileEntry.full_path`` show."""
        raise NotImplementedError

    def resolve(self, rel: str) -> str:
        """The name ``rel`` is read by (a local file: its real path inside the directory),
        refusing names that leave the directory."""
        raise NotImplementedError

    def source(self, rel: str, *, head: int | None = None) -> ByteSource:
        """The file ``rel`` opened for reads (the caller closes it); ``head``: the bytes of
        its head the reader wants first (a hint)."""
        return self.open(self.resolve(rel), head=head)

    def open(self, full: str, *, head: int | None = None) -> ByteSource:
        """:meth:`source` of a file by its full name (a path, a URL)."""
        raise NotImplementedError

    def read_bytes(self, rel: str, *, what: str = "file") -> tuple[str, bytes]:
        """The whole file ``rel`` (one request behind a URL), with its full name."""
        raise NotImplementedError

    def nbytes(self, rel: str) -> int:
        """The size of the file ``rel``."""
        with self.source(rel) as src:
            return src.nbytes

    def sizes(self, names: list[str] | None, *, listed: bool = False) -> dict[str, int]:
        """Bytes of each file of ``names`` that exists (the missing ones left out); None:
        every entry of the directory's listing (none where it cannot be listed). With
        ``listed`` (names from a listing), entries that are not readable regular files, and
        links out of the directory, are left out instead of refused."""
        out: dict[str, int] = {}
        for name in (self.list() or []) if names is None else names:
            try:
                out[name] = self.nbytes(name)
            except NotFoundError:
                continue
        return out

    def fetch(self, full: str, start: int, end: int, into: Any = None) -> bytes:
        """Bytes ``[start, end)`` of the file named ``full`` (one read; fewer at its end).
        ``into``: writable memory of at least ``end - start`` bytes that a local file is read
        into (then a view of it is returned: no new memory); a URL's bytes are returned as
        they arrive."""
        raise NotImplementedError

    def mapped(self, rel: str, max_nbytes: int) -> contextlib.AbstractContextManager[
            tuple[Any, tuple[int, ...]]]:
        """The bytes of ``rel`` (a buffer valid inside the ``with``) and its identity (what
        :meth:`again` compares; ``()`` where there is none). Raises ValueError when the file
        is empty or longer than ``max_nbytes``."""
        raise NotImplementedError

    def again(self, rel: str, data: Any, identity: tuple[int, ...]) -> Callable[[], bytes]:
        """A way to have the bytes :meth:`mapped` gave once more, later: a local file is read
        again (refused if it is no longer the file of ``identity``), a URL's are kept."""
        raise NotImplementedError

    def on_disk(self, wanted: Callable[[], tuple[dict[str, bytes], list[str]]]
                ) -> contextlib.AbstractContextManager[str]:
        """A local directory holding the files the tree's reader needs: ``wanted()`` gives
        the bytes already at hand by name and the other names (called only where files must
        be copied)."""
        raise NotImplementedError


class LocalTree(Tree):
    """A directory on this machine."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.name = self.root = os.fspath(root)

    def __repr__(self) -> str:
        return f"LocalTree({self.root!r})"

    def list(self) -> list[str]:
        """Regular files directly in the directory (sorted), refusing links that leave it."""
        out = []
        for name in sorted(os.listdir(self.root)):
            full = os.path.join(self.root, name)
            if os.path.islink(full):
                resolve_inside(self.root, name)  # refuses a link out of the directory
            if os.path.isfile(full):
                out.append(name)
        return out

    def name_of(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def resolve(self, rel: str) -> str:
        return resolve_inside(self.root, rel)

    def source(self, rel: str, *, head: int | None = None) -> ByteSource:
        # opened inside the directory (no link out of it, not even one swapped in after the
        # check), shown by its real path
        fd = open_inside_fd(self.root, rel)
        try:
            return ByteSource.from_fd(fd, resolve_inside(self.root, rel))
        except BaseException:
            os.close(fd)
            raise

    def open(self, full: str, *, head: int | None = None) -> ByteSource:
        return ByteSource(full)

    def read_bytes(self, rel: str, *, what: str = "file") -> tuple[str, bytes]:
        full = self.resolve(rel)
        with ByteSource(full) as src:
            return full, src.read(0, src.nbytes, what=what)

    def nbytes(self, rel: str) -> int:
        return os.path.getsize(self.resolve(rel))

    def sizes(self, names: list[str] | None, *, listed: bool = False) -> dict[str, int]:
        out = {}
        for name in sorted(os.listdir(self.root)) if names is None else names:
            full = os.path.join(self.root, name)
            try:
                real = resolve_inside(self.root, name)
                info = os.stat(real)
            except ArchiveError:
                if listed:
                    continue
                raise
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode) and listed:
                continue
            if not stat.S_ISREG(info.st_mode):
                if listed:
                    continue
                check_regular(info.st_mode, full)
            out[name] = info.st_size
        return out

    def fetch(self, full: str, start: int, end: int, into: Any = None) -> bytes:
        # into a bytearray the caller may keep (a tensor built on it needs no second copy),
        # or into the caller's memory
        fd = os.open(full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            if end <= start:
                return b""
            if not hasattr(os, "preadv"):
                return os.pread(fd, end - start, start)
            buf = bytearray(end - start) if into is None else \
                memoryview(into).cast("B")[:end - start]
            got = os.preadv(fd, [buf], start)
            return buf if got == len(buf) else buf[:got]  # type: ignore[return-value]
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def mapped(self, rel: str, max_nbytes: int) -> Iterator[tuple[Any, tuple[int, ...]]]:
        # mapped, not copied: a decoder reads the pages straight from the page cache, so a
        # 127 MB .metadata does not become 127 MB of process memory
        import mmap

        with open_inside(self.root, rel) as f:
            info = os.fstat(f.fileno())
            if not 0 < info.st_size <= max_nbytes:
                raise ValueError(f"{rel}: {info.st_size} bytes")
            with mmap.mmap(f.fileno(), info.st_size, access=mmap.ACCESS_READ) as data:
                yield data, file_identity(info)

    def again(self, rel: str, data: Any, identity: tuple[int, ...]) -> Callable[[], bytes]:
        def read() -> bytes:
            check_unchanged(os.path.join(self.root, rel), rel, identity)
            with open_inside(self.root, rel) as f:
                return f.read(identity[2])
        return read

    @contextlib.contextmanager
    def on_disk(self, wanted: Callable[[], tuple[dict[str, bytes], list[str]]]
                ) -> Iterator[str]:
        yield self.root


def file_identity(info: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one version of a file from another: device, inode, size, mtime (ns)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def check_unchanged(path: str, what: str, identity: tuple[int, ...], *,
                    unreadable: str | None = None) -> None:
    """Refuse ``path`` when it is no longer the file whose :func:`file_identity` was
    ``identity`` (another inode, size or mtime): what was read from it is stale.

    Raises
    ------
    ArchiveError
        ``path`` cannot be stat'ed ("cannot read WHAT: ...", or UNREADABLE for WHAT).
    CorruptArchiveError
        It changed ("WHAT changed since the directory was inspected; inspect it again").
    """
    try:
        now = file_identity(os.stat(path))
    except OSError as exc:
        raise ArchiveError(f"cannot read {unreadable or what}: {exc.strerror}",
                           path=path) from None
    if now != identity:
        raise CorruptArchiveError(
            f"{what} changed since the directory was inspected; inspect it again",
            path=path, expected=f"size {identity[2]}, mtime_ns {identity[3]}",
            actual=f"size {now[2]}, mtime_ns {now[3]}")


class RemoteTree(Tree):
    """A directory behind a URL (``root``, without its ``/``): files are read with exact
    ranged requests through ``store`` (a :class:`~ckptlab.source.RemoteStore`), nothing is
    listed."""

    def __init__(self, store: Any, root: str) -> None:
        self.store = store
        self.name = self.root = root.rstrip("/")

    def __repr__(self) -> str:
        return f"RemoteTree({self.root!r})"

    def list(self) -> None:
        return None  # HTTP cannot list a directory

    def name_of(self, rel: str) -> str:
        from ckptlab.source._remote import join_url

        return join_url(self.root, rel)  # refuses names that leave the directory

    resolve = name_of

    def open(self, full: str, *, head: int | None = None) -> ByteSource:
        from ckptlab.source._remote import RemoteSource

        if head is not None:
            return RemoteSource(self.store, full, first="head", window_nbytes=head)
        return RemoteSource(self.store, full)

    def read_bytes(self, rel: str, *, what: str = "file") -> tuple[str, bytes]:
        url = self.name_of(rel)
        return url, self.store.whole(url)

    def fetch(self, full: str, start: int, end: int, into: Any = None) -> bytes:
        return self.store.range(full, start, end)

    @contextlib.contextmanager
    def mapped(self, rel: str, max_nbytes: int) -> Iterator[tuple[Any, tuple[int, ...]]]:
        _, data = self.read_bytes(rel)
        if not 0 < len(data) <= max_nbytes:
            raise ValueError(f"{rel}: {len(data)} bytes")
        yield data, ()

    def again(self, rel: str, data: Any, identity: tuple[int, ...]) -> Callable[[], bytes]:
        kept = bytes(data)
        return lambda: kept

    @contextlib.contextmanager
    def on_disk(self, wanted: Callable[[], tuple[dict[str, bytes], list[str]]]
                ) -> Iterator[str]:
        """The files copied into a temporary directory (the bytes at hand written, every
        other one moved whole in one request), removed on exit; an error of the scan names
        the URL, not the copy."""
        have, names = wanted()
        urls = {name: self.name_of(name) for name in names}  # refuses names leaving root
        tmp = tempfile.mkdtemp(prefix="ckptlab-copy-")
        try:
            for name, data in have.items():
                with open(os.path.join(tmp, *name.split("/")), "wb") as f:
                    f.write(data)
            for name in names:
                if name in have:
                    continue
                target = os.path.join(tmp, *name.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    self.store.stream_to(urls[name], f)
            try:
                yield tmp
            except ArchiveError as exc:  # it names the URL, not the temporary copy
                if exc.path is not None and (exc.path + "/").startswith(tmp + "/"):
                    exc.path = self.root + exc.path[len(tmp):]
                    exc.args = (exc._render(),)
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class Location:
    """Where a name points: ``tree`` (the directory) and ``file`` (the full name of a file in
    it, None: the directory itself) with ``rel`` (the file's own name: the last component of
    its path or URL), or ``obj`` (bytes or a file object, read as they are; the others are
    then None)."""

    tree: Tree | None
    file: str | None = None
    rel: str | None = None
    obj: Any = None


def locate(source: Any, storage_options: dict[str, Any] | None = None) -> Location:
    """Where ``source`` points (see the module docstring).

    A path or URL ending in ``/`` (or a local directory) is a directory; a URL that is not is
    a file until its first request says it is a directory (:class:`~ckptlab.source.
    IsDirectoryError`: the caller opens it as one, with ``/`` added).

    Raises
    ------
    ArchiveError
        A local path where nothing is (``no such file or directory``); what the remote
        store raises for a URL it cannot read (a missing extra, an unknown protocol).
    """
    if is_url(source):
        local = file_url_path(source)
        if local is None:
            from ckptlab.source._remote import RemoteStore, url_name

            store = RemoteStore(source, storage_options)
            if source.endswith("/"):
                return Location(RemoteTree(store, source))
            parent = source.rsplit("/", 1)[0]
            return Location(RemoteTree(store, parent), source, url_name(source))
        source = local
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            return Location(LocalTree(path))
        if not os.path.exists(path):
            raise ArchiveError("no such file or directory", path=path)
        return Location(LocalTree(os.path.dirname(path)), path, os.path.basename(path))
    return Location(None, obj=source)
