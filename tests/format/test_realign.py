"""``realign`` and ``alignment_costs`` against files torch.save really writes at each alignment.

``realign(inspect(file saved at A), B)`` must be the layout of the file saved at B, and
``alignment_costs`` rows must be the sizes of the files torch writes, for random objects
(``ckptlab.testing.strategies``) and for zip64 archives (sparse files, as in test_zip64).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ckptlab as cl
from ckptlab.errors import InvalidArgumentError
from ckptlab.format import SegmentKind
from ckptlab.format.predict import DEFAULT_ALIGNMENTS, AlignmentCost
from ckptlab.testing import strategies as cst

pytestmark = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental:UserWarning")

U32 = 0xFFFFFFFF
# records whose bytes differ between two saves of one object at two alignments
CHANGING = (".storage_alignment", ".data/serialization_id")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("realign")


def saved(config: cst.SaveConfig, obj: Any, base: Path) -> cl.format.ArchiveLayout:
    with tempfile.TemporaryDirectory(dir=base) as d:
        return cl.inspect(config.save(obj, d))


def assert_same_placement(got: cl.format.ArchiveLayout, want: cl.format.ArchiveLayout, *,
                          crc: bool = True) -> None:
    """Every offset and size of two layouts; CRCs too (but of the records that change)."""
    assert got.format == want.format == "torch-zip"
    assert got.file_nbytes == want.file_nbytes
    assert got.archive_name == want.archive_name
    ordered = sorted(want.records, key=lambda r: r.header_offset)
    assert [r.name for r in got.records] == [r.name for r in ordered]
    for g, w in zip(got.records, ordered):
        for field in ("header_offset", "name_nbytes", "extra_nbytes", "zip64_extra_nbytes",
                      "padding_nbytes", "data_offset", "data_nbytes", "descriptor_nbytes",
                      "uncompressed_nbytes", "method", "header_nbytes", "end_offset"):
            assert getattr(g, field) == getattr(w, field), (g.name, field)
        if crc and g.short_name not in CHANGING:
            assert g.crc32 == w.crc32, g.name
    for field in ("central_directory_offset", "central_directory_nbytes", "zip64_eocd_offset",
                  "zip64_locator_offset", "eocd_offset", "zip64", "alignment",
                  "storage_alignment", "format_version", "byteorder", "pickle_protocol"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.storages == want.storages
    assert got.tensors == want.tensors
    assert got.segments == want.segments


# ---------------------------------------------------------------------------------------------
# realign


@given(obj=cst.state_dicts(), config=cst.save_configs(), target=cst.alignments())
def test_realign_is_the_file_torch_writes(workdir, obj, config, target):
    source = saved(config, obj, workdir)
    want = saved(dataclasses.replace(config, alignment=target), obj, workdir)
    got = cl.format.realign(source, target)
    assert_same_placement(got, want)
    assert got.path == f"<realigned from {source.path}>"
    assert got.record(".storage_alignment").crc32 == 0  # its text changed; CRC unknown
    # and the prediction from the object agrees
    predicted = cl.predict_layout(obj, alignment=target, archive_name=source.archive_name,
                                  pickle_protocol=config.pickle_protocol,
                                  disable_byteorder_record=config.disable_byteorder_record)
    assert_same_placement(got, predicted, crc=False)


@given(obj=cst.state_dicts(max_leaves=6), a=cst.alignments(), b=cst.alignments())
def test_realign_of_a_prediction_and_composition(obj, a, b):
    at_a = cl.predict_layout(obj, alignment=a)
    at_b = cl.predict_layout(obj, alignment=b)
    assert_same_placement(cl.format.realign(at_a, b), at_b, crc=False)
    assert_same_placement(cl.format.realign(cl.format.realign(at_b, a), b), at_b, crc=False)


def test_realign_to_its_own_alignment_is_the_file(sample_layout):
    same = cl.format.realign(sample_layout, sample_layout.storage_alignment)
    assert same.segments == sample_layout.segments
    assert same.storages == sample_layout.storages
    assert [dataclasses.replace(r, crc32=0) for r in same.records] == [
        dataclasses.replace(r, crc32=0) for r in sample_layout.records]
    # CRCs are the file's, but for .storage_alignment (its text may change)
    assert [r.crc32 for r in same.records if r.short_name != ".storage_alignment"] == [
        r.crc32 for r in sample_layout.records if r.short_name != ".storage_alignment"]
    assert same.file_nbytes == sample_layout.file_nbytes


def test_realign_moves_storages_and_nothing_else(sample_layout):
    moved = cl.format.realign(sample_layout, 4096)
    assert moved.storage_alignment == moved.alignment == 4096
    assert [(s.key, s.record, s.dtype, s.nbytes, s.device) for s in moved.storages] == [
        (s.key, s.record, s.dtype, s.nbytes, s.device) for s in sample_layout.storages]
    for s in moved.storages:
        assert s.data_offset % 4096 == 0
        assert s.data_offset == moved.record(s.record).data_offset
    assert moved.tensors == sample_layout.tensors
    # realign of a 3-digit alignment grows .storage_alignment by a byte: "64" -> "4096"
    assert moved.record(".storage_alignment").data_nbytes == 4
    assert moved.file_nbytes > sample_layout.file_nbytes


@pytest.mark.parametrize("alignment", [0, -64, 65505, 1 << 20, 64.0, "64", None, True])
def test_realign_rejects_bad_alignments(sample_layout, alignment):
    with pytest.raises(InvalidArgumentError, match=r"1\.\.65504"):
        cl.format.realign(sample_layout, alignment)


def test_realign_needs_a_torch_zip(safetensors_file):
    layout = cl.inspect(safetensors_file)
    with pytest.raises(InvalidArgumentError, match="torch-zip"):
        cl.format.realign(layout, 64)
    with pytest.raises(InvalidArgumentError, match="torch-zip"):
        cl.format.alignment_costs(layout)


# ---------------------------------------------------------------------------------------------
# zip64: sparse files


def big(nbytes: int) -> torch.Tensor:
    try:
        return torch.empty(nbytes, dtype=torch.uint8)  # address space only, never touched
    except RuntimeError as exc:
        pytest.skip(f"cannot reserve {nbytes} bytes of virtual memory: {exc}")


def save_sparse(obj: Any, path: Path, alignment: int) -> cl.format.ArchiveLayout:
    from torch.utils.serialization import config

    with config.patch({"save.storage_alignment": alignment}), torch.serialization.skip_data():
        torch.save(obj, path)
    try:
        return cl.inspect(path)
    finally:
        path.unlink()


@pytest.mark.parametrize("source, target", [(64, 1), (64, 65504), (1, 4096), (4096, 7)])
def test_realign_zip64_archive(tmp_path, source, target):
    obj = {"a": torch.ones(3), "big": big(U32 - 15), "b": torch.ones(2, 3).t(),
           "huge": big(U32 + 5), "c": torch.arange(4)}
    at_source = save_sparse(obj, tmp_path / "z.pt", source)
    at_target = save_sparse(obj, tmp_path / "z.pt", target)
    assert at_source.zip64 and at_target.zip64
    got = cl.format.realign(at_source, target)
    assert_same_placement(got, at_target, crc=False)  # skip_data: CRCs are not the data's
    assert sum(s.nbytes for s in got.segments if s.kind is SegmentKind.ZIP64_EXTRA) == sum(
        r.zip64_extra_nbytes for r in at_target.records)
    costs = cl.format.alignment_costs(at_source, (source, target))
    assert [c.file_nbytes for c in costs] == [at_source.file_nbytes, at_target.file_nbytes]


# ---------------------------------------------------------------------------------------------
# alignment costs


def direct_cost(layout: cl.format.ArchiveLayout) -> AlignmentCost:
    """One cost row counted directly from a real file's layout."""
    data = sum(r.data_nbytes for r in layout.records)
    starts = [s.data_offset for s in layout.storages if s.nbytes]
    return AlignmentCost(layout.storage_alignment, layout.file_nbytes, data,
                         layout.padding_nbytes, layout.file_nbytes - data, len(starts),
                         sum(1 for o in starts if o % 4096 == 0))


