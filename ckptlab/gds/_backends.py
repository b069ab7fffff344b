"""The byte movers behind :func:`ckptlab.gds.open`: POSIX, O_DIRECT, torch.cuda.gds, kvikio.

Every backend declares what it moves on :class:`Backend`: host bytes (``write`` /
``read_into`` of a memoryview: the ``posix`` and ``odirect`` backends) or device storages
(``save_storage`` / ``load_storage`` of a CUDA storage: the ``torch`` and ``kvikio`` backends,
which share :class:`GpuBackend`). The handle dispatches on those attributes, never on
``hasattr``.

Each backend writes and reads exactly the payload's bytes: nothing outside ``[offset, offset +
nbytes)`` changes, which matters because a storage's last 4 KiB block also holds its zip data
descriptor and the next record's header. The aligned I/O itself (aligned buffers, O_DIRECT and
its EINVAL fallback, whole transfers, the copy) is :mod:`ckptlab._io`.
"""

from __future__ import annotations

import abc
import errno
import functools
import os
import tempfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, ClassVar

from ckptlab import _io
from ckptlab._io import BLOCK, address_of, align_down, align_up, aligned_buffer, copy_bytes
from ckptlab.errors import BackendUnavailableError, StorageIOError
from ckptlab.gds._buffers import byte_tensor

__all__ = ["BLOCK", "COMPAT", "GDS", "ODIRECT", "POSIX", "Backend", "GpuBackend",
           "KvikioBackend", "ODirectBackend", "PosixBackend", "TorchGdsBackend",
           "kvikio_compat", "kvikio_status", "torch_gds_status"]

CHUNK = 16 << 20  # one bounce buffer: large O_DIRECT requests, small enough to overlap copies
DEPTH = 4  # bounce buffers in the ring: writes behind and reads ahead of the caller
IO_THREADS = 1  # O_DIRECT writes in flight (2 measured slower on this virtio disk)
READ_NBYTES = 8 << 20  # one O_DIRECT read request straight into the caller's memory
READ_THREADS = 2  # O_DIRECT reads in flight (2-4 measured 15-20% faster than 1 here)

GDS, COMPAT, ODIRECT, POSIX = "GDS", "cuFile compat", "O_DIRECT", "POSIX"


class Backend(abc.ABC):
    """What :class:`~ckptlab.gds.GdsHandle` needs from a byte mover.

    Call order: the constructor opens ``path`` (raising
    :class:`~ckptlab.errors.BackendUnavailableError` where the backend cannot run here, or
    :class:`~ckptlab.errors.StorageIOError`), then any number of transfers, ``fsync``, and
    ``close`` (idempotent). A backend moves host bytes (:attr:`moves_host_bytes`: ``write``
    and ``read_into``), device storages (:attr:`moves_device_storages`: ``save_storage`` and
    ``load_storage``), or both.

    Attributes
    ----------
    name : str
        The backend's name in ``gds.open(..., backend=name)``.
    moves_host_bytes, moves_device_storages : bool
        The capabilities (class attributes).
    path : str
    io_path : str
        What really moves the bytes: :data:`GDS`, :data:`COMPAT`, :data:`ODIRECT` or
        :data:`POSIX`.
    reason : str
        Why this backend and path (the auto choice, or a fallback that happened).
    direct_nbytes, buffered_nbytes : int
        Bytes moved around the page cache, and through it.
    """

    name: ClassVar[str]
    moves_host_bytes: ClassVar[bool] = False
    moves_device_storages: ClassVar[bool] = False

    path: str
    io_path: str
    reason: str
    direct_nbytes: int
    buffered_nbytes: int

    @abc.abstractmethod
    def fsync(self) -> None:
        """Flush the file's data to the device."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the file (idempotent)."""

    # host bytes (moves_host_bytes)
    def write(self, view: memoryview, offset: int) -> None:
        """Write all of ``view`` at ``offset``."""
        raise NotImplementedError(f"backend {self.name!r} does not move host bytes")

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill all of ``view`` from ``offset``."""
        raise NotImplementedError(f"backend {self.name!r} does not move host bytes")

    # device storages (moves_device_storages)
    def save_storage(self, storage: Any, offset: int) -> None:
        """Write a device storage's bytes at ``offset``."""
        raise NotImplementedError(f"backend {self.name!r} does not move device storages")

    def load_storage(self, storage: Any, offset: int) -> None:
        """Fill a device storage from ``offset``."""
        raise NotImplementedError(f"backend {self.name!r} does not move device storages")


