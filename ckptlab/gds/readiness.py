"""Is this checkpoint, on this filesystem, on this machine, ready for GPUDirect Storage reads?"""

from __future__ import annotations

import ctypes.util
import errno as errno_
import os
from dataclasses import asdict, dataclass
from typing import Any

from ckptlab.format import alignment_costs, inspect
from ckptlab.gds._backends import BLOCK, kvikio_status, torch_gds_status
from ckptlab.gds._buffers import aligned_buffer

__all__ = ["Readiness", "filesystem_of", "o_direct_probe", "readiness"]


@dataclass(frozen=True, slots=True)
class Readiness:
    """What stands between a checkpoint and 4 KiB-aligned direct reads.

    ``ready`` is True when every non-empty storage starts on a 4096-byte boundary and the
    filesystem accepts O_DIRECT; cuFile / nvidia-fs / CUDA decide whether the reads go GPU
    direct (``gds``) or through cuFile's compat mode or the O_DIRECT emulation.
    """

    path: str
    file_nbytes: int
    storages: int  # non-empty storages
    storages_4k_aligned: int
    unaligned_keys: tuple[str, ...]  # storage keys whose data does not start on 4096
    storage_alignment: int | None  # the .storage_alignment record
    file_nbytes_at_64: int  # the same archive written at alignment 64 ...
    file_nbytes_at_4096: int  # ... and at 4096 (what GDS alignment costs)
    filesystem: str  # type of the filesystem holding the file (ext4, xfs, tmpfs, ...)
    mount_point: str
    o_direct: bool  # an aligned O_DIRECT read of the file succeeded
    o_direct_reason: str
    nvidia_fs: bool  # /proc/driver/nvidia-fs (the GDS kernel driver) is present
    cufile: bool  # libcufile is loadable
    torch_gds: bool
    torch_gds_reason: str
    kvikio: bool
    kvikio_reason: str

    @property
    def ready(self) -> bool:
        return self.storages_4k_aligned == self.storages and self.o_direct

    @property
    def gds(self) -> bool:
        """GPU-direct reads are possible: ready, plus the driver, cuFile and torch bindings."""
        return self.ready and self.nvidia_fs and self.cufile and (self.torch_gds or self.kvikio)

    @property
    def padding_cost_nbytes(self) -> int:
        """Extra bytes 4096 alignment costs over 64."""
        return self.file_nbytes_at_4096 - self.file_nbytes_at_64

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ready=self.ready, gds=self.gds, padding_cost_nbytes=self.padding_cost_nbytes,
                   unaligned_keys=list(self.unaligned_keys))
        return out


def filesystem_of(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(filesystem type, mount point) of the filesystem holding ``path``, from /proc/mounts."""
    real = os.path.realpath(os.fspath(path))
    best = ("unknown", "/")
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[1]):
                    best = (parts[2], mount)
    except OSError:
        pass
    return best


def o_direct_probe(path: str | os.PathLike[str]) -> tuple[bool, str]:
    """Open ``path`` with O_DIRECT and read its first aligned block (never writes)."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this platform has no O_DIRECT"
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        return False, f"open with O_DIRECT failed: {exc.strerror}"
    try:
        buf = aligned_buffer(BLOCK)
        try:
            os.preadv(fd, [buf], 0)
        except OSError as exc:
            why = "EINVAL: the filesystem refuses O_DIRECT" if exc.errno == errno_.EINVAL \
                else exc.strerror
            return False, f"aligned O_DIRECT read failed ({why})"
        finally:
            buf.release()
    finally:
        os.close(fd)
    return True, f"an aligned {BLOCK}-byte O_DIRECT read succeeded"


def readiness(path: str | os.PathLike[str]) -> Readiness:
    """Check a torch.save checkpoint for GDS / O_DIRECT reads (reads headers only).

    Examples
    --------
    >>> import ckptlab.gds
    >>> r = ckptlab.gds.readiness(ckptlab.samples.sample_path())
    >>> r.storages_4k_aligned == r.storages   # the sample is saved at alignment 64
    False
    """
    path = os.fspath(path)
    layout = inspect(path)
    storages = [s for s in layout.storages if s.nbytes]
    unaligned = tuple(s.key for s in storages if s.data_offset % BLOCK)
    at64, at4096 = (alignment_costs(layout, (64, 4096)) if layout.format == "torch-zip"
                    else (None, None))
    fs, mount = filesystem_of(path)
    o_direct, o_direct_reason = o_direct_probe(path)
    torch_ok, torch_why = torch_gds_status()
    kvikio_ok, kvikio_why = kvikio_status()
    return Readiness(
        path=path, file_nbytes=layout.file_nbytes, storages=len(storages),
        storages_4k_aligned=len(storages) - len(unaligned), unaligned_keys=unaligned,
        storage_alignment=layout.storage_alignment,
        file_nbytes_at_64=at64.file_nbytes if at64 else layout.file_nbytes,
        file_nbytes_at_4096=at4096.file_nbytes if at4096 else layout.file_nbytes,
        filesystem=fs, mount_point=mount, o_direct=o_direct, o_direct_reason=o_direct_reason,
        nvidia_fs=os.path.exists("/proc/driver/nvidia-fs"),
        cufile=ctypes.util.find_library("cufile") is not None,
        torch_gds=torch_ok, torch_gds_reason=torch_why, kvikio=kvikio_ok,
        kvikio_reason=kvikio_why)
