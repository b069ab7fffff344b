"""DCP directories as a :class:`~ckptlab.checkpoint.Checkpoint`: one tensor per fqn, one part
per saved chunk, the non-tensor items as values, and every data file tiled by its items."""

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
    span_nbytes,
)
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format.layout import Segment, SegmentKind

__all__ = ["dcp_files", "open_dcp"]


def _path_of(meta: Any, fqn: str) -> tuple[Any, ...]:
    """The state-dict path DCP flattened into ``fqn`` (``planner_data``), else ``(fqn,)``."""
    mapping = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    path = mapping.get(fqn)
    if isinstance(path, (tuple, list)) and path and all(isinstance(k, (str, int)) for k in path):
        return tuple(path)
    return (fqn,)


def dcp_files(layout: Any, root: str) -> tuple[FileEntry, ...]:
    """``.metadata`` and every data file, each tiled by its items' own segments."""
    from ckptlab.plan.metadata import METADATA

    files = [FileEntry(METADATA, "dcp-metadata", layout.metadata_nbytes,
                       (Segment(SegmentKind.HEADER, 0, layout.metadata_nbytes, METADATA),)
                       if layout.metadata_nbytes else (), None, os.path.join(root, METADATA))]
    by_file: dict[str, list[Any]] = {}
    for item in layout.items:
        by_file.setdefault(item.file, []).append(item)
    for name, nbytes in layout.files:
        segments: list[Segment] = []
        cursor = 0
        for item in sorted(by_file.get(name, ()), key=lambda i: i.offset):
            if item.offset > cursor:
                segments.append(Segment(SegmentKind.UNKNOWN, cursor, item.offset - cursor))
            if item.layout is not None:
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


def open_dcp(root: str) -> Checkpoint:
    """A DCP directory (torch.save items) as a checkpoint; see the module docstring."""
    from ckptlab.checkpoint.open import _reader
    from ckptlab.plan.metadata import inspect_dcp

    layout = inspect_dcp(root)
    meta = layout.metadata
    chunks: dict[str, list[Part]] = {}
    objects: dict[str, Any] = {}
    for item in layout.items:
        if item.kind == "bytes":
            values = item.layout.objects if item.layout is not None else ()
            if values and values[0][0] == ():
                objects[item.fqn] = values[0][1]
            elif item.layout is not None:
                objects[item.fqn] = {"type": "pickled object", "nbytes": item.nbytes}
            continue
        dtype = item.dtype or "uint8"
        itemsize = DTYPE_ITEMSIZE.get(dtype, 1)
        shape = item.chunk_sizes
        if item.layout is not None and item.layout.tensors:
            info = item.layout.tensors[0]
            stride = info.stride
            offset = item.data_offset + info.storage_offset * itemsize \
                if item.data_offset is not None else item.offset
        else:
            stride = contiguous_strides(shape)
            offset = item.data_offset if item.data_offset is not None else item.offset
        chunks.setdefault(item.fqn, []).append(Part(
            "chunk", item.file, offset, span_nbytes(shape, stride, itemsize), dtype, shape,
            stride, 0, item.fqn, chunk_offsets=item.chunk_offsets, item_offset=item.offset))
    tensors: dict[str, TensorEntry] = {}
    for fqn, md in meta.state_dict_metadata.items():
        if not hasattr(md, "chunks"):
            continue
        dtype = str(md.properties.dtype).removeprefix("torch.")
        shape = tuple(md.size)
        parts = tuple(sorted(chunks.get(fqn, ()), key=lambda p: p.chunk_offsets or ()))
        tensors[fqn] = TensorEntry(fqn, _path_of(meta, fqn), dtype, shape,
                                   contiguous_strides(shape), "dense", parts,
                                   requires_grad=bool(md.properties.requires_grad))
    return Checkpoint("dcp", root, dcp_files(layout, root), tensors, objects, _reader(root))
