"""zip64 boundaries of torch.save archives, on sparse files (no 4 GiB of memory or disk).

``torch.empty(n, dtype=torch.uint8)`` does not touch its memory and ``skip_data`` makes the
writer seek past the data, so a 4-8 GiB archive costs a few KiB of disk. Each test checks
ckptlab's ``inspect`` against torch's ``PyTorchFileReader.get_record_offset``, Python's
``zipfile`` (central directory only; the data is never read), the ``_checkpoint_offset`` of a
load under FakeTensorMode, ``storage_offsets`` and ``predict_layout``, and the zip64 rules themselves: a zip64
extra exists iff the size or the header offset is >= 0xFFFFFFFF (inclusive), 20 bytes for a
big size, 12 for a big offset, 28 for both; the data descriptor is then 24 bytes.
"""

from __future__ import annotations

import itertools
import shutil
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab
from ckptlab import _torch_compat as tc
from ckptlab.format import SegmentKind

U32 = 0xFFFFFFFF
GiB = 1 << 30


def big(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor: virtual memory only, never touched."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except RuntimeError as exc:  # a strict overcommit policy may refuse 4 GiB of address space
        pytest.skip(f"cannot reserve {nbytes} bytes of virtual memory: {exc}")


@pytest.fixture
def bigdir(tmp_path: Path) -> Iterator[Path]:
    """A directory for sparse multi-GiB files, emptied after the test."""
    if shutil.disk_usage(tmp_path).free < GiB:
        pytest.skip("less than 1 GiB free for sparse zip64 files")
    yield tmp_path
    for p in tmp_path.iterdir():
        if p.is_file():
            p.unlink()


def save_sparse(obj: Any, path: Path, alignment: int = 64) -> Path:
    from torch.utils.serialization import config

    with config.patch({"save.storage_alignment": alignment}):
        with torch.serialization.skip_data():
            torch.save(obj, path)
    st = path.stat()
    if hasattr(st, "st_blocks"):  # the data are holes: only headers take disk
        assert st.st_blocks * 512 < 64 * 1024 * 1024, "file system does not keep files sparse"
    return path


def expected_zip64_extra(header_offset: int, nbytes: int) -> int:
    big_size, big_offset = nbytes >= U32, header_offset >= U32
    return (4 + 16 * big_size + 8 * big_offset) if (big_size or big_offset) else 0


def check_archive(path: Path, obj: Any, alignment: int = 64) -> ckptlab.format.ArchiveLayout:
    """Everything ckptlab says about ``path`` against torch, zipfile and the zip64 rules."""
    layout = ckptlab.inspect(path)
    size = path.stat().st_size
    assert layout.file_nbytes == size
    assert layout.archive_name == ckptlab.format.archive_name_for(path)

    # torch's reader: every record's data offset
    reader = tc.pytorch_file_reader()(str(path))
    assert sorted(reader.get_all_records()) == sorted(r.short_name for r in layout.records)
    for r in layout.records:
        assert r.data_offset == reader.get_record_offset(r.short_name), r.name

    # zip64 rules, record by record
    for r in layout.records:
        z = expected_zip64_extra(r.header_offset, r.data_nbytes)
        assert r.zip64_extra_nbytes == z, r.name
        assert r.extra_nbytes == z + 4 + r.padding_nbytes, r.name
        assert r.data_offset == r.header_offset + 30 + r.name_nbytes + r.extra_nbytes, r.name
        assert r.data_offset % alignment == 0, r.name
        assert r.descriptor_nbytes == (0 if r.data_nbytes == 0 else 24 if z else 16), r.name
    assert layout.zip64 == any(r.zip64_extra_nbytes for r in layout.records)

    # Python's zipfile reads the same central directory (sizes and offsets from zip64 extras)
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
    assert [i.filename for i in infos] == [r.name for r in layout.records]
    cd_nbytes = 0
    for info, r in zip(infos, layout.records):
        assert (info.header_offset, info.file_size, info.compress_size, info.CRC) == (
            r.header_offset, r.uncompressed_nbytes, r.data_nbytes, r.crc32), r.name
        fields = 2 * (r.data_nbytes >= U32) + (r.header_offset >= U32)
        assert len(info.extra) == (4 + 8 * fields if fields else 0), r.name
        cd_nbytes += 46 + r.name_nbytes + len(info.extra)
    assert layout.central_directory_nbytes == cd_nbytes
    assert layout.central_directory_offset == max(r.end_offset for r in layout.records)
    assert size == layout.central_directory_offset + cd_nbytes + 98

    # the trailer: zip64 EOCD, locator, and an EOCD whose fields saturate
    with open(path, "rb") as f:
        f.seek(size - 98)
        tail = f.read(98)
    assert tail[:4] == b"PK\x06\x06" and tail[56:60] == b"PK\x06\x07" and tail[76:80] == b"PK\x05\x06"
    z64_cd_nbytes, z64_cd_offset = struct.unpack_from("<QQ", tail, 40)
    assert (z64_cd_nbytes, z64_cd_offset) == (cd_nbytes, layout.central_directory_offset)
    eocd_cd_nbytes, eocd_cd_offset = struct.unpack_from("<II", tail, 76 + 12)
    assert eocd_cd_offset == min(layout.central_directory_offset, U32)
    assert eocd_cd_nbytes == min(cd_nbytes, U32)
    assert (layout.zip64_eocd_offset, layout.zip64_locator_offset, layout.eocd_offset) == (
        size - 98, size - 42, size - 22)

    # segments tile the file
    segs = layout.segments
    assert segs[0].offset == 0 and segs[-1].end_offset == size
    assert all(a.end_offset == b.offset for a, b in itertools.pairwise(segs))
    assert not [s for s in segs if s.kind is SegmentKind.UNKNOWN]
    assert sum(s.nbytes for s in segs if s.kind is SegmentKind.ZIP64_EXTRA) == sum(
        r.zip64_extra_nbytes for r in layout.records)

    # storage offsets: arithmetic, torch's meta load, and the layout agree
    expected = {s.key: s.data_offset for s in layout.storages}
    for scan in (False, True):  # central directory order / the pickle's order
        res = ckptlab.storage_offsets(path, scan=scan)
        assert res.offsets == expected, scan
        assert res.method == "cursor", (scan, res.reason)
        assert res.reads <= 3, scan
    with tc.fake_tensor_mode()():  # reads no bytes; records every storage's file offset
        loaded = torch.load(path, weights_only=False)
    for t in layout.tensors:
        real = loaded
        for k in t.path:
            real = real[k]
        assert tc.checkpoint_offset(real.untyped_storage()) == expected[t.storage_key], t.path
        assert (tuple(real.shape), real.stride(), real.storage_offset()) == (
            t.shape, t.stride, t.storage_offset), t.path

    # the prediction is the file
    predicted = ckptlab.predict_layout(obj, alignment=alignment,
                                       archive_name=ckptlab.format.archive_name_for(path))
    assert predicted.file_nbytes == size
    assert len(predicted.records) == len(layout.records)
    real_by_name = {r.name: r for r in layout.records}
    for p in predicted.records:
        a = real_by_name[p.name]
        assert (p.header_offset, p.zip64_extra_nbytes, p.padding_nbytes, p.data_offset,
                p.data_nbytes, p.descriptor_nbytes, p.extra_nbytes) == (
            a.header_offset, a.zip64_extra_nbytes, a.padding_nbytes, a.data_offset,
            a.data_nbytes, a.descriptor_nbytes, a.extra_nbytes), p.name
    assert (predicted.central_directory_offset, predicted.central_directory_nbytes) == (
        layout.central_directory_offset, layout.central_directory_nbytes)
    assert [(s.key, s.data_offset) for s in predicted.storages] == [
        (s.key, s.data_offset) for s in layout.storages]
    assert [(s.kind, s.offset, s.nbytes) for s in predicted.segments] == [
        (s.kind, s.offset, s.nbytes) for s in layout.segments]
    assert predicted.zip64 == layout.zip64
    return layout


def test_record_of_exactly_0xffffffff_bytes(bigdir: Path) -> None:
    obj = {"w": big(U32)}
    path = save_sparse(obj, bigdir / "exact.pt")
    layout = check_archive(path, obj)
    r = layout.record("data/0")
    assert (r.data_nbytes, r.zip64_extra_nbytes, r.descriptor_nbytes) == (U32, 20, 24)
    # everything after it sits past 4 GiB: offset-only zip64 extras
    for name in ("version", ".data/serialization_id"):
        assert layout.record(name).header_offset >= U32
        assert layout.record(name).zip64_extra_nbytes == 12
        assert layout.record(name).descriptor_nbytes == 24
    assert layout.zip64


def test_record_of_0xfffffffe_bytes_has_no_zip64_extra(bigdir: Path) -> None:
    obj = {"w": big(U32 - 1)}
    path = save_sparse(obj, bigdir / "below.pt")
    layout = check_archive(path, obj)
    r = layout.record("data/0")
    assert (r.data_nbytes, r.zip64_extra_nbytes, r.descriptor_nbytes) == (U32 - 1, 0, 16)
    # the record after it starts past 0xFFFFFFFF: offset zip64 extra only
    nxt = layout.record("version")
    assert nxt.header_offset >= U32 and nxt.zip64_extra_nbytes == 12


@pytest.mark.parametrize("alignment", [64, 1, 1000])
def test_headers_past_4gib_after_a_large_record(bigdir: Path, alignment: int) -> None:
    small = torch.arange(10, dtype=torch.float32)
    obj = {"big": big(U32 - 15), "a": small, "view": small[3:7], "empty": torch.empty(0),
           "b": torch.ones(2, 3, dtype=torch.float64).t(), "p": torch.nn.Parameter(torch.ones(4))}
    path = save_sparse(obj, bigdir / "later.pt", alignment)
    layout = check_archive(path, obj, alignment)
    assert layout.record("data/0").zip64_extra_nbytes == 0  # 0xFFFFFFF0 bytes, at a small offset
    later = [r for r in layout.records if r.header_offset >= U32]
    assert len(later) == len(layout.records) - 5  # all but the four small records and data/0
    for r in later:
        assert r.zip64_extra_nbytes == 12, r.name
        assert r.descriptor_nbytes == (24 if r.data_nbytes else 0), r.name
    empty = next(s for s in layout.storages if s.nbytes == 0)
    assert layout.record(f"data/{empty.key}").descriptor_nbytes == 0
    assert layout.central_directory_offset > U32


def _first_tensor_size_for_header_at(target: int, alignment: int) -> int:
    """Size of data/0 that puts data/1's local header exactly at ``target`` (via predict)."""
    def layout_for(n: int) -> ckptlab.format.ArchiveLayout:
        return ckptlab.predict_layout({"a": big(n), "b": torch.ones(3)}, alignment=alignment,
                                      archive_name="at")
    n = target - 1024
    for _ in range(4):  # the pickle (numel's encoding) can shift data/0; converge
        r0 = layout_for(n).record("data/0")
        n = target - r0.data_offset - 16
    assert layout_for(n).record("data/1").header_offset == target
    return n


@pytest.mark.parametrize("target, zip64", [(U32 - 1, False), (U32, True), (U32 + 1, True)])
@pytest.mark.parametrize("alignment", [64, 7])
def test_header_at_the_zip64_offset_threshold(bigdir: Path, target: int, zip64: bool,
                                              alignment: int) -> None:
    n = _first_tensor_size_for_header_at(target, alignment)
    assert n < U32
    obj = {"a": big(n), "b": torch.ones(3)}
    path = save_sparse(obj, bigdir / "at.pt", alignment)
    layout = check_archive(path, obj, alignment)
    r = layout.record("data/1")
    assert r.header_offset == target
    assert r.zip64_extra_nbytes == (12 if zip64 else 0)
    assert r.descriptor_nbytes == (24 if zip64 else 16)
    assert layout.record("data/0").zip64_extra_nbytes == 0


def test_large_record_past_4gib_has_both_zip64_fields(bigdir: Path) -> None:
    obj = {"a": big(U32 - 15), "b": big(U32 + 5), "c": torch.ones(2)}
    path = save_sparse(obj, bigdir / "both.pt")
    layout = check_archive(path, obj)
    assert layout.record("data/0").zip64_extra_nbytes == 0
    r = layout.record("data/1")
    assert r.header_offset >= U32 and r.data_nbytes >= U32
    assert (r.zip64_extra_nbytes, r.descriptor_nbytes) == (28, 24)
    assert layout.record("data/2").zip64_extra_nbytes == 12
    assert layout.file_nbytes > 2 * U32

