"""A real DCP checkpoint directory, read safely: its files and every item in them.

:func:`inspect_dcp` gives a :class:`DcpLayout`: ``.metadata`` (:mod:`ckptlab.dcp.metadata`),
the data files, and every item with its place in its global tensor and in its file, and its
own layout (:mod:`ckptlab.dcp.items`: what an item is in each variant torch's writers produce).

That general path costs about 2 ms an item (the interpreter builds ten objects per item, and
every zip is scanned): 5,000 items took 5 s of CPU. A directory in DCP's default format
(torch.save items, no transforms) is read instead as :func:`ckptlab.open` reads it:
``.metadata`` decoded into typed columns (:mod:`ckptlab.dcp.columns`), and each tensor item's
layout shared with an earlier item whose bytes up to the data are the same
(:class:`~ckptlab.dcp.items.ItemLayouts`); ``DcpLayout.metadata`` is then decoded on first
access. The result is equal to the general path's (``tests/dcp/test_inspect_dcp_fast.py``),
which takes over for anything else and for every error.

A directory ``HuggingFaceStorageWriter(save_distributed=True)`` wrote without consolidating
has no ``.metadata``: :func:`is_dcp_shards_dir` tells it by its file names
(``ckptlab.checkpoint`` opens it).
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
from dataclasses import dataclass
from typing import Any

from ckptlab.dcp.items import (
    ZIP_MAGIC,
    ItemLayouts,
    _inflated_object,
    _pread,
    _safetensors_blob,
    _zstd_frame_end,
    compression_of,
    item_layout,
    sharding_offsets,
)
from ckptlab.dcp.metadata import METADATA, _load_unchanged, load_metadata, read_columns
from ckptlab.errors import ArchiveError, CorruptArchiveError
from ckptlab.format.archive import largest_alignment
from ckptlab.format.layout import ArchiveLayout
from ckptlab.format.safetensors import looks_like_safetensors
from ckptlab.source import LocalTree
from ckptlab.source._paths import open_inside

__all__ = ["SHARD_FILE", "DcpItem", "DcpLayout", "columns_layout", "data_files", "inspect_dcp",
           "is_dcp_shards_dir"]

# torch.distributed.checkpoint._hf_utils.SHARDED_FILE_NAME + SUFFIX
SHARD_FILE = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")


def is_dcp_shards_dir(root: str, names: list[str] | None = None) -> bool:
    """``root`` holds what ``HuggingFaceStorageWriter(save_distributed=True)`` writes without
    consolidating: ``shard-NNNNN-model-NNNNN-of-NNNNN.safetensors`` files (one per rank and
    output file), no ``.metadata`` and no ``*.index.json``. Reads no file (``names``: the
    directory's listing, when the caller has it)."""
    if names is None:
        names = sorted(os.listdir(root))
    shards = [n for n in names if n.endswith(".safetensors")]
    return bool(shards) and all(SHARD_FILE.fullmatch(n) for n in shards) and not any(
        n == METADATA or n.endswith(".index.json") for n in names)


@dataclass(frozen=True, slots=True)
class DcpItem:
    """One stored item: a chunk of a tensor, or a pickled object, in one data file."""

    fqn: str  # fully qualified name in the state dict ("model.layers.0.weight")
    kind: str  # "tensor" or "bytes"
    chunk_offsets: tuple[int, ...]  # where the chunk starts in the global tensor (tensor items)
    chunk_sizes: tuple[int, ...]  # the chunk's shape (tensor items)
    index: int | None  # the chunk's index in the tensor's chunk list
    file: str  # data file relative to the directory ("__0_0.distcp")
    offset: int  # first byte of the item (a torch.save zip, a zstd frame, a safetensors blob)
    nbytes: int  # bytes of the item as stored
    dtype: str | None  # tensor items: the tensor's dtype
    data_offset: int | None  # tensor items: where the chunk's bytes start in the file (None
    #                          when they are compressed)
    layout: ArchiveLayout | None  # the item's own layout, offsets inside the item: its
    #   torch.save zip (of the inflated bytes for a compressed object), or the file's safetensors
    #   blob (shared by the file's tensor items); None for a compressed tensor chunk
    serialization: str = "torch-save"  # "torch-save" (a zip per item) or "safetensors"
    compression: str | None = None  # "zstd" when the stored bytes must be inflated to read
    transforms: tuple[str, ...] = ()  # .metadata's transform_descriptors ("stream.zstd/1")

    @property
    def data_alignment(self) -> int | None:
        """Largest power of two (<= 4096) dividing ``data_offset``: what O_DIRECT / GDS see."""
        return None if self.data_offset is None else largest_alignment([self.data_offset])

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "kind": self.kind, "chunk_offsets": list(self.chunk_offsets),
                "chunk_sizes": list(self.chunk_sizes), "index": self.index, "file": self.file,
                "offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype,
                "data_offset": self.data_offset, "data_alignment": self.data_alignment,
                "serialization": self.serialization, "compression": self.compression,
                "transforms": list(self.transforms)}


