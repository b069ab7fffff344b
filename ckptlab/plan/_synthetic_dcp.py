"""Large DCP directories without large worlds: what ``dcp.save`` on N ranks would write.

Running 1,024 gloo processes to get a 1,000,000-item ``.metadata`` is out of reach on a
laptop, and the bytes of ``.metadata`` do not depend on how many processes wrote it: torch's
coordinator builds one :class:`~torch.distributed.checkpoint.metadata.Metadata` from every
rank's write results and ``FileSystemWriter.finish`` pickles it with :func:`pickle.dump`. This
module builds that same object from DCP's own classes (``TensorStorageMetadata`` with its
``ChunkStorageMetadata`` list, ``MetadataIndex`` keys, ``_StorageInfo`` values, ``StorageMeta``
and the default planner's ``planner_data``) for tensors sharded row-wise (``Shard(0)``) over
``ranks`` ranks, and pickles it exactly as ``finish`` does.

The data files are ``__{rank}_0.distcp`` with each rank's chunks back to back, each chunk the
``torch.save`` zip ``FileSystemWriter`` writes for it (``data="real"``, readable by torch's own
``dcp.load``), or holes of the right size (``data="sparse"``: the files are truncated to their
length, nothing is written but each file's first tensor item; for opening benchmarks at sizes
whose data would not fit a disk).
Object items (``step``) are always real bytes at the start of rank 0's file.

Used by ``benchmarks/dcp_open.py`` and the tests of the fast DCP open; not part of the public
API.
"""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass
from typing import Any

__all__ = ["SyntheticDcp", "write_synthetic_dcp"]

_DTYPES = ("float32", "bfloat16", "float16", "int64")


@dataclass(frozen=True, slots=True)
class SyntheticDcp:
    """What :func:`write_synthetic_dcp` wrote."""

    path: str
    tensors: int  # global tensors
    ranks: int
    items: int  # storage_data entries: tensors * ranks chunks + object items
    metadata_nbytes: int
    data_nbytes: int  # bytes of all data files (sparse ones included at their length)


def _chunk_bytes(cache: dict[tuple[str, tuple[int, ...]], bytes], dtype: str,
                 shape: tuple[int, ...]) -> bytes:
    """The torch.save zip DCP writes for a chunk of this dtype and shape (one per kind)."""
    import torch

    key = (dtype, shape)
    if key not in cache:
        numel = 1
        for d in shape:
            numel *= d
        values = (torch.arange(numel, dtype=torch.float64) % 251 - 125).reshape(shape)
        buf = io.BytesIO()
        torch.save(values.to(getattr(torch, dtype)), buf)
        cache[key] = buf.getvalue()
    return cache[key]


def write_synthetic_dcp(root: str | os.PathLike[str], *, tensors: int, ranks: int,
                        data: str = "real", objects: bool = True) -> SyntheticDcp:
    """Write the directory ``dcp.save`` on ``ranks`` ranks would write for ``tensors``
    tensors, each sharded by rows over every rank.

    Parameters
    ----------
    root
        Directory to create (its parents too); must not hold a checkpoint already.
    tensors
        Global tensors, named ``model.layers.{i // 4}.w{i % 4}``; float32, bfloat16, float16
        and int64 in turn, 1-D and 2-D, 1 to 3 rows per rank.
    ranks
        Simulated world size: one chunk per tensor per rank, one data file per rank.
    data
        ``"real"`` (every chunk's torch.save bytes) or ``"sparse"`` (files of the right length
        whose chunk bytes are holes, but for each file's first tensor item).
    objects
        Also save a ``step`` object item (rank 0), as a training state would.

    Returns
    -------
    SyntheticDcp
        Counts and sizes of what was written.
    """
    import torch
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md

    from ckptlab._torch_compat import metadata_file_name, storage_info_class

    storage_info = storage_info_class()

    if data not in ("real", "sparse"):
        raise ValueError(f"data must be 'real' or 'sparse', got {data!r}")
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    cache: dict[tuple[str, tuple[int, ...]], bytes] = {}
    state: dict[str, Any] = {}
    planner_data: dict[str, tuple[str, ...]] = {}
    storage_data: dict[Any, Any] = {}
    per_rank: list[list[tuple[Any, bytes | int]]] = [[] for _ in range(ranks)]
    if objects:
        buf = io.BytesIO()
        torch.save(1000, buf)
        state["step"] = md.BytesStorageMetadata()
        planner_data["step"] = ("step",)
        per_rank[0].append((md.MetadataIndex("step"), buf.getvalue()))
    props = {d: md.TensorProperties(dtype=getattr(torch, d)) for d in _DTYPES}
    for i in range(tensors):
        fqn = f"model.layers.{i // 4}.w{i % 4}"
        dtype = _DTYPES[i % len(_DTYPES)]
        rows = 1 + i % 3
        cols = (0, 8, 3, 16)[(i // 3) % 4]
        shape = (rows, cols) if cols else (rows,)
        size = torch.Size((rows * ranks, *shape[1:]))
        chunks = []
        for r in range(ranks):
            offsets = torch.Size((r * rows, *(0,) * (len(shape) - 1)))
            chunks.append(md.ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(shape)))
            payload = _chunk_bytes(cache, dtype, shape)
            # sparse: each data file's first tensor item is real (the fast open reads its
            # first 4 bytes to tell a torch.save zip from a SAFETENSORS blob), the rest holes
            per_rank[r].append((md.MetadataIndex(fqn, offsets, r),
                                payload if data == "real" or i == 0 else len(payload)))
        state[fqn] = md.TensorStorageMetadata(properties=props[dtype], size=size, chunks=chunks)
        planner_data[fqn] = ("model", f"layers.{i // 4}.w{i % 4}")
    data_nbytes = 0
    for r, entries in enumerate(per_rank):
        name = f"__{r}_0{fs.DEFAULT_SUFFIX}"
        offset = 0
        with open(os.path.join(root, name), "wb") as f:
            for index, payload in entries:
                length = payload if isinstance(payload, int) else len(payload)
                if not isinstance(payload, int):
                    f.write(payload)
                storage_data[index] = storage_info(name, offset, length)
                offset += length
            f.truncate(offset)
        data_nbytes += offset
    # .metadata records DCP's version from torch 2.8 on (a field torch 2.7's Metadata lacks)
    version = getattr(fs, "CURRENT_DCP_VERSION", None)
    meta = md.Metadata(state_dict_metadata=state, planner_data=planner_data,
                       storage_data=storage_data,
                       storage_meta=md.StorageMeta(checkpoint_id=root, save_id="synthetic"),
                       **({} if version is None else {"version": version}))
    meta_path = os.path.join(root, metadata_file_name())
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)  # what FileSystemWriter.finish does
    return SyntheticDcp(root, tensors, ranks, len(storage_data), os.path.getsize(meta_path),
                        data_nbytes)
