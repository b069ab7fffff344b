"""Golden checks of the layout engine on the embedded sample, against torch and zipfile."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

import ckptlab as cl
from ckptlab import _torch_compat as tc
from ckptlab.format.layout import SegmentKind


@pytest.fixture(scope="module")
def layout(sample_file):
    return cl.inspect(sample_file)


def test_records_match_torch_and_zipfile(sample_file, layout):
    reader = tc.pytorch_file_reader()(str(sample_file))
    infos = zipfile.ZipFile(sample_file).infolist()
    assert [r.name for r in layout.records] == [i.filename for i in infos]
    for rec, info in zip(layout.records, infos):
        assert rec.data_offset == reader.get_record_offset(rec.short_name)
        assert rec.header_offset == info.header_offset
        assert rec.data_nbytes == info.file_size == info.compress_size
        assert rec.crc32 == info.CRC
        assert rec.header_nbytes == 30
        assert rec.data_offset % 64 == 0  # torch aligns every record, not only storages


def test_segments_tile_the_file(layout):
    cursor = 0
    for seg in layout.segments:
        assert seg.offset == cursor and seg.nbytes > 0
        cursor = seg.end_offset
    assert cursor == layout.file_nbytes
    assert not [s for s in layout.segments if s.kind is SegmentKind.UNKNOWN]
    tail = [s.kind for s in layout.segments[-4:]]
    assert tail == [SegmentKind.CENTRAL_DIRECTORY, SegmentKind.ZIP64_EOCD,
                    SegmentKind.ZIP64_LOCATOR, SegmentKind.EOCD]
    assert layout.file_nbytes == layout.central_directory_offset + \
        layout.central_directory_nbytes + 98


def test_small_records_and_metadata(layout):
    assert layout.archive_name == "sample"
    assert (layout.format_version, layout.storage_alignment, layout.byteorder) == ("1", 64,
                                                                                   "little")
    assert layout.pickle_protocol == 2
    assert [r.short_name for r in layout.records[:4]] == [
        "data.pkl", ".format_version", ".storage_alignment", "byteorder"]
    assert [r.short_name for r in layout.records[-2:]] == ["version", ".data/serialization_id"]
    assert layout.alignment >= 64 and layout.alignment & (layout.alignment - 1) == 0


def test_tensors_match_torch_load(sample_file, layout):
    loaded = torch.load(sample_file, weights_only=True)
    storages = {s.key: s for s in layout.storages}
    for info in layout.tensors:
        obj = loaded
        for key in info.path:
            obj = obj[key]
        assert str(obj.dtype) == f"torch.{info.dtype}"
        assert tuple(obj.shape) == info.shape and tuple(obj.stride()) == info.stride
        assert obj.storage_offset() == info.storage_offset
        assert storages[info.storage_key].nbytes == obj.untyped_storage().nbytes()
    by_path = {t.path: t for t in layout.tensors}
    assert by_path[("model", "lm_head.weight")].storage_key == \
        by_path[("model", "transformer.wte.weight")].storage_key
    dtypes = {t.dtype for t in layout.tensors}
    assert {"float32", "bfloat16", "int64", "bool"} <= dtypes


def test_storage_bytes_are_where_the_layout_says(sample_file, layout):
    loaded = torch.load(sample_file, weights_only=True)
    raw = sample_file.read_bytes()
    emb = loaded["model"]["transformer.wte.weight"]
    key = {t.path: t for t in layout.tensors}[("model", "transformer.wte.weight")].storage_key
    s = layout.storage(key)
    assert raw[s.data_offset:s.data_offset + s.nbytes] == bytes(emb.untyped_storage())


def test_fileobj_and_bytes_inputs_give_the_same_layout(sample_file, layout):
    from_bytes = cl.inspect(sample_file.read_bytes())
    with open(sample_file, "rb") as f:
        from_file = cl.inspect(f)
    assert from_bytes.records == from_file.records == layout.records
    assert cl.inspect(io.BytesIO(sample_file.read_bytes())).storages == layout.storages
