"""The workers: persistent threads, each writing one data file at a time with large aligned
writes through :mod:`ckptlab._io`."""

from __future__ import annotations

import errno as errno_
import mmap
import os
import queue
import stat
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ckptlab import _io
from ckptlab._io import BLOCK, address_of, align_down, align_up
from ckptlab._io.durable import NEW_FILE_FLAGS
from ckptlab.errors import StorageIOError
from ckptlab.gds._backends import ODIRECT, POSIX
from ckptlab.write._placement import FileJob
from ckptlab.write.timeline import _Recorder

__all__ = ["BOUNCE_NBYTES", "DIRECT_MIN_NBYTES", "WRITE_NBYTES", "FileWriter", "IoHook",
           "WorkerPool", "file_task"]

BOUNCE_NBYTES = 8 << 20  # per worker: small items, headers and tails are gathered here
WRITE_NBYTES = 32 << 20  # largest single write (one timeline event each)
DIRECT_MIN_NBYTES = 1 << 20  # tensor data at least this big is written from staging memory

IoHook = Callable[[int | None, str, str, int, int], None]  # (bucket, phase, file, offset, nbytes)


class FileWriter:
    """Writes a FileJob's segments as a stream of aligned writes.

    The file is opened at once; nothing is written before the caller's copy into staging
    memory is done (:meth:`StagingState.wait_all`). Small pieces (headers, pickles, bytes
    items, the last partial block of each tensor) are gathered in a page-aligned bounce
    buffer; the aligned body of each large tensor goes straight from staging memory. Every
    write starts at a 4096-aligned file offset and covers a multiple of 4096 bytes, so
    O_DIRECT accepts it; the file is truncated to its real size at the end.
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

        Then ask for ``O_DIRECT`` on the open descriptor: a filesystem that refuses it keeps
        the buffered descriptor, and nothing is ever reopened by name.
        """
        t = self.recorder.now()
        try:
            self._call_hook("open", 0, 0)
            self.fd = os.open(self.job.path, NEW_FILE_FLAGS, 0o644)
        except OSError as exc:
            if exc.errno in (errno_.EEXIST, errno_.ELOOP):
                raise self._refusal() from None
            raise self._error("open", exc, 0, 0) from None
        if self.created is not None:
            st = os.fstat(self.fd)
            self.created[self.job.name] = (st.st_dev, st.st_ino)
        if self.direct and _io.enable_direct(self.fd):
            self.io_path = ODIRECT
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
        while True:
            try:
                self._call_hook("write", offset, len(view))
                _io.pwrite_all(self.fd, view, offset, self.job.path, raw=True)
                break
            except OSError as exc:
                if isinstance(exc, StorageIOError):  # no progress: it names file and bytes
                    raise
                if _io.refused(exc) and self.io_path == ODIRECT:
                    # the filesystem refused O_DIRECT after all: drop it on the same
                    # descriptor (never reopen by name: a link may be there since) and redo
                    _io.disable_direct(self.fd, self.job.path)
                    self.io_path = POSIX
                    continue
                raise self._error("write", exc, offset, len(view)) from None
        self.written += len(view)
        self.recorder.add(self.job.bucket, "write", t, len(view), self.job.name)

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
            _io.copy_bytes(self.bounce[self.fill:self.fill + n], view[:n])
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

    def _segments(self) -> None:
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
            view = _io.as_bytes(seg.source)
            body = align_down(len(view))
            if seg.data and body >= DIRECT_MIN_NBYTES and seg.offset % BLOCK == 0 \
                    and address_of(view) % BLOCK == 0:
                self._flush()  # bstart is now seg.offset: aligned
                for lo in range(0, body, WRITE_NBYTES):
                    self._pwrite(view[lo:min(lo + WRITE_NBYTES, body)], seg.offset + lo)
                self.bstart = seg.offset + body
                view = view[body:]
            self._emit(view)

    def run(self) -> None:
        self.open()
        try:
            if self.job.staging is not None:  # write once the caller's copy is done
                self.job.staging.wait_all()
            self._segments()
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


def file_task(job: FileJob, recorder: _Recorder, created: dict[str, tuple[int, int]], *,
              direct: bool, sync: bool, hook: IoHook | None) -> Callable[[memoryview], int]:
    """What a worker runs for one data file (:meth:`WorkerPool.submit`): write ``job`` with
    its bounce buffer, record what it created in ``created``; returns the bytes written."""
    def run(bounce: memoryview) -> int:
        writer = FileWriter(job, bounce, direct=direct, sync=sync, recorder=recorder,
                            hook=hook, created=created)
        writer.run()
        return writer.written
    return run


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