@dataclass(frozen=True, slots=True)
class DcpLayout:
    """A DCP checkpoint directory: its metadata, its data files and every item in them."""

    path: str
    metadata: Any  # torch.distributed.checkpoint.metadata.Metadata (read safely)
    metadata_nbytes: int
    files: tuple[tuple[str, int], ...]  # (data file, bytes), sorted by name
    items: tuple[DcpItem, ...]  # in file, then offset order

    format = "dcp"

    @property
    def file_nbytes(self) -> int:
        """Bytes of the checkpoint: metadata plus every data file."""
        return self.metadata_nbytes + sum(n for _, n in self.files)

    @property
    def tensors(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """fqn -> (dtype, global shape, number of chunks) for every tensor in the metadata."""
        out = {}
        for fqn, md in self.metadata.state_dict_metadata.items():
            if hasattr(md, "chunks"):
                out[fqn] = (str(md.properties.dtype).removeprefix("torch."), tuple(md.size),
                            len(md.chunks))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The ``ckptlab inspect DIR --json`` object (DESIGN's schema plus ``items``)."""
        data = [i.data_offset for i in self.items if i.data_offset is not None and
                i.layout is not None and any(s.nbytes for s in i.layout.storages)]
        return {
            "format": "dcp", "path": self.path, "file_nbytes": self.file_nbytes,
            "archive_name": "", "alignment": largest_alignment(data) if data else 4096,
            "zip64": any(i.layout is not None and i.layout.zip64 for i in self.items),
            "metadata_nbytes": self.metadata_nbytes,
            "files": [{"name": n, "nbytes": b} for n, b in self.files],
            "records": [], "storages": [],
            "tensors": [{"path": [fqn], "dtype": dtype, "shape": list(shape), "chunks": n}
                        for fqn, (dtype, shape, n) in self.tensors.items()],
            "items": [i.to_dict() for i in self.items],
        }



def _referenced_files(root: str, referenced: set[str]) -> dict[str, int]:
    """The sizes of the data files ``.metadata`` names, in name order: those the directory
    lists from its listing, the others (a subdirectory's, or missing) one by one, refusing
    names that leave the directory. Other files beside them (Megatron-Core's
    ``metadata.json``, a README) are not data files."""
    listed = data_files(root, [name for name in sorted(os.listdir(root))
                               if name in referenced], listed=True)
    listed.update(data_files(root, sorted(referenced - set(listed))))
    return dict(sorted(listed.items()))


def data_files(root: str, names: list[str], *, listed: bool = False) -> dict[str, int]:
    """Bytes of each file ``names`` gives, relative to ``root``; none may leave ``root``.

    Every name is resolved (:func:`ckptlab.source._paths.resolve_inside`): ``..``, absolute
    names and symlinks out of the directory raise :class:`ArchiveError`, and so does a
    FIFO, device or socket. With ``listed`` (names from ``os.listdir``, not from the
    metadata) such entries and subdirectories are left out instead, and a name that cannot be
    stat'ed is too; a name the metadata gives that does not exist is left out (the caller
    reports the missing file). (:meth:`ckptlab.source.LocalTree.sizes`.)
    """
    return LocalTree(root).sizes(names, listed=listed)


_PENDING = object()
_METADATA_SLOT = DcpLayout.__dict__["metadata"]  # the slot under the property below


class _ColumnarDcpLayout(DcpLayout):
    """A :class:`DcpLayout` built from ``.metadata``'s columns: ``tensors`` comes from the
    columns, and ``metadata`` (DCP's ``Metadata`` object, which the bounded interpreter
    takes about 10x longer to build than the columns) is decoded on first access, from the
    same file (refused if it changed since). Equal to, and pickled as, a plain
    :class:`DcpLayout`."""

    __slots__ = ("_loader", "_tensor_rows")

    def __init__(self, path: str, metadata: Any, metadata_nbytes: int,
                 files: tuple[tuple[str, int], ...], items: tuple[DcpItem, ...], *,
                 tensors: dict[str, tuple[str, tuple[int, ...], int]] | None = None,
                 loader: Any = None) -> None:
        for name, value in (("path", path), ("metadata_nbytes", metadata_nbytes),
                            ("files", files), ("items", items)):
            DcpLayout.__dict__[name].__set__(self, value)
        _METADATA_SLOT.__set__(self, metadata)
        object.__setattr__(self, "_loader", loader)
        object.__setattr__(self, "_tensor_rows", tensors)

    @property  # type: ignore[override]
    def metadata(self) -> Any:
        value = _METADATA_SLOT.__get__(self, type(self))
        if value is _PENDING:
            value = self._loader()
            _METADATA_SLOT.__set__(self, value)
        return value

    @property
    def tensors(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        if self._tensor_rows is not None:
            return dict(self._tensor_rows)
        return DcpLayout.tensors.fget(self)  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DcpLayout):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name)
                   for f in dataclasses.fields(DcpLayout))

    __hash__ = DcpLayout.__hash__

    def __reduce__(self) -> Any:
        return (DcpLayout, (self.path, self.metadata, self.metadata_nbytes, self.files,
                            self.items))