class PosixBackend(Backend):
    """``pwrite`` / ``preadv`` through the page cache: works on every filesystem."""

    name = "posix"
    moves_host_bytes = True

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
        _io.pwrite_all(self.fd, view, offset, self.path)
        self.buffered_nbytes += len(view)

    def read_into(self, view: memoryview, offset: int) -> None:
        _io.check_inside(self.fd, offset, len(view), self.path)
        _io.pread_all(self.fd, view, offset, self.path)
        self.buffered_nbytes += len(view)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _reopen_flags(flags: int) -> int:
    """Flags for a second descriptor on a file the first one already created/truncated."""
    return flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)


class ODirectBackend(PosixBackend):
    """Aligned blocks with O_DIRECT (no page cache); the partial blocks at either end of a
    payload go through the page cache, so no byte outside the payload is ever written.

    The aligned middle is written straight from the source when its address is 4096-aligned
    (zero copy, synchronous). Otherwise it is copied into a ring of page-aligned bounce
    buffers that one I/O thread writes behind the caller: ``write`` returns once the bytes
    are copied (the source may change right after), and the next copy overlaps the disk.
    Writes still in flight finish before any read, ``fsync`` or ``close``, which report their
    errors. Reads into page-aligned memory go straight in (``preadv``); others run ahead
    through the ring. If the filesystem refuses O_DIRECT (EINVAL at open or at a transfer)
    the handle falls back to POSIX for good and says why; nothing is lost.
    """

    name = "odirect"

    def __init__(self, path: str, flags: int, *, reason: str = "requested") -> None:
        super().__init__(path, flags, reason=reason)
        self.io_path = ODIRECT
        self._buffers: list[memoryview] = []
        self._io: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[Future, int, int, int]] = deque()  # future, slot, off, n
        self._next_slot = 0
        self._refused = False  # an in-flight O_DIRECT write got EINVAL
        try:
            self.direct_fd = _io.open_direct(path, _reopen_flags(flags))
        except StorageIOError:
            super().close()
            raise
        if self.direct_fd < 0:
            self._fall_back("the filesystem refused O_DIRECT at open (Invalid argument)")

    def _fall_back(self, why: str) -> None:
        self.io_path = POSIX
        self.reason = f"{self.reason}; {why}: using POSIX pwrite/pread"
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
        self.direct_fd = -1

    def _ring(self) -> ThreadPoolExecutor:
        if self._io is None:
            self._buffers = [aligned_buffer(CHUNK, huge_pages=True) for _ in range(DEPTH)]
            self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="ckptlab-odirect")
        return self._io

    def _direct_error(self, exc: OSError, offset: int, nbytes: int, what: str) -> StorageIOError:
        return StorageIOError(f"O_DIRECT {what} failed: {exc.strerror}", path=self.path,
                              offset=offset, nbytes=nbytes, errno=exc.errno)

    # -- writes -------------------------------------------------------------------------------
    def write(self, view: memoryview, offset: int) -> None:
        end = offset + len(view)
        lo, hi = align_up(offset), align_down(end)
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
                    _io.pwrite_all(self.direct_fd, middle, lo, self.path, raw=True)
                    self.direct_nbytes += len(middle)
            else:
                self._write_behind(middle, lo)
        except OSError as exc:
            if not _io.refused(exc):
                if isinstance(exc, StorageIOError):
                    raise
                raise self._direct_error(exc, lo, hi - lo, "write") from None
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
        chunk = CHUNK
        for start in range(0, len(view), chunk):
            if self._refused:  # an earlier chunk was refused: the rest goes buffered
                self.drain()
                PosixBackend.write(self, view[start:], offset + start)
                return
            part = view[start : start + chunk]
            self._wait_for(offset + start, offset + start + len(part))  # same bytes in flight
            slot = self._next_slot
            self._next_slot = (slot + 1) % DEPTH
            if len(self._pending) == DEPTH:  # the oldest write used this slot: let it finish
                self._finish(self._pending.popleft())
            buf = self._buffers[slot]
            copy_bytes(buf[: len(part)], part)
            fut = io.submit(_io.pwrite_all, self.direct_fd, buf[: len(part)], offset + start,
                            self.path, raw=True)
            self._pending.append((fut, slot, offset + start, len(part)))
            self.direct_nbytes += len(part)

    def _finish(self, entry: tuple[Future, int, int, int]) -> None:
        fut, slot, offset, nbytes = entry
        try:
            fut.result()
        except OSError as exc:
            if not _io.refused(exc):
                if isinstance(exc, StorageIOError):
                    raise
                raise self._direct_error(exc, offset, nbytes, "write") from None
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
        _io.check_inside(self.fd, offset, len(view), self.path)
        end = offset + len(view)
        lo, hi = align_down(offset), align_up(end)
        try:
            if lo == offset and address_of(view) % BLOCK == 0:
                # in place: the aligned body straight into the caller's memory, the tail (a
                # partial block, whose read would run past the view) through the ring
                body = align_down(len(view))
                if body:
                    self._read_direct(view[:body], offset)
                if body < len(view):
                    self._read_ahead(view[body:], offset + body, offset + body, hi)
            else:
                self._read_ahead(view, offset, lo, hi)
        except OSError as exc:
            if not _io.refused(exc):
                if isinstance(exc, StorageIOError):
                    raise
                raise self._direct_error(exc, offset, len(view), "read") from None
            self._fall_back(f"the filesystem refused an O_DIRECT read ({exc.strerror})")
            return super().read_into(view, offset)
        self.direct_nbytes += len(view)

    def _read_direct(self, view: memoryview, offset: int) -> None:
        """Aligned reads straight into aligned memory, several requests in flight."""
        step = READ_NBYTES
        if len(view) <= step or READ_THREADS < 2:
            _io.pread_all(self.direct_fd, view, offset, self.path, raw=True)
            return
        if self._readers is None:
            self._readers = ThreadPoolExecutor(READ_THREADS,
                                               thread_name_prefix="ckptlab-odirect-read")
        futures = [self._readers.submit(_io.pread_all, self.direct_fd, view[lo:lo + step],
                                        offset + lo, self.path, raw=True)
                   for lo in range(0, len(view), step)]
        for fut in futures:  # every request lands before an error is raised
            fut.exception()
        for fut in futures:
            fut.result()

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
                copy_bytes(view[a - offset : b - offset],
                           self._buffers[i % DEPTH][a - start : b - start])
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
            for pool in (self._io, self._readers):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._io = self._readers = None
            for buf in self._buffers:
                buf.release()
            self._buffers = []
            super().close()


