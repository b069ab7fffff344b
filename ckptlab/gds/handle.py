"""``ckptlab.gds.open``: one handle over torch.cuda.gds, kvikio, O_DIRECT and POSIX."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ckptlab.errors import BackendUnavailableError, InvalidArgumentError
from ckptlab.gds._backends import (
    Backend,
    KvikioBackend,
    ODirectBackend,
    PosixBackend,
    TorchGdsBackend,
    kvikio_status,
    torch_gds_status,
)
from ckptlab.gds._buffers import aligned_buffer, storage_view

__all__ = ["BACKENDS", "BackendStatus", "GdsHandle", "backend_status", "open"]

BACKENDS = ("torch", "kvikio", "odirect", "posix")
_CLASSES: dict[str, type[Backend]] = {"torch": TorchGdsBackend, "kvikio": KvikioBackend, "odirect": ODirectBackend,
            "posix": PosixBackend}


@dataclass(frozen=True, slots=True)
class BackendStatus:
    """Whether a backend can run on this machine, and why (not)."""

    name: str
    available: bool
    reason: str


def backend_status() -> tuple[BackendStatus, ...]:
    """Every backend in the order ``backend="auto"`` tries them."""
    torch_ok, torch_why = torch_gds_status()
    kvikio_ok, kvikio_why = kvikio_status()
    odirect_ok = hasattr(os, "O_DIRECT")
    return (
        BackendStatus("torch", torch_ok, torch_why),
        BackendStatus("kvikio", kvikio_ok, kvikio_why),
        BackendStatus("odirect", odirect_ok, "os.O_DIRECT exists (the filesystem decides at open)"
                      if odirect_ok else "this platform has no O_DIRECT"),
        BackendStatus("posix", True, "pwrite/pread work everywhere"),
    )


class GdsHandle:
    """An open checkpoint file for storage-sized reads and writes at given offsets.

    Attributes
    ----------
    path : str
    backend : str
        The backend that serves the handle: ``"torch"``, ``"kvikio"``, ``"odirect"`` or
        ``"posix"``.
    io_path : str
        What really moves the bytes: ``"GDS"``, ``"cuFile compat"``, ``"O_DIRECT"`` or
        ``"POSIX"`` (an ``odirect`` handle whose filesystem refused O_DIRECT says ``"POSIX"``).
    reason : str
        Why this backend and path: the auto choice, or the fallback that happened.
    direct_nbytes, buffered_nbytes : int
        Bytes moved around the page cache, and through it (the partial blocks at a payload's
        ends, or everything on POSIX).

    Notes
    -----
    No byte outside ``[offset, offset + storage.nbytes())`` is ever written: a storage's last
    4 KiB block also holds its zip data descriptor and the next record's header, so padding a
    write up to 4096 bytes would corrupt the archive. The host backends write the aligned
    middle of a payload with O_DIRECT and its partial end blocks through the page cache.
    CUDA storages go to the host first on the ``odirect`` and ``posix`` backends.
    """

    def __init__(self, impl: Backend) -> None:
        self._impl: Backend | None = impl
        self._last = impl  # what a closed handle still reports (path taken, byte counts)
        self.path: str = impl.path
        self.backend: str = impl.name

    @property
    def closed(self) -> bool:
        return self._impl is None

    @property
    def moves_host_bytes(self) -> bool:
        """Whether the backend writes and reads host bytes (``write_bytes``/``read_bytes``)."""
        return self._last.moves_host_bytes

    @property
    def io_path(self) -> str:
        return self._last.io_path

    @property
    def reason(self) -> str:
        return self._last.reason

    @property
    def direct_nbytes(self) -> int:
        return self._last.direct_nbytes

    @property
    def buffered_nbytes(self) -> int:
        return self._last.buffered_nbytes

    def _open_impl(self) -> Backend:
        if self._impl is None:
            raise InvalidArgumentError(f"{self.path}: the handle is closed")
        return self._impl

    def _check(self, storage: Any, offset: int) -> Any:
        import torch

        from ckptlab._torch_compat import untyped_storage

        if isinstance(storage, torch.TypedStorage):
            storage = untyped_storage(storage)  # .untyped() warns that TypedStorage is deprecated
        if not isinstance(storage, torch.UntypedStorage):
            raise InvalidArgumentError(
                f"expected a torch.UntypedStorage (tensor.untyped_storage()), got "
                f"{type(storage).__name__}")
        _check_offset(offset)
        self._open_impl()
        return storage

    def save_storage(self, storage: Any, offset: int) -> None:
        """Write ``storage``'s bytes at ``offset`` (exactly ``storage.nbytes()`` bytes)."""
        storage = self._check(storage, offset)
        impl = self._open_impl()
        if impl.moves_device_storages and storage.device.type != "cpu":
            impl.save_storage(storage, offset)
            return
        if not impl.moves_host_bytes:
            raise InvalidArgumentError(
                f"backend {self.backend!r} writes CUDA storages; got one on {storage.device}")
        if storage.device.type != "cpu":
            storage = storage.cpu()
        impl.write(storage_view(storage), offset)

    def load_storage(self, storage: Any, offset: int) -> None:
        """Fill ``storage`` with ``storage.nbytes()`` bytes read at ``offset``."""
        storage = self._check(storage, offset)
        impl = self._open_impl()
        if impl.moves_device_storages and storage.device.type != "cpu":
            impl.load_storage(storage, offset)
            return
        if not impl.moves_host_bytes:
            raise InvalidArgumentError(
                f"backend {self.backend!r} reads into CUDA storages; got {storage.device}")
        if storage.device.type == "cpu":
            impl.read_into(storage_view(storage), offset)
            return
        import torch

        nbytes = storage.nbytes()
        host = aligned_buffer(max(nbytes, 1))[:nbytes]
        impl.read_into(host, offset)
        staged = torch.frombuffer(host, dtype=torch.uint8) if nbytes else torch.empty(0)
        storage.copy_(staged.untyped_storage())

    def write_bytes(self, data: Any, offset: int) -> None:
        """Write raw bytes at ``offset`` (host backends only; for tests and patch-ups)."""
        impl = self._open_impl()
        try:
            view = memoryview(data).cast("B")
        except TypeError:
            raise InvalidArgumentError(
                f"data must support the buffer protocol (bytes, bytearray, mmap, numpy, ...), "
                f"got {type(data).__name__}") from None
        _check_offset(offset)
        if not impl.moves_host_bytes:
            raise InvalidArgumentError(f"backend {self.backend!r} writes storages only")
        impl.write(view, offset)

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        """Read ``nbytes`` raw bytes at ``offset`` (host backends only)."""
        impl = self._open_impl()
        _check_offset(offset)
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if not impl.moves_host_bytes:
            raise InvalidArgumentError(f"backend {self.backend!r} reads storages only")
        out = bytearray(nbytes)
        impl.read_into(memoryview(out), offset)
        return bytes(out)

    def fsync(self) -> None:
        """Flush the file's data to the device."""
        self._open_impl().fsync()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._impl is not None:
            self._impl.close()
            self._impl = None

    def __enter__(self) -> GdsHandle:
        return self

    def __del__(self) -> None:  # a dropped handle must not leak its descriptors
        try:
            self.close()
        except Exception:
            pass

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GdsHandle({self.path!r}, backend={self.backend!r}, io_path={self.io_path!r}, "
                f"reason={self.reason!r})")


