"""``storage_offsets`` (ckptlab/format/offsets.py): offsets from headers only, checked
against torch's own reader, in at most three reads, and refusals that name the record."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.serialization import config

import ckptlab as cl
from ckptlab import _torch_compat as tc
from ckptlab.errors import CorruptArchiveError
from ckptlab.testing.archives import mixed_state_dict, rewrite_archive, save_bytes


@pytest.fixture(scope="module")
def layout(sample_file):
    return cl.inspect(sample_file)


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
    reader = tc.pytorch_file_reader()(str(path))
    assert result.offsets == {str(i): reader.get_record_offset(f"data/{i}") for i in range(3000)}
    assert result.reads <= 3



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


@pytest.mark.parametrize("alignment", [1, 64, 4096, 32768])
def test_offsets_are_torchs_at_any_alignment(tmp_path, alignment):
    path = tmp_path / "a.pt"
    with config.patch({"save.storage_alignment": alignment}):
        torch.save(mixed_state_dict(), path)
    result = cl.storage_offsets(path)
    reader = tc.pytorch_file_reader()(str(path))
    assert result.offsets == {k: reader.get_record_offset(f"data/{k}") for k in result.offsets}
    assert len(result.offsets) == 5 and result.alignment == alignment
    assert result.method == "cursor" and result.reads <= 3
    assert cl.storage_offsets(path, scan=True).offsets == result.offsets


def test_no_storages():
    result = cl.storage_offsets(save_bytes({"step": 3}))
    assert result.offsets == {} and result.method == "cursor" and result.reads <= 3


def test_to_dict_is_the_cli_contract(sample_file):
    out = cl.storage_offsets(sample_file).to_dict()
    assert set(out) >= {"offsets", "reads", "bytes_read", "method", "archive_name",
                        "alignment", "reason"}
    assert all(isinstance(k, str) and isinstance(v, int) for k, v in out["offsets"].items())
    assert out["bytes_read"] > 0 and out["reads"] >= 1


def test_scan_checks_the_pickle_against_the_records():
    data = save_bytes(mixed_state_dict())
    # data/0 (40 float32) one byte longer than the pickle's FloatStorage says
    bad = rewrite_archive(data, {"data/0": bytes(161)})
    assert cl.storage_offsets(bad).offsets.keys() == cl.storage_offsets(data).offsets.keys()
    with pytest.raises(CorruptArchiveError, match="differs from the pickle") as info:
        cl.storage_offsets(bad, scan=True)
    assert info.value.record == "archive/data/0"
    assert info.value.expected == 160 and info.value.actual == 161


@pytest.mark.parametrize("text", [b"abc", b"0", b"99999999999", b"-4", b""])
def test_bad_storage_alignment_record(text):
    bad = rewrite_archive(save_bytes(mixed_state_dict()), {".storage_alignment": text})
    with pytest.raises(CorruptArchiveError, match=r"bad \.storage_alignment") as info:
        cl.storage_offsets(bad)
    assert info.value.record == "archive/.storage_alignment"
