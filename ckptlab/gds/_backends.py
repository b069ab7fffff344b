"""The byte movers behind :func:`ckptlab.gds.open`: POSIX, O_DIRECT, torch.cuda.gds, kvikio.

Each backend writes and reads exactly the payload's bytes: nothing outside ``[offset, offset +
nbytes)`` changes, which matters because a storage's last 4 KiB block also holds its zip data
descriptor and the next record's header.
"""

from __future__ import annotations

import errno as errno_
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

from ckptlab.errors import BackendUnavailableError, StorageIOError
from ckptlab.gds._buffers import address_of, aligned_buffer, byte_tensor

BLOCK = 4096  # O_DIRECT granularity used here (ext4/xfs need 512 or 4096; 4096 covers both)
CHUNK = 16 << 20  # one bounce buffer: large O_DIRECT requests, small enough to overlap copies
DEPTH = 4  # bounce buffers in the ring: writes behind and reads ahead of the caller
IO_THREADS = 1  # O_DIRECT requests in flight (2 measured slower on this virtio disk)

GDS, COMPAT, ODIRECT, POSIX = "GDS", "cuFile compat", "O_DIRECT", "POSIX"


def _reopen_flags(flags: int) -> int:
    """Flags for a second descriptor on a file the first one already created/truncated."""
    return flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)