def _check_offset(offset: object) -> None:
    if type(offset) is not int or offset < 0:
        raise InvalidArgumentError(f"offset must be a non-negative int, got {offset!r}")


def open(path: str | os.PathLike[str], flags: int = os.O_RDWR, *,
         backend: str = "auto", device: Any = None) -> GdsHandle:
    """Open ``path`` for storage reads and writes through one of the GDS backends.

    Parameters
    ----------
    path
        The checkpoint file.
    flags
        ``os.open`` flags (``os.O_RDWR``, ``os.O_RDWR | os.O_CREAT``, ...); the backends add
        ``O_DIRECT`` themselves where they use it.
    backend
        ``"auto"`` (torch.cuda.gds when CUDA and real cuFile bindings exist, else kvikio when
        installed with CUDA, else O_DIRECT, which falls back to POSIX if the filesystem refuses
        it), or one of ``"torch"``, ``"kvikio"``, ``"odirect"``, ``"posix"``.
    device
        Where the storages this handle will move live, for ``backend="auto"``: for host
        storages (``"cpu"``) auto skips the cuFile backends, which move device memory only.
        None (the default) or a CUDA device lets auto take them.

    Returns
    -------
    GdsHandle
        ``handle.backend``, ``handle.io_path`` and ``handle.reason`` say what runs and why.

    Raises
    ------
    BackendUnavailableError
        For a named backend that cannot run here (no CUDA, no cuFile, no kvikio).
    StorageIOError
        When the file cannot be opened.

    Notes
    -----
    O_DIRECT needs the buffer address, the file offset and the length aligned (512 bytes on
    ext4 here; 4096 is used). ``torch.empty`` buffers are only 64-byte aligned, so unaligned
    sources go through a page-aligned bounce buffer; aligned ones are written in place.
    """
    path = os.fspath(path)
    if backend not in ("auto", *BACKENDS):
        raise InvalidArgumentError(
            f"backend must be 'auto' or one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend != "auto":
        return GdsHandle(_CLASSES[backend](path, flags))
    skipped = []
    on_host = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cpu"
    for status in backend_status():
        if not status.available:
            skipped.append(f"{status.name}: {status.reason}")
            continue
        if on_host and not _CLASSES[status.name].moves_host_bytes:
            skipped.append(f"{status.name}: moves device storages only, and these are on the host")
            continue
        try:
            impl = _CLASSES[status.name](path, flags,
                                         reason="auto: " + ("; ".join(skipped) or "first choice"))
        except (BackendUnavailableError, RuntimeError, OSError) as exc:
            # cuFile driver missing, GdsFile's O_DIRECT open refused, ...
            skipped.append(f"{status.name}: {exc}")
            continue
        return GdsHandle(impl)
    raise AssertionError("posix is always available")  # pragma: no cover
