"""The layout data model: frozen descriptions of every byte of a checkpoint file.

All offsets are absolute byte offsets in the file; all sizes are in bytes (``*_nbytes``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptlab.format._bulk import LazyTuple
from ckptlab.format._records import record_type

__all__ = [
    "SEGMENT_KINDS",
    "ArchiveLayout",
    "Record",
    "Segment",
    "SegmentColumns",
    "SegmentKind",
    "SegmentTuple",
    "StorageInfo",
    "TensorInfo",
    "contiguous_strides",
]


class SegmentKind(enum.StrEnum):
    """What a run of bytes in a checkpoint file is."""

    LOCAL_HEADER = "local_header"  # 30-byte zip local file header
    NAME = "name"  # the record name after a local header
    ZIP64_EXTRA = "zip64_extra"  # zip64 extended-information extra field (id 0x0001)
    PADDING = "padding"  # torch's 'FB' extra field (id 0x4246) that aligns the data
    EXTRA = "extra"  # any other extra field (foreign writers)
    DATA = "data"  # a record's payload (a storage's bytes, data.pkl, ...)
    DESCRIPTOR = "descriptor"  # zip data descriptor after the payload
    CENTRAL_DIRECTORY = "central_directory"
    ZIP64_EOCD = "zip64_eocd"  # zip64 end of central directory record
    ZIP64_LOCATOR = "zip64_locator"  # zip64 end of central directory locator
    EOCD = "eocd"  # end of central directory record (+ comment)
    HEADER_LENGTH = "header_length"  # safetensors: u64 length of the JSON header
    HEADER = "header"  # safetensors: the JSON header; tensorizer: the metadata block
    HEADER_PADDING = "header_padding"  # safetensors: spaces that align the data to 8 bytes;
    #                                    tensorizer: the room it reserves after its metadata
    FILE_HEADER = "file_header"  # tensorizer: magic, data version, feature flags, counts
    TENSOR_HEADER = "tensor_header"  # tensorizer: a tensor's name, dtype, shape and hashes
    UNKNOWN = "unknown"  # bytes no structure of the format accounts for


@dataclass(frozen=True, slots=True)
class Segment:
    """One contiguous run of bytes of a single kind."""

    kind: SegmentKind  # what the bytes are
    offset: int  # first byte
    nbytes: int  # length in bytes
    record: str | None = None  # owning record / tensor name, if any

    @property
    def end_offset(self) -> int:
        return self.offset + self.nbytes


SEGMENT_KINDS = tuple(SegmentKind)  # what a :class:`SegmentColumns` kind code indexes


@dataclass(frozen=True, slots=True, eq=False)
class SegmentColumns:
    """A file's segments as arrays, in file order: the fields :class:`Segment` objects are
    made from, for readers of half a million segments that need numbers, not objects (the
    byte map)."""

    kinds: Any  # numpy int (S,): index into SEGMENT_KINDS
    offsets: Any  # numpy int64 (S,)
    nbytes: Any  # numpy int64 (S,)
    records: Any  # numpy int64 (S,): index into ``names``; -1: the segment has no record
    names: Sequence[str]


class SegmentTuple(LazyTuple[Segment]):
    """``ArchiveLayout.segments`` made from columns: the :class:`Segment` objects when first
    used, and :attr:`columns` (a :class:`SegmentColumns`) before that."""

    __slots__ = ("columns",)

    def __init__(self, columns: SegmentColumns, make: Callable[[], Iterable[Segment]]) -> None:
        super().__init__(len(columns.offsets), make)
        self.columns = columns


@dataclass(frozen=True, slots=True)
class Record:
    """One zip entry, from its local header to the end of its data descriptor."""

    name: str  # full name in the archive, e.g. "model/data/0"
    header_offset: int  # offset of the local header signature PK\\3\\4
    name_nbytes: int  # length of the name
    extra_nbytes: int  # all local extra fields (zip64 extra + FB padding field + others)
    zip64_extra_nbytes: int  # the zip64 extra field including its 4-byte header, 0 if absent
    padding_nbytes: int  # payload of the 'FB' padding field (the alignment padding proper)
    data_offset: int  # first byte of the payload
    data_nbytes: int  # stored (compressed) size of the payload
    descriptor_nbytes: int  # data descriptor after the payload: 0, 12, 16, 20 or 24
    crc32: int  # CRC-32 from the central directory (0 when written with compute_crc32=False)
    uncompressed_nbytes: int  # uncompressed size (== data_nbytes for stored records)
    method: int = 0  # zip compression method (0 = stored, which torch always uses)
    header_nbytes: int = 30  # the fixed local header

    @property
    def end_offset(self) -> int:
        """First byte after the record (header of the next record, or central directory)."""
        return self.data_offset + self.data_nbytes + self.descriptor_nbytes

    @property
    def short_name(self) -> str:
        """The name without the archive prefix (``data/0``, ``data.pkl``, ...)."""
        return self.name.split("/", 1)[1] if "/" in self.name else self.name


# A storage as the pickle declares it, and where its bytes are: ``key`` (storage key in the
# pickle: "0", "1", ...), ``record`` (the full record name holding its bytes), ``dtype``
# (element type, torch's name without prefix; "uint8" if untyped), ``nbytes``, ``data_offset``
# (of its first byte in the file), ``device`` (location as saved: "cpu", "cuda:0", ...),
# ``storage_type`` (the pickled storage class: "FloatStorage", "UntypedStorage", ...). An
# immutable record the collector does not track (:mod:`ckptlab.format._records`).
StorageInfo = record_type(
    "ckptlab.format.layout.StorageInfo",
    ("key", "record", "dtype", "nbytes", "data_offset", "device", "storage_type"), ("",),
    {"__doc__": "A storage as the pickle declares it, and where its bytes are."})


def segments_json(segments: Sequence[Segment]) -> list[dict[str, Any]]:
    """Segments as the CLI's JSON gives them: ``{"kind", "offset", "nbytes", "record"}``."""
    return [{"kind": s.kind.value, "offset": s.offset, "nbytes": s.nbytes, "record": s.record}
            for s in segments]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape``
    (``torch.empty(shape).stride()``): a dimension of size 0 counts as 1, so shape (2, 0)
    has stride (1, 1)."""
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(strides))


def _numel(self: Any) -> int:
    n = 1
    for s in self.shape:
        n *= s
    return n


# A tensor as the pickle rebuilds it (without rebuilding it): ``path`` (keys / indices /
# attribute names from the root object), ``storage_key`` (the storage it views), ``dtype``
# (torch's name without prefix), ``shape``, ``stride``, ``storage_offset`` (in elements of
# ``dtype``), ``requires_grad``, ``is_parameter`` (rebuilt through
# ``torch._utils._rebuild_parameter``). An immutable record the collector does not track
# (:mod:`ckptlab.format._records`).
TensorInfo = record_type(
    "ckptlab.format.layout.TensorInfo",
    ("path", "storage_key", "dtype", "shape", "stride", "storage_offset", "requires_grad",
     "is_parameter"), (False, False),
    {"numel": property(_numel), "__doc__": "A tensor as the pickle rebuilds it."})


@dataclass(frozen=True, slots=True)
class ArchiveLayout:
    """Every byte of a checkpoint file, and what the pickle says lives where.

    ``segments`` tile the file: sorted, contiguous, no gap, no overlap.

    Two alignments, two ideas. ``alignment`` is *observed*: the largest power of two (at most
    4096) that divides every non-empty storage's data offset, whatever wrote the file.
    ``storage_alignment`` is *recorded*: the content of the archive's ``.storage_alignment``
    record, the alignment torch.save was asked for (``config.save.storage_alignment``), None
    when the archive has no such record. The ``alignment=`` argument of
    :func:`~ckptlab.format.predict_layout`, :func:`~ckptlab.format.realign` and
    :func:`ckptlab.samples.write_sample` is the recorded kind: what torch.save is asked for.

    ``tensors`` are the tensors as the pickle rebuilds them (storage views, one
    :class:`TensorInfo` each, in pickle order); the tensor-first view, name -> entry, is
    :attr:`ckptlab.checkpoint.Checkpoint.tensors`.
    """

    format: str  # "torch-zip" or "safetensors"
    path: str
    file_nbytes: int
    archive_name: str  # prefix of every record name ("" for safetensors)
    records: tuple[Record, ...]
    storages: tuple[StorageInfo, ...]
    tensors: tuple[TensorInfo, ...]
    segments: tuple[Segment, ...]
    alignment: int  # observed: largest power of two (<= 4096) dividing every storage's offset
    zip64: bool  # some record needed a zip64 extra field
    central_directory_offset: int = 0
    central_directory_nbytes: int = 0
    zip64_eocd_offset: int | None = None
    zip64_locator_offset: int | None = None
    eocd_offset: int | None = None
    storage_alignment: int | None = None  # recorded: content of the .storage_alignment record
    format_version: str | None = None  # content of the .format_version record
    byteorder: str | None = None  # content of the byteorder record
    pickle_protocol: int | None = None
    metadata: dict[str, str] | None = field(default=None, hash=False)  # safetensors __metadata__
    # the pickle's view of the same file (torch formats): every tensor as a user knows it
    # (ckptlab.format._pickle.ScannedTensor) and the non-tensor values beside them
    logical: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    objects: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def record(self, name: str) -> Record:
        """The record with full name ``name`` or short name (``data/0``)."""
        for r in self.records:
            if r.name == name or r.short_name == name:
                return r
        raise KeyError(name)

    def storage(self, key: str) -> StorageInfo:
        for s in self.storages:
            if s.key == key:
                return s
        raise KeyError(key)

    @property
    def overhead_nbytes(self) -> int:
        """Bytes that are not payload data (headers, names, extras, descriptors, trailer)."""
        return self.file_nbytes - sum(
            s.nbytes for s in self.segments if s.kind is SegmentKind.DATA
        )

    @property
    def padding_nbytes(self) -> int:
        """Bytes of alignment padding (FB payloads, or safetensors header padding)."""
        if self.format == "safetensors":
            return sum(s.nbytes for s in self.segments if s.kind is SegmentKind.HEADER_PADDING)
        return sum(r.padding_nbytes for r in self.records)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the ``ckptlab inspect --json`` schema)."""
        out: dict[str, Any] = {
            "format": self.format,
            "path": self.path,
            "file_nbytes": self.file_nbytes,
            "archive_name": self.archive_name,
            "alignment": self.alignment,
            "zip64": self.zip64,
            "storage_alignment": self.storage_alignment,
            "format_version": self.format_version,
            "byteorder": self.byteorder,
            "pickle_protocol": self.pickle_protocol,
            "central_directory": {
                "offset": self.central_directory_offset,
                "nbytes": self.central_directory_nbytes,
            },
            "zip64_eocd_offset": self.zip64_eocd_offset,
            "zip64_locator_offset": self.zip64_locator_offset,
            "eocd_offset": self.eocd_offset,
            "overhead_nbytes": self.overhead_nbytes,
            "padding_nbytes": self.padding_nbytes,
            "records": [dict(asdict(r), end_offset=r.end_offset) for r in self.records],
            "storages": [s._asdict() for s in self.storages],
            "tensors": [
                dict(zip(t._fields, t.__reduce__()[1]), path=list(t.path), shape=list(t.shape),
                     stride=list(t.stride))
                for t in self.tensors
            ],
            "segments": segments_json(self.segments),
        }
        if self.metadata is not None:
            out["metadata"] = dict(self.metadata)
        return out
