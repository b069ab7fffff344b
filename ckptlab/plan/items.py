"""Write items: what one rank asks the checkpoint to store, as plain frozen values.

A DCP save starts with every rank listing its write items: for each state-dict entry, the box
(chunk) of the global tensor it holds, or an opaque object to pickle. The kinds follow torch:

- a plain ``torch.Tensor`` is the whole tensor (kind ``"tensor"``, chunk at offset 0);
- a ``DTensor`` is the box its mesh coordinate holds under its placements (kind ``"shard"``),
  or nothing when the rank is not in the mesh;
- a ``ShardedTensor`` is one box per local shard (kind ``"shard"``);
- anything else is pickled bytes (kind ``"bytes"``, no chunk).

:func:`shard_chunk` is the DTensor arithmetic as a pure function of the global shape, the mesh
shape, a mesh coordinate and the placements, so N ranks' plans can be built in one process
without a process group (a test checks it against torch's own
``_compute_local_shape_and_global_offset``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptlab.errors import InvalidArgumentError, PlanError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.plan.reshard import Chunk

__all__ = ["LocalPlan", "WriteItem", "local_plan", "parse_placements", "shard_chunk",
           "tensor_properties", "write_items"]

KINDS = ("tensor", "shard", "bytes")


@dataclass(frozen=True, slots=True)
class WriteItem:
    """One entry a rank writes: a chunk of a tensor, or a pickled object.

    ``key`` is the item's identity in the checkpoint (torch's ``MetadataIndex``: the name and
    the chunk's offsets); two ranks holding the same key hold the same bytes (replicas), and
    the global plan keeps one of them.

    The last four fields are the rest of torch's ``TensorProperties``, which the checkpoint's
    ``.metadata`` records for each tensor (from its first item in rank order) and which
    ``dcp.load`` may use to build a tensor; they are part of the item's identity, so a plan
    whose tensors only changed ``requires_grad`` is a changed plan.
    """

    fqn: str
    kind: str  # "tensor", "shard" or "bytes"
    chunk: Chunk | None = None  # None for bytes
    size: tuple[int, ...] = ()  # the global tensor's shape
    dtype: str = ""  # torch's name without the prefix; "" for bytes
    layout: str = "strided"  # torch.layout's name without the prefix
    requires_grad: bool = False
    memory_format: str = "contiguous_format"  # torch.memory_format's name without the prefix
    pin_memory: bool = False

    @property
    def key(self) -> tuple[str, tuple[int, ...] | None]:
        return (self.fqn, None if self.chunk is None else self.chunk.offsets)

    @property
    def nbytes(self) -> int:
        """The chunk's payload in bytes (0 for pickled objects: unknown before pickling)."""
        if self.chunk is None:
            return 0
        return self.chunk.numel * DTYPE_ITEMSIZE.get(self.dtype, 1)


@dataclass(frozen=True, slots=True)
class LocalPlan:
    """One rank's write items, in order, with a fingerprint of their structure.

    Build it with :func:`local_plan`; the fingerprint is what a rank sends instead of its plan
    when nothing changed since the last save.
    """

    rank: int
    items: tuple[WriteItem, ...]
    fingerprint: str = field(compare=False)
    nbytes: int = field(compare=False, default=-1)  # payload bytes of all items

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            object.__setattr__(self, "nbytes", sum(item.nbytes for item in self.items))


def _fingerprint(items: Sequence[WriteItem]) -> str:
    """A digest of every field of every item, in order: everything a checkpoint's metadata is
    made of (names, kinds, chunks, global shapes, dtypes and the other tensor properties)."""
    h = hashlib.blake2b(digest_size=16)
    for it in items:
        c = it.chunk
        h.update(f"{it.fqn}\0{it.kind}\0{it.dtype}\0{it.size}\0"
                 f"{None if c is None else (c.offsets, c.sizes)}\0{it.layout}\0"
                 f"{it.requires_grad}\0{it.memory_format}\0{it.pin_memory}\n".encode())
    return h.hexdigest()


def local_plan(rank: int, items: Iterable[WriteItem]) -> LocalPlan:
    """A :class:`LocalPlan` for ``rank`` with its structure fingerprint."""
    items = tuple(items)
    for it in items:
        if not isinstance(it, WriteItem) or it.kind not in KINDS:
            raise InvalidArgumentError(f"rank {rank}: expected WriteItem, got {it!r}")
        if (it.chunk is None) != (it.kind == "bytes"):
            raise InvalidArgumentError(f"rank {rank}: {it.fqn}: a {it.kind} item "
                                       f"{'needs' if it.kind != 'bytes' else 'has no'} chunk")
    return LocalPlan(rank, items, _fingerprint(items))


_PLACEMENT = re.compile(r"^(?:S(?:hard)?\(\s*(?:dim\s*=\s*)?(-?\d+)\s*\)|S(\d+)|R(?:eplicate)?(?:\(\))?)$")


