"""ckptlab.testing.damage and ckptlab.testing.archives: the helpers the damage and format
tests share."""

from __future__ import annotations

import io
import zipfile
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptlab as cl
from ckptlab.testing import strategies as cst
from ckptlab.testing.archives import (
    local_data_offset,
    mixed_state_dict,
    rewrite_archive,
    save_bytes,
)
from ckptlab.testing.damage import assert_tiles, bit_flips, flip_bit, open_and_read, truncations


def test_flip_bit_changes_one_bit():
    data = bytes(range(16))
    for i in range(16):
        out = flip_bit(data, i)
        diff = [(a ^ b) for a, b in zip(data, out)]
        assert diff[i] == 1 << (i % 8) and sum(1 for d in diff if d) == 1
    with pytest.raises(IndexError):
        flip_bit(data, 16)


def test_bit_flips_cover_the_ranges():
    data = bytes(10)
    assert [i for i, _ in bit_flips(data, [(2, 4), (7, 8)])] == [2, 3, 7]
    assert [i for i, _ in bit_flips(data)] == list(range(10))
    assert all(out != data for _, out in bit_flips(data))


def test_truncations():
    assert list(truncations(b"abcd")) == [b"", b"a", b"ab", b"abc"]
    assert list(truncations(b"abcdefg", step=3)) == [b"", b"abc", b"abcdef"]
    with pytest.raises(ValueError):
        list(truncations(b"ab", step=0))


def test_open_and_read(tmp_path):
    data = save_bytes(mixed_state_dict())
    ck = open_and_read(data)
    assert ck is not None and set(ck.tensors) == set(mixed_state_dict())
    assert open_and_read(data[:100]) is None  # a CkptlabError: swallowed
    assert open_and_read(data, tmp_path / "c.pt").files[0].nbytes == len(data)


def test_assert_tiles():
    seg = [SimpleNamespace(offset=o, nbytes=n, end_offset=o + n) for o, n in ((0, 4), (4, 6))]
    assert_tiles(seg, 10)
    for bad, nbytes in ((seg, 11), (seg[1:], 6), ([seg[0], seg[0]], 8)):
        with pytest.raises(AssertionError):
            assert_tiles(bad, nbytes)


def test_rewrite_archive_keeps_what_it_does_not_change():
    data = save_bytes(mixed_state_dict())
    again = rewrite_archive(data)
    assert cl.inspect(again).storages == cl.inspect(data).storages
    moved = rewrite_archive(data, {"data/1": bytes(56)}, insert_after={"data/0": [("x", b"y")]})
    zf = zipfile.ZipFile(io.BytesIO(moved))
    assert zf.read("archive/data/1") == bytes(56) and zf.read("archive/x") == b"y"
    info = zf.getinfo("archive/data/1")
    assert moved[local_data_offset(moved, info):][:56] == bytes(56)
    fake = zipfile.ZipInfo("fake")
    fake.header_offset = 5  # inside the first header: no signature there
    with pytest.raises(ValueError, match="no local header signature at offset 5"):
        local_data_offset(moved, fake)


@settings(max_examples=30)
@given(st.data())
def test_overwritten_bytes_stay_in_their_ranges(data):
    original = bytes(64)
    out = data.draw(cst.overwritten_bytes(original, [(8, 12), (40, 41)], max_count=3))
    changed = [i for i, (a, b) in enumerate(zip(original, out)) if a != b]
    assert len(out) == 64 and len(changed) <= 3
    assert all(8 <= i < 12 or i == 40 for i in changed)
    with pytest.raises(ValueError):
        data.draw(cst.overwritten_bytes(original, [(3, 3)]))
