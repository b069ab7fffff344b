"""``predict_layout``, ``archive_name_for``, ``alignment_costs`` and ``layout_records``
(ckptlab/format/predict.py): the layout torch.save would write, without writing it.

``realign`` has its own module (test_realign.py); the property tests against torch.save over
random objects are in tests/property/.
"""

from __future__ import annotations

import io
import itertools
import warnings
import zipfile

import pytest
import torch

import ckptlab as cl
from ckptlab.errors import InvalidArgumentError, UnsupportedFormatError
from ckptlab.format.predict import layout_records, torch_records
from ckptlab.testing.archives import local_data_offset, mixed_state_dict, save_bytes
from ckptlab.testing.damage import assert_tiles


@pytest.fixture(scope="module")
def layout(sample_file):
    return cl.inspect(sample_file)


def test_predict_layout_equals_the_written_file(sample_file, layout):
    predicted = cl.predict_layout(cl.samples.tiny_checkpoint(), archive_name="sample")
    assert predicted.file_nbytes == layout.file_nbytes
    for p, r in zip(predicted.records, layout.records, strict=True):
        assert (p.name, p.header_offset, p.data_offset, p.data_nbytes, p.padding_nbytes,
                p.extra_nbytes, p.descriptor_nbytes) == (
            r.name, r.header_offset, r.data_offset, r.data_nbytes, r.padding_nbytes,
            r.extra_nbytes, r.descriptor_nbytes)
    assert [s.kind for s in predicted.segments] == [s.kind for s in layout.segments]
    assert predicted.storages == layout.storages
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
    assert cl.format.archive_name_for("/a/b/model.pt") == "model"
    assert cl.format.archive_name_for("a.b.c") == "a.b"
    assert cl.format.archive_name_for("weights") == "weights"
    assert cl.format.archive_name_for("modèle.pt") == "archive"




@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("alignment", [1, 7, 64, 4096])
def test_prediction_is_the_file_torch_writes(alignment, protocol):
    from torch.utils.serialization import config

    obj = mixed_state_dict()
    with config.patch({"save.storage_alignment": alignment}):
        data = save_bytes(obj, pickle_protocol=protocol)
    predicted = cl.predict_layout(obj, alignment=alignment, pickle_protocol=protocol)
    assert predicted.file_nbytes == len(data)
    assert_tiles(predicted.segments, len(data), "predicted")
    zf = zipfile.ZipFile(io.BytesIO(data))
    assert [r.name for r in predicted.records] == zf.namelist()
    for r in predicted.records:
        info = zf.getinfo(r.name)
        assert (r.header_offset, r.data_offset, r.data_nbytes) == (
            info.header_offset, local_data_offset(data, info), info.file_size), r.name
    assert predicted.storage_alignment == alignment and predicted.pickle_protocol == protocol
    assert all(s.data_offset % alignment == 0 for s in predicted.storages)


def test_torch_records_are_the_write_order():
    records, pickle = torch_records(mixed_state_dict())
    data = save_bytes(mixed_state_dict())
    zf = zipfile.ZipFile(io.BytesIO(data))
    assert [f"archive/{n}" for n, _ in records] == zf.namelist()
    assert pickle == zf.read("archive/data.pkl")
    sizes = dict(records)
    assert sizes["data/0"] == 160 and sizes["version"] == len(zf.read("archive/version"))


def test_layout_records_place_back_to_back():
    placed, cd_offset, cd_nbytes = layout_records([("a", 10), ("data/0", 100), ("b", 0)],
                                                  alignment=64, archive_name="x")
    assert [r.name for r in placed] == ["x/a", "x/data/0", "x/b"]
    assert placed[0].header_offset == 0
    for before, after in itertools.pairwise(placed):
        assert after.header_offset == before.end_offset
    assert all(r.data_offset % 64 == 0 for r in placed)
    assert cd_offset == placed[-1].end_offset and cd_nbytes > 0


def test_alignment_costs_agree_with_predictions():
    obj = mixed_state_dict()
    rows = cl.format.alignment_costs(obj, (1, 64, 4096))
    assert [r.alignment for r in rows] == [1, 64, 4096]
    for row in rows:
        predicted = cl.predict_layout(obj, alignment=row.alignment)
        assert row.file_nbytes == predicted.file_nbytes
        assert row.padding_nbytes == predicted.padding_nbytes
        assert row.overhead_nbytes == predicted.overhead_nbytes
        assert row.storages == sum(1 for s in predicted.storages if s.nbytes)
        assert row.storages_4k_aligned == sum(
            1 for s in predicted.storages if s.nbytes and s.data_offset % 4096 == 0)
        assert row.overhead_fraction == row.overhead_nbytes / row.file_nbytes
    assert rows[-1].storages_4k_aligned == rows[-1].storages == 4  # the empty one has none
    # a layout of the file gives the same rows as the object
    layout_rows = cl.format.alignment_costs(cl.predict_layout(obj), (1, 64, 4096))
    assert layout_rows == rows


def test_alignment_costs_refuse_other_formats():
    safetensors = pytest.importorskip("safetensors.torch")
    layout = cl.inspect(safetensors.save({"a": torch.ones(2)}))
    with pytest.raises(InvalidArgumentError, match="torch-zip"):
        cl.format.alignment_costs(layout, (64,))


def test_objects_torch_cannot_save_without_data():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
        q = torch.quantize_per_tensor(torch.ones(4), 0.5, 0, torch.qint8)
    with pytest.raises(UnsupportedFormatError, match="predicting the layout"):
        cl.predict_layout({"q": q})