def parse_placements(placements: Sequence[Any]) -> tuple[int | None, ...]:
    """Placements as sharded tensor dims (None = replicated).

    Accepts torch placements (``Shard(d)``, ``Replicate()``) or their short forms
    (``"S(0)"``, ``"S0"``, ``"R"``). ``Partial`` and strided shards are not boxes of the
    global tensor: a :class:`~ckptlab.errors.PlanError`.
    """
    out: list[int | None] = []
    for p in placements:
        if isinstance(p, int) or p is None:
            out.append(p)
            continue
        name = type(p).__name__
        if name == "Shard":
            out.append(int(p.dim))
        elif name == "Replicate":
            out.append(None)
        elif isinstance(p, str) and (m := _PLACEMENT.match(p.replace(" ", ""))):
            dim = m.group(1) or m.group(2)
            out.append(None if dim is None else int(dim))
        else:
            raise PlanError(f"placement {p!r} does not describe a box of the global tensor "
                            "(only Shard(d) and Replicate() do)")
    return tuple(out)


def shard_chunk(size: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                placements: Sequence[Any]) -> Chunk:
    """The box of a global tensor that one mesh coordinate holds.

    Shards are applied left to right over the mesh dimensions, each one splitting the current
    local extent the way ``torch.chunk`` does (ceil-sized pieces, trailing pieces short or
    empty); an empty piece sits at the end of the dimension, as torch reports it.

    Parameters
    ----------
    size
        The global tensor's shape.
    mesh_shape, coordinate
        The device mesh's shape and this rank's coordinate in it.
    placements
        One per mesh dimension (see :func:`parse_placements`).
    """
    dims = parse_placements(placements)
    if not len(dims) == len(mesh_shape) == len(coordinate):
        raise InvalidArgumentError(f"{len(dims)} placements, a mesh of {len(mesh_shape)} dims "
                                   f"and a coordinate of {len(coordinate)}")
    size = tuple(int(n) for n in size)
    local = list(size)
    start: dict[int, int] = {}
    for n_chunks, c, d in zip(mesh_shape, coordinate, dims):
        if d is None:
            continue
        if not 0 <= d < len(size):
            raise PlanError(f"Shard({d}) of a {len(size)}-d tensor")
        if not 0 <= c < n_chunks:
            raise InvalidArgumentError(f"coordinate {tuple(coordinate)} outside mesh "
                                       f"{tuple(mesh_shape)}")
        n = local[d]
        piece = -(-n // n_chunks)
        lo = min(n, piece * c)
        local[d] = max(0, min(n, lo + piece) - lo)
        start[d] = start.get(d, 0) + lo
    offsets = tuple(size[d] if local[d] == 0 and d in start else start.get(d, 0)
                    for d in range(len(size)))
    return Chunk(offsets, tuple(local))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_properties(properties: Any) -> dict[str, Any]:
    """A torch ``TensorProperties`` as :class:`WriteItem` keyword arguments (``dtype``,
    ``layout``, ``requires_grad``, ``memory_format``, ``pin_memory``)."""
    return {"dtype": _dtype_name(properties.dtype), "layout": _dtype_name(properties.layout),
            "requires_grad": bool(properties.requires_grad),
            "memory_format": _dtype_name(properties.memory_format),
            "pin_memory": bool(properties.pin_memory)}


def write_items(state_dict: Mapping[str, Any]) -> tuple[WriteItem, ...]:
    """This rank's write items for ``state_dict``, as DCP's default planner makes them.

    Nested dicts are flattened the way DCP flattens them (``"optim.state.0.exp_avg"``).
    Must run where the state dict's DTensors / ShardedTensors live (their mesh coordinate
    and local shards are this rank's).
    """
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties

    from ckptlab._torch_compat import flatten_state_dict

    flat, _ = flatten_state_dict()(dict(state_dict))
    out: list[WriteItem] = []
    for fqn, obj in flat.items():
        kind = type(obj).__name__
        if kind == "DTensor":
            mesh = obj.device_mesh
            coord = mesh.get_coordinate()
            if coord is None:  # this rank is not in the tensor's mesh: it writes nothing
                continue
            size = tuple(obj.shape)
            chunk = shard_chunk(size, tuple(mesh.shape), coord, obj.placements)
            props = tensor_properties(TensorProperties.create_from_tensor(obj.to_local()))
            out.append(WriteItem(fqn, "shard", chunk, size, **props))
        elif kind == "ShardedTensor":
            md = obj.metadata()
            size = tuple(md.size)
            props = tensor_properties(md.tensor_properties)
            for shard in obj.local_shards():
                sm = shard.metadata
                out.append(WriteItem(fqn, "shard", Chunk(tuple(sm.shard_offsets),
                                                         tuple(sm.shard_sizes)), size, **props))
        elif isinstance(obj, torch.Tensor):
            size = tuple(obj.shape)
            props = tensor_properties(TensorProperties.create_from_tensor(obj))
            out.append(WriteItem(fqn, "tensor", Chunk((0,) * len(size), size), size, **props))
        else:
            out.append(WriteItem(fqn, "bytes"))
    return tuple(out)

