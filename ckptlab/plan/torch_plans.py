"""Conversions between ckptlab's plan values and torch.distributed.checkpoint's.

torch's ``SavePlan`` / ``WriteItem`` / ``Metadata`` are what its planner consumes and writes;
ckptlab's :class:`~ckptlab.plan.items.LocalPlan` and :class:`~ckptlab.plan.planning.GlobalPlan`
are small frozen values. These functions map one onto the other so the two planners can be run
on the same input and their results compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptlab.plan.items import LocalPlan, WriteItem, local_plan
from ckptlab.plan.planning import GlobalPlan
from ckptlab.plan.reshard import Chunk

__all__ = ["from_torch_plan", "metadata_chunks", "to_torch_metadata", "to_torch_plan"]


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def to_torch_plan(plan: LocalPlan) -> Any:
    """torch's ``SavePlan`` for ``plan`` (the items torch's local planner would make)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItemType,
    )
    from torch.distributed.checkpoint.planner import WriteItem as TorchWriteItem

    props: dict[str, Any] = {}
    items = []
    for it in plan.items:
        if it.chunk is None:
            items.append(TorchWriteItem(index=MetadataIndex(it.fqn),
                                        type=WriteItemType.BYTE_IO))
            continue
        p = props.get(it.dtype)
        if p is None:
            p = props[it.dtype] = TensorProperties(dtype=_torch_dtype(it.dtype))
        offsets = torch.Size(it.chunk.offsets)
        items.append(TorchWriteItem(
            index=MetadataIndex(it.fqn, offsets),
            type=WriteItemType.SHARD if it.kind == "shard" else WriteItemType.TENSOR,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(it.chunk.sizes)),
                properties=p, size=torch.Size(it.size))))
    return SavePlan(items, planner_data={})


def from_torch_plan(plan: Any, rank: int) -> LocalPlan:
    """ckptlab's :class:`LocalPlan` for a torch ``SavePlan``."""
    items = []
    for it in plan.items:
        td = it.tensor_data
        if td is None:
            items.append(WriteItem(it.index.fqn, "bytes"))
            continue
        kind = "shard" if it.type.name == "SHARD" else "tensor"
        items.append(WriteItem(it.index.fqn, kind,
                               Chunk(tuple(td.chunk.offsets), tuple(td.chunk.sizes)),
                               tuple(td.size), str(td.properties.dtype).removeprefix("torch.")))
    return local_plan(rank, items)


def metadata_chunks(metadata: Any) -> dict[str, tuple[tuple[int, ...], str, list[Chunk]]]:
    """torch ``Metadata`` as fqn -> (size, dtype, chunks); pickled entries are omitted."""
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not hasattr(md, "chunks"):
            continue
        out[fqn] = (tuple(md.size), str(md.properties.dtype).removeprefix("torch."),
                    [Chunk(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
    return out


def to_torch_metadata(result: GlobalPlan) -> Any:
    """torch's ``Metadata`` (without storage data) for a ckptlab global plan."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    md: dict[str, Any] = {}
    for fqn, entry in result.tensors.items():
        md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=_torch_dtype(entry.dtype)),
            size=torch.Size(entry.size),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets),
                                         sizes=torch.Size(c.sizes)) for c in entry.chunks])
    for fqn in result.objects:
        md[fqn] = BytesStorageMetadata()
    return Metadata(md)


def torch_plans(plans: Sequence[LocalPlan]) -> list[Any]:
    """:func:`to_torch_plan` for every rank."""
    return [to_torch_plan(p) for p in plans]
