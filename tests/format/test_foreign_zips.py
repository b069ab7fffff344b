"""Zips torch.save did not write (ckptlab/format/archive.py and offsets.py).

A Python-zipfile copy of a torch archive (no 'FB' padding, no descriptors), torch archives with
a foreign record between two storages or storages out of pickle order, deflated copies and an
archive comment: ``inspect`` finds the right bytes and ``storage_offsets`` falls back to the
local headers instead of trusting torch's arithmetic.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckptlab
from ckptlab.errors import UnsupportedFormatError
from ckptlab.format import SegmentKind
from ckptlab.testing.archives import (
    local_data_offset,
    mixed_state_dict,
    rewrite_archive,
    save_bytes,
    storage_bytes,
)
from ckptlab.testing.damage import assert_tiles


def check_tiles(layout: ckptlab.format.ArchiveLayout, nbytes: int) -> None:
    assert layout.file_nbytes == nbytes
    assert_tiles(layout.segments, nbytes, layout.path)


def call_all(source: Any) -> list[Callable[[], Any]]:
    return [lambda: ckptlab.inspect(source), lambda: ckptlab.storage_offsets(source),
            lambda: ckptlab.storage_offsets(source, scan=True)]


def rezip(data: bytes, compress: Callable[[str], int] = lambda name: zipfile.ZIP_STORED) -> bytes:
    """The same records, re-written by Python's zipfile (no FB padding, no descriptors)."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name), compress_type=compress(name))
    return out.getvalue()


def check_offsets_point_at_storages(data: bytes, offsets: dict[str, int]) -> None:
    """Each offset is the record's data offset (local header) and holds the storage bytes."""
    zf = zipfile.ZipFile(io.BytesIO(data))
    prefix = zf.namelist()[0].split("/", 1)[0]
    for key, off in offsets.items():
        info = zf.getinfo(f"{prefix}/data/{key}")
        assert off == local_data_offset(data, info), key
        assert data[off:off + info.file_size] == zf.read(info), key


@pytest.mark.parametrize("protocol", [2, 4])
def test_python_zipfile_copy(protocol: int) -> None:
    original = save_bytes(mixed_state_dict(), pickle_protocol=protocol)
    data = rezip(original)
    layout = ckptlab.inspect(data)
    assert layout.format == "torch-zip" and layout.pickle_protocol == protocol
    check_tiles(layout, len(data))
    assert all(r.padding_nbytes == 0 and r.descriptor_nbytes == 0 for r in layout.records)
    loaded = torch.load(io.BytesIO(data), weights_only=False)
    for t in layout.tensors:
        real = loaded[t.path[0]]
        s = layout.storage(t.storage_key)
        assert data[s.data_offset:s.data_offset + s.nbytes] == storage_bytes(real), t
    by_key = {s.key: s.data_offset for s in layout.storages}
    for scan in (False, True):
        result = ckptlab.storage_offsets(data, scan=scan)
        assert result.method == "central_directory" and result.reason
        assert result.offsets == by_key
        check_offsets_point_at_storages(data, result.offsets)
    # the original torch archive: verified arithmetic, same storages
    result = ckptlab.storage_offsets(original)
    assert result.method == "cursor" and result.reason is None
    check_offsets_point_at_storages(original, result.offsets)


def rewrite(data: bytes, extra_after: dict[str, list[tuple[str, bytes]]],
            order: Callable[[list[str]], list[str]] = lambda names: names) -> bytes:
    """The archive re-written by torch's own writer, with foreign records inserted."""
    return rewrite_archive(data, insert_after=extra_after, order=order)


def naive_cursor_offsets(data: bytes) -> dict[str, int]:
    """torch's calculate_storage_offsets: data/0's real offset, then arithmetic (unverified)."""
    from ckptlab.format._zip import record_geometry

    zf = zipfile.ZipFile(io.BytesIO(data))
    prefix = zf.namelist()[0].split("/", 1)[0]
    keys = sorted((n for n in zf.namelist() if n.startswith(f"{prefix}/data/")),
                  key=lambda n: int(n.rsplit("/", 1)[1]))
    cursor = zf.getinfo(keys[0]).header_offset
    out = {}
    for name in keys:
        info = zf.getinfo(name)
        geom = record_geometry(cursor, len(name), info.file_size, 64)
        out[name.rsplit("/", 1)[1]] = geom.data_offset
        cursor = geom.end_offset
    return out