def columns_layout(root: str, cols: Any, metadata_nbytes: int, identity: tuple[int, ...],
                  files: dict[str, int], layouts: ItemLayouts, rows: Any, *,
                  object_layouts: dict[int, ArchiveLayout] | None = None,
                  item_layouts: bool = True, loader: Any = None) -> DcpLayout:
    """The :class:`DcpLayout` of a directory in DCP's default format (torch.save items, no
    transforms, no overlapping items, no duplicate keys: the caller checked) from its
    columns: the same items, in the same order, with the same fields as the general path of
    :func:`inspect_dcp`, each tensor item's layout from ``layouts`` (templates).

    ``rows`` maps each storage entry to its chunk row (-1: none;
    :func:`ckptlab.dcp.columns.chunk_rows`); ``object_layouts`` holds the layouts
    of object entries already scanned (by entry); ``loader`` decodes ``.metadata`` when the
    layout's ``metadata`` is first asked for (default: from ``root``, refused if it changed
    since it had ``identity``). Raises what a damaged item raises.
    """
    fqns, names = cols.fqns, cols.files
    e_fqn, e_file, e_index = cols.entry_fqn, cols.entry_file, cols.entry_index
    e_offset, e_length = cols.entry_offset, cols.entry_length
    tensors = cols.tensors
    known = object_layouts or {}
    items = []
    for e in range(cols.entries):
        fqn = fqns[e_fqn[e]]
        file = names[e_file[e]]
        offset = e_offset[e]
        length = e_length[e]
        if file not in files:
            raise CorruptArchiveError("an item's data file is missing",
                                      path=os.path.join(root, file), record=fqn)
        if offset + length > files[file]:
            raise CorruptArchiveError(
                "an item runs past the end of its data file", path=os.path.join(root, file),
                record=fqn, offset=offset, expected=f"end <= {files[file]}",
                actual=f"end {offset + length}")
        index = e_index[e]
        t = tensors.get(fqn)
        if t is None:
            layout = None
            if item_layouts:
                layout = known.get(e) or layouts.scan(file, fqn, offset, length)
            items.append(DcpItem(fqn, "bytes", (), (), index if index >= 0 else None, file,
                                 offset, length, None, None, layout))
            continue
        row = int(rows[e])
        chunk_offsets, sizes = cols.chunk(row) if row >= 0 else ((), ())
        data_offset = layout = None
        if item_layouts:
            layout = layouts.layout(file, fqn, offset, length, (length, t[0], sizes))
            if layout.storages:
                data_offset = offset + layout.storages[0].data_offset
        items.append(DcpItem(fqn, "tensor", chunk_offsets, sizes,
                             index if index >= 0 else None, file, offset, length, t[0],
                             data_offset, layout))
    items.sort(key=lambda i: (i.file, i.offset))
    return _ColumnarDcpLayout(
        root, _PENDING, metadata_nbytes, tuple(files.items()), tuple(items),
        tensors={fqn: (t[0], t[2], t[4]) for fqn, t in tensors.items()},
        loader=loader or (lambda: _load_unchanged(root, identity)))


