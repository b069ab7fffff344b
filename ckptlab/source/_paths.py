"""Opening checkpoint files for reading: regular files only, and never outside a directory.

Two ways a path can hurt a reader that only means to look at bytes:

- it is not a regular file. ``open`` of a FIFO blocks until a writer appears (``ckptlab
  inspect FIFO`` hung forever), a character device like ``/dev/zero`` or ``/dev/urandom``
  never ends, a tape device rewinds on open. So the kind is checked with ``os.stat`` before
  anything is opened, the open itself is non-blocking (``O_NONBLOCK``, ``O_NOCTTY``: a path
  swapped for a FIFO between the stat and the open cannot block it), and the opened
  descriptor is checked again with ``os.fstat``, which is what counts.
- it belongs to a directory checkpoint (DCP ``.metadata``, ``relative_path`` of a data file)
  but resolves outside that directory: an absolute name, ``..``, or a symlink. Inspecting a
  directory must describe that directory, not whatever a link in it points at, so every such
  path is resolved (``os.path.realpath``) and refused unless it stays under the directory's own
  real path; after the open, the descriptor's path (``/proc/self/fd``, where there is one) or
  its device and inode are checked against the resolved path, so a link swapped in after the
  check is caught too. A symlink that stays inside the directory is followed.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from ckptlab.errors import ArchiveError, UnsupportedFormatError

__all__ = ["IsDirectoryError", "NotFoundError", "open_inside", "open_inside_fd", "open_regular",
           "resolve_inside"]


class NotFoundError(ArchiveError, FileNotFoundError):
    """The name names nothing: no such file in a directory, HTTP 404/410 for a URL, no such
    key in a store."""


class IsDirectoryError(ArchiveError, IsADirectoryError):
    """The name of a file is a directory's (a URL redirected to itself with ``/`` added)."""

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))


def file_kind(mode: int) -> str:
    """``"a regular file"``, ``"a FIFO (named pipe)"``, ``"a character device"``, ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), f"file type {stat.S_IFMT(mode):o}")


def check_regular(mode: int, path: str) -> None:
    """Raise unless ``mode`` is a regular file's (directories get their own message)."""
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise ArchiveError("is a directory, not a checkpoint file", path=path)
    kind = file_kind(mode)
    raise UnsupportedFormatError(f"is {kind}, not a regular file; ckptlab reads only regular "
                                 "files (copy the bytes to a file first)", path=path)


def open_regular(path: str, *, nofollow: bool = False, name: str | None = None) -> int:
    """A read-only descriptor of the regular file ``path``; never blocks, never opens a device.

    ``name`` is the path errors show (``path`` when not given).

    Raises
    ------
    ArchiveError
        ``path`` cannot be opened, or is a directory.
    UnsupportedFormatError
        ``path`` is a FIFO, a device, a socket (the message says which).
    """
    shown = path if name is None else name
    try:
        check_regular(os.stat(path).st_mode, shown)
        fd = os.open(path, _OPEN_FLAGS | (getattr(os, "O_NOFOLLOW", 0) if nofollow else 0))
    except OSError as exc:
        error = NotFoundError if isinstance(exc, FileNotFoundError) else ArchiveError
        raise error(f"cannot open: {exc.strerror or exc}", path=shown) from None
    try:
        check_regular(os.fstat(fd).st_mode, shown)  # what was opened, not what was stat'ed
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_inside(real: str, root_real: str) -> bool:
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


def resolve_inside(root: str | os.PathLike[str], relpath: str | os.PathLike[str]) -> str:
    """The real path of ``root/relpath``; refuses any path that leaves ``root``.

    ``relpath`` must be relative and free of ``..``; a symlink anywhere on the way may point
    elsewhere inside ``root`` but not out of it.

    Raises
    ------
    ArchiveError
        The path is absolute, climbs with ``..``, or resolves outside ``root`` (the message
        names both paths).
    """
    root = os.fspath(root)
    rel = os.fspath(relpath)
    shown = os.path.join(root, rel)
    parts = rel.replace("\\", "/").split("/")
    if (not rel or os.path.isabs(rel) or os.path.splitdrive(rel)[0] or rel.startswith(("/", "\\"))
            or ".." in parts):
        raise ArchiveError(f"names {rel!r}, a path outside the checkpoint directory (absolute "
                           "or with '..'); refusing to read it", path=shown)
    root_real = os.path.realpath(root)
    real = os.path.realpath(shown)
    if not _is_inside(real, root_real):
        raise ArchiveError(f"is a symlink that leaves the checkpoint directory (it resolves to "
                           f"{real}, outside {root_real}); refusing to read it", path=shown)
    return real


def open_inside(root: str | os.PathLike[str], relpath: str | os.PathLike[str]) -> BinaryIO:
    """``root/relpath`` opened for binary reading, if it is a regular file inside ``root``.

    See :func:`resolve_inside` and :func:`open_regular`; the returned file object owns the
    descriptor (use it as a context manager).
    """
    return os.fdopen(open_inside_fd(root, relpath), "rb")


def open_inside_fd(root: str | os.PathLike[str], relpath: str | os.PathLike[str]) -> int:
    """:func:`open_inside`'s descriptor (the caller closes it)."""
    real = resolve_inside(root, relpath)
    shown = os.path.join(os.fspath(root), os.fspath(relpath))
    fd = open_regular(real, nofollow=True, name=shown)
    try:
        opened = _fd_path(fd)
        st = os.fstat(fd)
        if opened is not None:
            moved = not _is_inside(opened, os.path.realpath(root))
        else:  # no /proc: the descriptor must be the file the resolved path names now
            now = os.stat(real)
            moved = (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino)
        if moved:
            raise ArchiveError("changed while it was opened and now leaves the checkpoint "
                               "directory; refusing to read it", path=shown)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
