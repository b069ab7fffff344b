"""The byte map's numbers: a file's segments as arrays, ready to bin at any zoom.

:class:`ByteMap` holds, once per file, each segment's start, size and kind, the items (a zip
record, a safetensors tensor, a trailer structure) they belong to, the lanes and their prefix
sums, and which tensors each item holds (named on demand, for hover text). It is built from an
:class:`~ckptlab.format.ArchiveLayout` or one file of a :class:`~ckptlab.checkpoint.Checkpoint`,
from the segments' and tensors' columns where the scan kept them (a large zip: no object per
segment). The figures of :mod:`ckptlab.viz.bytemap` bin these arrays.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

import numpy as np

from ckptlab.checkpoint.model import is_checkpoint
from ckptlab.errors import InvalidArgumentError
from ckptlab.format.archive import largest_alignment
from ckptlab.format.layout import SEGMENT_KINDS, ArchiveLayout, Segment, SegmentKind
from ckptlab.viz._style import (
    KIND_ORDER,
    LANE_ORDER,
    METADATA_LANE,
    plain_text,
)

__all__ = ["ByteMap", "checkpoint_file"]

KIND_CODE = {k: i for i, k in enumerate(KIND_ORDER)}
LANE_CODE = {k: i for i, k in enumerate(LANE_ORDER)}
# a SegmentColumns kind code (index into SEGMENT_KINDS) -> its index into KIND_ORDER
_SEGMENT_KIND_CODE = np.array([KIND_CODE[k] for k in SEGMENT_KINDS], dtype=np.int16)
_DATA_LANE = LANE_CODE[SegmentKind.DATA]
_META_LANE = LANE_CODE[METADATA_LANE]
# segment kind code -> lane code (a JSON header is metadata; DATA is split per segment)
_KIND_TO_LANE = np.array([_META_LANE if k is SegmentKind.HEADER else LANE_CODE[k]
                          for k in KIND_ORDER], dtype=np.int16)
_TRAILER_NAMES = {
    SegmentKind.CENTRAL_DIRECTORY: "<central directory>",
    SegmentKind.ZIP64_EOCD: "<zip64 EOCD>",
    SegmentKind.ZIP64_LOCATOR: "<zip64 locator>",
    SegmentKind.EOCD: "<EOCD>",
    SegmentKind.HEADER_LENGTH: "<header length>",
    SegmentKind.HEADER: "<JSON header>",
    SegmentKind.HEADER_PADDING: "<header padding>",
    SegmentKind.UNKNOWN: "<unknown bytes>",
    SegmentKind.FILE_HEADER: "<file header>",
}
_TENSORIZER_NAMES = {**_TRAILER_NAMES, SegmentKind.HEADER: "<metadata>",
                     SegmentKind.HEADER_PADDING: "<reserved>",
                     SegmentKind.TENSOR_HEADER: "<end marker>"}
_ITEM_WORDS = {  # items that are not a record or a tensor, in words
    "<central directory>": "the zip central directory (one entry per record)",
    "<zip64 EOCD>": "the zip64 end of central directory record",
    "<zip64 locator>": "the zip64 end of central directory locator",
    "<EOCD>": "the end of central directory record",
    "<header length>": "the header length (8 bytes)",
    "<JSON header>": "the JSON header (every tensor's name, dtype, shape and offsets)",
    "<header padding>": "the header padding (spaces that align the data)",
    "<unknown bytes>": "bytes no structure of the format accounts for",
    "<file header>": "tensorizer's file header (magic, data version, feature flags, count)",
    "<metadata>": "tensorizer's metadata (every tensor's name, dtype, shape and offsets)",
    "<reserved>": "the room tensorizer reserves after its metadata (zeros)",
    "<end marker>": "tensorizer's end marker (a tensor header length of 0)",
    ".metadata": "DCP's .metadata (the pickled plan: every item's file, offset and size)",
}


@dataclass(frozen=True, eq=False)
class ByteMap:
    """A file's segments as numeric arrays, ready to bin at any zoom.

    Segments are grouped into *items*: a zip record (header, name, extras, data, descriptor),
    a safetensors tensor or a trailer structure. ``item_names[i]`` names item ``i``; items
    are in file order. ``item_tensors[i]`` names the tensors whose bytes item ``i`` holds.
    """

    layout: ArchiveLayout  # the file's layout (made of its segments for a checkpoint file)
    starts: np.ndarray  # int64 (S,): first byte of each segment, ascending, tiling the file
    nbytes: np.ndarray  # int64 (S,)
    kinds: np.ndarray  # int16 (S,): index into KIND_ORDER (the segment's kind)
    items: np.ndarray  # int32 (S,): index into item_names
    item_names: tuple[str, ...]
    lanes: tuple[str, ...]  # lanes present in the file, in LANE_ORDER (SegmentKind or "metadata")
    prefix: np.ndarray  # int64 (len(lanes), S + 1): bytes of each lane before segment i
    lane_segments: tuple[np.ndarray, ...]  # per lane: indices of its segments, ascending
    item_starts: np.ndarray  # int64 (items + 1,): first byte of each item, then the file size
    lane_codes: np.ndarray | None = None  # int16 (S,): index into LANE_ORDER (the lane)
    owners: Any = field(default=None, repr=False)  # an _Owners: item -> its tensors, lazily
    file: str = ""  # the file's path in its checkpoint ("" for a layout)

    def item_owners(self, item: int) -> list[tuple[str, str]]:
        """``(name, "name dtype[shape]")`` of the tensors whose bytes item ``item`` holds
        (formatted on demand: a map of 100,000 tensors names only what is hovered)."""
        return self.owners.get(item) if self.owners is not None else []

    @property
    def item_tensors(self) -> tuple[tuple[str, ...], ...]:
        """Per item: the tensors whose bytes it holds, as "name dtype[shape]" labels."""
        return tuple(tuple(lab for _, lab in self.item_owners(i))
                     for i in range(len(self.item_names)))

    @property
    def item_tensor_names(self) -> tuple[tuple[str, ...], ...]:
        """Per item: the names of the tensors whose bytes it holds."""
        return tuple(tuple(n for n, _ in self.item_owners(i))
                     for i in range(len(self.item_names)))

    @classmethod
    def from_layout(cls, layout: ArchiveLayout) -> ByteMap:
        """Build the arrays of one file's layout (linear in the number of segments)."""
        if not isinstance(layout, ArchiveLayout):
            raise InvalidArgumentError(
                f"expected an ArchiveLayout (from ckptlab.inspect), got {type(layout).__name__}")
        def owners(names: tuple[str, ...], items: np.ndarray) -> _Owners:
            tensors = layout.tensors
            # a scan of dense tensors keeps their fields as columns: read those, no objects
            cols = getattr(layout.logical, "columns", None)
            if cols is not None and len(cols.keys) != len(tensors):
                cols = None

            def index() -> _Grouped:  # item -> tensors, one pass, no formatting
                item_of = {n: i for i, n in enumerate(names)}
                item_of_key = {s.key: item_of.get(s.record, -1) for s in layout.storages}
                keys = cols.keys if cols is not None else [t.storage_key for t in tensors]
                return _Grouped(np.fromiter(map(item_of_key.get, keys, repeat(-1)),
                                            dtype=np.int64, count=len(keys)))

            def label(j: int) -> tuple[str, str]:
                if cols is not None:
                    path, dtype, shape = cols.paths[j], cols.dtypes[j], cols.shapes[j]
                else:
                    t = tensors[j]
                    path, dtype, shape = t.path, t.dtype, t.shape
                name = ".".join(map(str, path))
                return name, f"{name} {dtype}{list(shape)}"

            return _Owners(index, label)

        tensor_records = {s.record for s in layout.storages}
        segs = layout.segments
        cols = getattr(segs, "columns", None)

        def tensor_data(data_idx: np.ndarray) -> np.ndarray:
            if cols is not None:  # per record name once, not per segment object
                held = np.fromiter((name in tensor_records for name in cols.names), dtype=bool,
                                   count=len(cols.names))
                records = np.asarray(cols.records)[data_idx]
                return (records >= 0) & held[np.maximum(records, 0)]
            return np.fromiter((segs[i].record in tensor_records for i in data_idx.tolist()),
                               dtype=bool, count=len(data_idx))

        return cls._build(layout, tensor_data, owners)

    @classmethod
    def from_file(cls, entry: Any, tensors: Iterable[Any] = ()) -> ByteMap:
        """The map of one file of a :class:`~ckptlab.checkpoint.Checkpoint`.

        Parameters
        ----------
        entry
            A :class:`~ckptlab.checkpoint.model.FileEntry` (its segments tile the file).
        tensors
            The checkpoint's :class:`~ckptlab.checkpoint.model.TensorEntry` objects; the parts
            that lie in this file say which data bytes are tensor bytes (the rest of the
            data, a pickle or a JSON header, goes to the metadata lane) and name the tensors
            in the hover text.
        """
        segments = getattr(entry, "segments", None)
        path = getattr(entry, "path", None)
        if segments is None or path is None or not hasattr(entry, "nbytes"):
            raise InvalidArgumentError(
                f"expected a FileEntry of a Checkpoint (ck.files), got {type(entry).__name__}")
        parts = [(t, p) for t in tensors for p in t.parts if p.file == path]
        layout = entry.layout if isinstance(entry.layout, ArchiveLayout) else _segment_layout(
            entry, [p.offset for _, p in parts if p.nbytes and p.compression is None])
        cols = getattr(segments, "columns", None)
        starts = np.asarray(cols.offsets, dtype=np.int64) if cols is not None else np.fromiter(
            (s.offset for s in segments), dtype=np.int64, count=len(segments))
        covered = np.zeros(len(segments) + 1, dtype=np.int64)
        first = np.zeros(0, dtype=np.int64)
        if parts and len(segments):
            offs = np.fromiter((p.offset for _, p in parts), dtype=np.int64, count=len(parts))
            ends = offs + np.fromiter((max(p.nbytes, 1) for _, p in parts), dtype=np.int64,
                                      count=len(parts))
            first = np.clip(np.searchsorted(starts, offs, side="right") - 1, 0, None)
            last = np.clip(np.searchsorted(starts, ends - 1, side="right") - 1, 0, None)
            np.add.at(covered, first, 1)
            np.add.at(covered, last + 1, -1)
        is_tensor = np.cumsum(covered[:-1]) > 0

        def tensor_data(data_idx: np.ndarray) -> np.ndarray:
            return is_tensor[data_idx]

        def item_labels(names: tuple[str, ...], items: np.ndarray) -> _Owners:
            def index() -> dict[int, list[Any]]:
                out: dict[int, list[Any]] = {}
                for tp, seg in zip(parts, first.tolist(), strict=True):
                    out.setdefault(int(items[seg]), []).append(tp)
                return out

            def label(tp: Any) -> tuple[str, str]:
                t, p = tp
                shape = list(p.shape) if t.shape is None else list(t.shape)
                role = "" if p.role in ("data", "chunk") else f" ({p.role})"
                return f"{t.name}{role}", f"{t.name}{role} {t.dtype}{shape}"

            return _Owners(index, label, len(parts))

        return cls._build(layout, tensor_data, item_labels, segments=segments, file=path)

    @classmethod
    def from_checkpoint(cls, checkpoint: Any, file: str | None = None) -> ByteMap:
        """The map of file ``file`` of ``checkpoint`` (its largest file holding tensor bytes
        by default)."""
        entry = checkpoint_file(checkpoint, file)
        layout = entry.layout
        if (len(checkpoint.files) == 1 and isinstance(layout, ArchiveLayout)
                and layout.format == "torch-zip" and len(layout.tensors) == len(
                    checkpoint.tensors) and _same_first_name(checkpoint, layout)):
            # one torch.save file: its layout names the checkpoint's tensors, and its map
            # comes from its columns, without making an entry object per tensor
            return replace(cls.from_layout(layout), file=entry.path)
        return cls.from_file(entry, checkpoint.tensors.values())

    @classmethod
    def _build(cls, layout: ArchiveLayout, tensor_data: Any, item_labels: Any, *,
               segments: tuple[Segment, ...] | None = None, file: str = "") -> ByteMap:
        segs = layout.segments if segments is None else segments
        trailer = _TENSORIZER_NAMES if layout.format == "tensorizer" else _TRAILER_NAMES
        starts, nbytes, kinds, items, names = _segment_arrays(segs, trailer)
        n = len(starts)
        lane_codes = _KIND_TO_LANE[kinds]  # data and JSON headers decided below
        data_idx = np.flatnonzero(kinds == KIND_CODE[SegmentKind.DATA])
        if len(data_idx):
            lane_codes[data_idx] = np.where(tensor_data(data_idx), _DATA_LANE, _META_LANE)
        present = np.unique(lane_codes)
        lanes = tuple(LANE_ORDER[c] for c in present)
        prefix = np.zeros((len(lanes), n + 1), dtype=np.int64)
        lane_segments = []
        for row, code in enumerate(present):
            mask = lane_codes == code
            np.cumsum(np.where(mask, nbytes, 0), out=prefix[row, 1:])
            lane_segments.append(np.flatnonzero(mask))
        first = np.flatnonzero(np.diff(items, prepend=-1))  # first segment of each item
        file_nbytes = int(starts[-1] + nbytes[-1]) if n else layout.file_nbytes
        item_starts = np.append(starts[first], max(file_nbytes, layout.file_nbytes))
        name_tuple = tuple(names)
        return cls(layout, starts, nbytes, kinds, items, name_tuple, lanes, prefix,
                   tuple(lane_segments), item_starts, lane_codes,
                   item_labels(name_tuple, items), file)

    @property
    def file_nbytes(self) -> int:
        return int(self.item_starts[-1]) if len(self.item_starts) > 1 else self.layout.file_nbytes

    def segment_index(self, offsets: np.ndarray) -> np.ndarray:
        """Index of the segment holding each byte offset (clipped into the file)."""
        idx = np.searchsorted(self.starts, offsets, side="right") - 1
        return np.clip(idx, 0, len(self.starts) - 1)

    def _codes(self) -> np.ndarray:
        return self.lane_codes if self.lane_codes is not None else self.kinds

    def cumulative(self, edges: np.ndarray) -> np.ndarray:
        """Bytes of each lane in ``[0, edge)`` for each edge: shape ``(lanes, len(edges))``."""
        edges = np.clip(np.asarray(edges, dtype=np.int64), 0, self.file_nbytes)
        idx = self.segment_index(edges)
        within = np.minimum(edges - self.starts[idx], self.nbytes[idx])
        codes = np.array([LANE_CODE[k] for k in self.lanes], dtype=np.int16)
        own = self._codes()[idx][None, :] == codes[:, None]
        return self.prefix[:, idx] + np.where(own, within[None, :], 0)

    def coverage(self, edges: np.ndarray) -> np.ndarray:
        """Bytes of each lane in each bin ``[edges[j], edges[j+1])``: ``(lanes, bins)``."""
        return np.diff(self.cumulative(edges), axis=1)

    def item_span(self, item: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of item ``item``."""
        if not 0 <= item < len(self.item_names):
            raise InvalidArgumentError(f"no item {item} (the map has {len(self.item_names)})")
        return int(self.item_starts[item]), int(self.item_starts[item + 1])

    def items_in(self, lo: int, hi: int) -> range:
        """The items with bytes in ``[lo, hi)``."""
        first = int(np.searchsorted(self.item_starts, lo, side="right")) - 1
        last = int(np.searchsorted(self.item_starts, hi, side="left"))
        return range(max(first, 0), min(last, len(self.item_names)))

    def item_at(self, offset: int) -> int:
        """The item holding byte ``offset``."""
        return int(self.items[self.segment_index(np.array([offset]))[0]])

    def tensors_at(self, offset: int) -> tuple[str, ...]:
        """The tensors whose item holds byte ``offset`` ("name dtype[shape]" labels)."""
        return tuple(lab for _, lab in self.item_owners(self.item_at(offset)))

    def item_label(self, item: int) -> str:
        """The item's name and, for a storage record, the tensors that view it (raw text: pass
        it through :func:`~ckptlab.viz._style.plain_text` before a figure shows it)."""
        name = self.item_names[item]
        tensors = [lab for _, lab in self.item_owners(item)]
        if not tensors:
            return name
        shown = ", ".join(tensors[:3]) + (f" (+{len(tensors) - 3})" if len(tensors) > 3 else "")
        return f"{name} · {shown}"

    def item_description(self, item: int) -> str:
        """What item ``item`` is, in plain words, escaped for plotly ("tensor w float32[3]
        (record data/0)", "data.pkl, the pickle that names every tensor", ...)."""
        cache = self.__dict__.get("_descriptions")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_descriptions", cache)  # a memo of frozen data
        text = cache.get(item)
        if text is None:
            owners = self.item_owners(item)
            text = cache[item] = _describe(self.item_names[item], [lab for _, lab in owners],
                                           [n for n, _ in owners])
        return text

    def _tensors_by_record(self) -> dict[str, list[str]]:
        """Record name -> tensor labels (kept for callers of the earlier private name)."""
        return {n: list(t) for n, t in zip(self.item_names, self.item_tensors, strict=False) if t}


def _segment_arrays(segs: Sequence[Segment], trailer: dict[SegmentKind, str]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Each segment's start, size, kind (index into KIND_ORDER) and item, and the items' names.

    An item is a run of segments of one name: the record's, else the trailer structure's
    (``trailer``, by kind). From the segments' columns when they have them (a large zip's
    :class:`~ckptlab.format.layout.SegmentTuple`: no object per segment), else from the objects.
    """
    cols = getattr(segs, "columns", None)
    if cols is None:
        n = len(segs)
        starts = np.fromiter((s.offset for s in segs), dtype=np.int64, count=n)
        nbytes = np.fromiter((s.nbytes for s in segs), dtype=np.int64, count=n)
        kinds = np.fromiter((KIND_CODE[s.kind] for s in segs), dtype=np.int16, count=n)
        names: list[str] = []
        items = np.empty(n, dtype=np.int32)
        last: str | None = None
        for i, s in enumerate(segs):
            name = s.record if s.record is not None else trailer.get(s.kind, s.kind.value)
            if name != last:
                names.append(name)
                last = name
            items[i] = len(names) - 1
        return starts, nbytes, kinds, items, names
    starts = np.asarray(cols.offsets, dtype=np.int64)
    nbytes = np.asarray(cols.nbytes, dtype=np.int64)
    kinds = _SEGMENT_KIND_CODE[np.asarray(cols.kinds)]
    records = np.asarray(cols.records, dtype=np.int64)
    # runs of one record, or of one trailer kind; then runs whose names are equal are merged
    keys = np.where(records >= 0, records, -2 - kinds.astype(np.int64))
    run_start = np.ones(len(keys), dtype=bool)
    run_start[1:] = keys[1:] != keys[:-1]
    firsts = np.flatnonzero(run_start)
    run_names = [cols.names[r] if r >= 0 else trailer.get(KIND_ORDER[k], KIND_ORDER[k].value)
                 for r, k in zip(records[firsts].tolist(), kinds[firsts].tolist(), strict=True)]
    new_name = np.fromiter((i == 0 or run_names[i] != run_names[i - 1]
                            for i in range(len(run_names))), dtype=bool, count=len(run_names))
    item_of_run = np.cumsum(new_name) - 1
    items = item_of_run[np.cumsum(run_start) - 1].astype(np.int32)
    return starts, nbytes, kinds, items, [n for n, new in zip(run_names, new_name.tolist(),
                                                              strict=True) if new]


class _Grouped:
    """Positions grouped by a key: ``get(k)`` is the positions ``j`` (ascending) where
    ``keys[j] == k``, from one sort (no dict of 100,000 lists)."""

    def __init__(self, keys: np.ndarray) -> None:
        self._order = np.argsort(keys, kind="stable")
        self._sorted = keys[self._order]

    def get(self, key: int, default: Any = ()) -> Any:
        lo, hi = np.searchsorted(self._sorted, [key, key + 1])
        return self._order[lo:hi].tolist() if hi > lo else default


class _Owners:
    """Item -> the tensors whose bytes it holds: indexed on first use (one pass, integers
    only) and named per item on demand."""

    def __init__(self, index: Any, label: Any, parts: int = 0) -> None:
        self._index_fn, self._label, self.parts = index, label, parts
        self._index: Any = None  # item -> its tensors: a dict, or a _Grouped
        self._named: dict[int, list[tuple[str, str]]] = {}

    def get(self, item: int) -> list[tuple[str, str]]:
        named = self._named.get(item)
        if named is None:
            if self._index is None:
                self._index = self._index_fn()
            named = self._named[item] = list(dict.fromkeys(
                self._label(x) for x in self._index.get(item, ())))
        return named


def _describe(name: str, tensors: Sequence[str], plain: Sequence[str]) -> str:
    short = name.split("/", 1)[1] if "/" in name and not name.startswith("<") else name
    if tensors:
        plain = list(plain) or list(tensors)
        what = (f"tensor {plain_text(tensors[0])}" if len(tensors) == 1 else
                "tensors " + ", ".join(plain_text(t) for t in plain[:3])
                + (f" (+{len(plain) - 3})" if len(plain) > 3 else ""))
        return what if plain[0] == name else f"{what} (record {plain_text(short)})"
    if name in _ITEM_WORDS:
        return _ITEM_WORDS[name]
    head, sep, rest = name.partition(":")
    if sep and "/" in rest and "/" not in head:  # a DCP item's own record: "fqn:archive/..."
        return f"{_describe(rest, (), ())} of DCP item {plain_text(head)}"
    if name.endswith("data.pkl"):
        return f"{plain_text(short)}, the pickle that names every tensor and value"
    if name.endswith((".format_version", "/byteorder", "/version", ".storage_alignment",
                      "serialization_id")):
        return f"record {plain_text(short)} (a small fact about the file)"
    return f"record {plain_text(short)}"


def _segment_layout(entry: Any, offsets: list[int]) -> ArchiveLayout:
    """An ArchiveLayout made of a checkpoint file's segments (a DCP data file, a JSON index,
    .metadata): what the overhead figure and the hex view read."""
    return ArchiveLayout(format=entry.format, path=entry.path, file_nbytes=entry.nbytes,
                         archive_name="", records=(), storages=(), tensors=(),
                         segments=tuple(entry.segments),
                         alignment=largest_alignment(offsets) if offsets else 4096, zip64=False)


def _same_first_name(checkpoint: Any, layout: ArchiveLayout) -> bool:
    """Whether the checkpoint names its first tensor as the layout's path does (no prefix)."""
    first = next(iter(checkpoint.tensors), None)
    cols = getattr(layout.logical, "columns", None)
    path = (cols.paths[0] if cols is not None and len(cols.keys) else
            layout.tensors[0].path if layout.tensors else None)
    return first is None or (path is not None and first == ".".join(map(str, path)))


