"""Chunk validation against torch's _validate_global_plan on valid and broken tilings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptlab.errors import PlanError
from ckptlab.plan.reshard import Chunk
from ckptlab.plan.validate import require_valid, validate_chunks
from ckptlab.testing.strategies import chunk_grids


@st.composite
def broken_tilings(draw):
    shape = tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=3)))
    chunks = list(draw(chunk_grids(shape)))
    change = draw(st.sampled_from(["none", "drop", "duplicate", "shift", "grow"]))
    i = draw(st.integers(0, len(chunks) - 1))
    c = chunks[i]
    if change == "drop" and len(chunks) > 1:
        chunks.pop(i)
    elif change == "duplicate":
        chunks.append(c)
    elif change == "shift":
        d = draw(st.integers(0, len(shape) - 1))
        offsets = list(c.offsets)
        offsets[d] += draw(st.integers(1, 3))
        chunks[i] = Chunk(tuple(offsets), c.sizes)
    elif change == "grow":
        d = draw(st.integers(0, len(shape) - 1))
        sizes = list(c.sizes)
        sizes[d] += 1
        chunks[i] = Chunk(c.offsets, tuple(sizes))
    return shape, chunks


def _torch_errors(shape, chunks) -> list[str]:
    """torch's verdicts: the messages it returns (2.8 on) or, where it returns a bool and
    logs them (2.7), the messages it logs."""
    import logging

    md = Metadata(state_dict_metadata={"t": TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size(shape),
        [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in chunks])})
    logged: list[str] = []
    keep = logging.Handler()
    keep.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("torch.distributed.checkpoint.default_planner")
    log.addHandler(keep)
    try:
        verdict = _validate_global_plan([None, None], md)  # two plans: the volume is checked
    finally:
        log.removeHandler(keep)
    return logged if isinstance(verdict, bool) else verdict


@given(broken_tilings())
def test_same_verdicts_as_torch(case) -> None:
    shape, chunks = case
    ours = validate_chunks("t", shape, chunks)
    theirs = _torch_errors(shape, chunks)
    kinds = {p.kind for p in ours}
    assert ("out_of_bounds" in kinds) == any("out of bounds" in m for m in theirs)
    assert ("volume" in kinds) == any("invalid fill" in m for m in theirs)
    assert sum(p.kind == "overlap" for p in ours) == sum("overlapping" in m for m in theirs)
    assert (not ours) == (not theirs)


def test_a_valid_grid_and_plan_error() -> None:
    chunks = [Chunk((0, 0), (2, 3)), Chunk((2, 0), (2, 3))]
    assert validate_chunks("w", (4, 3), chunks) == []
    require_valid("w", (4, 3), chunks)
    with pytest.raises(PlanError, match=r"w: overlap: chunks 0 and 2") as info:
        require_valid("w", (4, 3), [*chunks, Chunk((1, 1), (1, 1))])
    assert "volume" in str(info.value)