@given(obj=cst.state_dicts(), alignments=st.lists(cst.alignments(), min_size=1, max_size=3),
       filename=st.sampled_from(cst.FILENAMES))
def test_alignment_costs_are_the_files_torch_writes(workdir, obj, alignments, filename):
    chosen = [1, 65504, *alignments]
    config = cst.SaveConfig(filename=filename)
    files = [saved(dataclasses.replace(config, alignment=a), obj, workdir) for a in chosen]
    from_layout = cl.format.alignment_costs(files[0], chosen)
    from_object = cl.format.alignment_costs(obj, chosen, archive_name=files[0].archive_name)
    assert from_layout == from_object
    assert list(from_layout) == [direct_cost(f) for f in files]
    for cost in from_layout:
        assert cost.overhead_fraction == cost.overhead_nbytes / cost.file_nbytes
    # every other file gives the same rows
    assert cl.format.alignment_costs(files[-1], chosen) == from_layout


def test_alignment_costs_default_sweep(sample_layout):
    costs = cl.format.alignment_costs(sample_layout)
    assert [c.alignment for c in costs] == list(DEFAULT_ALIGNMENTS)
    # the payload is the same at every alignment but for the text of .storage_alignment
    assert len({c.data_nbytes - len(str(c.alignment)) for c in costs}) == 1
    assert len({c.storages for c in costs}) == 1
    assert costs[0].padding_nbytes == 0  # alignment 1: no padding at all
    assert costs[DEFAULT_ALIGNMENTS.index(64)] == direct_cost(sample_layout)
    sizes = [c.file_nbytes for c in costs]
    assert sizes[:-1] == sorted(sizes[:-1])  # powers of two: each doubling pads more
    for c in costs:
        moved = cl.format.realign(sample_layout, c.alignment)
        assert c == direct_cost(moved)
    # the order given is the order returned, duplicates included
    assert [c.alignment for c in cl.format.alignment_costs(sample_layout, (4096, 1, 4096))] == [
        4096, 1, 4096]
    assert cl.format.alignment_costs(sample_layout, ()) == ()


@pytest.mark.parametrize("bad", [(0,), (64, 65505), (64.0,), ("64",)])
def test_alignment_costs_reject_bad_alignments(sample_layout, bad):
    with pytest.raises(InvalidArgumentError):
        cl.format.alignment_costs(sample_layout, bad)


def test_alignment_costs_of_an_object_with_nothing_to_align():
    (cost,) = cl.format.alignment_costs({"step": 1, "name": "x"}, (4096,))
    assert (cost.storages, cost.storages_4k_aligned) == (0, 0)
    assert cost.file_nbytes == cl.predict_layout({"step": 1, "name": "x"},
                                                 alignment=4096).file_nbytes
