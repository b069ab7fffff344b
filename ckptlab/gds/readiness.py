"""Is this checkpoint, on this filesystem, on this machine, ready for GPUDirect Storage reads?

A direct reader (``O_DIRECT``, cuFile) reads whole 4096-byte blocks at 4096-byte offsets, so a
tensor can be read in place only when its bytes start on a 4096-byte boundary. Where that
boundary falls is the writer's choice, and each format leaves a different choice:

- torch.save files: the storage alignment (``torch.utils.serialization.config.save
  .storage_alignment``, 64 by default) pads every storage's zip record to it.
- safetensors files: no writer option. The data section starts where the JSON header ends
  (padded to 8 bytes) and tensors follow each other with no gap (the format forbids gaps), so
  only padding the header moves them, all by the same amount.
- DCP directories: each item is placed by the storage writer; torch's ``FileSystemWriter``
  packs items back to back, ckptlab's ``AsyncWriter`` puts every item's tensor bytes on a
  4096-byte boundary. Compressed items are inflated on read, never read in place.

:func:`readiness` reads headers only (plus one aligned block for the O_DIRECT probe).
"""

from __future__ import annotations

import ctypes.util
import errno as errno_
import os
from dataclasses import asdict, dataclass
from typing import Any

from ckptlab.format import alignment_costs
from ckptlab.format.layout import ArchiveLayout, SegmentKind
from ckptlab.gds._backends import BLOCK, kvikio_status, torch_gds_status
from ckptlab.gds._buffers import aligned_buffer

__all__ = ["ByteRange", "FileReadiness", "Readiness", "filesystem_of", "o_direct_probe",
           "readiness", "tensor_ranges"]


def _alignment_of(offset: int, cap: int = BLOCK) -> int:
    """Largest power of two <= ``cap`` dividing ``offset`` (``cap`` for offset 0)."""
    alignment = cap
    while offset % alignment:
        alignment //= 2
    return alignment


@dataclass(frozen=True, slots=True)
class ByteRange:
    """The bytes of one tensor part (or one torch.save storage) in one file."""

    name: str  # the tensor's key (see tensor_ranges) or a torch.save storage key
    file: str  # relative to the checkpoint ("" never: a single file is named by itself)
    offset: int  # absolute file offset of the first byte
    nbytes: int
    compression: str | None = None  # "zstd": the bytes at offset are a compressed frame

    @property
    def alignment(self) -> int:
        """Largest power of two (<= 4096) dividing ``offset``."""
        return _alignment_of(self.offset)

    @property
    def aligned(self) -> bool:
        """A direct reader can read these bytes in place: 4096-aligned and not compressed."""
        return self.compression is None and self.offset % BLOCK == 0

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "file": self.file, "offset": self.offset,
               "nbytes": self.nbytes, "alignment": self.alignment, "aligned": self.aligned}
        if self.compression is not None:
            out["compression"] = self.compression
        return out


def tensor_ranges(ck: Any) -> tuple[ByteRange, ...]:
    """One :class:`ByteRange` per part of every tensor of a checkpoint, keyed by name.

    The key is the tensor's name when it has one part; ``name@o1,o2`` for each saved chunk of
    a tensor saved in several chunks (DCP; the chunk's offsets in the global tensor); and
    ``name/role`` for the parts of a sparse, quantized, nested or subclass tensor
    (``w/indices``, ``w/values``). A key that would repeat gets ``#2``, ``#3``...
    """
    out: list[ByteRange] = []
    seen: set[str] = set()
    for t in ck.tensors.values():
        many = len(t.parts) > 1
        for i, p in enumerate(t.parts):
            if not many:
                key = t.name
            elif p.chunk_offsets is not None:
                key = f"{t.name}@{','.join(map(str, p.chunk_offsets))}"
            else:
                key = f"{t.name}/{p.role}"
                if sum(q.role == p.role for q in t.parts) > 1:
                    key += f".{i}"
            unique, n = key, 1
            while unique in seen:
                n += 1
                unique = f"{key}#{n}"
            seen.add(unique)
            out.append(ByteRange(unique, p.file, p.offset, p.nbytes, p.compression))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class FileReadiness:
    """One file of a checkpoint: its tensor bytes' alignment and what would align them."""

    path: str  # relative to the checkpoint
    format: str  # torch-zip, safetensors, distcp, ...
    nbytes: int
    unit: str  # what ``ranges`` are, in words: "storages", "tensors", "chunks"
    ranges: tuple[ByteRange, ...]  # non-empty ones, in file order
    data_offset: int | None = None  # safetensors: where the data section starts
    aligned_if_padded: int | None = None  # safetensors: ranges aligned once the header is
    #                                       padded to end on a 4096 boundary
    storage_alignment: int | None = None  # torch.save: the .storage_alignment record

    @property
    def aligned(self) -> int:
        return sum(r.aligned for r in self.ranges)

    @property
    def ready(self) -> bool:
        return self.aligned == len(self.ranges)

    @property
    def header_padding_nbytes(self) -> int | None:
        """safetensors: spaces to add to the header so the data starts on a 4096 boundary."""
        if self.data_offset is None:
            return None
        return -self.data_offset % BLOCK

    @property
    def fix(self) -> str:
        """What would make this file's bytes 4096-aligned, in words ("" when they are)."""
        if self.ready:
            return ""
        return _FIXES.get(self.format, _fix_other)(self)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "nbytes": self.nbytes,
                "unit": self.unit, "ranges": [r.to_dict() for r in self.ranges],
                "aligned": self.aligned,
                "ready": self.ready, "data_offset": self.data_offset,
                "header_padding_nbytes": self.header_padding_nbytes,
                "aligned_if_padded": self.aligned_if_padded,
                "storage_alignment": self.storage_alignment, "fix": self.fix}