# -- GPU backends (need CUDA; exercised by the `gpu` tests) ------------------------------------
@contextmanager
def _as_storage_error(path: str, offset: int, nbytes: int, what: str) -> Iterator[None]:
    """cuFile and kvikio report I/O errors as RuntimeError: say which file and bytes."""
    try:
        yield
    except RuntimeError as exc:
        raise StorageIOError(f"{what} failed: {exc}", path=path, offset=offset,
                             nbytes=nbytes, errno=_errno_in(str(exc))) from exc


def _errno_in(message: str) -> int | None:
    """The OS error a library's message names in words (kvikio: "POSIX error on pwrite: No
    space left on device"), so a full disk is ``errno.ENOSPC`` on every backend."""
    named = [(len(os.strerror(n)), n) for n in errno.errorcode
             if os.strerror(n) in message and not os.strerror(n).startswith("Unknown error")]
    return max(named)[1] if named else None  # the longest: "Not a directory" over a part


def torch_gds_status(directory: str | None = None) -> tuple[bool, str]:
    """Whether torch.cuda.gds can run here (on files in ``directory``; the temp directory
    where it is None or not a directory), and why not.

    On CPU builds ``torch._C._gds_*`` exist but are Python stubs that raise, so ``hasattr`` is
    no detection: the real ones are C functions.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False, "torch is not installed"
    from ckptlab._torch_compat import gds_register_handle

    fn = gds_register_handle()
    if fn is None or not type(fn).__name__.startswith("builtin"):
        return False, "this torch build has no cuFile bindings (torch._C._gds_* are stubs)"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    refused = _cufile_refusal(directory if directory and os.path.isdir(directory)
                              else tempfile.gettempdir())
    if refused:
        return False, refused
    return True, "torch.cuda.gds bindings, a CUDA device, and cuFile registers files"


@functools.cache
def _cufile_refusal(directory: str) -> str | None:
    """Why cuFile would not register a file in ``directory``, or None when it does.

    Bindings and a device are not enough: ``cuFileHandleRegister`` refuses every file where
    the nvidia-fs driver is absent and cuFile cannot identify the filesystem's volume, even
    in compat mode (seen on a virtio-disk VM with an H100: "file descriptor is not
    registered"). One register / deregister of a scratch file, once per process.
    """
    import torch

    try:
        fd, probe = tempfile.mkstemp(prefix="ckptlab-cufile-", dir=directory)
    except OSError as exc:
        return f"no scratch file in {directory} to try cuFile on ({exc})"
    os.close(fd)
    try:
        gds_file = torch.cuda.gds.GdsFile(probe, os.O_RDWR)
    except RuntimeError as exc:
        return _cufile_refusal_text(directory, exc)
    finally:
        os.unlink(probe)
    gds_file.deregister_handle()
    del gds_file  # GdsFile.__del__ closes its descriptor
    return None


def _cufile_refusal_text(where: str, exc: BaseException) -> str:
    """What cuFile's refusal of a file in ``where`` means, with its filesystem."""
    from ckptlab.gds.readiness import filesystem_of

    fs, mount = filesystem_of(where)
    return (f"cuFile refused to register a file in {where} ({fs} on {mount}): {exc}; "
            "it needs the nvidia-fs driver, or compat mode (allow_compat_mode in cufile.json) "
            "on a filesystem whose volume cuFile can identify")


def kvikio_status(directory: str | None = None) -> tuple[bool, str]:
    """Whether kvikio can run here (installed and a CUDA device present). ``directory`` is
    not looked at: kvikio falls back to POSIX reads and writes where cuFile cannot run."""
    try:
        import kvikio  # noqa: F401
    except Exception as exc:  # kvikio raises more than ImportError without libcuda
        return False, f"kvikio is not importable ({type(exc).__name__}: {exc})"
    import torch

    if not torch.cuda.is_available():
        return False, "kvikio is installed but there is no CUDA device"
    return True, "kvikio and a CUDA device"


def kvikio_compat(defaults: Any) -> bool:
    """Whether kvikio will move bytes in its POSIX compat mode rather than through cuFile.

    ``defaults`` is the ``kvikio.defaults`` module. Its documented Python API answers this in
    one of two ways, by version:

    - ``kvikio.defaults.is_compat_mode_preferred()`` (25.02 on): True when compat mode is ON,
      or AUTO and cuFile cannot run here;
    - ``kvikio.defaults.compat_mode()`` (24.x; deprecated in 25.04 for
      ``defaults.get("compat_mode")``): the ``CompatMode`` setting (``ON``/``OFF``/``AUTO``;
      a bool before ``CompatMode`` existed). AUTO cannot be resolved there, so it counts as
      compat: the report never claims GDS it cannot prove.
    """
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if callable(preferred):
        return bool(preferred())
    getter = getattr(defaults, "compat_mode", None)
    if not callable(getter):
        return True  # no documented way to ask: say compat
    mode = getter()
    if isinstance(mode, bool):
        return mode
    return getattr(mode, "name", str(mode)).upper() != "OFF"


class GpuBackend(Backend):
    """The skeleton the cuFile backends share: check the backend can run, open the file,
    say which path it takes; synchronize, move one device storage, count, and turn the
    library's RuntimeError into :class:`~ckptlab.errors.StorageIOError`.

    A subclass names itself, gives :meth:`status`, :meth:`_open`, :meth:`_write` and
    :meth:`_read`, and the file's descriptor for :meth:`fsync`.
    """

    moves_device_storages = True
    _write_what: ClassVar[str] = "write"
    _read_what: ClassVar[str] = "read"

    def __init__(self, path: str, flags: int, *, reason: str = "requested") -> None:
        ok, why = self.status(os.path.dirname(os.path.abspath(path)))
        if not ok:
            raise BackendUnavailableError(f"backend {self.name!r} cannot run: {why}")
        import torch

        self._torch = torch
        self.path, self.reason = path, reason
        self.direct_nbytes = 0
        self.buffered_nbytes = 0
        self.file: Any = None
        self.io_path = self._open(path, flags)

    @staticmethod
    @abc.abstractmethod
    def status(directory: str | None = None) -> tuple[bool, str]:
        """Whether the backend can run on this machine (on files in ``directory``), and why
        (not)."""

    @abc.abstractmethod
    def _open(self, path: str, flags: int) -> str:
        """Open ``path`` into ``self.file``; return the io_path (:data:`GDS` or
        :data:`COMPAT`)."""

    @abc.abstractmethod
    def _write(self, storage: Any, offset: int) -> None: ...

    @abc.abstractmethod
    def _read(self, storage: Any, offset: int) -> None: ...

    @abc.abstractmethod
    def _fd(self) -> int:
        """A descriptor of the open file (for size checks and fsync)."""

    def save_storage(self, storage: Any, offset: int) -> None:
        nbytes = storage.nbytes()
        if nbytes == 0:  # cuFileWrite refuses a 0-byte request with EINVAL
            return
        self._torch.cuda.synchronize()  # cuFile is not stream-ordered
        with _as_storage_error(self.path, offset, nbytes, self._write_what):
            self._write(storage, offset)
        self.direct_nbytes += nbytes

    def load_storage(self, storage: Any, offset: int) -> None:
        nbytes = storage.nbytes()
        _io.check_inside(self._fd(), offset, nbytes, self.path)  # cuFile reads short
        if nbytes == 0:  # as for writes: nothing to read, and cuFileRead would say EINVAL
            return
        self._torch.cuda.synchronize()
        with _as_storage_error(self.path, offset, nbytes, self._read_what):
            self._read(storage, offset)
        self.direct_nbytes += nbytes

    def fsync(self) -> None:
        os.fsync(self._fd())


class TorchGdsBackend(GpuBackend):
    """torch.cuda.gds.GdsFile (cuFile). CUDA storages only; cuFile is synchronous and not
    stream-ordered, so the device is synchronized before each call."""

    name = "torch"
    _write_what = "cuFileWrite"
    _read_what = "cuFileRead"
    status = staticmethod(torch_gds_status)

    def _open(self, path: str, flags: int) -> str:
        try:
            self.file = self._torch.cuda.gds.GdsFile(path, flags)
        except RuntimeError as exc:  # cuFileHandleRegister refused this file's filesystem
            raise BackendUnavailableError(
                f"backend 'torch' cannot open {path}: "
                + _cufile_refusal_text(os.path.dirname(path) or ".", exc)) from exc
        return GDS if os.path.exists("/proc/driver/nvidia-fs") else COMPAT

    def _write(self, storage: Any, offset: int) -> None:
        self.file.save_storage(storage, offset)

    def _read(self, storage: Any, offset: int) -> None:
        self.file.load_storage(storage, offset)

    def _fd(self) -> int:
        return int(self.file.fd)

    def close(self) -> None:
        if self.file is not None:
            from ckptlab._torch_compat import gds_file_release_fd

            if self.file.handle is not None:
                self.file.deregister_handle()
            # GdsFile.__del__ closes its fd again: leave it /dev/null to close
            os.close(gds_file_release_fd(self.file, os.open(os.devnull, os.O_RDONLY)))
            self.file = None


class KvikioBackend(GpuBackend):
    """kvikio.CuFile: cuFile with its own compat mode (POSIX underneath when GDS is absent)."""

    name = "kvikio"
    _write_what = "kvikio pwrite"
    _read_what = "kvikio pread"
    status = staticmethod(kvikio_status)

    def _open(self, path: str, flags: int) -> str:
        import kvikio
        import kvikio.defaults

        if flags & os.O_CREAT or flags & os.O_TRUNC:  # create / truncate as os.open would
            os.close(os.open(path, flags & (os.O_CREAT | os.O_TRUNC | os.O_EXCL) | os.O_WRONLY,
                             0o644))
        self.file = kvikio.CuFile(path, "r" if flags & os.O_ACCMODE == os.O_RDONLY else "r+")
        self._size_fd = os.open(path, os.O_RDONLY)
        return COMPAT if kvikio_compat(kvikio.defaults) else GDS

    def _write(self, storage: Any, offset: int) -> None:
        buf = byte_tensor(storage)
        self.file.pwrite(buf, buf.numel(), offset).get()

    def _read(self, storage: Any, offset: int) -> None:
        buf = byte_tensor(storage)
        got = self.file.pread(buf, buf.numel(), offset).get()
        if got != buf.numel():
            raise StorageIOError("file ends before the payload", path=self.path, offset=offset,
                                 nbytes=buf.numel())

    def _fd(self) -> int:
        return self._size_fd

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            os.close(self._size_fd)
            self._size_fd = -1
