"""Layout of a .safetensors file: u64 header length, JSON header, 8-byte alignment, tensor data."""

from __future__ import annotations

import json
import struct

from ckptlab.errors import CorruptArchiveError, TruncatedArchiveError, UnsupportedFormatError
from ckptlab.format._dtypes import (
    DTYPE_ITEMSIZE,
    SAFETENSORS_DTYPE,
    SAFETENSORS_PACKED,
    SAFETENSORS_SUBBYTE_BITS,
)
from ckptlab.format.archive import largest_alignment
from ckptlab.format.layout import (
    ArchiveLayout,
    Segment,
    SegmentKind,
    StorageInfo,
    TensorInfo,
    contiguous_strides,
)
from ckptlab.source._bytes import ByteSource

__all__ = ["looks_like_safetensors", "scan_safetensors"]

MAX_HEADER_NBYTES = 100_000_000  # the limit the safetensors library enforces
_MAX_DIM = 1 << 62  # a dimension past this cannot be a real tensor (and products stay cheap)


def looks_like_safetensors(head: bytes, file_nbytes: int) -> bool:
    """A plausible header length followed by a JSON object."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack_from("<Q", head)
    return 2 <= n <= min(MAX_HEADER_NBYTES, file_nbytes - 8) and head[8:9] == b"{"


def scan_safetensors(src: ByteSource) -> ArchiveLayout:
    """Every byte of a safetensors file; raises a ckptlab error naming the tensor at fault."""
    path = src.name
    (n,) = struct.unpack("<Q", src.read(0, 8, what="safetensors header length"))
    if n > MAX_HEADER_NBYTES:
        raise CorruptArchiveError("safetensors header length too large", path=path, offset=0,
                                  expected=f"<= {MAX_HEADER_NBYTES}", actual=n)
    if 8 + n > src.nbytes:
        raise TruncatedArchiveError("file ends inside the safetensors header", path=path,
                                    offset=8, expected=f"{n} header bytes",
                                    actual=f"{src.nbytes - 8} bytes")
    raw = src.read(8, n, what="safetensors header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise CorruptArchiveError(f"safetensors header is not UTF-8 JSON: {reason}", path=path,
                                  offset=8) from None
    if not isinstance(header, dict):
        raise CorruptArchiveError("safetensors header is not a JSON object", path=path, offset=8)
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise CorruptArchiveError("__metadata__ must map strings to strings", path=path, offset=8)
    json_nbytes = len(raw.rstrip(b" "))
    data_start = 8 + n
    data_nbytes = src.nbytes - data_start
    entries = []
    for name, info in header.items():
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
                and isinstance(info.get("shape"), list)
                and all(type(d) is int and d >= 0 for d in info["shape"])
                and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
                and all(type(o) is int and o >= 0 for o in info["data_offsets"])):
            raise CorruptArchiveError("tensor entry needs dtype, shape and data_offsets",
                                      path=path, record=name, offset=8)
        tag = info["dtype"]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if any(d > _MAX_DIM for d in shape) or len(shape) > 64:
            raise CorruptArchiveError("tensor shape is out of range", path=path, record=name,
                                      offset=8, expected=f"at most 64 dims of <= {_MAX_DIM}",
                                      actual=f"{len(shape)} dims")
        numel = 1
        for d in shape:
            numel *= d
        if tag in SAFETENSORS_PACKED:  # F4: torch packs two values a byte in the last dim
            dtype, per_byte = SAFETENSORS_PACKED[tag]
            if not shape or shape[-1] % per_byte:
                raise CorruptArchiveError(f"{tag} tensor's last dimension is not a multiple of "
                                          f"{per_byte}", path=path, record=name, offset=8,
                                          actual=list(shape))
            shape = (*shape[:-1], shape[-1] // per_byte)
            want = numel // per_byte
        elif tag in SAFETENSORS_DTYPE:
            dtype = SAFETENSORS_DTYPE[tag]
            want = numel * DTYPE_ITEMSIZE[dtype]
        elif tag in SAFETENSORS_SUBBYTE_BITS:
            dtype = tag.lower()
            want = -(-numel * SAFETENSORS_SUBBYTE_BITS[tag] // 8)
        else:
            raise UnsupportedFormatError(f"unknown safetensors dtype {tag!r}", path=path,
                                         record=name, offset=8)
        # offsets in these errors point at the header, where the bad numbers are
        if end < begin or end - begin != want:
            raise CorruptArchiveError("tensor byte range does not match dtype x shape",
                                      path=path, record=name, offset=8,
                                      expected=f"{want} bytes", actual=f"[{begin}, {end})")
        if end > data_nbytes:
            raise TruncatedArchiveError("tensor data runs past the end of the file", path=path,
                                        record=name, offset=8,
                                        expected=f"end <= {data_nbytes}", actual=end)
        entries.append((begin, end, name, dtype, shape))
    entries.sort()
    segments = [Segment(SegmentKind.HEADER_LENGTH, 0, 8),
                Segment(SegmentKind.HEADER, 8, json_nbytes)]
    if n > json_nbytes:
        segments.append(Segment(SegmentKind.HEADER_PADDING, 8 + json_nbytes, n - json_nbytes))
    cursor = 0
    storages, tensors = [], []
    for begin, end, name, dtype, shape in entries:
        if begin < cursor:
            raise CorruptArchiveError("tensor data overlaps the previous tensor", path=path,
                                      record=name, offset=data_start + begin,
                                      expected=f">= {data_start + cursor}",
                                      actual=data_start + begin)
        if begin > cursor:
            segments.append(Segment(SegmentKind.UNKNOWN, data_start + cursor, begin - cursor))
        if end > begin:
            segments.append(Segment(SegmentKind.DATA, data_start + begin, end - begin, name))
        cursor = max(cursor, end)
        storages.append(StorageInfo(name, name, dtype, end - begin, data_start + begin, "",
                                    "safetensors"))
        tensors.append(TensorInfo((name,), name, dtype, shape, contiguous_strides(shape), 0))
    if cursor < data_nbytes:
        segments.append(Segment(SegmentKind.UNKNOWN, data_start + cursor, data_nbytes - cursor))
    return ArchiveLayout(
        format="safetensors", path=path, file_nbytes=src.nbytes, archive_name="", records=(),
        storages=tuple(storages), tensors=tuple(tensors), segments=tuple(segments),
        alignment=largest_alignment([s.data_offset for s in storages if s.nbytes]),
        zip64=False, metadata=metadata,
    )
