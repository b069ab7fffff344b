"""Layout of a tensorizer ``.tensors`` file (CoreWeave's tensorizer, data versions 1-5).

Read from tensorizer's own serializer (``tensorizer/serialization.py``); every number little
endian::

    file header   b"|TZR|", u32 data version, 32 bytes of feature flags (version 4+: bit 0
                  encrypted, bit 1 versioned metadata entries), u64 nominal data size,
                  8 unused bytes, u64 tensor count
    metadata      u64 length, then one entry per tensor: [u32 entry version, when versioned]
                  u16 + name, u8 tensor type (0 parameter, 1 buffer, 2 state dict), u8 + dtype,
                  u8 ndim + dims (u32 each; u64 for entry version 5+), u64 header offset,
                  u64 data offset, u64 data length
    (zero bytes: the room the metadata length reserves for more entries)
    per tensor    a header: u64 header length, u16 module index, u8 tensor type, u16 + name,
                  u8 + dtype, u8 ndim + dims, u16 + hash block (u8 count, then per hash u8
                  type, u8 length, the hash: 0 CRC32 as u32, 1 SHA-256), [u64 + crypt info,
                  when the file can be encrypted], i64 data length; then the data
    end           u64 0 (a header length of 0: no more tensors)

A name is UTF-8, or a JSON array of keys after an ASCII record separator (0x1E) for nested
state dicts (``{"model": {"w": t}}``: ``model.w``). A dtype is NumPy's (``<f4``), or NumPy's
stand-in, a NUL and torch's name for dtypes NumPy lacks (``<V2\\0torch.bfloat16``). A tensor
saved from the ``meta`` device has data length 0: tensorizer loads it as zeros.

Each tensor's hashes cover its header (with the hash values zeroed) followed by its data;
:func:`check_hashes` checks them as tensorizer does, when the tensor is read. Encrypted files
are refused by name (ckptlab does not decrypt).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib
from typing import Any

from ckptlab.errors import CorruptArchiveError, TruncatedArchiveError, UnsupportedFormatError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
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

__all__ = ["MAGIC", "check_hashes", "looks_like_tensorizer", "scan_tensorizer",
           "scan_tensorizer_entries"]

MAGIC = b"|TZR|"
_FILE = struct.Struct("<I32sQ8xQ")  # after the magic: version, flags, data size, tensor count
FILE_HEADER_NBYTES = len(MAGIC) + _FILE.size
VERSIONS = range(1, 6)  # the data versions tensorizer 2.x writes
_ENCRYPTED, _VERSIONED = 1, 2  # feature flag bits
TENSOR_TYPES = ("parameter", "buffer", "state_dict")
_MAX_METADATA = 1 << 30  # a metadata block past 1 GiB is not one tensorizer wrote
_HASHES = {0: ("crc32", 4), 1: ("sha256", 32)}
# NumPy dtype codes (byte order stripped) -> torch's name
_NUMPY = {"f2": "float16", "f4": "float32", "f8": "float64", "i1": "int8", "i2": "int16",
          "i4": "int32", "i8": "int64", "u1": "uint8", "u2": "uint16", "u4": "uint32",
          "u8": "uint64", "b1": "bool", "c8": "complex64", "c16": "complex128"}


def looks_like_tensorizer(head: bytes) -> bool:
    """Whether a file starts with tensorizer's magic."""
    return head[:len(MAGIC)] == MAGIC


class _Cursor:
    """Reads fields of one block of bytes, each error naming the file offset it stopped at."""

    def __init__(self, data: bytes, base: int, path: str, what: str, record: str | None = None
                 ) -> None:
        self.data, self.base, self.path, self.what, self.record = data, base, path, what, record
        self.at = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.data):
            raise CorruptArchiveError(f"{self.what} ends inside a field", path=self.path,
                                      record=self.record, offset=self.base + self.at,
                                      expected=f"{size} more bytes",
                                      actual=f"{len(self.data) - self.at}")
        value = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += size
        return value if len(value) > 1 else value[0]

    def bytes(self, length_fmt: str) -> bytes:
        n = self.take(length_fmt)
        if self.at + n > len(self.data):
            raise CorruptArchiveError(f"{self.what} ends inside a field", path=self.path,
                                      record=self.record, offset=self.base + self.at,
                                      expected=f"{n} bytes", actual=len(self.data) - self.at)
        out = self.data[self.at:self.at + n]
        self.at += n
        return bytes(out)

    def shape(self, long: bool) -> tuple[int, ...]:
        ndim = self.take("B")
        return tuple(self.take("Q" if long else "I") for _ in range(ndim)) if ndim else ()


