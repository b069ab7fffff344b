"""The one direct-I/O layer: aligned host memory, O_DIRECT with its EINVAL fallback, whole
transfers, the GIL-free copy.

``ckptlab.gds`` (the handle backends) and ``ckptlab.write`` (the async writer's workers) move
bytes through these functions and nothing else does direct I/O. Why each piece exists:

- **Alignment.** O_DIRECT needs the buffer address, the file offset and the length aligned to
  the device's logical block (512 or 4096 bytes on ext4/xfs); :data:`BLOCK` (4096) covers both.
  ``torch.empty`` memory is only 64-byte aligned, so :func:`aligned_buffer` maps anonymous
  memory, which is page aligned. The mapping is private (Python's ``mmap(-1, n)`` is shared
  anonymous memory, backed by shmem, whose page faults cost 1.4x more here) and, on request,
  backed by transparent huge pages: one fault per 2 MiB instead of per 4 KiB, which is what
  an O_DIRECT load into fresh host memory waits on.
- **EINVAL.** A filesystem that does not do O_DIRECT (ramfs, some FUSE and network mounts)
  says so with EINVAL, at ``open`` or only at the first transfer. :func:`open_direct` and
  :func:`enable_direct` return False instead of raising, and :func:`refused` recognises the
  transfer-time case, so the caller falls back to the page cache and says why.
- **Whole transfers.** ``pwrite``/``preadv`` may move fewer bytes than asked (a signal, a
  file-size limit, a full disk); :func:`pwrite_all` / :func:`pread_all` loop and turn a
  failure into :class:`~ckptlab.errors.StorageIOError` naming the file and the bytes.
- **The copy.** A memoryview slice assignment holds the GIL for the whole memcpy; numpy's
  ``copyto`` releases it, so an I/O thread's next syscall starts while a chunk is copied.

The durable-file helpers (atomic metadata write, directory fsync, small new files) are in
:mod:`ckptlab._io.durable`.
"""

from __future__ import annotations

import ctypes
import errno as errno_
import fcntl
import mmap
import os
from typing import Any

import numpy as np

from ckptlab.errors import InvalidArgumentError, StorageIOError

__all__ = [
    "BLOCK",
    "address_of",
    "align_down",
    "align_up",
    "aligned_buffer",
    "check_inside",
    "copy_bytes",
    "disable_direct",
    "enable_direct",
    "open_direct",
    "populate",
    "pread_all",
    "pwrite_all",
    "refused",
]

BLOCK = 4096  # the one O_DIRECT / GDS granularity used everywhere in ckptlab
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
HUGE_PAGE = 2 << 20  # buffers from this size on ask for transparent huge pages
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def align_up(n: int, alignment: int = BLOCK) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment


def align_down(n: int, alignment: int = BLOCK) -> int:
    """``n`` rounded down to a multiple of ``alignment``."""
    return n // alignment * alignment


def aligned_buffer(nbytes: int, *, huge_pages: bool = False) -> memoryview:
    """A writable, zero-filled host buffer whose address is page aligned (private anonymous
    mmap).

    ``huge_pages=True`` asks for transparent huge pages from 2 MiB on: one page fault per
    2 MiB instead of per 4 KiB, which is what an O_DIRECT read into fresh memory waits on
    (a 512 MiB load here: 2.6x faster). Leave it off for memory filled through the page cache:
    there the kernel compacts memory the cache just filled to find huge pages, and reads
    slow down 2-3x.

    Raises
    ------
    InvalidArgumentError
        For ``nbytes`` < 1.
    """
    if nbytes <= 0:
        raise InvalidArgumentError(f"buffer size must be positive, got {nbytes}")
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    if huge_pages and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # pragma: no cover - a kernel without transparent huge pages
            pass
    return memoryview(buf)