def _fix_torch_zip(f: FileReadiness) -> str:
    return ("save with torch.utils.serialization.config.save.storage_alignment = 4096 (or "
            "ckptlab.gds.save): torch.save then pads every storage to a 4096-byte boundary")


def _fix_safetensors(f: FileReadiness) -> str:
    pad = f.header_padding_nbytes or 0
    total = len(f.ranges)
    if pad:
        first = (f"pad the JSON header with {pad:,} more spaces (the format allows trailing "
                 f"spaces) so the data starts at byte {(f.data_offset or 0) + pad:,}, a 4096 "
                 f"boundary: {f.aligned_if_padded} of {total} tensors would then start aligned")
    else:
        first = "the data section already starts on a 4096 boundary"
    if f.aligned_if_padded == total:
        return first
    return (first + "; safetensors packs tensors back to back with no gap, so the others start "
            "where the sizes before them put them. No safetensors writer option aligns them: "
            "to read every tensor in place, convert the file to a torch.save file written with "
            "4096-byte storage alignment (ckptlab.gds.save does)")


def _fix_distcp(f: FileReadiness) -> str:
    if any(r.compression for r in f.ranges):
        return ("compressed items are inflated on read, never read in place: save without "
                "the ZStandard extension, with ckptlab.write.AsyncWriter as the storage writer")
    return ("torch's FileSystemWriter packs items back to back and has no alignment option: "
            "save with ckptlab.write.AsyncWriter as the storage writer (dcp.save(..., "
            "storage_writer=AsyncWriter(DIR))), which puts every item's tensor bytes on a "
            "4096-byte boundary")


def _fix_other(f: FileReadiness) -> str:
    return (f"ckptlab knows no writer option that aligns a {f.format} file: re-save the "
            "tensors as a torch.save file with 4096-byte storage alignment (ckptlab.gds.save)")


_FIXES = {"torch-zip": _fix_torch_zip, "safetensors": _fix_safetensors,
          "distcp": _fix_distcp}
_UNITS = {"torch-zip": "storages", "safetensors": "tensors", "distcp": "chunks"}


@dataclass(frozen=True, slots=True)
class Readiness:
    """What stands between a checkpoint and 4 KiB-aligned direct reads.

    ``ready`` is True when every non-empty storage (torch.save), tensor (safetensors) or
    chunk (DCP) starts on a 4096-byte boundary, none is compressed, and the filesystem
    accepts O_DIRECT; cuFile / nvidia-fs / CUDA decide whether the reads go GPU direct
    (``gds``) or through cuFile's compat mode or the O_DIRECT emulation. ``files`` says it
    per file, with what would fix each (``FileReadiness.fix``).

    The ``storages`` fields count what a direct reader reads in place: storages of a
    torch.save file, tensor parts of the other formats (their keys as
    :func:`tensor_ranges` names them; ``file:key`` for the storages of a torch.save file
    inside a directory).
    """

    path: str
    file_nbytes: int
    storages: int  # non-empty storages (torch.save) or tensor byte ranges (other formats)
    storages_4k_aligned: int
    unaligned_keys: tuple[str, ...]  # storage keys / range names whose data is not on 4096
    storage_alignment: int | None  # the .storage_alignment record (a torch.save file)
    file_nbytes_at_64: int | None  # the same archive written at alignment 64 ... (None where
    file_nbytes_at_4096: int | None  # ... and at 4096: alignment is no torch.save choice)
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
    format: str = "torch-zip"  # the checkpoint's format (ckptlab.open's names)
    files: tuple[FileReadiness, ...] = ()  # every file holding tensor bytes

    @property
    def ready(self) -> bool:
        return self.storages_4k_aligned == self.storages and self.o_direct

    @property
    def gds(self) -> bool:
        """GPU-direct reads are possible: ready, plus the driver, cuFile and torch bindings."""
        return self.ready and self.nvidia_fs and self.cufile and (self.torch_gds or self.kvikio)

    @property
    def padding_cost_nbytes(self) -> int | None:
        """Extra bytes 4096 alignment costs over 64 (a torch.save file; None otherwise)."""
        if self.file_nbytes_at_4096 is None or self.file_nbytes_at_64 is None:
            return None
        return self.file_nbytes_at_4096 - self.file_nbytes_at_64

    @property
    def fixes(self) -> tuple[tuple[str, str], ...]:
        """(file, what to do) for every file that is not ready, in words."""
        return tuple((f.path, f.fix) for f in self.files if f.fix)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "files"}
        out.update(ready=self.ready, gds=self.gds, padding_cost_nbytes=self.padding_cost_nbytes,
                   unaligned_keys=list(self.unaligned_keys),
                   files=[f.to_dict() for f in self.files],
                   fixes=[{"file": p, "fix": fix} for p, fix in self.fixes])
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


