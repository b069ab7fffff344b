"""Opening a DCP directory at the speed of its ``.metadata``: the common case, lazily.

:func:`ckptlab.checkpoint._dcp.open_dcp` used to read every item's torch.save zip (headers,
pickle, central directory) before it returned: about 2 ms an item, 10 s for 5,000 items, and
a 1,000,000-item checkpoint never opened. Here, for directories ``FileSystemWriter`` writes by
default (torch.save items back to back in each data file, no transforms):

- ``.metadata`` is read once and decoded into columns
  (:func:`ckptlab.dcp.columns.decode_columns`), never into one object per item;
- at open, only what needs no item bytes is checked: every data file exists and holds its
  items, items do not overlap, each tensor's saved chunks lie inside it and their volumes add
  up to it;
- a tensor's :class:`~ckptlab.checkpoint.TensorEntry` is built when it is first asked for:
  each of its items is read up to its data (one ``pread``), and when those bytes equal the
  ones of an item already scanned (same length, dtype and chunk shape: the *template*) except
  for the data record's CRC, the template's layout is the item's; otherwise the item is
  scanned in full, as before. Chunk tiling is then checked exactly, as before. (The
  templates are :class:`ckptlab.dcp.items.ItemLayouts`, which ``inspect_dcp`` uses too.)
- a data file's segments are built when they are first used, from the same item layouts;
- :meth:`DcpCheckpoint.dcp_layout` gives the directory's ``DcpLayout`` (what
  ``ckptlab inspect DIR --json`` prints) from the same columns and item layouts, equal to
  :func:`ckptlab.dcp.inspect_dcp`'s.

The directory is a :class:`~ckptlab.source.Tree`: a local one, or one behind a URL, read
by the same code. Behind a URL each read is a request: ``.metadata`` is one, each data file's
head one (its size and object items), and the item reads read ahead over the neighbouring
items' heads (:class:`~ckptlab.dcp.items.ItemLayouts`): a directory opens in ``1 + files``
requests whatever the size of its tensors.

Anything else (SAFETENSORS serialization, zstd transforms, a ``.metadata`` the columnar
decoder does not read) returns None and takes the general path (which reads a URL's files
from a temporary copy). The two give equal checkpoints
(``tests/checkpoint/test_dcp_fast.py``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ckptlab.checkpoint.model import (
    Checkpoint,
    FileEntry,
    Part,
    Scratch,
    TensorEntry,
    contiguous_strides,
    span_nbytes,
)
from ckptlab.dcp.columns import EntryColumns
from ckptlab.dcp.items import (
    MAX_HANDLES,
    ItemLayouts,
    head_nbytes,
    item_spans,
    raw_items,
)
from ckptlab.errors import ArchiveError, CorruptArchiveError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format.layout import ArchiveLayout, Segment, SegmentKind
from ckptlab.source import LocalTree, NotFoundError, Tree

__all__ = ["DcpCheckpoint", "open_columns", "open_dcp_fast", "open_fast"]

_SLICE = 1 << 16  # entries per slice of the open-time checks


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
    segments are built on first access (``tensors`` is a read-only mapping).

    ``read(name)`` costs one read (behind a URL: one request) per part: a tensor whose entry
    is not built yet has each of its items read whole (header, data, directory: one read
    each), its entry built from those bytes and its data taken from them; a tensor built
    already has each part's data read."""

    def __init__(self, dcp: _Dcp, files: tuple[FileEntry, ...], objects: dict[str, Any],
                 reader: Any) -> None:
        super().__init__("dcp", dcp.root, files, {}, objects, reader, ())
        self.tensors = _Tensors(dcp)  # type: ignore[assignment]
        self._dcp = dcp

    def read(self, name: str, *, scratch: Scratch | None = None) -> Any:
        dcp = self._dcp
        if name not in dcp.cols.tensors or name in self.tensors._built:  # type: ignore
            return super().read(name, scratch=scratch)
        # each item read whole (outside the lock: threads read at once), kept while the
        # entry is built from those bytes, the tensor's data taken from them
        cols, items = dcp.cols, dcp.items
        moved: dict[str, list[tuple[int, bytes]]] = {}
        for e in dcp.by_fqn.get(dcp.fqn_ids.get(name, -1), ()):
            file = cols.files[cols.entry_file[e]]
            lo = int(cols.entry_offset[e])
            data = items.tree.fetch(self.file(file).full_path, lo,
                                    lo + int(cols.entry_length[e]))
            moved.setdefault(file, []).append((lo, data))
        with items.lock:
            for file, pieces in moved.items():
                for lo, data in pieces:
                    items.source(file).keep(lo, data)
            try:
                entry = self.tensors[name]
            finally:
                for file, pieces in moved.items():
                    for lo, data in pieces:
                        items.source(file).forget(lo, lo + len(data))
        return self._reader(self, entry, moved)

    def dcp_layout(self) -> Any:
        """The :class:`~ckptlab.dcp.DcpLayout` of the directory, equal to
        :func:`ckptlab.dcp.inspect_dcp`'s, from this checkpoint's columns and the item
        layouts its tensors already read (``ckptlab inspect DIR --json`` uses it). The item
        layouts not read yet are read in file order (behind a URL, each read-ahead request
        then serves the items after it)."""
        dcp = self._dcp
        if dcp._layout is None:
            dcp.read_layouts()
        return dcp.layout()


