"""DCP directories as a :class:`~ckptlab.checkpoint.Checkpoint`: one tensor per fqn, one part
per saved chunk, the non-tensor items as values, and every data file tiled by its items.

Every variant torch 2.13's writers produce opens here (the directories are read by
:mod:`ckptlab.dcp`, and the byte layouts described in :mod:`ckptlab.dcp.items`):

- ``FileSystemWriter`` with torch.save items (the default): a part is the chunk's bytes inside
  its item's zip.
- ``serialization_format=SAFETENSORS``: a part is the chunk's bytes inside the data file's
  safetensors blob.
- ``_extensions=[ZStandard()]``: a part is the item's stored zstd frame (``compression="zstd"``,
  ``offset``/``nbytes`` = the stored bytes, ``stored_nbytes`` the same count); ``read``
  inflates it, never past the chunk's bytes plus the torch.save framing.
- ``HuggingFaceStorageWriter(save_distributed=True)`` without consolidation: ``shard-*``
  safetensors files and no ``.metadata`` (:func:`ckptlab.dcp.is_dcp_shards_dir`); each file's
  ``DCP_SHARDING_INFO`` places its tensors in the global ones (:func:`open_dcp_shards`). With
  an index (rank-0 saves, consolidated saves) the directory is plain Hugging Face
  safetensors, which :mod:`ckptlab.checkpoint.open` reads.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ckptlab.checkpoint.model import (
    Checkpoint,
    FileEntry,
    Part,
    TensorEntry,
    contiguous_strides,
    file_segments_or_unknown,
    span_nbytes,
)
from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format.layout import Segment, SegmentKind
from ckptlab.source import LocalTree, Tree

__all__ = ["dcp_files", "open_dcp", "open_dcp_shards"]


def _path_of(meta: Any, fqn: str) -> tuple[Any, ...]:
    """The state-dict path DCP flattened into ``fqn`` (``planner_data``), else ``(fqn,)``."""
    mapping = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    path = mapping.get(fqn)
    if isinstance(path, (tuple, list)) and path and all(isinstance(k, (str, int)) for k in path):
        return tuple(path)
    return (fqn,)


def dcp_files(layout: Any, root: str) -> tuple[FileEntry, ...]:
    """``.metadata`` and every data file, each tiled by its items' own segments (a file's
    safetensors blob once, however many tensor items it holds; a compressed item as one run
    of stored bytes)."""
    from ckptlab.dcp import METADATA

    files = [FileEntry(METADATA, "dcp-metadata", layout.metadata_nbytes,
                       (Segment(SegmentKind.HEADER, 0, layout.metadata_nbytes, METADATA),)
                       if layout.metadata_nbytes else (), None, os.path.join(root, METADATA))]
    by_file: dict[str, list[Any]] = {}
    for item in layout.items:
        by_file.setdefault(item.file, []).append(item)
    for name, nbytes in layout.files:
        segments: list[Segment] = []
        cursor = 0
        blob_end = -1
        for item in sorted(by_file.get(name, ()), key=lambda i: i.offset):
            if item.serialization == "safetensors" and item.offset + item.nbytes == blob_end:
                continue  # the blob another tensor item of this file laid out already
            if item.offset > cursor:
                segments.append(Segment(SegmentKind.UNKNOWN, cursor, item.offset - cursor))
            if item.serialization == "safetensors" and item.layout is not None:
                segments.extend(dataclasses.replace(s, offset=item.offset + s.offset)
                                for s in item.layout.segments)
                blob_end = item.offset + item.nbytes
            elif item.compression is not None:
                if item.nbytes:
                    segments.append(Segment(SegmentKind.DATA, item.offset, item.nbytes,
                                            f"{item.fqn} ({item.compression})"))
            elif item.layout is not None:
                segments.extend(dataclasses.replace(s, offset=item.offset + s.offset,
                                                    record=f"{item.fqn}:{s.record}"
                                                    if s.record else item.fqn)
                                for s in item.layout.segments)
            elif item.nbytes:
                segments.append(Segment(SegmentKind.DATA, item.offset, item.nbytes, item.fqn))
            cursor = max(cursor, item.offset + item.nbytes)
        if cursor < nbytes:
            segments.append(Segment(SegmentKind.UNKNOWN, cursor, nbytes - cursor))
        files.append(FileEntry(name, "distcp", nbytes, tuple(segments), None,
                               os.path.join(root, name)))
    return tuple(files)


def _chunk_part(item: Any) -> Part:
    """The part of one saved chunk: where its bytes are, as stored."""
    dtype = item.dtype or "uint8"
    itemsize = DTYPE_ITEMSIZE.get(dtype, 1)
    shape = item.chunk_sizes
    stride = contiguous_strides(shape)
    common = {"storage_key": item.fqn, "chunk_offsets": item.chunk_offsets,
              "item_offset": item.offset}
    if item.compression is not None:  # the stored frame; read() inflates it
        return Part("chunk", item.file, item.offset, item.nbytes, dtype, shape, stride,
                    compression=item.compression, stored_nbytes=item.nbytes, **common)
    offset = item.data_offset if item.data_offset is not None else item.offset
    if item.serialization == "torch-save" and item.layout is not None and item.layout.tensors:
        info = item.layout.tensors[0]
        stride = info.stride
        if item.data_offset is not None:
            offset = item.data_offset + info.storage_offset * itemsize
    return Part("chunk", item.file, offset, span_nbytes(shape, stride, itemsize), dtype, shape,
                stride, **common)


def _check_tiling(fqn: str, shape: tuple[int, ...], parts: list[Part], path: str) -> None:
    """The chunks must tile the tensor (in bounds, no overlap, no gap): what torch's planner
    checks before it saves. Anything else would read as uninitialised memory."""
    from ckptlab.plan.reshard import Chunk
    from ckptlab.plan.validate import validate_chunks

    chunks = [Chunk(tuple(p.chunk_offsets or ()), tuple(p.shape)) for p in parts]
    problems = validate_chunks(fqn, shape, chunks)
    if problems:
        raise CorruptArchiveError(f"the saved chunks do not tile the tensor: {problems[0]}",
                                  path=path, record=fqn, expected=f"chunks tiling {list(shape)}",
                                  actual=f"{len(parts)} chunks")


def open_dcp(tree: Tree | str, *, fast: bool = True) -> Checkpoint:
    """A DCP directory (any of the variants in the module docstring; a
    :class:`~ckptlab.source.Tree` or a local path) as a checkpoint.

    With ``fast`` (the default) a directory in DCP's default format opens from its
    ``.metadata`` alone and its tensors are built on first access
    (:mod:`ckptlab.checkpoint._dcp_fast`); every other one, and ``fast=False``, reads every
    item at open, which gives an equal checkpoint (behind a URL, from a temporary copy of
    ``.metadata`` and the data files it names, each moved whole in one request; the layout
    is kept on the ``.metadata`` file's entry, the files being gone).
    """
    from ckptlab.checkpoint._dcp_fast import open_fast
    from ckptlab.checkpoint.open import _reader
    from ckptlab.dcp import METADATA, inspect_dcp, metadata_of

    tree = tree if isinstance(tree, Tree) else LocalTree(tree)
    again = None
    if fast:
        quick, again = open_fast(tree)
        if quick is not None:
            return quick

    def wanted() -> tuple[dict[str, bytes], list[str]]:
        raw = again() if again is not None else tree.read_bytes(METADATA)[1]
        meta = metadata_of(raw, tree.name_of(METADATA))
        return {METADATA: raw}, sorted({str(info.relative_path)
                                        for info in meta.storage_data.values()})

    with tree.on_disk(wanted) as root:
        layout = inspect_dcp(root)
        tensors, objects, notes = _model(layout, root)
        files = dcp_files(layout, root)  # everything read before a copy goes
    layout = dataclasses.replace(layout, path=tree.name)
    files = tuple(dataclasses.replace(f, full_path=tree.name_of(f.path),
                                      layout=layout if f.path == METADATA else f.layout)
                  for f in files)
    return Checkpoint("dcp", tree.name, files, tensors, objects, _reader(tree), notes)


# who adds which attribute to DCP's Metadata, for the notes
_WRITERS = {"all_local_plans": " (Megatron-Core keeps its planners' local plans there)"}


def added_fields(record: Any) -> list[str]:
    """The attributes of a DCP record beyond its dataclass fields (what a writer added, as
    Megatron-Core adds ``all_local_plans`` to ``Metadata``), in the order written."""
    known = {f.name for f in dataclasses.fields(record)}
    return [name for name in getattr(record, "__dict__", {}) if name not in known]


def _model(layout: Any, root: str) -> tuple[dict[str, TensorEntry], dict[str, Any],
                                            tuple[str, ...]]:
    """The tensors, values and notes of a directory's :class:`~ckptlab.dcp.DcpLayout`."""
    from ckptlab.dcp import METADATA

    meta = layout.metadata
    chunks: dict[str, list[Part]] = {}
    objects: dict[str, Any] = {}
    notes = [f"{METADATA}: Metadata.{name} is an attribute its writer added beyond DCP's "
             f"fields{_WRITERS.get(name, '')}: kept as an inert value (layout.metadata), "
             "nothing in it built or run" for name in added_fields(meta)]
    for item in layout.items:
        if item.kind == "bytes":
            values = item.layout.objects if item.layout is not None else ()
            if values and values[0][0] == ():
                objects[item.fqn] = values[0][1]
            elif item.layout is not None:
                objects[item.fqn] = {"type": "pickled object", "nbytes": item.nbytes}
            else:
                objects[item.fqn] = {"type": "transformed object", "nbytes": item.nbytes,
                                     "transforms": list(item.transforms)}
                notes.append(f"{item.fqn}: an object stored through {item.compression!r}, "
                             "which ckptlab cannot undo here; its value is not shown")
            continue
        chunks.setdefault(item.fqn, []).append(_chunk_part(item))
    tensors: dict[str, TensorEntry] = {}
    for fqn, md in meta.state_dict_metadata.items():
        if not hasattr(md, "chunks"):
            continue
        dtype = str(md.properties.dtype).removeprefix("torch.")
        shape = tuple(md.size)
        parts = sorted(chunks.get(fqn, ()), key=lambda p: p.chunk_offsets or ())
        _check_tiling(fqn, shape, parts, os.path.join(root, METADATA))
        tensors[fqn] = TensorEntry(fqn, _path_of(meta, fqn), dtype, shape,
                                   contiguous_strides(shape), "dense", tuple(parts),
                                   requires_grad=bool(md.properties.requires_grad))
    return tensors, objects, tuple(notes)


# -- HuggingFaceStorageWriter(save_distributed=True), not consolidated -------------------------
def open_dcp_shards(tree: Tree | str) -> Checkpoint:
    """A directory of DCP-written safetensors shards (see :func:`ckptlab.dcp.is_dcp_shards_dir`)
    as one checkpoint of format ``"hf"``: each global tensor is made of the chunks the shards hold,
    placed by each file's ``__metadata__["DCP_SHARDING_INFO"]`` ``saved_offsets`` (all zeros
    where a file has none) and sized as ``HuggingFaceStorageReader`` sizes it: the largest
    ``offset + size`` in each dimension.

    Raises
    ------
    ArchiveError
        A damaged shard, sharding info that does not fit its tensor, one name saved with two
        dtypes, or chunks that do not tile the tensor.
    """
    from ckptlab.checkpoint.open import _reader
    from ckptlab.dcp.items import sharding_offsets
    from ckptlab.format.safetensors import scan_safetensors

    tree = tree if isinstance(tree, Tree) else LocalTree(tree)
    root = tree.name
    files: list[FileEntry] = []
    chunks: dict[str, list[Part]] = {}
    for rel in tree.list() or ():  # (a directory that cannot be listed has no shards found)
        full = tree.resolve(rel)  # refuses links out of the directory
        if not rel.endswith(".safetensors"):
            nbytes = tree.nbytes(rel)
            files.append(FileEntry(rel, "other", nbytes, file_segments_or_unknown(nbytes, None),
                                   None, full))
            continue
        with tree.source(rel) as src:
            layout = scan_safetensors(src)
        try:
            saved = sharding_offsets(layout)
        except ArchiveError as exc:
            raise CorruptArchiveError(exc.reason, path=full, record=exc.record,
                                      offset=exc.offset) from None
        files.append(FileEntry(rel, "safetensors", layout.file_nbytes, layout.segments, layout,
                               full))
        storages = {s.key: s for s in layout.storages}
        for t in layout.tensors:
            s = storages[t.storage_key]
            offsets = saved.get(t.storage_key, (0,) * len(t.shape))
            if len(offsets) != len(t.shape):
                raise CorruptArchiveError("saved_offsets do not match the tensor's dimensions",
                                          path=full, record=t.storage_key, offset=8,
                                          expected=f"{len(t.shape)} offsets",
                                          actual=f"{len(offsets)}")
            chunks.setdefault(t.storage_key, []).append(Part(
                "chunk", rel, s.data_offset, s.nbytes, t.dtype, t.shape, t.stride,
                storage_key=t.storage_key, chunk_offsets=offsets))
    if not chunks:
        raise UnsupportedFormatError("a directory of DCP safetensors shards without tensors",
                                     path=root)
    tensors: dict[str, TensorEntry] = {}
    for fqn, parts in chunks.items():
        dtypes = {p.dtype for p in parts}
        if len(dtypes) != 1:
            raise CorruptArchiveError("the shards save this tensor with different dtypes",
                                      path=root, record=fqn, expected="one dtype",
                                      actual=", ".join(sorted(dtypes)))
        rank = len(parts[0].shape)
        if any(len(p.shape) != rank for p in parts):
            raise CorruptArchiveError("the shards save this tensor with different ranks",
                                      path=root, record=fqn)
        shape = tuple(max(o + n for p in parts for o, n in
                          [(p.chunk_offsets[d], p.shape[d])]) for d in range(rank))
        parts.sort(key=lambda p: p.chunk_offsets or ())
        _check_tiling(fqn, shape, parts, root)
        tensors[fqn] = TensorEntry(fqn, (fqn,), parts[0].dtype, shape, contiguous_strides(shape),
                                   "dense", tuple(parts))
    return Checkpoint("hf", root, tuple(files), tensors, {}, _reader(tree))
