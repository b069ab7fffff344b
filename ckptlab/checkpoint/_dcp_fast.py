"""Opening a DCP directory at the speed of its ``.metadata``: the common case, lazily.

:func:`ckptlab.checkpoint._dcp.open_dcp` used to read every item's torch.save zip (headers,
pickle, central directory) before it returned: about 2 ms an item, 10 s for 5,000 items, and
a 1,000,000-item checkpoint never opened. Here, for directories ``FileSystemWriter`` writes by
default (torch.save items back to back in each data file, no transforms):

- ``.metadata`` is read once and decoded into columns
  (:func:`ckptlab.plan._metadata_columns.decode_columns`), never into one object per item;
- at open, only what needs no item bytes is checked: every data file exists and holds its
  items, items do not overlap, each tensor's saved chunks lie inside it and their volumes add
  up to it;
- a tensor's :class:`~ckptlab.checkpoint.TensorEntry` is built when it is first asked for:
  each of its items is read up to its data (one ``pread``), and when those bytes equal the
  ones of an item already scanned (same length, dtype and chunk shape: the *template*) except
  for the data record's CRC, the template's layout is the item's; otherwise the item is
  scanned in full, as before. Chunk tiling is then checked exactly, as before.
- a data file's segments are built when they are first used, from the same item layouts.

Anything else (SAFETENSORS serialization, zstd transforms, a ``.metadata`` the columnar
decoder does not read) returns None and takes the general path, which is unchanged. The two
give equal checkpoints (``tests/checkpoint/test_dcp_fast.py``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ckptlab.checkpoint.model import (
    Checkpoint,
    FileEntry,
    Part,
    TensorEntry,
    contiguous_strides,
    span_nbytes,
)
from ckptlab.errors import ArchiveError, CorruptArchiveError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format.layout import ArchiveLayout, Segment, SegmentKind

__all__ = ["open_dcp_fast"]

_MAX_HANDLES = 32
_SLICE = 1 << 16  # entries per slice of the open-time checks


class _Items:
    """Per-item layouts, read on demand, shared through templates (see the module
    docstring). Each data file is opened once, inside the directory."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.handles: dict[str, Any] = {}
        # (length, dtype, chunk sizes) -> [(layout, header bytes, crc position), ...]
        self.templates: dict[tuple[Any, ...], list[tuple[ArchiveLayout, bytes, int]]] = {}
        self.cache: dict[tuple[str, int], ArchiveLayout] = {}

    def handle(self, file: str) -> Any:
        f = self.handles.get(file)
        if f is None:
            from ckptlab.format._paths import open_inside

            if len(self.handles) >= _MAX_HANDLES:  # the oldest goes: never 1,024 open files
                self.handles.pop(next(iter(self.handles))).close()
            f = self.handles[file] = open_inside(self.root, file)
        return f

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()

    def scan(self, file: str, fqn: str, offset: int, length: int) -> ArchiveLayout:
        """The item's own layout, read in full (the general path's way)."""
        from ckptlab.plan.metadata import _item_layout

        try:
            return _item_layout(self.handle(file), file, offset, length)
        except ArchiveError as exc:
            raise CorruptArchiveError(f"item is not a torch.save archive: {exc}",
                                      path=os.path.join(self.root, file), record=fqn,
                                      offset=offset) from None

    def layout(self, file: str, fqn: str, offset: int, length: int, key: Any) -> ArchiveLayout:
        """The layout of the tensor item at ``offset``: a template's when the item's bytes up
        to its data are the template's (but for the data record's CRC), else its own."""
        hit = self.cache.get((file, offset))
        if hit is not None:
            return hit
        candidates = self.templates.setdefault(key, [])
        layout = None
        if candidates:
            n = len(candidates[0][1])
            head = os.pread(self.handle(file).fileno(), n, offset)
            for template, expected, crc in candidates:
                if len(expected) == len(head) and (
                        head[:crc] == expected[:crc] and head[crc + 4:] == expected[crc + 4:]):
                    layout = template
                    break
        if layout is None:
            layout = self.scan(file, fqn, offset, length)
            template = _template(self, file, offset, layout)
            if template is not None and len(candidates) < 8:
                candidates.append(template)
        self.cache[(file, offset)] = layout
        return layout