class _Dcp:
    """The columns of one directory and what is derived from them on demand."""

    def __init__(self, root: str, cols: Any, files: dict[str, int],
                 items: ItemLayouts | None = None) -> None:
        self.root = root
        self.cols = cols
        self.files = files
        self.items = items if items is not None else ItemLayouts(root)
        self.metadata_loader: Any = None  # decodes .metadata (default: from root)
        self.by_fqn: dict[int, np.ndarray] = {}  # fqn id -> entries (tensor items)
        self.rows: np.ndarray = np.empty(0, np.int64)  # entry -> chunk row (-1: none)
        self.order: np.ndarray = np.empty(0, np.int64)  # entries in file, offset order
        self.file_of: np.ndarray = np.empty(0, np.int32)  # entry -> file id
        self.fqn_ids = {name: i for i, name in enumerate(cols.fqns)}
        self.object_layouts: dict[int, ArchiveLayout] = {}  # entry -> its zip's layout
        self.metadata_nbytes = 0
        self.identity: tuple[int, ...] = ()  # .metadata's (device, inode, size, mtime)
        self._layout: Any = None

    def layout(self) -> Any:
        """The directory's DcpLayout (:func:`ckptlab.dcp.layout.columns_layout`)."""
        if self._layout is None:
            from ckptlab.dcp.layout import columns_layout

            self._layout = columns_layout(self.root, self.cols, self.metadata_nbytes,
                                          self.identity, self.files, self.items, self.rows,
                                          object_layouts=self.object_layouts,
                                          loader=self.metadata_loader)
        return self._layout

    def read_layouts(self) -> None:
        """Every tensor item's layout, read in file order."""
        cols = self.cols
        for e in self.order:
            e = int(e)
            fqn = cols.fqns[cols.entry_fqn[e]]
            t = cols.tensors.get(fqn)
            if t is not None:
                length = cols.entry_length[e]
                self.items.layout(cols.files[cols.entry_file[e]], fqn, cols.entry_offset[e],
                                  length, (length, t[0], self.chunk_of(e)[1]))

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
        from ckptlab.dcp import METADATA

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


def open_dcp_fast(tree: Tree | str) -> Checkpoint | None:
    """The checkpoint of a default-format DCP directory (a :class:`~ckptlab.source.Tree`, or
    a local path), or None for the general path (see the module docstring).

    Raises
    ------
    CorruptArchiveError
        A data file that is missing or shorter than its items, items that overlap, chunks
        outside their tensor or whose volumes do not add up to it; on access, what the general
        path raises for a damaged item.
    """
    return open_fast(tree if isinstance(tree, Tree) else LocalTree(tree))[0]


def open_fast(tree: Tree) -> tuple[DcpCheckpoint | None, Callable[[], bytes] | None]:
    """:func:`open_dcp_fast`, and a way to have ``.metadata``'s bytes again for the general
    path (None where they could not be read: the general path reads them and says why).

    What is read: ``.metadata`` (behind a URL one request), the sizes of the data files, and
    of each data file the listing does not give its head (:func:`ckptlab.dcp.items.
    head_nbytes`: the object items and the first tensor item's magic; behind a URL one
    request each, which gives the size too). A directory whose items are raw chunks
    (SAFETENSORS) goes to the general path before any data file is read."""
    from ckptlab.checkpoint.open import _reader
    from ckptlab.dcp import METADATA, metadata_of
    from ckptlab.dcp.columns import decode_columns
    from ckptlab.dcp.metadata import MAX_METADATA_NBYTES

    again = None
    try:
        with tree.mapped(METADATA, MAX_METADATA_NBYTES) as (data, identity):
            again = tree.again(METADATA, data, identity)
            metadata_nbytes = len(data)
            cols = decode_columns(data)
    except NotFoundError:  # the caller says no such directory (a probe that missed)
        raise
    except (OSError, ValueError, ArchiveError):  # the general path says what is wrong
        return None, again
    if cols is None or cols.transforms or not cols.has_storage_data:
        return None, again
    entries = EntryColumns(cols)
    if raw_items(cols, entries):
        return None, again  # decided before any data file is read
    heads = head_nbytes(cols, entries)
    for name in cols.files:
        tree.name_of(name)  # a URL refuses names leaving the directory before any request
    named = set(cols.files)  # the data files; the directory's other files are the caller's
    files = {name: nbytes for name, nbytes in tree.sizes(None, listed=True).items()
             if name in named}  # (sizes of every regular file listed; none behind a URL)
    items = ItemLayouts(tree, spans=lambda: item_spans(cols, entries))
    try:
        for fid in sorted(range(len(cols.files)), key=cols.files.__getitem__):
            name = cols.files[fid]
            if name not in files:
                try:
                    files[name] = items.source(name, head=int(heads[fid])).nbytes
                except NotFoundError:
                    continue  # the open says which item's file is missing
        meta_path = tree.name_of(METADATA)
        ck = open_columns(tree.name, cols, files, items, metadata_nbytes=metadata_nbytes,
                          identity=identity, reader=_reader(tree), full_path=tree.name_of,
                          metadata_loader=lambda: metadata_of(again(), meta_path),
                          entries=entries)
        if ck is None:
            items.close()
            return None, again
        items.forget()  # the heads read at open did their work (object items are scanned)
        if len(files) <= MAX_HANDLES:
            # open every data file now (a few): later reads do not depend on the directory
            # staying where it is
            for name in files:
                items.source(name)
    except BaseException:
        items.close()
        raise
    return ck, again


