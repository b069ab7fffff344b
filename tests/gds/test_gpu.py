"""The GPU paths: torch.cuda.gds (cuFile) and kvikio, and CUDA storages on the host backends.

Every test is marked ``gpu``. Each one skips, with the reason ``ckptlab.gds.backend_status()``
gives, where its backend cannot run (a CPU-only torch build has only stub ``torch._C._gds_*``
functions; kvikio needs its package and a CUDA device). The generic byte-level cases for the
torch and kvikio backends live in test_conformance.py (its ``torch`` / ``kvikio`` params).
"""

from __future__ import annotations

import io
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from gds_support import BLOCK, assert_round_trip, require_backend, storage_bytes

import ckptlab as cl
from ckptlab import gds, samples
from ckptlab.errors import InvalidArgumentError
from ckptlab.testing import strategies as cst

pytestmark = pytest.mark.gpu

GPU_BACKENDS = ("torch", "kvikio")


def require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False: "
                    f"torch {torch.__version__}, CUDA build {torch.version.cuda})")


@pytest.fixture(params=GPU_BACKENDS)
def gpu_backend(request: pytest.FixtureRequest) -> str:
    require_backend(request.param)
    return request.param


@pytest.fixture(scope="module")
def ckpt() -> dict[str, Any]:
    return samples.tiny_checkpoint()


def to_cuda(obj: Any) -> Any:
    """``obj`` with every tensor on the GPU, storages still shared as before (tied weights)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cuda", weights_only=True)


def test_tutorial_round_trip_on_cuda(gpu_backend: str, ckpt: dict[str, Any],
                                     tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    on_gpu = to_cuda(ckpt)
    report = gds.save(on_gpu, path, backend=gpu_backend)
    assert (report.backend, report.file_nbytes) == (gpu_backend, path.stat().st_size)
    assert report.io_path in ("GDS", "cuFile compat")
    assert all(s.data_offset % BLOCK == 0 for s in cl.inspect(path).storages)
    assert_round_trip(torch.load(path, map_location="cpu", weights_only=True), ckpt)

    back, read = gds.load(path, "cuda", backend=gpu_backend)
    assert read.backend == gpu_backend
    assert all(t.device.type == "cuda" for _, t in cst.iter_tensors(back))
    assert_round_trip(back, ckpt)  # compares bytes on the host
    model = back["model"]
    assert (model["lm_head.weight"].untyped_storage().data_ptr()
            == model["transformer.wte.weight"].untyped_storage().data_ptr())


def test_fix_crc_on_cuda(gpu_backend: str, ckpt: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    gds.save(to_cuda(ckpt), path, backend=gpu_backend, fix_crc=True)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None


def test_registered_buffers(tmp_path: Path) -> None:
    """cuFileBufRegister'd storages (torch.cuda.gds.gds_register_buffer) through the handle."""
    require_backend("torch")
    src = torch.randn(3 * BLOCK // 4 + 5, device="cuda")  # not a whole number of blocks
    dst = torch.empty_like(src)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(BLOCK))
    for t in (src, dst):
        torch.cuda.gds.gds_register_buffer(t.untyped_storage())
    try:
        with gds.open(path, os.O_RDWR, backend="torch") as h:
            h.save_storage(src.untyped_storage(), BLOCK)
            h.load_storage(dst.untyped_storage(), BLOCK)
    finally:
        for t in (src, dst):
            torch.cuda.gds.gds_deregister_buffer(t.untyped_storage())
    assert torch.equal(src, dst)
    assert path.read_bytes()[BLOCK:] == storage_bytes(src.untyped_storage())


def test_gpu_backends_refuse_host_storages(gpu_backend: str, tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(BLOCK))
    with gds.open(path, os.O_RDWR, backend=gpu_backend) as h:
        with pytest.raises(InvalidArgumentError, match="CUDA"):
            h.save_storage(torch.ones(4).untyped_storage(), 0)
        with pytest.raises(InvalidArgumentError, match="CUDA"):
            h.load_storage(torch.ones(4).untyped_storage(), 0)
    assert path.read_bytes() == bytes(BLOCK)


@pytest.mark.parametrize("backend", ["odirect", "posix"])
@pytest.mark.parametrize("nbytes", [0, 100, 2 * BLOCK, 3 * BLOCK + 7])
def test_host_backends_stage_cuda_storages(backend: str, nbytes: int, tmp_path: Path) -> None:
    require_cuda()
    data = os.urandom(nbytes)
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda() if nbytes else \
        torch.empty(0, dtype=torch.uint8, device="cuda")
    dst = torch.full_like(src, 0xAA)
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(BLOCK))
    with gds.open(path, os.O_RDWR, backend=backend) as h:
        h.save_storage(src.untyped_storage(), 10)
        h.load_storage(dst.untyped_storage(), 10)
    assert path.read_bytes()[10:10 + nbytes] == data
    assert storage_bytes(dst.untyped_storage()) == data
    assert dst.device.type == "cuda"


@pytest.mark.parametrize("backend", ["odirect", "posix"])
def test_tutorial_on_cuda_through_a_host_backend(backend: str, ckpt: dict[str, Any],
                                                 tmp_path: Path) -> None:
    require_cuda()
    path = tmp_path / "model.pt"
    gds.save(to_cuda(ckpt), path, backend=backend, fix_crc=True)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
    back, _ = gds.load(path, "cuda", backend=backend)
    assert all(t.device.type == "cuda" for _, t in cst.iter_tensors(back))
    assert_round_trip(back, ckpt)


def test_auto_moves_host_storages_with_a_host_backend(ckpt: dict[str, Any],
                                                      tmp_path: Path) -> None:
    """On a CUDA machine the first backend auto finds may be a cuFile one, which moves device
    memory only: CPU tensors, saved or loaded to "cpu", go through odirect/posix instead."""
    require_cuda()
    path = tmp_path / "model.pt"
    report = gds.save(ckpt, path)
    assert report.backend in ("odirect", "posix"), report.reason
    back, read = gds.load(path, "cpu")
    assert read.backend in ("odirect", "posix"), read.reason
    assert_round_trip(back, ckpt)
    cuda_back, read = gds.load(path, "cuda")
    first = next(s.name for s in gds.backend_status() if s.available)
    assert read.backend == first, read.reason  # device storages: the first that runs
    assert_round_trip(cuda_back, ckpt)


def test_torch_status_tells_whether_cufile_registers_files(tmp_path: Path) -> None:
    """backend_status() tries cuFile on a scratch file: bindings and a device are not enough
    (a VM's virtio disk is refused even in compat mode). Where it says no, a named open says
    the same, naming the file."""
    require_cuda()
    from ckptlab.errors import BackendUnavailableError
    from ckptlab.gds._backends import torch_gds_status

    ok, why = torch_gds_status(str(tmp_path))
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(BLOCK))
    if ok:
        with gds.open(path, os.O_RDWR, backend="torch") as h:
            assert h.io_path in ("GDS", "cuFile compat")
        return
    if "cuFile refused" not in why:
        pytest.skip(f"torch.cuda.gds cannot run here: {why}")
    with pytest.raises(BackendUnavailableError, match=re.escape(str(tmp_path))):
        gds.open(path, os.O_RDWR, backend="torch")
    try:  # what the probe saw is what torch itself does
        torch.cuda.gds.GdsFile(str(path), os.O_RDWR)
    except RuntimeError as exc:
        assert str(exc) in why
    else:
        pytest.fail("GdsFile registered a file the status said cuFile refuses")