def _inspect_columns(path: str, item_layouts: bool) -> DcpLayout | None:
    """:func:`inspect_dcp` through the columns, or None where the general path must decide:
    a ``.metadata`` the columnar decoder does not read, transforms, items that overlap
    (SAFETENSORS), equal storage keys, or anything wrong (the general path then raises its
    own error, or reads an item the fast path does not, such as a safetensors blob)."""
    from ckptlab.dcp.columns import EntryColumns

    read = read_columns(path)
    if read is None:
        return None
    cols, metadata_nbytes, identity = read
    if cols.transforms or not cols.has_storage_data:
        return None
    entries = EntryColumns(cols)
    if entries.order is None:  # overlapping items (SAFETENSORS), equal keys
        return None
    layouts = ItemLayouts(path)
    try:
        files = _referenced_files(path, set(cols.files))
        return columns_layout(path, cols, metadata_nbytes, identity, files, layouts,
                             entries.rows, item_layouts=item_layouts)
    except (ArchiveError, OSError):
        return None
    finally:
        layouts.close()


def inspect_dcp(path: str | os.PathLike[str], *, item_layouts: bool = True,
                fast: bool = True) -> DcpLayout:
    """The layout of a DCP checkpoint directory, read without executing its pickle.

    Parameters
    ----------
    path
        The directory ``dcp.save`` wrote (``.metadata`` plus ``*.distcp`` files).
    item_layouts
        Also read each item's own layout (its torch.save headers, pickle and central directory,
        or its file's safetensors header; never the tensor bytes). Without it nothing but
        ``.metadata`` is read, and every item is taken for a torch.save zip.
    fast
        Read a directory in DCP's default format (torch.save items, no transforms) the way
        :func:`ckptlab.open` does: ``.metadata`` decoded into columns, never into one object
        per item, and each tensor item's layout shared with an earlier item whose bytes up to
        the data are the same but for the data's CRC-32 (only items that differ are scanned
        in full; the bytes after a shared item's data are not read). The result is equal to
        the general path's (``fast=False``: every item scanned, ``.metadata`` decoded by the
        bounded interpreter), which takes over for every other directory and for any error.
        ``metadata`` is then decoded on first access.

    Returns
    -------
    DcpLayout
        Items sorted by file and offset; tensor items carry their chunk's offsets and sizes in
        the global tensor and the absolute file offset of their bytes (see
        :mod:`ckptlab.dcp.items` for the SAFETENSORS serialization and compressed items).
    """
    path = os.fspath(path)
    if fast:
        quick = _inspect_columns(path, item_layouts)
        if quick is not None:
            return quick
    meta = load_metadata(path)
    metadata_nbytes = data_files(path, [METADATA])[METADATA]
    entries = []
    handles: dict[str, io.BufferedReader] = {}

    def handle(file: str) -> io.BufferedReader:
        if file not in handles:
            handles[file] = open_inside(path, file)  # inside the directory, regular
        return handles[file]

    try:
        files = _referenced_files(
            path, {str(info.relative_path) for info in meta.storage_data.values()})
        for index, info in meta.storage_data.items():
            file = str(info.relative_path)
            if file not in files:
                raise CorruptArchiveError("an item's data file is missing",
                                          path=os.path.join(path, file), record=index.fqn)
            if info.offset < 0 or info.length < 0 or info.offset + info.length > files[file]:
                raise CorruptArchiveError(
                    "an item runs past the end of its data file", path=os.path.join(path, file),
                    record=index.fqn, offset=info.offset,
                    expected=f"end <= {files[file]}", actual=f"end {info.offset + info.length}")
            md = meta.state_dict_metadata.get(index.fqn)
            is_tensor = md is not None and hasattr(md, "chunks")
            chunk = None
            if is_tensor:
                chunk = (md.chunks[index.index] if index.index is not None
                         and index.index < len(md.chunks) else None)
                if chunk is None:
                    chunk = next((c for c in md.chunks if index.offset is not None
                                  and tuple(c.offsets) == tuple(index.offset)), None)
            transforms = tuple(getattr(info, "transform_descriptors", None) or ())
            entries.append((index, info, file, md if is_tensor else None, chunk, transforms))
        # which tensor items are in a safetensors blob, and where each file's blob starts
        serialization: dict[int, str] = {}
        blob_start: dict[str, int] = {}
        for n, (_, info, file, md, _, transforms) in enumerate(entries):
            if md is None or not item_layouts:
                continue
            if not transforms:
                head = _pread(handle(file), info.offset, 9)
                if head[:4] != ZIP_MAGIC and looks_like_safetensors(head,
                                                                    files[file] - info.offset):
                    serialization[n] = "safetensors"
                    blob_start[file] = max(blob_start.get(file, 0), info.offset)
            elif compression_of(transforms) is not None:
                end = _zstd_frame_end(handle(file), info.offset)
                if end is not None:  # an empty frame: the chunk is in the blob after it
                    serialization[n] = "safetensors"
                    blob_start[file] = max(blob_start.get(file, 0), end)
        blobs: dict[str, ArchiveLayout] = {}
        for file, start in blob_start.items():
            full = os.path.join(path, file)
            try:
                blob = _safetensors_blob(handle(file), file, start, files[file])
            except ArchiveError as exc:
                raise CorruptArchiveError(f"the file's safetensors blob is damaged: {exc}",
                                          path=full, offset=start) from None
            if blob is None:
                raise CorruptArchiveError("no safetensors blob where the file's tensor items "
                                          "end", path=full, offset=start)
            blobs[file] = blob
        items = []
        for n, (index, info, file, md, chunk, transforms) in enumerate(entries):
            full = os.path.join(path, file)
            compression = compression_of(transforms)
            dtype = str(md.properties.dtype).removeprefix("torch.") if md is not None else None
            item = DcpItem(
                fqn=index.fqn, kind="tensor" if md is not None else "bytes",
                chunk_offsets=tuple(chunk.offsets) if chunk is not None else (),
                chunk_sizes=tuple(chunk.sizes) if chunk is not None else (),
                index=index.index, file=file, offset=info.offset, nbytes=info.length,
                dtype=dtype, data_offset=None, layout=None, compression=compression,
                transforms=transforms)
            if not item_layouts:
                pass
            elif serialization.get(n) == "safetensors":
                item = _blob_item(item, blobs[file], blob_start[file], full)
            elif compression is not None:
                if md is None:  # an object: inflate it (bounded) to show its value
                    item = dataclasses.replace(item, layout=_inflated_object(
                        _pread(handle(file), info.offset, info.length), compression, full,
                        index.fqn, info.offset))
            else:
                try:
                    layout = item_layout(handle(file), file, info.offset, info.length)
                except ArchiveError as exc:
                    raise CorruptArchiveError(
                        f"item is not a torch.save archive: {exc}", path=full,
                        record=index.fqn, offset=info.offset) from None
                data_offset = info.offset + layout.storages[0].data_offset \
                    if md is not None and layout.storages else None
                item = dataclasses.replace(item, layout=layout, data_offset=data_offset)
            items.append(item)
    finally:
        for f in handles.values():
            f.close()
    items.sort(key=lambda i: (i.file, i.offset))
    return DcpLayout(path, meta, metadata_nbytes, tuple(files.items()), tuple(items))