def _name(raw: bytes, path: str, offset: int) -> tuple[str | int, ...]:
    """A tensor's path: its UTF-8 name, or the keys of a JSON array after 0x1E."""
    try:
        if raw[:1] != b"\x1e":
            return (raw.decode("utf-8"),)
        keys = json.loads(raw[1:].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptArchiveError("tensor name is not UTF-8 or a JSON array of keys",
                                  path=path, offset=offset, actual=raw[:40]) from None
    if not (isinstance(keys, list) and keys and all(
            isinstance(k, str) or (type(k) is int and k >= 0) for k in keys)):
        raise CorruptArchiveError("tensor path is not a non-empty array of keys", path=path,
                                  offset=offset, actual=raw[:40])
    return tuple(keys)


def _dtype(raw: bytes, path: str, record: str, offset: int) -> str:
    text = raw.decode("utf-8", "replace")
    numpy_code, _, torch_name = text.partition("\0")
    if torch_name:  # a dtype NumPy lacks: torch's own name after the stand-in
        name = torch_name.removeprefix("torch.")
        if name in DTYPE_ITEMSIZE:
            return name
    elif numpy_code[:1] in "<|=" and numpy_code[1:] in _NUMPY:
        return _NUMPY[numpy_code[1:]]
    raise UnsupportedFormatError(f"tensorizer dtype {text!r} is not one ckptlab knows "
                                 "(little-endian NumPy codes and torch's opaque dtypes)",
                                 path=path, record=record, offset=offset)


def scan_tensorizer(src: ByteSource) -> ArchiveLayout:
    """Every byte of a tensorizer file; raises a ckptlab error naming the tensor at fault.

    Reads the file header, the metadata block and each tensor's header (the data is read
    only when a tensor is: :func:`check_hashes`)."""
    return scan_tensorizer_entries(src)[0]


def scan_tensorizer_entries(src: ByteSource) -> tuple[ArchiveLayout, dict[str, dict[str, Any]]]:
    """:func:`scan_tensorizer`, and per tensor name: its ``type`` (parameter, buffer,
    state_dict), ``hashes`` (name -> hex), ``header`` ([offset, bytes, hash block at]) and
    ``zeros`` (a meta tensor: no data, loaded as zeros)."""
    path = src.name
    head = src.read(0, min(FILE_HEADER_NBYTES, src.nbytes), what="tensorizer file header")
    if len(head) < FILE_HEADER_NBYTES:
        raise TruncatedArchiveError("file ends inside the tensorizer file header", path=path,
                                    offset=0, expected=f"{FILE_HEADER_NBYTES} bytes",
                                    actual=f"{len(head)} bytes")
    version, flag_bytes, _, count = _FILE.unpack_from(head, len(MAGIC))
    flags = int.from_bytes(flag_bytes, "little")
    if version not in VERSIONS:
        raise UnsupportedFormatError(f"tensorizer data version {version}: ckptlab reads "
                                     f"{VERSIONS[0]}-{VERSIONS[-1]}", path=path, offset=5)
    if version >= 4 and flags >= 4:
        raise CorruptArchiveError("unknown tensorizer feature flags", path=path, offset=9,
                                  expected="bits 0-1 at most", actual=hex(flags))
    crypt = version == 3 or (version >= 4 and bool(flags & _ENCRYPTED))
    if crypt:
        raise UnsupportedFormatError(
            f"an encrypted tensorizer file (data version {version}): ckptlab does not decrypt; "
            "load it with tensorizer's TensorDeserializer and the key it was encrypted with",
            path=path, offset=5)
    versioned = version >= 4 and bool(flags & _VERSIONED)
    (meta_nbytes,) = struct.unpack("<Q", src.read(FILE_HEADER_NBYTES, 8,
                                                  what="tensorizer metadata length"))
    meta_start = FILE_HEADER_NBYTES + 8
    if meta_nbytes > min(_MAX_METADATA, src.nbytes - meta_start):
        raise TruncatedArchiveError("tensorizer metadata runs past the end of the file",
                                    path=path, offset=FILE_HEADER_NBYTES,
                                    expected=f"<= {src.nbytes - meta_start} bytes",
                                    actual=meta_nbytes)
    if count > meta_nbytes:  # every entry takes bytes: a count past them is not a count
        raise CorruptArchiveError("tensor count larger than the metadata could hold",
                                  path=path, offset=FILE_HEADER_NBYTES - 8,
                                  expected=f"<= {meta_nbytes}", actual=count)
    meta = _Cursor(src.read(meta_start, meta_nbytes, what="tensorizer metadata"), meta_start,
                   path, "tensorizer metadata")
    entries = []
    for _ in range(count):
        entry_version = meta.take("I") if versioned else 1
        if entry_version not in VERSIONS:
            raise CorruptArchiveError("metadata entry of an unknown version", path=path,
                                      offset=meta.base + meta.at - 4, actual=entry_version)
        name_at = meta.base + meta.at
        key = _name(meta.bytes("H"), path, name_at)
        kind = meta.take("B")
        raw_dtype = meta.bytes("B")
        shape = meta.shape(entry_version >= 5)
        header_at, data_at, data_nbytes = meta.take("QQQ")
        entries.append((header_at, key, kind, raw_dtype, shape, data_at, data_nbytes,
                        entry_version >= 5, name_at))
    segments = [Segment(SegmentKind.FILE_HEADER, 0, FILE_HEADER_NBYTES),
                Segment(SegmentKind.HEADER, FILE_HEADER_NBYTES, 8 + meta.at)]
    if meta.at < meta_nbytes:  # the room tensorizer reserves for more entries (zeros)
        segments.append(Segment(SegmentKind.HEADER_PADDING, meta_start + meta.at,
                                meta_nbytes - meta.at))
    cursor = meta_start + meta_nbytes
    storages, tensors, extras = [], [], {}
    seen: set[tuple[Any, ...]] = set()
    for header_at, key, kind, raw_dtype, shape, data_at, data_nbytes, long, name_at in \
            sorted(entries, key=lambda e: e[0]):
        record = ".".join(map(str, key))
        if key in seen:
            raise CorruptArchiveError("two tensors of one name", path=path, record=record,
                                      offset=name_at)
        seen.add(key)
        if kind >= len(TENSOR_TYPES):
            raise CorruptArchiveError("unknown tensor type", path=path, record=record,
                                      offset=name_at, expected="0, 1 or 2", actual=kind)
        dtype = _dtype(raw_dtype, path, record, name_at)
        numel = math.prod(shape)
        if numel * DTYPE_ITEMSIZE[dtype] != data_nbytes and data_nbytes != 0:
            raise CorruptArchiveError("tensor data length does not match dtype x shape",
                                      path=path, record=record, offset=name_at,
                                      expected=f"{numel * DTYPE_ITEMSIZE[dtype]} bytes",
                                      actual=f"{data_nbytes} bytes")
        if header_at < cursor:
            raise CorruptArchiveError("tensor header overlaps the bytes before it", path=path,
                                      record=record, offset=header_at,
                                      expected=f">= {cursor}", actual=header_at)
        if header_at > cursor:
            segments.append(Segment(SegmentKind.UNKNOWN, cursor, header_at - cursor))
        hashes, block_at = _tensor_header(src, header_at, data_at, key, kind, raw_dtype,
                                          shape, data_nbytes, long, record)
        if data_at + data_nbytes > src.nbytes:
            raise TruncatedArchiveError("tensor data runs past the end of the file", path=path,
                                        record=record, offset=data_at,
                                        expected=f"{data_nbytes} bytes",
                                        actual=f"{max(0, src.nbytes - data_at)} bytes")
        segments.append(Segment(SegmentKind.TENSOR_HEADER, header_at, data_at - header_at,
                                record))
        if data_nbytes:
            segments.append(Segment(SegmentKind.DATA, data_at, data_nbytes, record))
        cursor = data_at + data_nbytes
        storages.append(StorageInfo(record, record, dtype, data_nbytes, data_at, "",
                                    "tensorizer"))
        tensors.append(TensorInfo(key, record, dtype, shape, contiguous_strides(shape), 0))
        extras[record] = {"type": TENSOR_TYPES[kind], "hashes": hashes,
                          "header": [header_at, data_at - header_at, block_at],
                          **({"zeros": True} if numel and not data_nbytes else {})}
    if cursor + 8 <= src.nbytes and src.read(cursor, 8, what="end marker") == bytes(8):
        segments.append(Segment(SegmentKind.TENSOR_HEADER, cursor, 8))  # header length 0: the end
        cursor += 8
    if cursor < src.nbytes:
        segments.append(Segment(SegmentKind.UNKNOWN, cursor, src.nbytes - cursor))
    layout = ArchiveLayout(
        format="tensorizer", path=path, file_nbytes=src.nbytes, archive_name="", records=(),
        storages=tuple(storages), tensors=tuple(tensors), segments=tuple(segments),
        alignment=largest_alignment([s.data_offset for s in storages if s.nbytes]),
        zip64=False, format_version=str(version))
    return layout, extras


def _tensor_header(src: ByteSource, at: int, data_at: int, key: tuple[Any, ...], kind: int,
                   raw_dtype: bytes, shape: tuple[int, ...], data_nbytes: int, long: bool,
                   record: str) -> tuple[dict[str, str], int]:
    """Check one tensor header against its metadata entry: its hashes (name -> hex) and
    where its hash block starts in it."""
    path = src.name
    if not at + 8 <= data_at <= src.nbytes or data_at - at > _MAX_METADATA:
        raise CorruptArchiveError("tensor header does not end where its data starts",
                                  path=path, record=record, offset=at,
                                  expected=f"a header in [{at}, {data_at})",
                                  actual=f"data at {data_at} of {src.nbytes} bytes")
    raw = src.read(at, data_at - at, what="tensorizer tensor header")
    c = _Cursor(raw, at, path, "tensor header", record)
    length = c.take("Q")
    if length != len(raw):
        raise CorruptArchiveError("tensor header length is not the distance to its data",
                                  path=path, record=record, offset=at,
                                  expected=len(raw), actual=length)
    _, header_kind = c.take("HB")
    same = (_name(c.bytes("H"), path, at) == key, header_kind == kind,
            c.bytes("B") == raw_dtype, c.shape(long) == shape)
    if not all(same):
        field = ("name", "tensor type", "dtype", "shape")[same.index(False)]
        raise CorruptArchiveError(f"tensor header's {field} differs from the metadata's",
                                  path=path, record=record, offset=at)
    block_at = c.at
    block = c.bytes("H")
    hashes, i = {}, 1
    for _ in range(block[0] if block else 0):
        if i + 2 > len(block):
            break
        code, size = block[i], block[i + 1]
        value = block[i + 2:i + 2 + size]
        if code not in _HASHES or _HASHES[code][1] != size or len(value) != size:
            raise CorruptArchiveError("unknown tensor hash", path=path, record=record,
                                      offset=at, actual=f"type {code}, {size} bytes")
        hashes[_HASHES[code][0]] = value.hex()
        i += 2 + size
    (length_field,) = struct.unpack_from("<q", raw, len(raw) - 8)
    if length_field != data_nbytes:
        raise CorruptArchiveError("tensor header's data length differs from the metadata's",
                                  path=path, record=record, offset=at + len(raw) - 8,
                                  expected=data_nbytes, actual=length_field)
    return hashes, block_at


def check_hashes(hashes: dict[str, str], header: bytes, hash_block: int, data: Any, *,
                 path: str, record: str, offset: int) -> None:
    """Raise unless a tensor's ``data`` after its ``header`` (as read, the u16-length hash
    block at ``hash_block``) gives the ``hashes`` tensorizer recorded (name -> hex)."""
    zeroed = bytearray(header)
    i = hash_block + 3
    for _ in range(zeroed[hash_block + 2]):  # the values zeroed, as tensorizer hashes them
        size = zeroed[i + 1]
        zeroed[i + 2:i + 2 + size] = bytes(size)
        i += 2 + size
    for name, want in hashes.items():
        if name == "crc32":
            got = struct.pack("<I", zlib.crc32(data, zlib.crc32(zeroed))).hex()
        else:
            sha = hashlib.sha256(zeroed)
            sha.update(data)
            got = sha.hexdigest()
        if got != want:
            raise CorruptArchiveError(f"tensor {name} does not match the one tensorizer "
                                      "recorded: its header or data changed", path=path,
                                      record=record, offset=offset, expected=want, actual=got)
