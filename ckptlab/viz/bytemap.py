"""The byte map: every byte of a checkpoint file, one lane and one colour per kind of bytes.

A plotly bar per segment takes seconds to draw at 10k records and minutes at 50k, so the map
is one heatmap trace: lanes are kinds of bytes, columns are byte bins (1000 by default), and a
cell's shade is proportional to the share of its bin that the lane's bytes cover (a bin that
is 1% header is 1% tinted, not solid). Bytes present in a bin but under a tenth of it also get
a thin tick in a second trace ("present but tiny"), so a 30-byte header in a megabyte bin
stays visible without the lane reading as solid. Once few enough segments are in view the
columns become the exact segments.

Lanes are segment kinds, except that the bytes which describe tensors (torch's ``data.pkl``
and its small records, a safetensors JSON header, DCP's ``.metadata``) have their own
``metadata`` lane: the data lane holds tensor bytes only. Hover text is in plain words and
names the tensors whose bytes a cell holds.

A map is built from an :class:`~ckptlab.format.ArchiveLayout` (one torch.save or safetensors file,
or a predicted layout) or from one file of a :class:`~ckptlab.checkpoint.Checkpoint` of any
format (its segments and its tensors' parts). :class:`ByteMap` holds the numeric arrays once
per file, so re-binning for a zoom is a few ``searchsorted`` calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ckptlab.errors import InvalidArgumentError
from ckptlab.format.archive import largest_alignment
from ckptlab.format.layout import SEGMENT_KINDS, ArchiveLayout, Segment, SegmentKind
from ckptlab.viz._style import (
    KIND_COLORS,
    KIND_ORDER,
    LANE_COLORS,
    LANE_LABELS,
    LANE_ORDER,
    LANE_WORDS,
    METADATA_LANE,
    NEUTRAL,
    SELECTION,
    human_nbytes,
    plain_text,
    style_figure,
    theme_colors,
)

__all__ = ["MAX_BOUNDARIES", "TINY_FRACTION", "ByteMap", "bytemap_boundaries", "bytemap_figure",
           "bytemap_marks", "bytemap_title", "bytemap_trace", "files_figure", "highlight_shapes",
           "overhead_figure", "update_bytemap"]

# Plotly samples a heatmap that has more columns than pixels, which drops the slivers (a
# header in a bin of megabytes) this map exists to show: keep columns at about one per pixel.
DEFAULT_BINS = 1000
EXACT_THRESHOLD = 1000  # at most this many visible segments are drawn one column each
TINY_FRACTION = 0.1  # a lane covering less than this share of a bin also gets a tick
MAX_BOUNDARIES = 300  # tensor boundaries marked in a view (more: the data lane is drawn plain)
_KIND_CODE = {k: i for i, k in enumerate(KIND_ORDER)}
_LANE_CODE = {k: i for i, k in enumerate(LANE_ORDER)}
# a SegmentColumns kind code (index into SEGMENT_KINDS) -> its index into KIND_ORDER
_SEGMENT_KIND_CODE = np.array([_KIND_CODE[k] for k in SEGMENT_KINDS], dtype=np.int16)
_DATA_LANE = _LANE_CODE[SegmentKind.DATA]
_META_LANE = _LANE_CODE[METADATA_LANE]
# segment kind code -> lane code (a JSON header is metadata; DATA is split per segment)
_KIND_TO_LANE = np.array([_META_LANE if k is SegmentKind.HEADER else _LANE_CODE[k]
                          for k in KIND_ORDER], dtype=np.int16)
_SHADE = 0.999  # z = lane + _SHADE * share: a full bin is the lane's colour, never the next's
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
        return cls.from_file(entry, checkpoint.tensors.values())

    @classmethod
    def _build(cls, layout: ArchiveLayout, tensor_data: Any, item_labels: Any, *,
               segments: tuple[Segment, ...] | None = None, file: str = "") -> ByteMap:
        segs = layout.segments if segments is None else segments
        trailer = _TENSORIZER_NAMES if layout.format == "tensorizer" else _TRAILER_NAMES
        starts, nbytes, kinds, items, names = _segment_arrays(segs, trailer)
        n = len(starts)
        lane_codes = _KIND_TO_LANE[kinds]  # data and JSON headers decided below
        data_idx = np.flatnonzero(kinds == _KIND_CODE[SegmentKind.DATA])
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
        codes = np.array([_LANE_CODE[k] for k in self.lanes], dtype=np.int16)
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
        kinds = np.fromiter((_KIND_CODE[s.kind] for s in segs), dtype=np.int16, count=n)
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
    holding = {p.file for t in checkpoint.tensors.values() for p in t.parts}
    ranked = sorted(files, key=lambda f: (f.path not in holding, -f.nbytes, f.path))
    return ranked[0]


def _is_checkpoint(source: Any) -> bool:
    return hasattr(source, "files") and hasattr(source, "tensors") and hasattr(source, "format")


def _as_bytemap(source: Any, file: str | None = None) -> ByteMap:
    if isinstance(source, ByteMap):
        return source
    if _is_checkpoint(source):
        return ByteMap.from_checkpoint(source, file)
    if hasattr(source, "segments") and hasattr(source, "path") and not isinstance(
            source, ArchiveLayout):
        return ByteMap.from_file(source)
    return ByteMap.from_layout(source)


def _window(bm: ByteMap, x_range: tuple[float, float] | None) -> tuple[int, int]:
    if x_range is None:
        return 0, bm.file_nbytes
    try:
        lo, hi = sorted(float(v) for v in x_range)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"x_range must be two byte offsets (lo, hi), got {x_range!r}") from None
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise InvalidArgumentError(f"x_range must be finite, got {x_range!r}")
    lo = int(np.clip(np.floor(lo), 0, bm.file_nbytes))
    hi = int(np.clip(np.ceil(hi), 0, bm.file_nbytes))
    if hi - lo < 1:  # a zero-width zoom: show the byte under it
        lo, hi = min(lo, bm.file_nbytes - 1), min(lo, bm.file_nbytes - 1) + 1
    return lo, hi


def _share(cover: int, width: int) -> str:
    if cover >= width:
        return "all of the bin"
    pct = 100 * cover / width
    return f"{pct:.1f}% of the bin" if pct >= 0.1 else "under 0.1% of the bin"


def bytemap_trace(source: Any, *, x_range: tuple[float, float] | None = None,
                  bins: int = DEFAULT_BINS, exact_threshold: int = EXACT_THRESHOLD,
                  file: str | None = None, theme: str | None = None) -> dict[str, Any]:
    """The heatmap trace properties of the byte map for one view (what a zoom updates).

    Parameters
    ----------
    source
        An :class:`~ckptlab.format.ArchiveLayout`, a :class:`ByteMap`, a checkpoint ``FileEntry``
        or a :class:`~ckptlab.checkpoint.Checkpoint` (then ``file`` picks its file).
    x_range, bins, exact_threshold
        As for :func:`bytemap_figure`.
    file
        For a checkpoint: the file (relative path, as in ``ck.files``).
    theme
        ``"light"``, ``"dark"`` or None (the notebook's, see :func:`~ckptlab.viz._style.resolve_theme`):
        the colour an empty share fades to.

    Returns
    -------
    dict
        Plotly heatmap properties (``x``, ``y``, ``z``, ``zmin``, ``zmax``, ``colorscale``,
        ``customdata``, ``text``, ``hovertemplate``) plus ``"meta"``: ``{"mode": "binned" |
        "exact", "x_range": [lo, hi], "columns": int, "visible_segments": int}``. ``z`` is
        ``lane + 0.999 * share`` (the share of the bin the lane's bytes cover; 1 for an exact
        column). ``customdata`` is ``[bytes, first item, last item]`` per cell when binned,
        ``[start, end, bytes, item]`` when exact; ``text`` is the hover sentence. Updating a
        figure's first trace with it redraws the map; :func:`update_bytemap` also redraws
        the ticks of tiny shares (:func:`bytemap_marks`).
    """
    for name, value, least in (("bins", bins, 1), ("exact_threshold", exact_threshold, 0)):
        if type(value) is not int or value < least:
            raise InvalidArgumentError(f"{name} must be an int >= {least}, got {value!r}")
    bm = _as_bytemap(source, file)
    lo, hi = _window(bm, x_range)
    i0, i1 = (int(v) for v in bm.segment_index(np.array([lo, hi - 1])))
    visible = i1 - i0 + 1
    codes = np.array([_LANE_CODE[k] for k in bm.lanes])
    lane_of = np.full(len(LANE_ORDER), -1)
    lane_of[codes] = np.arange(len(codes))
    n_lanes = len(bm.lanes)
    smallest = int(bm.nbytes[i0 : i1 + 1].min())
    lane_codes = bm._codes()
    words = [LANE_WORDS[k] for k in bm.lanes]
    # Exact columns only when every one gets at least a bin's width: narrower ones would be
    # dropped by plotly's heatmap drawing, and a byte map must not hide a header.
    if visible <= exact_threshold and smallest * bins >= hi - lo:
        seg = slice(i0, i1 + 1)
        starts = np.maximum(bm.starts[seg], lo)
        ends = np.minimum(bm.starts[seg] + bm.nbytes[seg], hi)
        edges = np.append(starts, ends[-1])
        rows = lane_of[lane_codes[seg]]
        cols = np.arange(visible)
        z = np.full((n_lanes, visible), np.nan)
        z[rows, cols] = rows + _SHADE
        items = bm.items[seg]
        custom = np.zeros((n_lanes, visible, 4), dtype=np.int64)
        custom[:, :, 0] = bm.starts[seg]
        custom[:, :, 1] = bm.starts[seg] + bm.nbytes[seg]
        custom[:, :, 2] = bm.nbytes[seg]
        custom[:, :, 3] = items
        text = np.full((n_lanes, visible), "", dtype=object)
        text[rows, cols] = [
            f"bytes {a:,}–{a + n - 1:,}: {words[r]} of {bm.item_description(int(i))} "
            f"({human_nbytes(n)})"
            for a, n, r, i in zip(bm.starts[seg].tolist(), bm.nbytes[seg].tolist(),
                                  rows.tolist(), items.tolist(), strict=True)]
        mode = "exact"
    else:
        n_cols = min(bins, hi - lo)
        edges = np.unique(np.linspace(lo, hi, n_cols + 1).round().astype(np.int64))
        cover = bm.coverage(edges)  # (lanes, cols)
        widths = np.diff(edges)
        frac = cover / widths
        z = np.where(cover > 0, np.arange(n_lanes)[:, None] + _SHADE * frac, np.nan)
        first = np.full(cover.shape, -1, dtype=np.int64)
        last = np.full(cover.shape, -1, dtype=np.int64)
        for row, segs in enumerate(bm.lane_segments):  # the items owning each lane's bytes
            seg_starts = bm.starts[segs]
            f = np.searchsorted(seg_starts + bm.nbytes[segs], edges[:-1], side="right")
            la = np.searchsorted(seg_starts, edges[1:], side="left") - 1
            valid = cover[row] > 0
            first[row] = np.where(valid, bm.items[segs[np.clip(f, 0, len(segs) - 1)]], -1)
            last[row] = np.where(valid, bm.items[segs[np.clip(la, 0, len(segs) - 1)]], -1)
        custom = np.empty((n_lanes, len(widths), 3), dtype=np.int64)
        custom[:, :, 0] = cover
        custom[:, :, 1] = first
        custom[:, :, 2] = last
        text = np.full(cover.shape, "", dtype=object)
        rr, cc = np.nonzero(cover > 0)
        e = edges.tolist()
        cov, fi, la_ = cover[rr, cc].tolist(), first[rr, cc].tolist(), last[rr, cc].tolist()
        sentences = []
        for r, c, n, a, b in zip(rr.tolist(), cc.tolist(), cov, fi, la_, strict=True):
            width = e[c + 1] - e[c]
            more = "" if b == a else (f"<br>… to {bm.item_description(b)} "
                                      f"({b - a} more item{'s' * (b - a > 1)})")
            sentences.append(f"bytes {e[c]:,}–{e[c + 1] - 1:,}: {human_nbytes(n)} of "
                             f"{words[r]} ({_share(n, width)})<br>in "
                             f"{bm.item_description(a)}{more}")
        text[rr, cc] = sentences
        mode = "binned"
    return {
        "x": edges,
        "y": [LANE_LABELS[k] for k in bm.lanes],
        "zmin": 0,
        "zmax": n_lanes,
        "colorscale": _colorscale(bm.lanes, theme),
        # None, not NaN, for empty cells: NaN is not JSON, and widget messages carry it raw
        "z": np.where(np.isnan(z), None, z),
        "customdata": custom,
        "text": text,
        "hovertemplate": "<b>%{y}</b> · %{text}<extra></extra>",
        "meta": {"mode": mode, "x_range": [lo, hi], "columns": int(z.shape[1]),
                 "visible_segments": int(visible)},
    }


def bytemap_marks(trace: dict[str, Any]) -> dict[str, Any]:
    """The "present but tiny" ticks of a :func:`bytemap_trace`: scatter properties.

    One tick at the middle of every binned cell whose lane covers more than nothing but
    less than :data:`TINY_FRACTION` of the bin (its shade alone would be near white). Returns
    ``x`` (bin centres), ``y`` (lane labels), ``text`` (the cell's hover sentence) and
    ``marker`` (a thin vertical tick in the lane's colour); no ticks in exact mode.
    """
    z = np.asarray(trace["z"], dtype=float)
    x = np.asarray(trace["x"], dtype=np.float64)
    labels = list(trace["y"])
    if trace["meta"]["mode"] != "binned" or z.size == 0:
        return {"x": [], "y": [], "text": [], "marker": _tick_marker(labels, np.zeros(0))}
    share = z - np.arange(z.shape[0])[:, None]
    tiny = ~np.isnan(z) & (share < _SHADE * TINY_FRACTION)
    rr, cc = np.nonzero(tiny)
    centres = (x[cc] + x[cc + 1]) / 2
    return {"x": centres, "y": [labels[r] for r in rr.tolist()],
            "text": np.asarray(trace["text"], dtype=object)[rr, cc],
            "marker": _tick_marker(labels, rr)}


def bytemap_boundaries(source: Any, trace: dict[str, Any]) -> dict[str, Any]:
    """Where one item's tensor bytes end and the next one's begin, in a :func:`bytemap_trace`'s
    view: scatter properties.

    Adjacent tensors of one colour would read as one solid bar (a shard of a few tensors, a
    zoom among neighbours); a thin break in the tensor-data lane marks each boundary, at most
    :data:`MAX_BOUNDARIES` of them (past that the lane is drawn plain). Returns ``x`` (the
    offsets), ``y`` (the lane's label), ``text`` (which tensor starts there) and ``marker``.
    """
    bm = _as_bytemap(source)
    lo, hi = trace["meta"]["x_range"]
    found = np.zeros(0, dtype=np.int64)
    segs = found
    if SegmentKind.DATA in bm.lanes:
        segs = bm.lane_segments[bm.lanes.index(SegmentKind.DATA)]
        starts = bm.starts[segs]
        ends = starts + bm.nbytes[segs]
        items = bm.items[segs]
        joined = np.flatnonzero((starts[1:] == ends[:-1]) & (items[1:] != items[:-1])) + 1
        found = joined[(starts[joined] > lo) & (starts[joined] < hi)]
    if not 0 < len(found) <= MAX_BOUNDARIES:
        found = found[:0]
    at = bm.starts[segs[found]]
    text = [f"byte {a:,}: {bm.item_description(i)} starts"
            for a, i in zip(at.tolist(), bm.items[segs[found]].tolist(), strict=True)]
    label = LANE_LABELS[SegmentKind.DATA]
    color = trace["colorscale"][0][1]  # the map's empty colour: a gap in the bar
    return {"x": at, "y": [label] * len(at), "text": text,
            "marker": {"symbol": "line-ns", "size": 18, "line": {"width": 1.5, "color": color}}}


def _tick_marker(labels: Sequence[str], rows: np.ndarray) -> dict[str, Any]:
    """Tick colours as lane numbers on a stepped scale of the lanes' colours: one numeric
    array (plotly validates a list of colour names one by one, slowly)."""
    colors = _lane_colors_by_label(labels) or [NEUTRAL]
    n = len(colors)
    scale: list[list[Any]] = []
    for i, c in enumerate(colors):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return {"symbol": "line-ns", "size": 7,
            "line": {"width": 1, "color": rows.astype(np.float64), "colorscale": scale,
                     "cmin": -0.5, "cmax": n - 0.5}}


def _lane_colors_by_label(labels: Sequence[str]) -> list[str]:
    by_label = {LANE_LABELS[k]: LANE_COLORS[k] for k in LANE_ORDER}
    return [by_label.get(lab, NEUTRAL) for lab in labels]


def _colorscale(lanes: Sequence[str], theme: str | None = None) -> list[list[Any]]:
    base = theme_colors(theme)["empty"]
    n = max(len(lanes), 1)
    scale: list[list[Any]] = []
    for i, kind in enumerate(lanes):
        scale.append([i / n, base])
        scale.append([(i + 1) / n, LANE_COLORS[kind]])
    if not scale:
        scale = [[0, base], [1, base]]
    return scale


def bytemap_title(source: Any) -> str:
    """The byte map's default title (escaped): file name, size, and records and alignment
    for a zip (tensor parts for other checkpoint files)."""
    return _default_title(_as_bytemap(source))


def _default_title(bm: ByteMap) -> str:
    layout = bm.layout
    name = plain_text((bm.file or layout.path).rsplit("/", 1)[-1])
    if bm.file and not layout.records:  # a checkpoint file without zip records
        n = bm.owners.parts if bm.owners is not None else 0
        return (f"{name} · {human_nbytes(bm.file_nbytes)} · {n} tensor part"
                f"{'s' * (n != 1)}")
    return (f"{name} · {human_nbytes(layout.file_nbytes)} · {len(layout.records)} records · "
            f"alignment {layout.alignment}")


def bytemap_figure(source: Any, *, x_range: tuple[float, float] | None = None,
                   bins: int = DEFAULT_BINS, exact_threshold: int = EXACT_THRESHOLD,
                   title: str | None = None, file: str | None = None,
                   highlight: Sequence[tuple[int, int]] = (),
                   theme: str | None = None) -> go.Figure:
    """The byte map of a checkpoint file: one lane per kind of bytes along the file.

    Parameters
    ----------
    source
        An :class:`~ckptlab.format.ArchiveLayout`, a prepared :class:`ByteMap` (reuse one to re-bin
        quickly), a checkpoint ``FileEntry``, or a :class:`~ckptlab.checkpoint.Checkpoint`
        (``ckptlab.open``; ``file`` picks the file).
    x_range
        Byte range ``(lo, hi)`` to show; the whole file by default.
    bins
        Columns when more than ``exact_threshold`` segments are visible.
    exact_threshold
        At most this many visible segments are drawn exactly, one column each.
    title
        Figure title, drawn as plotly text (markup is read: escape names in it with
        :func:`~ckptlab.viz._style.plain_text`); by default the file name (escaped), size and
        record count.
    file
        For a checkpoint: the file to map (relative path, as in ``ck.files``); by default
        the largest file holding tensor bytes.
    highlight
        Byte ranges ``(offset, nbytes)`` to outline (a tensor's parts, see
        :func:`highlight_shapes`).
    theme
        ``"light"``, ``"dark"`` or None for the notebook's theme.

    Returns
    -------
    plotly.graph_objects.Figure
        A heatmap trace (the shares) and a scatter trace (ticks where a lane is present but
        covers under a tenth of its bin). ``fig.layout.meta`` says ``mode`` (``"binned"`` or
        ``"exact"``), the byte range, the number of columns, the lanes and the file size.
        Hover text says in words which bytes a cell holds and names their tensors.
    """
    bm = _as_bytemap(source, file)
    data = bytemap_trace(bm, x_range=x_range, bins=bins, exact_threshold=exact_threshold,
                         theme=theme)
    marks = bytemap_marks(data)
    breaks = bytemap_boundaries(bm, data)
    meta = data.pop("meta")
    labels = data["y"]
    fig = go.Figure([
        go.Heatmap(showscale=False, hoverongaps=False, xgap=0, ygap=2, name="bytes", **data),
        go.Scatter(mode="markers", name="present but tiny", showlegend=False,
                   hovertemplate="<b>%{y}</b> · %{text}<extra></extra>",
                   x=marks["x"], y=marks["y"], text=marks["text"], marker=marks["marker"]),
        go.Scatter(mode="markers", name="tensor boundaries", showlegend=False,
                   hovertemplate="%{text}<extra></extra>", **breaks)])
    fig.update_layout(
        title=title if title is not None else _default_title(bm),
        height=110 + 28 * len(labels), margin={"l": 130, "r": 20, "t": 76, "b": 45},
        xaxis={"title": "file offset (bytes)", "range": meta["x_range"], "showgrid": False,
               "tickformat": ",d"},
        yaxis={"autorange": "reversed", "fixedrange": True, "type": "category",
               "categoryorder": "array", "categoryarray": labels},
        uirevision="bytemap",
        shapes=highlight_shapes(highlight),
        meta={"kind": "bytemap", **meta, "lanes": [str(k) for k in bm.lanes],
              "file_nbytes": bm.file_nbytes, **({"file": bm.file} if bm.file else {}),
              "tiny": len(marks["x"]), "boundaries": len(breaks["x"])},
    )
    return style_figure(fig, theme=theme)


def update_bytemap(figure: Any, source: Any, *, x_range: tuple[float, float] | None = None,
                   bins: int = DEFAULT_BINS, exact_threshold: int = EXACT_THRESHOLD,
                   theme: str | None = None) -> dict[str, Any]:
    """Redraw a :func:`bytemap_figure` (or its ``FigureWidget``) for another view or file.

    Updates both traces, ``layout.meta``, the lane axis and the x range in one batch (for a
    FigureWidget one message). Returns the new ``meta``.
    """
    bm = _as_bytemap(source)
    data = bytemap_trace(bm, x_range=x_range, bins=bins, exact_threshold=exact_threshold,
                         theme=theme)
    marks = bytemap_marks(data)
    breaks = bytemap_boundaries(bm, data)
    meta = data.pop("meta")
    batch = getattr(figure, "batch_update", None)
    ctx = batch() if batch is not None else _null()
    with ctx:
        figure.data[0].update(**data)
        if len(figure.data) > 1:
            figure.data[1].update(x=marks["x"], y=marks["y"], text=marks["text"],
                                  marker=marks["marker"])
        if len(figure.data) > 2:
            figure.data[2].update(**breaks)
        figure.layout.meta = {**(figure.layout.meta or {}), **meta,
                              "lanes": [str(k) for k in bm.lanes],
                              "file_nbytes": bm.file_nbytes, **({"file": bm.file} if bm.file else {}),
                              "tiny": len(marks["x"]), "boundaries": len(breaks["x"])}
        figure.layout.height = 110 + 28 * len(data["y"])
        figure.layout.yaxis.categoryarray = data["y"]
        figure.layout.xaxis.range = meta["x_range"]
    return dict(figure.layout.meta)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def highlight_shapes(ranges: Iterable[tuple[int, int]], *,
                     color: str = SELECTION) -> list[dict[str, Any]]:
    """Outlines for byte ranges ``(offset, nbytes)`` on a byte map (``layout.shapes``).

    A range narrower than a pixel still gets its outline (plotly draws the border).
    """
    return [dict(type="rect", xref="x", yref="paper", x0=int(o), x1=int(o) + max(int(n), 1),
                 y0=0, y1=1, line={"color": color, "width": 2},
                 fillcolor="rgba(127,127,127,0.12)") for o, n in ranges]


def files_figure(checkpoint: Any, *, max_files: int = 60, theme: str | None = None
                 ) -> go.Figure:
    """Bytes per file of a checkpoint: tensor bytes apart from the rest, the largest first.

    Parameters
    ----------
    checkpoint
        A :class:`~ckptlab.checkpoint.Checkpoint` (``ckptlab.open``), any format.
    max_files
        At most this many bars (the largest files); ``meta["omitted"]`` counts the rest.

    Returns
    -------
    plotly.graph_objects.Figure
        Two stacked horizontal bar traces (tensor bytes, other bytes). ``fig.layout.meta``
        has ``files``, ``nbytes``, ``tensor_nbytes`` (bytes of the file under some tensor
        part, counted once where tensors share bytes) and ``omitted``.
    """
    if not _is_checkpoint(checkpoint):
        raise InvalidArgumentError(
            f"expected a Checkpoint (ckptlab.open), got {type(checkpoint).__name__}")
    by_file: dict[str, list[tuple[int, int]]] = {}
    for t in checkpoint.tensors.values():
        for p in t.parts:
            by_file.setdefault(p.file, []).append((p.offset, p.nbytes))
    rows = sorted(((f.path, f.nbytes, union_nbytes(by_file.get(f.path, ())))
                   for f in checkpoint.files), key=lambda r: (-r[1], r[0]))
    shown = rows[:max(max_files, 1)]
    names = [plain_text(r[0]) for r in shown]
    fig = go.Figure([
        go.Bar(y=names, x=[r[2] for r in shown], orientation="h", name="tensor bytes",
               marker={"color": LANE_COLORS[SegmentKind.DATA]},
               hovertemplate="%{y}: %{x:,} B of tensors<extra></extra>"),
        go.Bar(y=names, x=[r[1] - r[2] for r in shown], orientation="h", name="other bytes",
               marker={"color": NEUTRAL},
               hovertemplate="%{y}: %{x:,} B besides tensors<extra></extra>")])
    fig.update_layout(
        barmode="stack", title=f"Bytes per file · {len(rows)} file{'s' * (len(rows) != 1)} · "
                               f"{human_nbytes(sum(r[1] for r in rows))}",
        xaxis={"title": "bytes", "tickformat": ",d"},
        yaxis={"autorange": "reversed", "automargin": True},
        legend={"orientation": "h", "y": -0.25, "x": 0},
        height=max(260, 130 + 22 * len(shown)), margin={"l": 20, "r": 20, "t": 76, "b": 60},
        meta={"kind": "files", "files": [r[0] for r in shown],
              "nbytes": [r[1] for r in shown], "tensor_nbytes": [r[2] for r in shown],
              "omitted": len(rows) - len(shown)})
    return style_figure(fig, theme=theme)


def union_nbytes(ranges: Iterable[tuple[int, int]]) -> int:
    """Bytes covered by ``(offset, nbytes)`` ranges (tensors that view one storage overlap)."""
    total, end = 0, -1
    for lo, n in sorted(ranges):
        hi = lo + n
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


_OVERHEAD_PARTS: tuple[tuple[str, tuple[SegmentKind, ...]], ...] = (
    ("header + name", (SegmentKind.LOCAL_HEADER, SegmentKind.NAME, SegmentKind.HEADER_LENGTH,
                       SegmentKind.HEADER)),
    ("zip64 / other extra", (SegmentKind.ZIP64_EXTRA, SegmentKind.EXTRA)),
    ("FB padding", (SegmentKind.PADDING, SegmentKind.HEADER_PADDING)),
    ("descriptor", (SegmentKind.DESCRIPTOR,)),
    ("trailer", (SegmentKind.CENTRAL_DIRECTORY, SegmentKind.ZIP64_EOCD,
                 SegmentKind.ZIP64_LOCATOR, SegmentKind.EOCD)),
    ("unknown", (SegmentKind.UNKNOWN,)),
    ("data", (SegmentKind.DATA,)),
)


def _kind_coverage(bm: ByteMap, edges: np.ndarray, kind: SegmentKind) -> np.ndarray:
    """Bytes of segment kind ``kind`` in each bin ``[edges[j], edges[j+1])``."""
    mine = bm.kinds == _KIND_CODE[kind]
    prefix = np.concatenate([[0], np.cumsum(np.where(mine, bm.nbytes, 0))])
    edges = np.clip(np.asarray(edges, dtype=np.int64), 0, bm.file_nbytes)
    idx = bm.segment_index(edges)
    within = np.minimum(edges - bm.starts[idx], bm.nbytes[idx])
    return np.diff(prefix[idx] + np.where(mine[idx], within, 0))


def overhead_figure(source: Any, *, by: str = "item", bins: int = DEFAULT_BINS,
                    file: str | None = None, theme: str | None = None) -> go.Figure:
    """Where the non-data bytes are, at a scale where they are visible.

    At true byte scale a 30-byte header next to a megabyte storage is sub-pixel. This view
    normalizes: with ``by="item"`` every record (and trailer structure) gets the same width
    and its bytes are split into header + name, extras, padding, descriptor and data (percent
    stacked, items aggregated into at most ``bins`` columns); with ``by="bytes"`` it shows
    the overhead percentage of each byte bin along the file.

    Parameters
    ----------
    source
        As for :func:`bytemap_figure` (a layout, a map, a checkpoint file or a checkpoint).
    by
        ``"item"`` or ``"bytes"``.
    bins
        Columns (items are aggregated, bytes binned, into at most this many).
    file
        For a checkpoint: which file.
    theme
        ``"light"``, ``"dark"`` or None for the notebook's theme.

    Returns
    -------
    plotly.graph_objects.Figure
        ``fig.layout.meta`` holds ``kind="overhead"``, ``by`` and ``columns``.
    """
    if by not in ("item", "bytes"):
        raise InvalidArgumentError(f"by must be 'item' or 'bytes', got {by!r}")
    if type(bins) is not int or bins < 1:
        raise InvalidArgumentError(f"bins must be a positive int, got {bins!r}")
    bm = _as_bytemap(source, file)
    fig = go.Figure()
    if by == "bytes":
        edges = np.unique(np.linspace(0, bm.file_nbytes, min(bins, bm.file_nbytes) + 1)
                          .round().astype(np.int64))
        data = _kind_coverage(bm, edges, SegmentKind.DATA)  # payload: tensors and pickles
        pct = 100.0 * (1.0 - data / np.diff(edges))
        fig.add_trace(go.Scatter(
            x=edges[:-1], y=pct, mode="lines", line={"shape": "hv", "color": "#e45756"},
            fill="tozeroy", name="overhead %",
            customdata=np.stack([edges[:-1], edges[1:]], axis=1),
            hovertemplate="bytes [%{customdata[0]:,}, %{customdata[1]:,}): "
                          "%{y:.3f}% overhead<extra></extra>"))
        fig.update_layout(xaxis={"title": "file offset (bytes)", "tickformat": ",d"},
                          yaxis={"title": "overhead (% of bin)", "rangemode": "tozero"})
        columns = len(edges) - 1
    else:
        n_items = len(bm.item_names)
        per_item = {}
        for label, kinds in _OVERHEAD_PARTS:
            mask = np.isin(bm.kinds, [_KIND_CODE[k] for k in kinds])
            per_item[label] = np.bincount(bm.items, weights=np.where(mask, bm.nbytes, 0),
                                          minlength=n_items)
        group_starts = np.unique(np.linspace(0, n_items, min(bins, n_items) + 1)
                                 .astype(np.int64))[:-1]
        columns = len(group_starts)
        for label, kinds in _OVERHEAD_PARTS:
            if not per_item[label].any():
                continue
            summed = np.add.reduceat(per_item[label], group_starts)
            fig.add_trace(go.Scatter(
                x=group_starts, y=summed, name=label, stackgroup="one", groupnorm="percent",
                mode="lines", line={"width": 0.5, "shape": "hv", "color": KIND_COLORS[kinds[0]]},
                hovertemplate=f"{label}: " + "%{y:,.0f} B<extra></extra>"))
        fig.update_layout(
            xaxis={"title": "item (records in file order, then the trailer)"},
            yaxis={"title": "share of the item's bytes (%)", "range": [0, 100]},
            hovermode="x unified")
    fig.update_layout(
        title=f"Overhead by {'item' if by == 'item' else 'byte bin'}: "
              f"{human_nbytes(bm.layout.overhead_nbytes)} of "
              f"{human_nbytes(bm.file_nbytes)} is file structure, not payload",
        height=380, margin={"l": 70, "r": 20, "t": 76, "b": 45},
        meta={"kind": "overhead", "by": by, "columns": columns})
    return style_figure(fig, theme=theme)
