"""Conversions between ckptlab's plan values and torch.distributed.checkpoint's.

torch's ``SavePlan`` / ``WriteItem`` / ``Metadata`` are what its planner consumes and writes;
ckptlab's :class:`~ckptlab.plan.items.LocalPlan` and :class:`~ckptlab.plan.planning.GlobalPlan`
are small frozen values. These functions map one onto the other so the two planners can be run
on the same input and their results compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptlab.plan.items import LocalPlan, WriteItem, local_plan, tensor_properties
from ckptlab.plan.planning import GlobalPlan
from ckptlab.plan.reshard import Chunk

__all__ = ["from_torch_plan", "metadata_chunks", "to_torch_metadata", "to_torch_plan"]


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _torch_properties(item: WriteItem) -> Any:
    """torch's ``TensorProperties`` for a tensor item (dtype, layout, requires_grad,
    memory_format, pin_memory: all of them are pickled into the checkpoint's metadata)."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties

    return TensorProperties(dtype=_torch_dtype(item.dtype), layout=getattr(torch, item.layout),
                            requires_grad=item.requires_grad,
                            memory_format=getattr(torch, item.memory_format),
                            pin_memory=item.pin_memory)


def to_torch_plan(plan: LocalPlan) -> Any:
    """torch's ``SavePlan`` for ``plan`` (the items torch's local planner would make)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItemType,
    )
    from torch.distributed.checkpoint.planner import WriteItem as TorchWriteItem

    props: dict[tuple, Any] = {}
    items = []
    for it in plan.items:
        if it.chunk is None:
            items.append(TorchWriteItem(index=MetadataIndex(it.fqn),
                                        type=WriteItemType.BYTE_IO))
            continue
        which = (it.dtype, it.layout, it.requires_grad, it.memory_format, it.pin_memory)
        p = props.get(which)
        if p is None:
            p = props[which] = _torch_properties(it)
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
    seen: dict[tuple, dict[str, Any]] = {}  # properties -> WriteItem keywords (few distinct)
    for it in plan.items:
        td = it.tensor_data
        if td is None:
            items.append(WriteItem(it.index.fqn, "bytes"))
            continue
        kind = "shard" if it.type.name == "SHARD" else "tensor"
        p = td.properties
        which = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
        kw = seen.get(which)
        if kw is None:
            kw = seen[which] = tensor_properties(p)
        items.append(WriteItem(it.index.fqn, kind,
                               Chunk(tuple(td.chunk.offsets), tuple(td.chunk.sizes)),
                               tuple(td.size), **kw))
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
    """torch's ``Metadata`` (without storage data) for a ckptlab global plan.

    Built the way torch's ``create_default_global_save_plan`` builds it from the deduplicated
    plans: entries in rank order, then item order; a tensor's size and properties (dtype,
    layout, requires_grad, memory_format, pin_memory) are those of its first item, its chunks
    listed in that order. For the same writers it equals the default planner's metadata,
    entry order included (``dcp_to_torch_save`` writes keys in that order); where a replica's
    writer differs from torch's choice, only the order of entries and chunks may differ.
    """
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorStorageMetadata,
    )

    md: dict[str, Any] = {}
    for plan in result.plans:
        for it in plan.items:
            c = it.chunk
            if c is None:
                md[it.fqn] = BytesStorageMetadata()
                continue
            entry = md.get(it.fqn)
            if entry is None:  # one properties object per tensor, as torch makes them
                entry = md[it.fqn] = TensorStorageMetadata(properties=_torch_properties(it),
                                                           size=torch.Size(it.size), chunks=[])
            entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size(c.offsets),
                                                     sizes=torch.Size(c.sizes)))
    return Metadata(md)


def torch_plans(plans: Sequence[LocalPlan]) -> list[Any]:
    """:func:`to_torch_plan` for every rank."""
    return [to_torch_plan(p) for p in plans]
