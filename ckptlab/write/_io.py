"""The byte movers of the async writer: reusable page-aligned staging memory, the placement of
items in a data file, and the worker that writes one data file with large aligned writes.
"""

from __future__ import annotations

import ctypes
import errno as errno_
import fcntl
import mmap
import os
import queue
import stat
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptlab.errors import StorageIOError
from ckptlab.gds._backends import ODIRECT, POSIX
from ckptlab.write._blob import ALIGNMENT, BlobTemplate
from ckptlab.write.timeline import _Recorder

BOUNCE_NBYTES = 8 << 20  # per worker: small items, headers and tails are gathered here
WRITE_NBYTES = 32 << 20  # largest single write (one timeline event each)
DIRECT_MIN_NBYTES = 1 << 20  # tensor data at least this big is written from staging memory
SLAB_MIN_NBYTES = 64 << 20  # staging memory grows in slabs at least this big
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14

IoHook = Callable[[int | None, str, str, int, int], None]  # (bucket, phase, file, offset, nbytes)


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def _populate(view: memoryview) -> None:
    """Fault a fresh mapping's pages in one call (faster than page by page in the copy)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(len(view)),
                     ctypes.c_int(_MADV_POPULATE_WRITE))
    except (OSError, AttributeError):  # pragma: no cover - no libc: the copy faults them
        pass


class _Slab:
    __slots__ = ("base", "nbytes", "tensor", "used", "view")

    def __init__(self, nbytes: int) -> None:
        import torch

        self.view = memoryview(mmap.mmap(-1, nbytes))  # page aligned, zero filled
        _populate(self.view)
        self.tensor = torch.frombuffer(self.view, dtype=torch.uint8)  # keeps the mapping alive
        self.base = self.tensor.data_ptr()
        self.nbytes = nbytes
        self.used = 0


class StagingArena:
    """Page-aligned host memory reused from save to save; every slot starts on 4096 bytes.

    Memory is a list of anonymous mappings (slabs). ``begin`` rewinds them for a new save,
    replacing them with one slab when the save needs more than they hold; ``alloc`` hands out
    slots and adds a slab when the current ones are full (slots already handed out never
    move). A slot's tensor keeps its mapping alive, so memory a caller still holds is never
    unmapped under it.
    """

    def __init__(self) -> None:
        self._slabs: list[_Slab] = []

    @property
    def capacity_nbytes(self) -> int:
        return sum(s.nbytes for s in self._slabs)

    @property
    def used_nbytes(self) -> int:
        return sum(s.used for s in self._slabs)

    def begin(self, need_nbytes: int) -> None:
        """Rewind for a new save that will stage about ``need_nbytes`` bytes."""
        if need_nbytes > self.capacity_nbytes:
            self._slabs = [_Slab(max(align_up(need_nbytes, 2 << 20), SLAB_MIN_NBYTES))]
        for slab in self._slabs:
            slab.used = 0

    def release(self) -> None:
        """Drop every slab (memory returns to the OS once no staged tensor refers to it)."""
        self._slabs = []

    def alloc(self, nbytes: int) -> tuple[Any, memoryview]:
        """A 4096-aligned slot: (uint8 tensor, memoryview) over the same ``nbytes`` bytes."""
        need = align_up(max(nbytes, 1))
        for slab in self._slabs:
            if slab.nbytes - slab.used >= need:
                break
        else:
            slab = _Slab(max(align_up(need, 2 << 20), SLAB_MIN_NBYTES))
            self._slabs.append(slab)
        start = slab.used
        slab.used += need
        return slab.tensor[start:start + nbytes], slab.view[start:start + nbytes]

    def find(self, tensor: Any) -> memoryview | None:
        """The staging bytes of a contiguous CPU tensor that lives at a 4096-aligned slot."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        ptr = tensor.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        for slab in self._slabs:
            if slab.base <= ptr and ptr + nbytes <= slab.base + slab.used \
                    and (ptr - slab.base) % ALIGNMENT == 0:
                return slab.view[ptr - slab.base:ptr - slab.base + nbytes]
        return None


@dataclass(frozen=True, slots=True)
class Segment:
    """Bytes to put at ``offset`` of a data file; ``data`` marks a tensor's storage bytes."""

    offset: int
    source: Any  # bytes or memoryview
    data: bool = False
    ready: threading.Event | None = None  # set once the caller has copied the bytes in

    @property
    def nbytes(self) -> int:
        return len(self.source)


@dataclass(frozen=True, slots=True)
class FileJob:
    """One bucket's data file: where it goes and what goes in it, in file order."""

    bucket: int
    path: str  # absolute path
    name: str  # relative to the checkpoint directory
    segments: tuple[Segment, ...]
    nbytes: int  # the file's final size
    staging: StagingState | None = None  # the caller's copy progress (None: all staged)