INSERTIONS = {
    "between-0-and-1": {"data/0": [("extra/notes.txt", b"x" * 100)]},
    "empty-record-between": {"data/0": [("extra/empty", b"")]},
    "aligned-record-between": {"data/1": [("extra/blob", b"y" * 64)]},
    "after-last-storage": {"data/3": [("extra/tail", b"z" * 10)]},
}


@pytest.mark.parametrize("insert", list(INSERTIONS.values()), ids=list(INSERTIONS))
def test_foreign_record_between_storages(insert: dict[str, list[tuple[str, bytes]]]) -> None:
    original = save_bytes(mixed_state_dict())
    data = rewrite(original, insert)
    assert torch.load(io.BytesIO(data))["w"].sum() == torch.arange(40.0).sum()
    zf = zipfile.ZipFile(io.BytesIO(data))
    layout = ckptlab.inspect(data)
    check_tiles(layout, len(data))
    truth = {s.key: local_data_offset(data, zf.getinfo(s.record)) for s in layout.storages}
    assert {s.key: s.data_offset for s in layout.storages} == truth
    if "data/3" not in insert:  # torch's unverified arithmetic goes wrong here
        assert naive_cursor_offsets(data) != truth
    for scan in (False, True):
        result = ckptlab.storage_offsets(data, scan=scan)
        assert result.method == "central_directory" and result.reason, result
        assert result.offsets == truth
        check_offsets_point_at_storages(data, result.offsets)


def test_storages_written_out_of_pickle_order() -> None:
    """Records data/1 and data/0 swapped: the arithmetic in pickle order cannot be trusted."""
    def swap(names: list[str]) -> list[str]:
        i, j = names.index("data/0"), names.index("data/1")
        names[i], names[j] = names[j], names[i]
        return names

    data = rewrite(save_bytes(mixed_state_dict()), {}, order=swap)
    zf = zipfile.ZipFile(io.BytesIO(data))
    layout = ckptlab.inspect(data)
    truth = {s.key: local_data_offset(data, zf.getinfo(s.record)) for s in layout.storages}
    assert {s.key: s.data_offset for s in layout.storages} == truth
    for scan in (False, True):
        result = ckptlab.storage_offsets(data, scan=scan)
        assert result.offsets == truth
        check_offsets_point_at_storages(data, result.offsets)
    assert ckptlab.storage_offsets(data, scan=True).method == "central_directory"


def test_rewritten_archive_without_foreign_records_keeps_the_cursor_method() -> None:
    data = rewrite(save_bytes(mixed_state_dict()), {})
    result = ckptlab.storage_offsets(data)
    assert result.method == "cursor" and result.reason is None
    check_offsets_point_at_storages(data, result.offsets)


def test_deflated_copy_is_inspected() -> None:
    data = rezip(save_bytes(mixed_state_dict()), lambda name: zipfile.ZIP_DEFLATED)
    layout = ckptlab.inspect(data)
    check_tiles(layout, len(data))
    assert {r.method for r in layout.records} == {8}
    assert len(layout.tensors) == 6
    for call in call_all(data)[1:]:
        with pytest.raises(UnsupportedFormatError, match="compressed"):
            call()


def test_deflated_storages_give_no_wrong_offsets() -> None:
    original = save_bytes(mixed_state_dict())
    data = rezip(original, lambda name: zipfile.ZIP_DEFLATED if "/data/" in name
                 else zipfile.ZIP_STORED)
    loaded = torch.load(io.BytesIO(data))  # torch inflates them
    assert torch.equal(loaded["w"], torch.arange(40.0).view(5, 8))
    zf = zipfile.ZipFile(io.BytesIO(data))
    for scan in (False, True):
        try:
            result = ckptlab.storage_offsets(data, scan=scan)
        except UnsupportedFormatError:
            continue
        for key, off in result.offsets.items():
            raw = zf.read(f"archive/data/{key}")
            assert data[off:off + len(raw)] == raw, f"offset {off} of storage {key} is wrong"


def test_zip_with_comment() -> None:
    """An archive comment moves the EOCD; inspect still tiles the file."""
    data = save_bytes(mixed_state_dict())
    zf_bytes = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(zf_bytes, "w") as dst:
        dst.comment = b"a comment" * 10
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    out = zf_bytes.getvalue()
    layout = ckptlab.inspect(out)
    check_tiles(layout, len(out))
    assert layout.segments[-1].kind is SegmentKind.EOCD and layout.segments[-1].nbytes == 22 + 90
    result = ckptlab.storage_offsets(out)
    check_offsets_point_at_storages(out, result.offsets)