def _template(items: _Items, file: str, offset: int, layout: ArchiveLayout
              ) -> tuple[ArchiveLayout, bytes, int] | None:
    """A scanned tensor item as a template: its bytes up to the data and where the data
    record's CRC-32 sits in them (the only header field that depends on the data)."""
    if len(layout.storages) != 1 or len(layout.tensors) != 1:
        return None
    storage = layout.storages[0]
    record = next((r for r in layout.records if r.data_offset == storage.data_offset), None)
    if record is None or storage.data_offset > (1 << 20):
        return None
    head = os.pread(items.handle(file).fileno(), storage.data_offset, offset)
    if len(head) != storage.data_offset:
        return None
    return layout, head, record.header_offset + 14


class _Tensors(Mapping[str, TensorEntry]):
    """fqn -> TensorEntry, built (and kept) on first access."""

    def __init__(self, dcp: _Dcp) -> None:
        self._dcp = dcp
        self._built: dict[str, TensorEntry] = {}

    def __getitem__(self, name: str) -> TensorEntry:
        entry = self._built.get(name)
        if entry is None:
            if name not in self._dcp.cols.tensors:
                raise KeyError(name)
            entry = self._built[name] = self._dcp.entry(name)
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._dcp.cols.tensors)

    def __len__(self) -> int:
        return len(self._dcp.cols.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._dcp.cols.tensors

    def __repr__(self) -> str:
        return f"<{len(self)} DCP tensors, {len(self._built)} built>"


class _Segments(Sequence[Segment]):
    """A data file's segments, built from its items' layouts on first use."""

    def __init__(self, dcp: _Dcp, file: str, nbytes: int) -> None:
        self._dcp = dcp
        self._file = file
        self._nbytes = nbytes
        self._value: tuple[Segment, ...] | None = None

    def _get(self) -> tuple[Segment, ...]:
        if self._value is None:
            self._value = self._dcp.segments(self._file, self._nbytes)
        return self._value

    def __getitem__(self, index: Any) -> Any:
        return self._get()[index]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self) -> Iterator[Segment]:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Segments):
            other = other._get()
        return self._get() == other

    def __hash__(self) -> int:
        return hash(self._get())

    def __repr__(self) -> str:
        return repr(self._get()) if self._value is not None else \
            f"<segments of {self._file}, not built yet>"


class DcpCheckpoint(Checkpoint):
    """A :class:`~ckptlab.checkpoint.Checkpoint` of a DCP directory whose tensors and file
    segments are built on first access (``tensors`` is a read-only mapping)."""

    def __init__(self, dcp: _Dcp, files: tuple[FileEntry, ...], objects: dict[str, Any],
                 reader: Any) -> None:
        super().__init__("dcp", dcp.root, files, {}, objects, reader, ())
        self.tensors = _Tensors(dcp)  # type: ignore[assignment]
        self._dcp = dcp