def checkpoint_file(checkpoint: Any, file: str | None = None) -> Any:
    """The :class:`~ckptlab.checkpoint.model.FileEntry` named ``file`` (relative path), or
    by default the largest file that holds tensor bytes (the largest file when none does)."""
    files = tuple(getattr(checkpoint, "files", ()))
    if not files:
        raise InvalidArgumentError(f"{getattr(checkpoint, 'path', checkpoint)!r} has no files")
    if file is not None:
        for f in files:
            if f.path == file:
                return f
        raise InvalidArgumentError(
            f"{checkpoint.path}: no file {file!r} (files: "
            f"{', '.join(f.path for f in files[:8])}{' …' if len(files) > 8 else ''})")
    if len(files) == 1:
        return files[0]
    holding = {p.file for t in checkpoint.tensors.values() for p in t.parts}
    ranked = sorted(files, key=lambda f: (f.path not in holding, -f.nbytes, f.path))
    return ranked[0]


def as_bytemap(source: Any, file: str | None = None) -> ByteMap:
    if isinstance(source, ByteMap):
        return source
    if is_checkpoint(source):
        return ByteMap.from_checkpoint(source, file)
    if hasattr(source, "segments") and hasattr(source, "path") and not isinstance(
            source, ArchiveLayout):
        return ByteMap.from_file(source)
    return ByteMap.from_layout(source)


