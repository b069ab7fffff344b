"""The declared backend interface (``ckptlab.gds._backends.Backend``): capabilities as
attributes, the shared GPU skeleton, and kvikio compat detection against its documented API."""

from __future__ import annotations

import enum
import errno
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ckptlab import gds
from ckptlab.errors import BackendUnavailableError, InvalidArgumentError
from ckptlab.gds import _backends
from ckptlab.gds._backends import (
    Backend,
    GpuBackend,
    KvikioBackend,
    ODirectBackend,
    PosixBackend,
    TorchGdsBackend,
    kvikio_compat,
)
from ckptlab.gds.handle import GdsHandle


def test_capabilities_are_declared_on_the_classes() -> None:
    for cls in (PosixBackend, ODirectBackend):
        assert cls.moves_host_bytes and not cls.moves_device_storages
    for cls in (TorchGdsBackend, KvikioBackend):
        assert issubclass(cls, GpuBackend)
        assert cls.moves_device_storages and not cls.moves_host_bytes
    assert {c.name for c in (PosixBackend, ODirectBackend, TorchGdsBackend, KvikioBackend)} \
        == set(gds.BACKENDS)
    with pytest.raises(TypeError):
        Backend()  # type: ignore[abstract]


def test_a_gpu_backend_that_cannot_run_says_why(tmp_path: Path) -> None:
    for cls in (TorchGdsBackend, KvikioBackend):
        ok, why = cls.status()
        if ok:
            continue
        with pytest.raises(BackendUnavailableError, match=f"cannot run: {why.split(' (')[0]}"):
            cls(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT)
        assert not (tmp_path / "f").exists()  # refused before anything was opened


class DeviceOnly(GpuBackend):
    """A GPU backend double: moves 'device' storages by copying bytes, counts calls."""

    name = "fake"
    error = "cuFile said no"

    @staticmethod
    def status(directory: str | None = None) -> tuple[bool, str]:
        return True, "always"

    def _open(self, path: str, flags: int) -> str:
        self.file = os.open(path, flags, 0o644)
        self.calls: list[tuple[str, int]] = []
        return _backends.COMPAT

    def _write(self, storage: Any, offset: int) -> None:
        self.calls.append(("write", offset))
        raise RuntimeError(self.error)

    def _read(self, storage: Any, offset: int) -> None:
        self.calls.append(("read", offset))

    def _fd(self) -> int:
        return self.file

    def close(self) -> None:
        if self.file is not None:
            os.close(self.file)
            self.file = None


def test_the_handle_dispatches_on_capabilities(tmp_path: Path) -> None:
    impl = DeviceOnly(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT)
    with GdsHandle(impl) as h:
        storage = torch.zeros(16, dtype=torch.uint8).untyped_storage()
        with pytest.raises(InvalidArgumentError, match="writes CUDA storages"):
            h.save_storage(storage, 0)  # a CPU storage, and the backend moves device ones
        with pytest.raises(InvalidArgumentError, match="reads into CUDA storages"):
            h.load_storage(storage, 0)
        with pytest.raises(InvalidArgumentError, match="storages only"):
            h.write_bytes(b"x", 0)
        assert h.io_path == "cuFile compat" and impl.calls == []


def test_the_gpu_skeleton_turns_library_errors_into_storage_errors(tmp_path: Path) -> None:
    impl = DeviceOnly(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT)
    impl._torch = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None))
    storage = torch.zeros(16, dtype=torch.uint8).untyped_storage()
    with pytest.raises(OSError, match="cuFile said no") as info:
        impl.save_storage(storage, 4096)
    assert (info.value.offset, info.value.nbytes) == (4096, 16)  # type: ignore[attr-defined]
    with pytest.raises(OSError, match="read past the end"):  # cuFile would read short
        impl.load_storage(storage, 0)
    (tmp_path / "f").write_bytes(bytes(32))
    impl.load_storage(storage, 16)
    assert impl.calls == [("write", 4096), ("read", 16)] and impl.direct_nbytes == 16
    impl.close()


def test_a_library_error_that_names_an_os_error_carries_its_errno(tmp_path: Path) -> None:
    """kvikio reports a full disk as RuntimeError text: it is ENOSPC, as on the host backends."""
    impl = DeviceOnly(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT)
    impl._torch = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None))
    storage = torch.zeros(16, dtype=torch.uint8).untyped_storage()
    for text, number in (("posix_io.hpp:90: POSIX error on pwrite: No space left on device",
                          errno.ENOSPC),
                         ("POSIX error on pread: Input/output error", errno.EIO),
                         ("Not a directory", errno.ENOTDIR),
                         ("cuFile said no", None)):
        impl.error = text
        with pytest.raises(OSError, match=re.escape(text)) as info:
            impl.save_storage(storage, 0)
        assert info.value.errno == number, text
    impl.close()


@pytest.fixture
def a_device_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """backend_status() says a cuFile backend runs (this machine has none), served by the
    DeviceOnly double: what ``backend="auto"`` does on a CUDA machine, for host storages."""
    from ckptlab.gds import handle

    real = handle.backend_status()
    monkeypatch.setattr(handle, "backend_status", lambda: (
        handle.BackendStatus("torch", True, "a double"), *real[1:]))
    monkeypatch.setitem(handle._CLASSES, "torch", DeviceOnly)


