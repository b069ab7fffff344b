"""Resharding read items: the same regions as torch's create_read_items_for_chunk_list, and
copying by them rebuilds every wanted chunk bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ckptlab.errors import InvalidArgumentError
from ckptlab.plan.reshard import Chunk, read_items, sweep_dimension
from ckptlab.testing.strategies import chunk_grids


@st.composite
def reshard_cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    return shape, draw(chunk_grids(shape)), draw(chunk_grids(shape))


def _torch_items(fqn, shape, saved, wanted):
    md = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape),
        chunks=[ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in saved])
    local = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in wanted]
    return {(r.dest_index.index, tuple(r.dest_offsets), r.storage_index.index,
             tuple(r.storage_offsets), tuple(r.lengths))
            for r in create_read_items_for_chunk_list(fqn, md, local)}


def _slices(offsets, sizes):
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


@given(reshard_cases())
def test_same_regions_as_torch(case) -> None:
    shape, saved, wanted = case
    ours = read_items("t", saved, wanted)
    assert {(r.dest_index, r.dest_offsets, r.storage_index, r.storage_offsets, r.lengths)
            for r in ours} == _torch_items("t", shape, saved, wanted)
    # any sweep dimension gives the same items
    for d in range(len(shape)):
        assert read_items("t", saved, wanted, dim=d) == ours


@given(reshard_cases())
def test_copying_by_the_items_rebuilds_every_wanted_chunk(case) -> None:
    shape, saved, wanted = case
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    stored = [full[_slices(c.offsets, c.sizes)].clone() for c in saved]
    out = [torch.full(c.sizes, float("nan"), dtype=torch.float64) for c in wanted]
    for r in read_items("t", saved, wanted):
        out[r.dest_index][_slices(r.dest_offsets, r.lengths)] = \
            stored[r.storage_index][_slices(r.storage_offsets, r.lengths)]
    for c, got in zip(wanted, out):
        assert torch.equal(got, full[_slices(c.offsets, c.sizes)])
    # saved chunks tile the tensor: every wanted element is read exactly once
    per_dest = [0] * len(wanted)
    for r in read_items("t", saved, wanted):
        per_dest[r.dest_index] += r.numel
    assert per_dest == [c.numel for c in wanted]


def test_the_sweep_takes_the_split_dimension() -> None:
    # a wide Shard(0) weight: rows split 8 ways, columns whole; torch sweeps the columns
    rows, cols = 4096, 14336
    saved = [Chunk((r * rows // 8, 0), (rows // 8, cols)) for r in range(8)]
    wanted = [Chunk((r * rows // 16, 0), (rows // 16, cols)) for r in range(16)]
    assert sweep_dimension(saved, wanted) == 0
    items = read_items("w", saved, wanted)
    assert len(items) == 16 and all(r.lengths == (rows // 16, cols) for r in items)


def test_degenerate_and_bad_inputs() -> None:
    assert read_items("t", [], [Chunk((0,), (3,))]) == ()
    assert read_items("t", [Chunk((0,), (3,))], []) == ()
    scalar = read_items("s", [Chunk((), ())], [Chunk((), ())])
    assert len(scalar) == 1 and scalar[0].lengths == ()
    assert read_items("t", [Chunk((0,), (3,))], [Chunk((1,), (0,))]) == ()  # empty wanted
    with pytest.raises(InvalidArgumentError):
        read_items("t", [Chunk((0,), (3,))], [Chunk((0, 0), (1, 1))])
    with pytest.raises(InvalidArgumentError):
        read_items("t", [Chunk((0,), (-1,))], [Chunk((0,), (1,))])
    with pytest.raises(InvalidArgumentError):
        read_items("t", [Chunk((0,), (3,))], [Chunk((0,), (3,))], dim=1)
