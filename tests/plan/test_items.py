"""Write items and DTensor box arithmetic against torch's own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.tensor import Partial, Replicate, Shard

from ckptlab.testing import plan_workers

try:  # torch >= 2.8: the box arithmetic on a mesh shape and coordinate, no DeviceMesh needed
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
except ImportError:  # torch 2.7 has only the DeviceMesh form
    _compute_local_shape_and_global_offset = None

from ckptlab.errors import InvalidArgumentError, PlanError
from ckptlab.plan import run_ranks
from ckptlab.plan.items import WriteItem, local_plan, parse_placements, shard_chunk, write_items
from ckptlab.plan.reshard import Chunk
from ckptlab.plan.torch_plans import from_torch_plan, to_torch_plan


@st.composite
def shardings(draw):
    size = tuple(draw(st.lists(st.integers(0, 11), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = [draw(st.one_of(st.just(Replicate()),
                                 st.integers(0, len(size) - 1).map(Shard))) for _ in mesh]
    coord = tuple(draw(st.integers(0, m - 1)) for m in mesh)
    return size, mesh, coord, placements


@pytest.mark.skipif(_compute_local_shape_and_global_offset is None,
                    reason="this torch has no _compute_local_shape_and_global_offset (2.7 "
                    "computes boxes only from a live DeviceMesh)")
@given(shardings())
def test_shard_chunk_matches_torch(case):
    size, mesh, coord, placements = case
    shape, offsets = _compute_local_shape_and_global_offset(size, mesh, list(coord), placements)
    assert shard_chunk(size, mesh, coord, placements) == Chunk(tuple(offsets), tuple(shape))


@given(shardings())
def test_shard_chunks_of_all_coordinates_tile_the_tensor(case):
    import itertools

    from ckptlab.plan.validate import validate_chunks

    size, mesh, _, placements = case
    boxes = {shard_chunk(size, mesh, c, placements)
             for c in itertools.product(*(range(m) for m in mesh))}
    assert validate_chunks("t", size, sorted(boxes, key=lambda c: c.offsets)) == []


def test_placement_forms():
    assert parse_placements([Shard(1), Replicate(), "S(0)", "S2", "R", "Shard(dim=3)", None,
                             0]) == (1, None, 0, 2, None, 3, None, 0)
    with pytest.raises(PlanError, match="Partial"):
        parse_placements([Partial()])
    with pytest.raises(PlanError, match="does not describe a box"):
        parse_placements(["X"])
    with pytest.raises(PlanError, match=r"Shard\(2\) of a 2-d tensor"):
        shard_chunk((4, 4), (2,), (0,), [Shard(2)])
    with pytest.raises(InvalidArgumentError, match="outside mesh"):
        shard_chunk((4, 4), (2,), (2,), [Shard(0)])
    with pytest.raises(InvalidArgumentError, match="2 placements"):
        shard_chunk((4,), (2,), (0,), [Shard(0), Shard(0)])


def test_plain_tensors_and_objects_match_torch():
    state = {"w": torch.ones(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16),
             "s": torch.tensor(2.0), "opt": {"lr": 0.1, "m": torch.ones(2)}, "tag": "x"}
    from ckptlab._torch_compat import flatten_state_dict as _flatten
    flatten_state_dict = _flatten()

    flat, _ = flatten_state_dict(state)
    theirs = from_torch_plan(create_default_local_save_plan(flat, True), 0)
    assert write_items(state) == theirs.items
    assert [i.kind for i in theirs.items] == ["tensor", "tensor", "tensor", "bytes", "tensor",
                                              "bytes"]
    assert theirs.items[0].nbytes == 48 and theirs.items[3].nbytes == 0


@pytest.mark.slow  # 11 s: spawns ranks
def test_dtensor_and_sharded_tensor_items_match_torch_on_real_ranks():
    for mine, theirs in run_ranks(plan_workers.write_items_vs_torch, 4, timeout=180):
        assert mine == theirs
        kinds = {fqn: kind for fqn, kind, *_ in mine}
        assert kinds["a"] == kinds["st"] == "shard" and kinds["plain"] == "tensor"
        assert kinds["step"] == kinds["nested.lr"] == "bytes"


def test_local_plan_fingerprint_and_round_trip():
    items = [WriteItem("w", "shard", Chunk((0, 0), (2, 3)), (4, 3), "float32"),
             WriteItem("o", "bytes")]
    a, b = local_plan(0, items), local_plan(5, items)
    assert a.fingerprint == b.fingerprint and a.nbytes == 24
    moved = local_plan(0, [WriteItem("w", "shard", Chunk((2, 0), (2, 3)), (4, 3), "float32"),
                           items[1]])
    assert moved.fingerprint != a.fingerprint
    assert from_torch_plan(to_torch_plan(a), 0) == a
    with pytest.raises(InvalidArgumentError, match="needs chunk"):
        local_plan(0, [WriteItem("w", "shard")])
    with pytest.raises(InvalidArgumentError, match="expected WriteItem"):
        local_plan(0, ["w"])
