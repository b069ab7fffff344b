"""Durable small files: the atomic metadata write, directory fsync, new marker files.

A checkpoint is committed by renaming its metadata into place; these helpers make that rename
atomic and durable, and never write through (or replace, or remove) a symbolic link.
"""

from __future__ import annotations

import contextlib
import errno as errno_
import os
import stat
from collections.abc import Callable
from pathlib import Path

from ckptlab.errors import StorageIOError

__all__ = ["METADATA", "NEW_FILE_FLAGS", "fsync_dir", "read_small", "write_metadata",
           "write_new_file"]

METADATA = ".metadata"  # DCP's metadata file name, the commit point of a checkpoint
# a file created new, never through a link
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
    | getattr(os, "O_CLOEXEC", 0)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory, so the renames and new names in it are durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: str | os.PathLike[str], data: bytes, *, sync: bool,
                   on_created: Callable[[], None] | None = None) -> None:
    """Create ``path`` new (``O_EXCL | O_NOFOLLOW``), write ``data``, optionally fsync.

    Parameters
    ----------
    path
        The file to create; nothing may be at that name (not even a link).
    data
        Its bytes.
    sync
        fsync the file before closing it.
    on_created
        Runs once the file exists, before the first byte is written: a caller that must
        remove a half-written file on failure learns here that the file is its own.

    Raises
    ------
    OSError
        As the OS reports it (EEXIST, ELOOP for a link at the name, ENOSPC...).
    """
    fd = os.open(path, NEW_FILE_FLAGS, 0o644)
    try:
        if on_created is not None:
            on_created()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_small(path: str | os.PathLike[str]) -> bytes | None:
    """A small file's bytes, read without following a link; None if it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks)


def _refuse_symlink(path: Path, what: str) -> bool:
    """Raise if ``path`` is a symbolic link; True if something else is there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:  # pragma: no cover - raced away
            target = "?"
        raise StorageIOError(
            f"refusing to write the metadata: the {what} is a symbolic link (to {target!r}); "
            "ckptlab never writes through, replaces or removes a link in a checkpoint "
            "directory: remove it or save elsewhere", path=str(path), offset=0, nbytes=0,
            errno=errno_.ELOOP)
    return True


def write_metadata(directory: str | os.PathLike[str], data: bytes,
                   name: str = METADATA, *, sync: bool = True,
                   before_rename: Callable[[], None] | None = None) -> Path:
    """Write a checkpoint's metadata atomically: a temporary file, fsync, rename, then fsync
    of the directory, so a reader sees the old metadata or the new one, never a part.

    Parameters
    ----------
    directory
        The checkpoint directory.
    data
        The metadata's bytes.
    name
        The final file name (``.metadata``).
    sync
        fsync the file and the directory (without it the rename stays atomic, not durable).
    before_rename
        For tests and tracing: runs once the temporary is complete, just before the rename.

    Returns
    -------
    Path
        The final path.

    Raises
    ------
    StorageIOError
        On any failure (the temporary file is removed), or for a symbolic link at the
        temporary's (``{name}.tmp``) or the final name (errno ``ELOOP``; its target is never
        opened). A regular file left at the temporary name by a killed writer is removed first.
    """
    directory = Path(directory)
    final = directory / name
    tmp = directory / f"{name}.tmp"
    created: list[bool] = []  # non-empty once the temporary is ours: remove it on failure
    try:
        _refuse_symlink(final, "final name")
        if _refuse_symlink(tmp, "temporary"):
            os.unlink(tmp)  # a stale temporary of a writer that died before its rename
        write_new_file(tmp, data, sync=sync, on_created=lambda: created.append(True))
        if before_rename is not None:
            before_rename()
        _refuse_symlink(final, "final name")
        os.replace(tmp, final)
        created.clear()
        if sync:
            fsync_dir(directory)
    except BaseException as e:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, StorageIOError):
            raise StorageIOError(f"could not write the metadata ({len(data)} bytes): "
                                 f"{e.strerror or e}", path=str(final), offset=0,
                                 nbytes=len(data), errno=e.errno) from e
        raise
    return final
