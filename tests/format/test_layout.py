"""Golden checks of the layout engine on the embedded sample, against torch and zipfile."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ckptlab as cl
from ckptlab.format.layout import SegmentKind


@pytest.fixture(scope="module")
def layout(sample_file):
    return cl.inspect(sample_file)


def test_records_match_torch_and_zipfile(sample_file, layout):
    reader = torch._C.PyTorchFileReader(str(sample_file))
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


@pytest.mark.parametrize("kind", ["path", "fileobj", "bytes"])
def test_storage_offsets_in_at_most_three_reads(sample_file, layout, kind):
    src = {"path": sample_file, "fileobj": open(sample_file, "rb"),
           "bytes": sample_file.read_bytes()}[kind]
    result = cl.storage_offsets(src)
    assert result.offsets == {s.key: s.data_offset for s in layout.storages}
    assert list(result.offsets) == [s.key for s in layout.storages]
    assert result.method == "cursor" and result.reason is None
    assert 1 <= result.reads <= 3
    assert result.alignment == 64 and result.archive_name == "sample"
    assert cl.storage_offsets(src, scan=False).offsets == result.offsets


def test_storage_offsets_reads_stay_constant_with_many_storages(tmp_path):
    path = tmp_path / "many.pt"
    torch.save({f"t{i}": torch.full((3,), float(i)) for i in range(3000)}, path)
    result = cl.storage_offsets(path)
    reader = torch._C.PyTorchFileReader(str(path))
    assert result.offsets == {str(i): reader.get_record_offset(f"data/{i}") for i in range(3000)}
    assert result.reads <= 3


def test_predict_layout_equals_the_written_file(sample_file, layout):
    predicted = cl.predict_layout(cl.samples.tiny_checkpoint(), archive_name="sample")
    assert predicted.file_nbytes == layout.file_nbytes
    for p, r in zip(predicted.records, layout.records, strict=True):
        assert (p.name, p.header_offset, p.data_offset, p.data_nbytes, p.padding_nbytes,
                p.extra_nbytes, p.descriptor_nbytes) == (
            r.name, r.header_offset, r.data_offset, r.data_nbytes, r.padding_nbytes,
            r.extra_nbytes, r.descriptor_nbytes)
    assert [s.kind for s in predicted.segments] == [s.kind for s in layout.segments]
    assert predicted.storages == tuple(
        s.__class__(**{**{f: getattr(s, f) for f in s.__dataclass_fields__}})
        for s in layout.storages)
    assert predicted.tensors == layout.tensors


def test_predict_layout_at_4096_matches_torch(tmp_path):
    from torch.utils.serialization import config

    state = cl.samples.tiny_gpt()
    path = tmp_path / "gds.pt"
    with config.patch({"save.storage_alignment": 4096}):
        torch.save(state, path)
    real = cl.inspect(path)
    predicted = cl.predict_layout(state, alignment=4096, archive_name="gds")
    assert real.alignment == 4096 and real.storage_alignment == 4096
    assert [(r.data_offset, r.end_offset) for r in real.records] == [
        (r.data_offset, r.end_offset) for r in predicted.records]
    assert predicted.file_nbytes == real.file_nbytes


@pytest.mark.parametrize("alignment", [0, -1, 65505, 1.5, "64"])
def test_predict_layout_rejects_alignments_torch_cannot_write(alignment):
    with pytest.raises(cl.errors.InvalidArgumentError, match="alignment"):
        cl.predict_layout({"x": torch.zeros(1)}, alignment=alignment)


def test_archive_name_for():
    assert cl.archive_name_for("/a/b/model.pt") == "model"
    assert cl.archive_name_for("a.b.c") == "a.b"
    assert cl.archive_name_for("weights") == "weights"
    assert cl.archive_name_for("modèle.pt") == "archive"


def test_fileobj_and_bytes_inputs_give_the_same_layout(sample_file, layout):
    from_bytes = cl.inspect(sample_file.read_bytes())
    with open(sample_file, "rb") as f:
        from_file = cl.inspect(f)
    assert from_bytes.records == from_file.records == layout.records
    assert cl.inspect(io.BytesIO(sample_file.read_bytes())).storages == layout.storages


@given(cursor=st.integers(0, 2**34), name_nbytes=st.integers(1, 300),
       nbytes=st.one_of(st.integers(0, 2**34), st.sampled_from([0xFFFFFFFE, 0xFFFFFFFF])),
       alignment=st.integers(1, 65504))
def test_cursor_arithmetic_equals_record_geometry(cursor, name_nbytes, nbytes,
                                                          alignment):
    from ckptlab.format import _zip
    from ckptlab.format.offsets import _cursor_offsets

    geom = _zip.record_geometry(cursor, name_nbytes, nbytes, alignment)
    entry = _zip.CentralEntry("x" * name_nbytes, name_nbytes, 0x8 if nbytes else 0, 0, 0,
                              nbytes, nbytes, cursor, 0, 46)
    trailer = _zip.Trailer(geom.end_offset, 0, 1, 0, 22, None, 0, None)
    offsets, reason = _cursor_offsets([entry], [entry], trailer, alignment)
    assert reason is None and offsets == [geom.data_offset]