class PosixBackend:
    """``pwrite`` / ``preadv`` through the page cache: works on every filesystem."""

    name = "posix"

    def __init__(self, path: str, flags: int, *, reason: str = "requested") -> None:
        self.path = path
        self.io_path = POSIX
        self.reason = reason
        self.direct_nbytes = 0
        self.buffered_nbytes = 0
        try:
            self.fd = os.open(path, flags, 0o644)
        except OSError as exc:
            raise StorageIOError(f"cannot open: {exc.strerror}", path=path, offset=0, nbytes=0,
                                 errno=exc.errno) from None

    def write(self, view: memoryview, offset: int) -> None:
        _pwrite_all(self.fd, view, offset, self.path)
        self.buffered_nbytes += len(view)

    def read_into(self, view: memoryview, offset: int) -> None:
        _check_inside(self.fd, offset, len(view), self.path)
        _pread_all(self.fd, view, offset, self.path)
        self.buffered_nbytes += len(view)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ODirectBackend(PosixBackend):
    """Aligned blocks with O_DIRECT (no page cache); the partial blocks at either end of a
    payload go through the page cache, so no byte outside the payload is ever written.

    The aligned middle is written straight from the source when its address is 4096-aligned
    (zero copy, synchronous). Otherwise it is copied into a ring of page-aligned bounce
    buffers that one I/O thread writes behind the caller: ``write`` returns once the bytes
    are copied (the source may change right after), and the next copy overlaps the disk.
    Writes still in flight finish before any read, ``fsync`` or ``close``, which report their
    errors. Reads run ahead the same way. If the filesystem refuses O_DIRECT (EINVAL at open
    or at a transfer) the handle falls back to POSIX for good and says why; nothing is lost.
    """

    name = "odirect"

    def __init__(self, path: str, flags: int, *, reason: str = "requested") -> None:
        super().__init__(path, flags, reason=reason)
        self.io_path = ODIRECT
        self._buffers: list[memoryview] = []
        self._io: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[Future, int, int, int]] = deque()  # future, slot, off, n
        self._next_slot = 0
        self._refused = False  # an in-flight O_DIRECT write got EINVAL
        self.direct_fd = -1
        try:
            self.direct_fd = os.open(path, _reopen_flags(flags) | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno_.EINVAL:
                super().close()
                raise StorageIOError(f"cannot open with O_DIRECT: {exc.strerror}", path=path,
                                     offset=0, nbytes=0, errno=exc.errno) from None
            self._fall_back(f"the filesystem refused O_DIRECT at open ({exc.strerror})")

    def _fall_back(self, why: str) -> None:
        self.io_path = POSIX
        self.reason = f"{self.reason}; {why}: using POSIX pwrite/pread"
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
        self.direct_fd = -1

    def _ring(self) -> ThreadPoolExecutor:
        if self._io is None:
            self._buffers = [aligned_buffer(CHUNK) for _ in range(DEPTH)]
            self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="ckptlab-odirect")
        return self._io

    # -- writes -------------------------------------------------------------------------------
    def write(self, view: memoryview, offset: int) -> None:
        end = offset + len(view)
        lo = -(-offset // BLOCK) * BLOCK
        hi = end // BLOCK * BLOCK
        if self._refused:
            self.drain()
        if self.direct_fd < 0 or hi <= lo:
            self._wait_for(offset, end)
            return super().write(view, offset)
        if lo > offset:
            self._wait_for(offset, lo)
            super().write(view[: lo - offset], offset)
        middle = view[lo - offset : hi - offset]
        try:
            if address_of(middle) % BLOCK == 0:
                self._wait_for(lo, hi)
                if self.direct_fd < 0:  # the wait found O_DIRECT refused
                    super().write(middle, lo)
                else:
                    _pwrite_all(self.direct_fd, middle, lo, self.path, raw=True)
                    self.direct_nbytes += len(middle)
            else:
                self._write_behind(middle, lo)
        except OSError as exc:
            if exc.errno != errno_.EINVAL:
                raise StorageIOError(f"O_DIRECT write failed: {exc.strerror}", path=self.path,
                                     offset=lo, nbytes=hi - lo, errno=exc.errno) from None
            self.drain()
            if self.direct_fd >= 0:
                self._fall_back(f"the filesystem refused an O_DIRECT write ({exc.strerror})")
            super().write(middle, lo)
        if end > hi:
            self._wait_for(hi, end)
            super().write(view[hi - offset :], hi)

    def _wait_for(self, lo: int, hi: int) -> None:
        """Writes land in call order: finish in-flight writes that overlap ``[lo, hi)``."""
        if any(off < hi and lo < off + n for _, _, off, n in self._pending):
            self.drain()

    def _write_behind(self, view: memoryview, offset: int) -> None:
        io = self._ring()
        for start in range(0, len(view), CHUNK):
            if self._refused:  # an earlier chunk was refused: the rest goes buffered
                self.drain()
                PosixBackend.write(self, view[start:], offset + start)
                return
            part = view[start : start + CHUNK]
            self._wait_for(offset + start, offset + start + len(part))  # same bytes in flight
            slot = self._next_slot
            self._next_slot = (slot + 1) % DEPTH
            if len(self._pending) == DEPTH:  # the oldest write used this slot: let it finish
                self._finish(self._pending.popleft())
            buf = self._buffers[slot]
            _copy(buf[: len(part)], part)
            fut = io.submit(_pwrite_all, self.direct_fd, buf[: len(part)], offset + start,
                            self.path, raw=True)
            self._pending.append((fut, slot, offset + start, len(part)))
            self.direct_nbytes += len(part)

    def _finish(self, entry: tuple[Future, int, int, int]) -> None:
        fut, slot, offset, nbytes = entry
        try:
            fut.result()
        except OSError as exc:
            if exc.errno != errno_.EINVAL:
                raise StorageIOError(f"O_DIRECT write failed: {exc.strerror}", path=self.path,
                                     offset=offset, nbytes=nbytes, errno=exc.errno) from None
            self._refused = True  # the bytes are still in the slot: write them buffered
            PosixBackend.write(self, self._buffers[slot][:nbytes], offset)
            self.direct_nbytes -= nbytes

    def drain(self) -> None:
        """Wait for every write still in flight; raise the first failure."""
        first: BaseException | None = None
        while self._pending:
            try:
                self._finish(self._pending.popleft())
            except StorageIOError as exc:
                first = first or exc
        if self._refused and self.direct_fd >= 0:
            self._fall_back("the filesystem refused an O_DIRECT write (EINVAL)")
        if first is not None:
            raise first

    # -- reads --------------------------------------------------------------------------------
    def read_into(self, view: memoryview, offset: int) -> None:
        self.drain()
        if self.direct_fd < 0 or len(view) == 0:
            return super().read_into(view, offset)
        _check_inside(self.fd, offset, len(view), self.path)
        end = offset + len(view)
        lo = offset // BLOCK * BLOCK
        hi = -(-end // BLOCK) * BLOCK
        try:
            if lo == offset and hi == end and address_of(view) % BLOCK == 0:
                _pread_all(self.direct_fd, view, offset, self.path, raw=True)
            else:
                self._read_ahead(view, offset, lo, hi)
        except OSError as exc:
            if isinstance(exc, StorageIOError) or exc.errno != errno_.EINVAL:
                raise
            self._fall_back(f"the filesystem refused an O_DIRECT read ({exc.strerror})")
            return super().read_into(view, offset)
        self.direct_nbytes += len(view)

    def _read_ahead(self, view: memoryview, offset: int, lo: int, hi: int) -> None:
        io = self._ring()
        end = offset + len(view)
        starts = list(range(lo, hi, CHUNK))
        inflight: deque[Future] = deque()

        def fetch(i: int) -> None:
            want = min(CHUNK, hi - starts[i])
            inflight.append(io.submit(os.preadv, self.direct_fd,
                                      [self._buffers[i % DEPTH][:want]], starts[i]))

        for i in range(min(DEPTH - 1, len(starts))):
            fetch(i)
        try:
            for i, start in enumerate(starts):
                got = inflight.popleft().result()
                if i + DEPTH - 1 < len(starts):
                    fetch(i + DEPTH - 1)  # the disk reads ahead while this chunk is copied
                want = min(CHUNK, hi - start)
                a, b = max(start, offset), min(start + got, end)
                if b < min(start + want, end):  # the size was checked: a shrinking file
                    raise StorageIOError("file ends before the payload", path=self.path,
                                         offset=offset, nbytes=len(view))
                _copy(view[a - offset : b - offset], self._buffers[i % DEPTH][a - start : b - start])
        finally:
            for fut in inflight:  # an error left reads running: let them land first
                fut.exception()

    def fsync(self) -> None:
        self.drain()
        super().fsync()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self.direct_fd >= 0:
                os.close(self.direct_fd)
                self.direct_fd = -1
            if self._io is not None:
                self._io.shutdown(wait=True)
                self._io = None
            for buf in self._buffers:
                buf.release()
            self._buffers = []
            super().close()


@contextmanager
def _as_storage_error(path: str, offset: int, nbytes: int, what: str) -> Iterator[None]:
    """cuFile and kvikio report I/O errors as RuntimeError: say which file and bytes."""
    try:
        yield
    except RuntimeError as exc:
        raise StorageIOError(f"{what} failed: {exc}", path=path, offset=offset,
                             nbytes=nbytes) from exc


def _copy(dst: memoryview, src: memoryview) -> None:
    """memcpy that releases the GIL (numpy does; a memoryview slice assignment does not), so
    the I/O thread's next syscall starts while a chunk is being copied."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def _check_inside(fd: int, offset: int, nbytes: int, path: str) -> None:
    size = os.fstat(fd).st_size
    if offset < 0 or offset + nbytes > size:
        raise StorageIOError(f"read past the end of the file ({size} bytes)", path=path,
                             offset=offset, nbytes=nbytes)


def _pwrite_all(fd: int, view: memoryview, offset: int, path: str, *, raw: bool = False) -> None:
    done = 0
    while done < len(view):
        try:
            n = os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            if raw:
                raise
            raise StorageIOError(f"write failed: {exc.strerror}", path=path,
                                 offset=offset + done, nbytes=len(view) - done,
                                 errno=exc.errno) from None
        if n == 0:
            raise StorageIOError("write made no progress", path=path, offset=offset + done,
                                 nbytes=len(view) - done)
        done += n


def _pread_all(fd: int, view: memoryview, offset: int, path: str, *, raw: bool = False) -> None:
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            if raw:
                raise
            raise StorageIOError(f"read failed: {exc.strerror}", path=path,
                                 offset=offset + done, nbytes=len(view) - done,
                                 errno=exc.errno) from None
        if n == 0:
            raise StorageIOError("file ends before the payload", path=path,
                                 offset=offset + done, nbytes=len(view) - done)
        done += n


# -- GPU backends (need CUDA; exercised by the `gpu` tests) ------------------------------------
def torch_gds_status() -> tuple[bool, str]:
    """Whether torch.cuda.gds can run here, and why not.

    On CPU builds ``torch._C._gds_*`` exist but are Python stubs that raise, so ``hasattr`` is
    no detection: the real ones are C functions.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False, "torch is not installed"
    fn = getattr(torch._C, "_gds_register_handle", None)
    if fn is None or not type(fn).__name__.startswith("builtin"):
        return False, "this torch build has no cuFile bindings (torch._C._gds_* are stubs)"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, "torch.cuda.gds bindings and a CUDA device"


def kvikio_status() -> tuple[bool, str]:
    """Whether kvikio can run here (installed and a CUDA device present)."""
    try:
        import kvikio  # noqa: F401
    except Exception as exc:  # kvikio raises more than ImportError without libcuda
        return False, f"kvikio is not importable ({type(exc).__name__}: {exc})"
    import torch

    if not torch.cuda.is_available():
        return False, "kvikio is installed but there is no CUDA device"
    return True, "kvikio and a CUDA device"


class TorchGdsBackend:
    """torch.cuda.gds.GdsFile (cuFile). CUDA storages only; cuFile is synchronous and not
    stream-ordered, so the device is synchronized before each call."""

    name = "torch"

    def __init__(self, path: str, flags: int, *, reason: str = "requested") -> None:
        ok, why = torch_gds_status()
        if not ok:
            raise BackendUnavailableError(f"backend 'torch' cannot run: {why}")
        import torch

        self.path, self.reason = path, reason
        self._torch = torch
        # GdsFile opens with O_DIRECT; register_handle fails without the cuFile driver
        self.file = torch.cuda.gds.GdsFile(path, flags)
        self.io_path = GDS if os.path.exists("/proc/driver/nvidia-fs") else COMPAT
        self.direct_nbytes = 0
        self.buffered_nbytes = 0

    def save_storage(self, storage: Any, offset: int) -> None:
        self._torch.cuda.synchronize()
        with _as_storage_error(self.path, offset, storage.nbytes(), "cuFileWrite"):
            self.file.save_storage(storage, offset)
        self.direct_nbytes += storage.nbytes()

    def load_storage(self, storage: Any, offset: int) -> None:
        _check_inside(self.file.fd, offset, storage.nbytes(), self.path)  # cuFile reads short
        self._torch.cuda.synchronize()
        with _as_storage_error(self.path, offset, storage.nbytes(), "cuFileRead"):
            self.file.load_storage(storage, offset)
        self.direct_nbytes += storage.nbytes()

    def fsync(self) -> None:
        os.fsync(self.file.fd)

    def close(self) -> None:
        if getattr(self, "file", None) is not None:
            if self.file.handle is not None:
                self.file.deregister_handle()
            os.close(self.file.fd)
            self.file.fd = os.open(os.devnull, os.O_RDONLY)  # GdsFile.__del__ closes it again
            self.file = None


def _kvikio_compat(kvikio: Any, file: Any) -> bool:
    """Whether kvikio will use its POSIX compat mode for this file (versions differ)."""
    preferred = getattr(file, "is_compat_mode_preferred", None)
    if callable(preferred):
        return bool(preferred())
    defaults = kvikio.defaults
    if hasattr(defaults, "is_compat_mode_preferred"):
        return bool(defaults.is_compat_mode_preferred())
    getter = getattr(defaults, "get", None)
    mode = getter("compat_mode") if callable(getter) else getattr(defaults, "compat_mode", None)
    mode = mode() if callable(mode) else mode
    name = getattr(mode, "name", str(mode)).upper()
    return name not in ("OFF", "FALSE", "0")  # ON, or AUTO without a way to ask: say compat


class KvikioBackend:
    """kvikio.CuFile: cuFile with its own compat mode (POSIX underneath when GDS is absent)."""

    name = "kvikio"

    def __init__(self, path: str, flags: int, *, reason: str = "requested") -> None:
        ok, why = kvikio_status()
        if not ok:
            raise BackendUnavailableError(f"backend 'kvikio' cannot run: {why}")
        import kvikio
        import kvikio.defaults

        self.path, self.reason = path, reason
        if flags & os.O_CREAT or flags & os.O_TRUNC:  # create / truncate as os.open would
            os.close(os.open(path, flags & (os.O_CREAT | os.O_TRUNC | os.O_EXCL) | os.O_WRONLY,
                             0o644))
        self.file = kvikio.CuFile(path, "r" if flags & os.O_ACCMODE == os.O_RDONLY else "r+")
        self.io_path = COMPAT if _kvikio_compat(kvikio, self.file) else GDS
        self.direct_nbytes = 0
        self.buffered_nbytes = 0

    def save_storage(self, storage: Any, offset: int) -> None:
        buf = byte_tensor(storage)
        with _as_storage_error(self.path, offset, buf.numel(), "kvikio pwrite"):
            self.file.pwrite(buf, buf.numel(), offset).get()
        self.direct_nbytes += buf.numel()

    def load_storage(self, storage: Any, offset: int) -> None:
        buf = byte_tensor(storage)
        with _as_storage_error(self.path, offset, buf.numel(), "kvikio pread"):
            got = self.file.pread(buf, buf.numel(), offset).get()
        if got != buf.numel():
            raise StorageIOError("file ends before the payload", path=self.path, offset=offset,
                                 nbytes=buf.numel())
        self.direct_nbytes += buf.numel()

    def fsync(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if getattr(self, "file", None) is not None:
            self.file.close()
            self.file = None