def open_columns(root: str, cols: Any, files: dict[str, int], items: ItemLayouts, *,
                 metadata_nbytes: int, identity: tuple[int, ...], reader: Any,
                 full_path: Any, metadata_loader: Any = None,
                 entries: EntryColumns | None = None) -> DcpCheckpoint | None:
    """The lazy checkpoint of a directory from its ``.metadata`` columns (default format, no
    transforms: the caller checked), its data files' sizes (``files``) and the reader of
    their items' bytes (``items``: local files, or URLs); None where the general path must
    decide (overlapping items, equal keys, a SAFETENSORS blob).

    ``full_path(name)`` is a file's ``FileEntry.full_path``; ``metadata_loader`` decodes
    ``.metadata`` for :meth:`DcpCheckpoint.dcp_layout` (default: from ``root``); ``entries``
    the columns' arrays, when the caller has them already. The object items are scanned
    here, through ``items``.
    """
    from ckptlab.dcp import METADATA

    n = cols.entries
    entries = entries if entries is not None else EntryColumns(cols)
    file_of, offset, length = entries.file_of, entries.offset, entries.length
    fqn_of, tensor_item = entries.fqn_of, entries.tensor_item
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
    order = entries.order
    if order is None:
        return None
    dcp = _Dcp(root, cols, files, items)
    dcp.metadata_nbytes = metadata_nbytes
    dcp.identity = identity
    dcp.metadata_loader = metadata_loader
    dcp.order = order
    dcp.file_of = file_of
    objects: dict[str, Any] = {}
    try:  # the data files opened from here on are closed if this does not return them
        if items.blob_first(entries):
            items.close()
            return None
        dcp.rows = entries.rows
        _check_volumes(root, entries)
        tensor_entries = np.nonzero(tensor_item)[0]
        if len(tensor_entries):
            by = fqn_of[tensor_entries]
            sort = np.argsort(by, kind="stable")
            keys, starts = np.unique(by[sort], return_index=True)
            groups = np.split(tensor_entries[sort], starts[1:])
            dcp.by_fqn = {int(k): g for k, g in zip(keys, groups)}
        # object items: read now (their values are shown), as the general path does
        for e in np.nonzero(~tensor_item)[0]:
            e = int(e)
            fqn = cols.fqns[fqn_of[e]]
            layout = items.scan(cols.files[file_of[e]], fqn, int(offset[e]), int(length[e]))
            dcp.object_layouts[e] = layout
            values = layout.objects
            objects[fqn] = values[0][1] if values and values[0][0] == () else {
                "type": "pickled object", "nbytes": int(length[e])}
    except BaseException:
        items.close()
        raise
    entries = [FileEntry(METADATA, "dcp-metadata", metadata_nbytes,
                         (Segment(SegmentKind.HEADER, 0, metadata_nbytes, METADATA),)
                         if metadata_nbytes else (), None, full_path(METADATA))]
    for name, nbytes in files.items():
        entries.append(FileEntry(name, "distcp", nbytes,
                                 _Segments(dcp, name, nbytes),  # type: ignore[arg-type]
                                 None, full_path(name)))
    return DcpCheckpoint(dcp, tuple(entries), objects, reader)


def _check_volumes(root: str, entries: EntryColumns) -> None:
    """At open, without item bytes: each tensor's saved chunks lie inside it and their
    volumes add up to its volume (the exact tiling is checked when the tensor is built)."""
    from ckptlab.dcp import METADATA

    cols, rows, fqn_of, tensor_item = entries.cols, entries.rows, entries.fqn_of, \
        entries.tensor_item
    volumes = entries.volumes

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
        volume = volumes[sl][have]
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
    from ckptlab.dcp import METADATA

    raise CorruptArchiveError("the saved chunks do not tile the tensor: their volumes add up "
                              "to another size", path=os.path.join(root, METADATA),
                              record=name, expected=f"{math.prod(shape)} elements "
                              f"({list(shape)})", actual=f"{got} elements")