def _storage_ranges(layout: ArchiveLayout, file: str, prefix: str = "") -> tuple[ByteRange, ...]:
    return tuple(ByteRange(prefix + s.key, file, s.data_offset, s.nbytes)
                 for s in layout.storages if s.nbytes)


def _file_readiness(entry: Any, ranges: list[ByteRange], multi: bool) -> FileReadiness:
    """One file: a torch.save file by its storages, any other by its tensor ranges."""
    layout = entry.layout
    if entry.format == "torch-zip" and isinstance(layout, ArchiveLayout):
        return FileReadiness(entry.path, entry.format, entry.nbytes, "storages",
                             _storage_ranges(layout, entry.path,
                                             f"{entry.path}:" if multi else ""),
                             storage_alignment=layout.storage_alignment)
    mine = tuple(sorted((r for r in ranges if r.file == entry.path and r.nbytes),
                        key=lambda r: r.offset))
    unit = _UNITS.get(entry.format, "tensors")
    if entry.format == "distcp" and not any("@" in r.name for r in mine):
        unit = "items"
    if entry.format == "safetensors" and isinstance(layout, ArchiveLayout):
        header = (SegmentKind.HEADER_LENGTH, SegmentKind.HEADER, SegmentKind.HEADER_PADDING)
        start = max((s.end_offset for s in layout.segments if s.kind in header), default=8)
        padded = start + (-start % BLOCK)
        return FileReadiness(entry.path, entry.format, entry.nbytes, unit, mine,
                             data_offset=start,
                             aligned_if_padded=sum((r.offset - start + padded) % BLOCK == 0
                                                   for r in mine))
    return FileReadiness(entry.path, entry.format, entry.nbytes, unit, mine)


def readiness(path: str | os.PathLike[str]) -> Readiness:
    """Check a checkpoint for GDS / O_DIRECT reads (reads headers only).

    Parameters
    ----------
    path
        Anything :func:`ckptlab.open` reads: a torch.save or safetensors file, a Hugging Face,
        DCP or plain checkpoint directory.

    Returns
    -------
    Readiness
        Per file (``files``): which storages, tensors or chunks start on 4096 bytes and what
        would align the others; the padding cost of 4096 alignment for a torch.save file;
        the filesystem, O_DIRECT and the GDS pieces of this machine.

    Examples
    --------
    >>> import ckptlab.gds
    >>> r = ckptlab.gds.readiness(ckptlab.samples.sample_path())
    >>> r.storages_4k_aligned == r.storages   # the sample is saved at alignment 64
    False
    """
    from ckptlab.checkpoint import open_checkpoint

    path = os.fspath(path)
    ck = open_checkpoint(path)
    ranges = list(tensor_ranges(ck))
    holding = {r.file for r in ranges}
    multi = len(ck.files) > 1
    files = tuple(_file_readiness(f, ranges, multi) for f in ck.files
                  if f.path in holding or (f.format == "torch-zip" and
                                           isinstance(f.layout, ArchiveLayout)))
    every = [r for f in files for r in f.ranges]
    unaligned = tuple(r.name for r in every if not r.aligned)
    at64 = at4096 = None
    storage_alignment = None
    if ck.format == "torch-zip" and len(ck.files) == 1 and isinstance(ck.files[0].layout,
                                                                        ArchiveLayout):
        layout = ck.files[0].layout
        storage_alignment = layout.storage_alignment
        at64, at4096 = (c.file_nbytes for c in alignment_costs(layout, (64, 4096)))
    probe = next((f.full_path for f in ck.files if f.path in holding and f.full_path),
                 next((f.full_path for f in ck.files if f.full_path), path))
    fs, mount = filesystem_of(probe)
    o_direct, o_direct_reason = o_direct_probe(probe)
    torch_ok, torch_why = torch_gds_status(os.path.dirname(os.path.abspath(probe)))
    kvikio_ok, kvikio_why = kvikio_status()
    return Readiness(
        path=path, file_nbytes=ck.nbytes, storages=len(every),
        storages_4k_aligned=len(every) - len(unaligned), unaligned_keys=unaligned,
        storage_alignment=storage_alignment, file_nbytes_at_64=at64, file_nbytes_at_4096=at4096,
        filesystem=fs, mount_point=mount, o_direct=o_direct, o_direct_reason=o_direct_reason,
        nvidia_fs=os.path.exists("/proc/driver/nvidia-fs"),
        cufile=ctypes.util.find_library("cufile") is not None,
        torch_gds=torch_ok, torch_gds_reason=torch_why, kvikio=kvikio_ok,
        kvikio_reason=kvikio_why, format=ck.format, files=files)
