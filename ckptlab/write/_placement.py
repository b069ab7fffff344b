"""Placement: where each item of a rank's plan goes in which data file.

Every bucket of the rank's items becomes one data file (:class:`FileJob`); each tensor item is
a ``torch.save`` blob (prefix, the tensor's bytes, suffix) at a 4096-aligned file offset, so
the tensor's bytes are 4096-aligned in the file; bytes items are written as they are. Nothing
is copied here: tensor items get a staging slot whose bytes the caller copies in afterwards.
"""

from __future__ import annotations

import io
import os
import threading
from dataclasses import dataclass
from typing import Any

from ckptlab._io import align_up
from ckptlab.errors import WriterError
from ckptlab.write._blob import BlobTemplate, BlobTemplates
from ckptlab.write._staging import PendingCopy, StagingArena, StagingState
from ckptlab.write.buckets import BucketAssignment, assign_buckets, item_nbytes

__all__ = ["Extent", "FileJob", "Placement", "place_item", "place_plan", "staging_nbytes"]

DATA_SUFFIX = ".distcp"  # DCP's data file suffix (FileSystemWriter's DEFAULT_SUFFIX)


@dataclass(frozen=True, slots=True)
class Extent:
    """Bytes to put at ``offset`` of a data file; ``data`` marks a tensor's storage bytes."""

    offset: int
    source: Any  # bytes or memoryview
    data: bool = False
    ready: threading.Event | None = None  # set once the caller has copied the bytes in

    @property
    def nbytes(self) -> int:
        return len(self.source)


@dataclass(frozen=True, slots=True)
class FileJob:
    """One bucket's data file: where it goes and what goes in it, in file order."""

    bucket: int
    path: str  # absolute path
    name: str  # relative to the checkpoint directory
    segments: tuple[Extent, ...]
    nbytes: int  # the file's final size
    staging: StagingState | None = None  # the caller's copy progress (None: all staged)


def place_item(cursor: int, template: BlobTemplate, data: memoryview | bytes,
               segments: list[Extent],
               ready: threading.Event | None = None) -> tuple[int, int]:
    """Append a tensor item at the next 4096-aligned offset; returns (item offset, new cursor)."""
    start = align_up(cursor)
    segments.append(Extent(start, template.prefix))
    if template.data_nbytes:
        segments.append(Extent(start + template.data_offset, data, data=True, ready=ready))
    segments.append(Extent(start + template.data_offset + template.data_nbytes, template.suffix))
    return start, start + template.nbytes


@dataclass(frozen=True, slots=True)
class Placement:
    """A rank's plan placed: DCP's write results, the file jobs, the copies still to do."""

    assignment: BucketAssignment
    results: list[Any]  # WriteResult per item
    jobs: list[FileJob]
    copies: list[list[PendingCopy]]  # per job, in file order

    @property
    def write_nbytes(self) -> int:
        """Bytes the workers write: each file rounded up to whole 4096-byte blocks."""
        return sum(align_up(job.nbytes) for job in self.jobs)


def _local_chunk(item: Any, data: Any) -> Any:
    """The resolved tensor of a chunk, checked against the plan."""
    if hasattr(data, "to_local") and hasattr(data, "device_mesh"):
        data = data.to_local()
    data = data.detach()
    shape = tuple(item.tensor_data.chunk.sizes)
    if tuple(data.shape) != shape:
        raise WriterError(f"item {item.index.fqn}: the planner resolved a tensor of shape "
                          f"{tuple(data.shape)} for a chunk of shape {shape}")
    return data


def staging_nbytes(plan: Any) -> int:
    """Staging memory a save of ``plan`` takes: each item's bytes from a 4096-byte slot."""
    return sum(align_up(item_nbytes(i)) for i in plan.items)


def place_plan(plan: Any, planner: Any, *, directory: str, prefix: str, buckets: int,
               separation_hint: str | None, arena: StagingArena, templates: BlobTemplates,
               staged: bool) -> Placement:
    """Resolve every item of ``plan``, give each tensor a staging slot (or find it already
    staged, after ``stage``) and each item its file offset in ``{prefix}{bucket}.distcp``.
    Unless ``staged``, ``arena`` was begun for this save (``arena.begin(staging_nbytes(plan))``:
    the caller times the mapping it may do)."""
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from ckptlab._torch_compat import storage_info_class

    storage_info = storage_info_class()
    assignment = assign_buckets(plan.items, buckets, separation_hint)
    staging = StagingState()
    results: list[Any] = []
    jobs: list[FileJob] = []
    copies: list[list[PendingCopy]] = []
    for bucket in assignment.buckets:
        if not bucket.items:
            continue
        name = f"{prefix}{bucket.index}{DATA_SUFFIX}"
        segments: list[Extent] = []
        todo: list[PendingCopy] = []
        cursor = 0
        for item in bucket.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                segments.append(Extent(cursor, raw))
                results.append(WriteResult(index=item.index, size_in_bytes=len(raw),
                                           storage_data=storage_info(name, cursor, len(raw))))
                cursor += len(raw)
                continue
            tensor = _local_chunk(item, data)
            template = templates.get(tensor.dtype, tuple(tensor.shape))
            view = arena.find(tensor) if staged else None
            ready = None
            if view is None:
                nbytes = tensor.numel() * tensor.element_size()
                slot, view = arena.alloc(nbytes)
                if nbytes:
                    ready = staging.event()
                    todo.append(PendingCopy(bucket.index, name, slot, tensor, nbytes, ready))
            start, cursor = place_item(cursor, template, view, segments, ready)
            results.append(WriteResult(index=item.index, size_in_bytes=template.nbytes,
                                       storage_data=storage_info(name, start, template.nbytes)))
        jobs.append(FileJob(bucket.index, os.path.join(directory, name), name,
                            tuple(segments), cursor, staging))
        copies.append(todo)
    return Placement(assignment, results, jobs, copies)