class _Dcp:
    """The columns of one directory and what is derived from them on demand."""

    def __init__(self, root: str, cols: Any, files: dict[str, int]) -> None:
        self.root = root
        self.cols = cols
        self.files = files
        self.items = _Items(root)
        self.by_fqn: dict[int, np.ndarray] = {}  # fqn id -> entries (tensor items)
        self.rows: np.ndarray = np.empty(0, np.int64)  # entry -> chunk row (-1: none)
        self.order: np.ndarray = np.empty(0, np.int64)  # entries in file, offset order
        self.file_of: np.ndarray = np.empty(0, np.int32)  # entry -> file id
        self.fqn_ids = {name: i for i, name in enumerate(cols.fqns)}
        self.object_layouts: dict[int, ArchiveLayout] = {}  # entry -> its zip's layout

    # -- one tensor ------------------------------------------------------------------------
    def chunk_of(self, e: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        row = int(self.rows[e])
        return self.cols.chunk(row) if row >= 0 else ((), ())

    def part(self, e: int, fqn: str, dtype: str) -> Part:
        cols = self.cols
        file = cols.files[cols.entry_file[e]]
        offset = cols.entry_offset[e]
        length = cols.entry_length[e]
        chunk_offsets, shape = self.chunk_of(e)
        layout = self.items.layout(file, fqn, offset, length, (length, dtype, shape))
        itemsize = DTYPE_ITEMSIZE.get(dtype, 1)
        stride = contiguous_strides(shape)
        data_offset = offset + layout.storages[0].data_offset if layout.storages else None
        at = data_offset if data_offset is not None else offset
        if layout.tensors:
            info = layout.tensors[0]
            stride = info.stride
            if data_offset is not None:
                at = data_offset + info.storage_offset * itemsize
        return Part("chunk", file, at, span_nbytes(shape, stride, itemsize), dtype, shape,
                    stride, storage_key=fqn, chunk_offsets=chunk_offsets, item_offset=offset)

    def entry(self, fqn: str) -> TensorEntry:
        from ckptlab.checkpoint._dcp import _check_tiling
        from ckptlab.plan.metadata import METADATA

        dtype, requires_grad, shape, _, _ = self.cols.tensors[fqn]
        fid = self.fqn_ids.get(fqn)
        entries = self.by_fqn.get(fid, ()) if fid is not None else ()
        parts = sorted((self.part(int(e), fqn, dtype) for e in entries),
                       key=lambda p: p.chunk_offsets or ())
        _check_tiling(fqn, shape, parts, os.path.join(self.root, METADATA))
        return TensorEntry(fqn, self.path_of(fqn), dtype, shape, contiguous_strides(shape),
                           "dense", tuple(parts), requires_grad=requires_grad)

    def path_of(self, fqn: str) -> tuple[Any, ...]:
        mapping = self.cols.planner_data if isinstance(self.cols.planner_data, dict) else {}
        path = mapping.get(fqn)
        if isinstance(path, (tuple, list)) and path and all(isinstance(k, (str, int))
                                                            for k in path):
            return tuple(path)
        return (fqn,)

    # -- one data file -----------------------------------------------------------------------
    def segments(self, file: str, nbytes: int) -> tuple[Segment, ...]:
        """The file tiled by its items' segments, as the general path tiles it."""
        cols = self.cols
        fid = cols.files.index(file) if file in cols.files else -1
        mine = self.order[self.file_of[self.order] == fid] if fid >= 0 else ()
        out: list[Segment] = []
        cursor = 0
        for e in mine:
            e = int(e)
            fqn = cols.fqns[cols.entry_fqn[e]]
            offset = cols.entry_offset[e]
            length = cols.entry_length[e]
            if fqn in cols.tensors:
                _, shape = self.chunk_of(e)
                layout = self.items.layout(file, fqn, offset, length,
                                           (length, cols.tensors[fqn][0], shape))
            else:
                layout = self.object_layouts[e]
            if offset > cursor:
                out.append(Segment(SegmentKind.UNKNOWN, cursor, offset - cursor))
            for s in layout.segments:
                out.append(Segment(s.kind, offset + s.offset, s.nbytes,
                                   f"{fqn}:{s.record}" if s.record else fqn))
            cursor = max(cursor, offset + length)
        if cursor < nbytes:
            out.append(Segment(SegmentKind.UNKNOWN, cursor, nbytes - cursor))
        return tuple(out)


def _decode_metadata_file(root: str) -> tuple[Any, int] | None:
    """``.metadata`` (a regular file inside ``root``, at most 1 GiB) decoded into columns,
    with its size; None where the general path should decide (and say what is wrong).

    The file is mapped, not copied: the decoder reads the pages straight from the page cache,
    so a 127 MB ``.metadata`` does not become 127 MB of process memory."""
    import mmap

    from ckptlab.format._paths import open_inside
    from ckptlab.plan._metadata_columns import decode_columns
    from ckptlab.plan.metadata import MAX_METADATA_NBYTES, METADATA

    try:
        with open_inside(root, METADATA) as f:
            nbytes = os.fstat(f.fileno()).st_size
            if not 0 < nbytes <= MAX_METADATA_NBYTES:
                return None
            with mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ) as data:
                cols = decode_columns(data)
    except (OSError, ValueError, ArchiveError):
        return None
    return (cols, nbytes) if cols is not None else None


