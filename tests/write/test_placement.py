"""Placement (``ckptlab.write._placement``): every item of a DCP plan at its file offset, each
tensor's bytes 4096-aligned, and the placed files readable item by item with torch.load."""

from __future__ import annotations

import io
import itertools
import mmap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from ckptlab.write._blob import BlobTemplates
from ckptlab.write._placement import Extent, place_item, place_plan, staging_nbytes
from ckptlab.write._staging import StagingArena, copy_in
from ckptlab.write._worker import FileWriter
from ckptlab.write.timeline import _Recorder


def local_plan(state_dict: dict[str, Any]) -> tuple[Any, DefaultSavePlanner]:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=True)
    return planner.create_local_plan(), planner


def state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"big": torch.randn(600, 1024), "small": torch.arange(7, dtype=torch.int16),
            "half": torch.randn(33, 3).half(), "empty": torch.empty(0), "step": 12,
            "cfg": {"name": "x" * 5000}}


def test_place_item_puts_the_data_on_a_block() -> None:
    template = BlobTemplates().get(torch.float32, (10,))
    segments: list[Extent] = []
    start, cursor = place_item(100, template, b"\0" * 40, segments)
    assert start == 4096 and cursor == start + template.nbytes
    assert [s.offset for s in segments] == [4096, 4096 + template.data_offset,
                                           4096 + template.data_offset + 40]
    assert segments[1].data and (4096 + template.data_offset) % 4096 == 0


@pytest.mark.parametrize("buckets", [1, 3])
def test_placed_files_hold_every_item(tmp_path: Path, buckets: int) -> None:
    sd = state()
    plan, planner = local_plan(sd)
    arena = StagingArena()
    arena.begin(staging_nbytes(plan))  # (AsyncWriter's save does it, timed as 'reserve')
    placed = place_plan(plan, planner, directory=str(tmp_path), prefix="__0_",
                        buckets=buckets, separation_hint=None, arena=arena,
                        templates=BlobTemplates(), staged=False)
    assert len(placed.results) == len(plan.items)
    assert len(placed.jobs) == min(buckets, len(plan.items))
    assert placed.write_nbytes == sum(-(-j.nbytes // 4096) * 4096 for j in placed.jobs)
    for job in placed.jobs:  # segments in file order, never overlapping
        ends = [(s.offset, s.offset + s.nbytes) for s in job.segments]
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends))
        assert job.path == str(tmp_path / job.name) and job.name.startswith("__0_")
    copy_in(_Recorder(str(tmp_path), 0), placed.copies)
    sd["big"].zero_()  # staged: later changes do not reach the files
    rec = _Recorder(str(tmp_path), 0)
    bounce = memoryview(mmap.mmap(-1, 1 << 20))
    for job in placed.jobs:
        FileWriter(job, bounce, direct=True, sync=False, recorder=rec, hook=None).run()
    want = state()
    by_index = {r.index: r for r in placed.results}  # results come in file order
    for item in plan.items:
        info = by_index[item.index].storage_data
        blob = (tmp_path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        got = torch.load(io.BytesIO(blob), weights_only=True)
        expected = want[item.index.fqn] if item.index.fqn in want else want["cfg"]["name"]
        if item.type == WriteItemType.BYTE_IO:  # bytes items: the planner's bytes, unpadded
            assert got == expected
            continue
        assert info.offset % 4096 == 0
        assert torch.equal(got, expected) and got.dtype == expected.dtype