def _blob_item(item: DcpItem, blob: ArchiveLayout, start: int, full: str) -> DcpItem:
    """A tensor item of the SAFETENSORS serialization: the file's blob, checked against the
    chunk ``.metadata`` lists (torch keys the blob by fqn, so a second chunk of one fqn in one
    file overwrote the first: that shows here as a mismatch)."""
    where = {"path": full, "record": item.fqn, "offset": start}
    storage = next((s for s in blob.storages if s.key == item.fqn), None)
    tensor = next((t for t in blob.tensors if t.storage_key == item.fqn), None)
    if storage is None or tensor is None:
        raise CorruptArchiveError("the file's safetensors blob has no tensor of this name",
                                  **where)
    saved = sharding_offsets(blob).get(item.fqn)
    if tensor.dtype != item.dtype or tuple(tensor.shape) != item.chunk_sizes or (
            saved is not None and saved != item.chunk_offsets):
        raise CorruptArchiveError(
            "the safetensors blob holds another chunk than .metadata lists",
            expected=f"{item.dtype} {list(item.chunk_sizes)} at {list(item.chunk_offsets)}",
            actual=f"{tensor.dtype} {list(tensor.shape)} at "
                   f"{list(saved) if saved is not None else '?'}", **where)
    if item.nbytes != storage.nbytes:
        raise CorruptArchiveError("the item's length is not its chunk's bytes",
                                  expected=f"{storage.nbytes} bytes",
                                  actual=f"{item.nbytes} bytes", **where)
    return dataclasses.replace(item, offset=start, nbytes=blob.file_nbytes,
                               data_offset=start + storage.data_offset, layout=blob,
                               serialization="safetensors", compression=None)