def _volumes(values: np.ndarray, start: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """Per chunk row: the product of its sizes (``ndim[i]`` values after its offsets), as
    int64; -1 where the product would not fit (the caller checks those exactly)."""
    out = np.ones(len(start), dtype=np.int64)
    for d in np.unique(ndim):
        if d == 0:
            continue
        rows = np.nonzero(ndim == d)[0]
        block = values[start[rows, None] + d + np.arange(d)[None, :]]
        fits = np.log2(np.maximum(block, 1)).sum(axis=1) < 62
        out[rows] = np.where(fits, np.prod(np.where(fits[:, None], block, 1), axis=1), -1)
    return out


def open_dcp_fast(root: str) -> Checkpoint | None:
    """The checkpoint of a default-format DCP directory, or None for the general path (see
    the module docstring).

    Raises
    ------
    CorruptArchiveError
        A data file that is missing or shorter than its items, items that overlap, chunks
        outside their tensor or whose volumes do not add up to it; on access, what the general
        path raises for a damaged item.
    """
    from ckptlab.checkpoint.open import _reader
    from ckptlab.plan.metadata import METADATA, _data_files

    read = _decode_metadata_file(root)
    if read is None:
        return None
    cols, metadata_nbytes = read
    if cols.transforms or not cols.has_storage_data:
        return None
    files = _data_files(root, [n for n in sorted(os.listdir(root)) if n != METADATA],
                        listed=True)
    files.update(_data_files(root, sorted(set(cols.files) - set(files))))
    n = cols.entries
    file_of = np.frombuffer(cols.entry_file, dtype=np.int32) if n else np.empty(0, np.int32)
    offset = np.frombuffer(cols.entry_offset, dtype=np.int64) if n else np.empty(0, np.int64)
    length = np.frombuffer(cols.entry_length, dtype=np.int64) if n else np.empty(0, np.int64)
    sizes = np.array([files.get(f, -1) for f in cols.files], dtype=np.int64)
    if n:
        missing = sizes[file_of] < 0
        if missing.any():
            e = int(np.argmax(missing))
            raise CorruptArchiveError("an item's data file is missing",
                                      path=os.path.join(root, cols.files[file_of[e]]),
                                      record=cols.fqns[cols.entry_fqn[e]])
        end = offset + length  # both below 2**63: may wrap; checked as Python ints below
        past = (end < offset) | (end > sizes[file_of])
        if past.any():
            e = int(np.argmax(past))
            file = cols.files[file_of[e]]
            raise CorruptArchiveError(
                "an item runs past the end of its data file", path=os.path.join(root, file),
                record=cols.fqns[cols.entry_fqn[e]], offset=int(offset[e]),
                expected=f"end <= {files[file]}", actual=f"end {int(offset[e]) + int(length[e])}")
    # items in file, then offset order; torch.save items lie back to back: an overlap means
    # another serialization (SAFETENSORS items share their blob) or a damaged file
    order = np.lexsort((offset, file_of))
    if n > 1:
        same = file_of[order][1:] == file_of[order][:-1]
        if (same & (offset[order][1:] < (offset + length)[order][:-1])).any():
            return None
    if _duplicate_keys(cols, n):
        return None  # a dict keeps one of them: the general path reads it as Python does
    dcp = _Dcp(root, cols, files)
    dcp.order = order
    dcp.file_of = file_of
    is_tensor = np.array([f in cols.tensors for f in cols.fqns], dtype=bool)
    fqn_of = np.frombuffer(cols.entry_fqn, dtype=np.int32) if n else np.empty(0, np.int32)
    tensor_item = is_tensor[fqn_of] if n else np.zeros(0, bool)
    dcp.rows = _chunk_rows(cols, fqn_of, tensor_item)
    _check_volumes(root, cols, dcp.rows, fqn_of, tensor_item)
    tensor_entries = np.nonzero(tensor_item)[0]
    if len(tensor_entries):
        by = fqn_of[tensor_entries]
        sort = np.argsort(by, kind="stable")
        keys, starts = np.unique(by[sort], return_index=True)
        groups = np.split(tensor_entries[sort], starts[1:])
        dcp.by_fqn = {int(k): g for k, g in zip(keys, groups)}
    # object items: read now (their values are shown), as the general path does
    objects: dict[str, Any] = {}
    try:
        for e in np.nonzero(~tensor_item)[0]:
            e = int(e)
            fqn = cols.fqns[fqn_of[e]]
            layout = dcp.items.scan(cols.files[file_of[e]], fqn, int(offset[e]),
                                    int(length[e]))
            dcp.object_layouts[e] = layout
            values = layout.objects
            objects[fqn] = values[0][1] if values and values[0][0] == () else {
                "type": "pickled object", "nbytes": int(length[e])}
    except BaseException:
        dcp.items.close()
        raise
    if len(files) <= _MAX_HANDLES:
        # open every data file now (a few): later reads do not depend on the directory
        # staying where it is (a remote directory is mirrored in a temporary one for the
        # time of the open)
        try:
            for name in files:
                dcp.items.handle(name)
        except BaseException:
            dcp.items.close()
            raise
    entries = [FileEntry(METADATA, "dcp-metadata", metadata_nbytes,
                         (Segment(SegmentKind.HEADER, 0, metadata_nbytes, METADATA),)
                         if metadata_nbytes else (), None, os.path.join(root, METADATA))]
    for name, nbytes in files.items():
        entries.append(FileEntry(name, "distcp", nbytes,
                                 _Segments(dcp, name, nbytes),  # type: ignore[arg-type]
                                 None, os.path.join(root, name)))
    return DcpCheckpoint(dcp, tuple(entries), objects, _reader(root))


def _duplicate_keys(cols: Any, n: int) -> bool:
    """Whether two storage entries have equal ``MetadataIndex`` keys (fqn and offsets; the
    chunk index does not take part in equality): a 64-bit hash of each key, sorted; equal
    hashes (a real duplicate, or a collision) send the file to the general path."""
    if n < 2:
        return False
    fqn = np.frombuffer(cols.entry_fqn, dtype=np.int32).astype(np.uint64)
    ndim = np.frombuffer(cols.entry_ndim, dtype=np.int8)
    where = np.frombuffer(cols.entry_offsets, dtype=np.int64)
    values = np.frombuffer(cols.index_values, dtype=np.int64).view(np.uint64) if len(
        cols.index_values) else np.empty(0, np.uint64)
    with np.errstate(over="ignore"):
        h = (fqn + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        h ^= np.where(where < 0, np.uint64(0xFFFF), ndim.astype(np.uint64))
        for d in np.unique(ndim[where >= 0]):
            d = int(d)
            sel = np.nonzero((ndim == d) & (where >= 0))[0]
            for j in range(d):
                h[sel] = (h[sel] ^ values[where[sel] + j]) * np.uint64(0xBF58476D1CE4E5B9)
                h[sel] ^= h[sel] >> np.uint64(31)
    h.sort()
    return bool((h[1:] == h[:-1]).any())


def _chunk_rows(cols: Any, fqn_of: np.ndarray, tensor_item: np.ndarray) -> np.ndarray:
    """Entry -> its chunk's row, as the general path finds it: ``index`` when it is in range,
    else the chunk whose offsets are the entry's; -1 for none (and for object items)."""
    n = cols.entries
    rows = np.full(n, -1, dtype=np.int64)
    if not n:
        return rows
    first = np.zeros(len(cols.fqns), dtype=np.int64)
    count = np.zeros(len(cols.fqns), dtype=np.int64)
    for i, name in enumerate(cols.fqns):
        t = cols.tensors.get(name)
        if t is not None:
            first[i], count[i] = t[3], t[4]
    index = np.frombuffer(cols.entry_index, dtype=np.int64)
    ok = tensor_item & (index >= 0) & (index < count[fqn_of])
    rows[ok] = first[fqn_of[ok]] + index[ok]
    for e in np.nonzero(tensor_item & ~ok)[0]:  # rare: search by offsets
        e = int(e)
        want = cols.entry_chunk_offsets(e)
        if want is None:
            continue
        f = int(fqn_of[e])
        for r in range(int(first[f]), int(first[f] + count[f])):
            if cols.chunk(r)[0] == want:
                rows[e] = r
                break
    return rows


def _check_volumes(root: str, cols: Any, rows: np.ndarray, fqn_of: np.ndarray,
                   tensor_item: np.ndarray) -> None:
    """At open, without item bytes: each tensor's saved chunks lie inside it and their
    volumes add up to its volume (the exact tiling is checked when the tensor is built)."""
    from ckptlab.plan.metadata import METADATA

    def array(buf: Any, dtype: Any) -> np.ndarray:
        return np.frombuffer(buf, dtype=dtype) if len(buf) else np.empty(0, dtype)

    values = array(cols.chunk_values, np.int64)
    start = array(cols.chunk_start, np.int64)
    ndims = array(cols.chunk_ndim, np.int8)
    nf = len(cols.fqns)
    totals = np.zeros(nf, dtype=np.int64)
    approx = np.zeros(nf, dtype=np.float64)
    overflow: set[int] = set()
    shapes = [cols.tensors[name][2] if name in cols.tensors else None for name in cols.fqns]
    tables: dict[int, np.ndarray] = {}
    n = len(rows)
    # in slices, so the temporaries stay a few MB whatever the number of items
    for lo_e in range(0, n, _SLICE):
        sl = slice(lo_e, min(n, lo_e + _SLICE))
        have = tensor_item[sl] & (rows[sl] >= 0)
        used = rows[sl][have]
        owners = fqn_of[sl][have].astype(np.int64)
        ne = ndims[used].astype(np.int64)
        volume = _volumes(values, start[used], ne)
        np.add.at(totals, owners, volume)
        approx += np.bincount(owners, weights=volume.astype(np.float64), minlength=nf)
        overflow.update(np.unique(owners[volume < 0]).tolist())
        for d in np.unique(ne):  # bounds: offset + size <= the tensor's extent
            d = int(d)
            if d == 0:
                continue
            sel = np.nonzero(ne == d)[0]
            idx = start[used[sel], None] + np.arange(d)[None, :]
            first = values[idx]
            extent = values[idx + d]
            table = tables.get(d)
            if table is None:
                table = tables[d] = np.full((nf, d), -1, dtype=np.int64)
                for f, shape in enumerate(shapes):
                    if shape is not None and len(shape) == d:
                        table[f] = shape
            limit = table[owners[sel]]
            with np.errstate(over="ignore"):
                end = first + extent
            bad = (end > limit) | (end < first) | (limit < 0)
            if bad.any():
                i = int(np.nonzero(bad.any(axis=1))[0][0])
                name = cols.fqns[int(owners[sel][i])]
                raise CorruptArchiveError(
                    "the saved chunks do not tile the tensor: a chunk lies outside it",
                    path=os.path.join(root, METADATA), record=name,
                    expected=f"chunks inside {list(cols.tensors[name][2])}",
                    actual=f"chunk at {first[i].tolist()} of {extent[i].tolist()}")
    overflow.update(np.nonzero(approx > 2.0 ** 62)[0].tolist())
    ids = {name: i for i, name in enumerate(cols.fqns)}
    for name, t in cols.tensors.items():
        shape = t[2]
        want = math.prod(shape)
        f = ids.get(name)
        if f is None:
            got = 0
        elif f in overflow:  # exactly, in Python ints: rare and hostile
            mine = np.nonzero(tensor_item & (rows >= 0) & (fqn_of == f))[0]
            got = sum(math.prod(cols.chunk(int(r))[1]) for r in rows[mine])
        else:
            got = int(totals[f])
        if got != want:
            _volume_error(root, name, shape, got)


def _volume_error(root: str, name: str, shape: tuple[int, ...], got: int) -> None:
    from ckptlab.plan.metadata import METADATA

    raise CorruptArchiveError("the saved chunks do not tile the tensor: their volumes add up "
                              "to another size", path=os.path.join(root, METADATA),
                              record=name, expected=f"{math.prod(shape)} elements "
                              f"({list(shape)})", actual=f"{got} elements")