@pytest.mark.usefixtures("a_device_backend")
def test_auto_gives_host_storages_a_host_backend(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(4096))
    with gds.open(path) as h:
        assert h.backend == "fake"  # no device named: the first backend that runs
    for device in ("cpu", torch.device("cpu")):
        with gds.open(path, device=device) as h:
            assert h.backend in ("odirect", "posix")
            assert "torch: moves device storages only, and these are on the host" in h.reason
    sd = {"w": torch.arange(3000.0), "b": torch.ones(5, dtype=torch.int64)}
    report = gds.save(sd, tmp_path / "m.pt")  # CPU tensors: a host backend writes them
    assert report.backend in ("odirect", "posix")
    back, read = gds.load(tmp_path / "m.pt", "cpu")
    assert read.backend in ("odirect", "posix")
    assert all(torch.equal(back[k], sd[k]) for k in sd)


class Mode(enum.Enum):
    OFF = 0
    ON = 1
    AUTO = 2


@pytest.mark.parametrize(("defaults", "compat"), [
    (SimpleNamespace(is_compat_mode_preferred=lambda: True), True),  # kvikio >= 25.02
    (SimpleNamespace(is_compat_mode_preferred=lambda: False, compat_mode=lambda: Mode.ON),
     False),  # the resolved answer wins over the setting
    (SimpleNamespace(compat_mode=lambda: Mode.OFF), False),  # kvikio 24.x
    (SimpleNamespace(compat_mode=lambda: Mode.ON), True),
    (SimpleNamespace(compat_mode=lambda: Mode.AUTO), True),  # unresolved: never claim GDS
    (SimpleNamespace(compat_mode=lambda: False), False),  # before CompatMode: a bool
    (SimpleNamespace(), True),  # no way to ask
])
def test_kvikio_compat_follows_its_documented_api(defaults: Any, compat: bool) -> None:
    assert kvikio_compat(defaults) is compat


def test_aligned_reads_go_in_place_with_several_requests_in_flight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptlab._io import address_of, aligned_buffer

    monkeypatch.setattr(_backends, "READ_NBYTES", 4096)  # 64 KiB: 16 requests, 2 in flight
    payload = os.urandom(16 * 4096 + 100)
    (tmp_path / "f").write_bytes(payload)
    seen: list[tuple[int, int]] = []
    real = os.preadv

    def preadv(fd: int, buffers: list[Any], offset: int) -> int:
        seen.append((address_of(buffers[0]), offset))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    with gds.open(tmp_path / "f", os.O_RDONLY, backend="odirect") as h:
        if h.io_path != "O_DIRECT":
            pytest.skip("this filesystem refuses O_DIRECT")
        dest = aligned_buffer(len(payload))
        h._impl.read_into(dest, 0)  # type: ignore[union-attr]
        assert bytes(dest) == payload and h.direct_nbytes == len(payload)
    base = address_of(dest)
    in_place = sorted(off for addr, off in seen if addr - base == off)
    assert in_place == list(range(0, 16 * 4096, 4096))  # every block straight into dest


def test_the_bounce_ring_is_private_huge_page_memory(tmp_path: Path) -> None:
    """The O_DIRECT ring's bounce buffers are filled by copies, never by the page cache:
    advised for huge pages (a save faults 64 MiB of them; 4 KiB faults made a loaded
    512 MiB save 1.7x slower), private, page aligned. Read from the kernel's VmFlags."""
    from ckptlab._io import address_of
    from ckptlab.testing.memory import mapping_flags

    with gds.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, backend="odirect") as h:
        if h.io_path != "O_DIRECT":
            pytest.skip("this filesystem refuses O_DIRECT")
        data = memoryview(bytearray(3 * 4096 + 1))[1:]  # an address off the block grid
        h.write_bytes(data, 4096)  # aligned in the file, not in memory: through the ring
        buffers = h._impl._buffers  # type: ignore[union-attr]
        assert len(buffers) == _backends.DEPTH
        flags = [mapping_flags(address_of(b)) for b in buffers]
        assert all(address_of(b) % 4096 == 0 for b in buffers)
    if flags[0] is None:
        pytest.skip("no /proc/self/smaps here")
    assert all("hg" in f and "sh" not in f for f in flags), flags


def test_einval_during_concurrent_reads_falls_back(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    from ckptlab._io import aligned_buffer

    monkeypatch.setattr(_backends, "READ_NBYTES", 4096)
    payload = os.urandom(8 * 4096)
    (tmp_path / "f").write_bytes(payload)
    real = os.preadv

    def preadv(fd: int, buffers: list[Any], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset >= 4 * 4096:
            raise OSError(22, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    with gds.open(tmp_path / "f", os.O_RDONLY, backend="odirect") as h:
        if h.io_path != "O_DIRECT":
            pytest.skip("this filesystem refuses O_DIRECT")
        dest = aligned_buffer(len(payload))
        h._impl.read_into(dest, 0)  # type: ignore[union-attr]
        assert bytes(dest) == payload
        assert h.io_path == "POSIX" and "refused an O_DIRECT read" in h.reason