class StagingState:
    """Shared by the caller (copying items in) and the workers (waiting for them)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.events: list[threading.Event] = []

    def event(self) -> threading.Event:
        ev = threading.Event()
        self.events.append(ev)
        return ev

    def abort(self, error: BaseException) -> None:
        """Staging failed: wake every waiting worker, which then gives up."""
        self.error = error
        for ev in self.events:
            ev.set()


def place_item(cursor: int, template: BlobTemplate, data: memoryview | bytes,
               segments: list[Segment],
               ready: threading.Event | None = None) -> tuple[int, int]:
    """Append a tensor item at the next 4096-aligned offset; returns (item offset, new cursor)."""
    start = align_up(cursor)
    segments.append(Segment(start, template.prefix))
    if template.data_nbytes:
        segments.append(Segment(start + template.data_offset, data, data=True, ready=ready))
    segments.append(Segment(start + template.data_offset + template.data_nbytes, template.suffix))
    return start, start + template.nbytes


class _FileWriter:
    """Writes a FileJob's segments as a stream of aligned writes.

    Small pieces (headers, pickles, bytes items, the last partial block of each tensor) are
    gathered in a page-aligned bounce buffer; the aligned body of each large tensor goes
    straight from staging memory. Every write starts at a 4096-aligned file offset and
    covers a multiple of 4096 bytes, so O_DIRECT accepts it; the file is truncated to its
    real size at the end.
    """

    def __init__(self, job: FileJob, bounce: memoryview, *, direct: bool, sync: bool,
                 recorder: _Recorder, hook: IoHook | None,
                 created: dict[str, tuple[int, int]] | None = None) -> None:
        self.job, self.bounce, self.sync = job, bounce, sync
        self.recorder, self.hook = recorder, hook
        self.created = created  # name -> (st_dev, st_ino) of each file this writer created
        self.direct = direct
        self.io_path = POSIX
        self.fd = -1
        self.bstart = 0  # file offset of bounce[0]
        self.fill = 0
        self.written = 0

    def _call_hook(self, phase: str, offset: int, nbytes: int) -> None:
        if self.hook is not None:
            self.hook(self.job.bucket, phase, self.job.name, offset, nbytes)

    def _error(self, what: str, exc: OSError, offset: int, nbytes: int) -> StorageIOError:
        return StorageIOError(f"bucket {self.job.bucket}: {what} failed: {exc.strerror or exc}",
                              path=self.job.path, offset=offset, nbytes=nbytes,
                              errno=exc.errno)

    def open(self) -> None:
        """Create the data file: new (``O_EXCL``), never through a link (``O_NOFOLLOW``).

        Then ask for ``O_DIRECT`` on the open descriptor (``fcntl``): a filesystem that
        refuses it keeps the buffered descriptor, and nothing is ever reopened by name.
        """
        t = self.recorder.now()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
            | getattr(os, "O_CLOEXEC", 0)
        try:
            self._call_hook("open", 0, 0)
            self.fd = os.open(self.job.path, flags, 0o644)
        except OSError as exc:
            if exc.errno in (errno_.EEXIST, errno_.ELOOP):
                raise self._refusal() from None
            raise self._error("open", exc, 0, 0) from None
        if self.created is not None:
            st = os.fstat(self.fd)
            self.created[self.job.name] = (st.st_dev, st.st_ino)
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETFL,
                            fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_DIRECT)
                self.io_path = ODIRECT
            except OSError:  # EINVAL: this filesystem does not do O_DIRECT
                pass
        self.recorder.add(self.job.bucket, "open", t, file=self.job.name)

    def _refusal(self) -> StorageIOError:
        path = self.job.path
        try:
            is_link = stat.S_ISLNK(os.lstat(path).st_mode)
            target = os.readlink(path) if is_link else ""
        except OSError:  # pragma: no cover - raced away
            is_link, target = False, ""
        what = (f"it is a symbolic link (to {target!r}); the writer never writes through a "
                "link" if is_link else "it already exists; the writer creates every data "
                "file new and never overwrites one")
        return StorageIOError(f"bucket {self.job.bucket}: refusing to open the data file: "
                              f"{what} (remove it, or save to another directory)",
                              path=path, offset=0, nbytes=0,
                              errno=errno_.ELOOP if is_link else errno_.EEXIST)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        t = self.recorder.now()
        done = 0
        while done < len(view):
            try:
                if done == 0:
                    self._call_hook("write", offset, len(view))
                n = os.pwrite(self.fd, view[done:], offset + done)
            except OSError as exc:
                if exc.errno == errno_.EINVAL and self.io_path == ODIRECT:
                    self._reopen_buffered()  # the filesystem refused O_DIRECT after all
                    continue
                raise self._error("write", exc, offset + done, len(view) - done) from None
            if n <= 0:
                raise StorageIOError(
                    f"bucket {self.job.bucket}: write made no progress (expected "
                    f"{len(view) - done} more bytes, the OS wrote {n})", path=self.job.path,
                    offset=offset + done, nbytes=len(view) - done)
            done += n
        self.written += len(view)
        self.recorder.add(self.job.bucket, "write", t, len(view), self.job.name)

    def _reopen_buffered(self) -> None:
        """Drop O_DIRECT on the same descriptor (never reopen by name: that could follow
        a link put there since)."""
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL,
                        fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        except OSError as exc:
            raise self._error("turning O_DIRECT off", exc, 0, 0) from None
        self.io_path = POSIX

    def _flush(self) -> None:
        if self.fill:
            self._pwrite(self.bounce[:self.fill], self.bstart)
            self.bstart += self.fill
            self.fill = 0

    def _emit(self, view: memoryview) -> None:
        """Copy bytes into the bounce buffer, writing it whenever it is full."""
        size = len(self.bounce)
        while len(view):
            n = min(size - self.fill, len(view))
            _copy(self.bounce[self.fill:self.fill + n], view[:n])
            self.fill += n
            view = view[n:]
            if self.fill == size:
                self._flush()

    def _zeros(self, nbytes: int) -> None:
        size = len(self.bounce)
        while nbytes:
            n = min(size - self.fill, nbytes)
            self.bounce[self.fill:self.fill + n] = bytes(n)
            self.fill += n
            nbytes -= n
            if self.fill == size:
                self._flush()

    def run(self) -> None:
        self.open()
        try:
            staging = self.job.staging
            for seg in self.job.segments:
                if seg.ready is not None:
                    seg.ready.wait()  # the caller is still copying this item in
                    if staging is not None and staging.error is not None:
                        raise RuntimeError(f"bucket {self.job.bucket}: staging failed, nothing "
                                           f"more is written ({staging.error!r})")
                pos = self.bstart + self.fill
                if seg.offset > pos:
                    self._zeros(seg.offset - pos)
                view = memoryview(seg.source).cast("B") if not isinstance(seg.source, memoryview) \
                    else seg.source
                body = len(view) // ALIGNMENT * ALIGNMENT
                if seg.data and body >= DIRECT_MIN_NBYTES and seg.offset % ALIGNMENT == 0 \
                        and _address(view) % ALIGNMENT == 0:
                    self._flush()  # bstart is now seg.offset: aligned
                    for lo in range(0, body, WRITE_NBYTES):
                        hi = min(lo + WRITE_NBYTES, body)
                        self._pwrite(view[lo:hi], seg.offset + lo)
                    self.bstart = seg.offset + body
                    view = view[body:]
                self._emit(view)
            end = self.bstart + self.fill
            self._zeros(align_up(end) - end)
            self._flush()
            if self.job.nbytes != end:  # pragma: no cover - placement guarantees this
                raise StorageIOError(f"bucket {self.job.bucket}: placed {end} bytes",
                                     path=self.job.path, offset=0, nbytes=self.job.nbytes)
            try:
                os.ftruncate(self.fd, end)
            except OSError as exc:
                raise self._error("truncate", exc, end, 0) from None
            if self.sync:
                t = self.recorder.now()
                try:
                    self._call_hook("fsync", 0, end)
                    os.fsync(self.fd)
                except OSError as exc:
                    raise self._error("fsync", exc, 0, end) from None
                self.recorder.add(self.job.bucket, "fsync", t, 0, self.job.name)
        finally:
            t = self.recorder.now()
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self.recorder.add(self.job.bucket, "close", t, 0, self.job.name)
        self.recorder.file(self.job.bucket, self.job.name, self.job.nbytes, self.io_path)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def _copy(dst: memoryview, src: memoryview) -> None:
    """memcpy that releases the GIL for large copies (numpy does)."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class WorkerPool:
    """Persistent worker threads, each with its own page-aligned bounce buffer.

    Threads, not processes: the staging copy is done by the caller, and a worker spends its
    time in ``pwrite`` / ``fsync`` (the GIL is released) and in numpy copies of small pieces
    (released too), so threads cost the caller's Python almost nothing, share the staging
    memory without shared-memory segments, and cannot leave a stale fork copy behind.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the writer's workers were closed")
            while len(self._threads) < self.n:
                t = threading.Thread(target=self._loop, name=f"ckptlab-writer-{len(self._threads)}",
                                     daemon=True)
                t.start()
                self._threads.append(t)

    def submit(self, fn: Callable[[memoryview], Any]) -> Future:
        """Run ``fn(bounce_buffer)`` on a worker; its result or exception lands in the future."""
        self._start()
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def _loop(self) -> None:
        bounce = memoryview(mmap.mmap(-1, BOUNCE_NBYTES))
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(bounce))
            except BaseException as exc:  # a worker never dies of a job: it reports it
                fut.set_exception(exc)

    @property
    def alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        for t in threads:
            t.join()