def address_of(view: memoryview) -> int:
    """The address of the first byte of a contiguous buffer (read-only ones too); 0 if empty."""
    if memoryview(view).nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def populate(address: int, nbytes: int) -> bool:
    """Fault in the whole pages of ``[address, address + nbytes)`` in one call
    (``madvise(MADV_POPULATE_WRITE)``).

    Fresh memory is otherwise faulted page by page on first write, which costs as much as a
    fast disk read; doing it ahead (or on another thread) takes it off the critical path.
    Returns False where the kernel cannot (the first write then faults the pages, as always).
    """
    start = align_up(address, mmap.PAGESIZE)
    end = align_down(address + nbytes, mmap.PAGESIZE)
    if end <= start:
        return False
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - no libc
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(start, end - start, _MADV_POPULATE_WRITE) == 0


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """memcpy ``src`` into ``dst`` (same length) without holding the GIL."""
    if len(dst) != len(src):
        raise InvalidArgumentError(f"copy between buffers of different sizes "
                                   f"(expected {len(dst)} bytes, got {len(src)})")
    if len(dst):
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a filesystem refusing O_DIRECT (EINVAL), not a real I/O error."""
    return isinstance(exc, OSError) and not isinstance(exc, StorageIOError) \
        and exc.errno == errno_.EINVAL


def open_direct(path: str, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_DIRECT)``; -1 where the filesystem refuses O_DIRECT.

    Raises
    ------
    StorageIOError
        For any other failure to open (missing file, permissions, too many open files).
    """
    if not O_DIRECT:
        return -1
    try:
        return os.open(path, flags | O_DIRECT, mode)
    except OSError as exc:
        if exc.errno == errno_.EINVAL:
            return -1
        raise StorageIOError(f"cannot open with O_DIRECT: {exc.strerror}", path=path,
                             offset=0, nbytes=0, errno=exc.errno) from None


def enable_direct(fd: int) -> bool:
    """Turn O_DIRECT on for an open descriptor (``fcntl``); False where it is refused.

    Nothing is reopened by name, so a link put at the name since cannot be followed.
    """
    if not O_DIRECT:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
    except OSError:  # EINVAL: this filesystem does not do O_DIRECT
        return False
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)


def disable_direct(fd: int, path: str) -> None:
    """Turn O_DIRECT off for an open descriptor (after a transfer-time EINVAL).

    Raises
    ------
    StorageIOError
        If the descriptor's flags cannot be changed.
    """
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
    except OSError as exc:
        raise StorageIOError(f"turning O_DIRECT off failed: {exc.strerror}", path=path,
                             offset=0, nbytes=0, errno=exc.errno) from None


def pwrite_all(fd: int, view: memoryview, offset: int, path: str, *,
               raw: bool = False) -> None:
    """Write all of ``view`` at ``offset``, looping over short writes.

    Parameters
    ----------
    raw
        Re-raise the OS's ``OSError`` as it is (the caller handles EINVAL), instead of a
        :class:`~ckptlab.errors.StorageIOError`.

    Raises
    ------
    StorageIOError
        On a failed write (ENOSPC, EFBIG, EIO...) or one that makes no progress.
    """
    done, total = 0, len(view)
    while done < total:
        try:
            n = os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            if raw:
                raise
            raise StorageIOError(f"write failed: {exc.strerror}", path=path,
                                 offset=offset + done, nbytes=total - done,
                                 errno=exc.errno) from None
        if n <= 0:
            raise StorageIOError(f"write made no progress (expected {total - done} more "
                                 f"bytes, the OS wrote {n})", path=path, offset=offset + done,
                                 nbytes=total - done, errno=errno_.EIO)
        done += n


def pread_all(fd: int, view: memoryview, offset: int, path: str, *,
              raw: bool = False) -> None:
    """Fill all of ``view`` from ``offset`` (``preadv`` straight into it), looping over short
    reads.

    Raises
    ------
    StorageIOError
        On a failed read, or when the file ends before ``view`` is full.
    """
    done, total = 0, len(view)
    while done < total:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            if raw:
                raise
            raise StorageIOError(f"read failed: {exc.strerror}", path=path,
                                 offset=offset + done, nbytes=total - done,
                                 errno=exc.errno) from None
        if n == 0:
            raise StorageIOError(f"file ends before the payload (expected {total - done} "
                                 "more bytes, got 0)", path=path, offset=offset + done,
                                 nbytes=total - done)
        done += n


def check_inside(fd: int, offset: int, nbytes: int, path: str) -> None:
    """Raise :class:`~ckptlab.errors.StorageIOError` unless ``[offset, offset + nbytes)``
    lies inside the file."""
    size = os.fstat(fd).st_size
    if offset < 0 or offset + nbytes > size:
        raise StorageIOError(f"read past the end of the file (expected at most {size} bytes, "
                             f"got a range ending at {offset + nbytes})", path=path,
                             offset=offset, nbytes=nbytes)


def as_bytes(source: Any) -> memoryview:
    """A flat byte view of ``source`` (bytes, bytearray, mmap, memoryview, numpy)."""
    view = source if isinstance(source, memoryview) else memoryview(source)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
