"""``read_range``: exactly the file's bytes, from every kind of source, or a named error."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptlab.errors import InvalidArgumentError, TruncatedArchiveError
from ckptlab.format import read_range


@given(data=st.data())
def test_read_range_is_a_slice_of_the_file(small_file, data):
    raw = small_file.read_bytes()
    offset = data.draw(st.integers(0, len(raw)), label="offset")
    nbytes = data.draw(st.integers(0, len(raw) - offset), label="nbytes")
    want = raw[offset:offset + nbytes]
    assert read_range(small_file, offset, nbytes) == want
    assert read_range(str(small_file), offset, nbytes) == want
    assert read_range(raw, offset, nbytes) == want
    with open(small_file, "rb") as f:
        assert read_range(f, offset, nbytes) == want
    assert read_range(io.BytesIO(raw), offset, nbytes) == want


@pytest.mark.parametrize("lo, hi", [(-3, 1), (0, 1), (10, 11), (None, 1)])
def test_read_range_past_the_end_names_file_and_offset(small_file, lo, hi):
    """[n + lo, n + hi) with n the file size (lo None: from byte 0)."""
    n = small_file.stat().st_size
    start = 0 if lo is None else n + lo
    with pytest.raises(TruncatedArchiveError) as info:
        read_range(small_file, start, n + hi - start)
    assert info.value.path == str(small_file)
    assert str(small_file) in str(info.value)
    assert read_range(small_file, n, 0) == b""  # an empty read at the very end is fine


@pytest.mark.parametrize("offset, nbytes", [(-1, 4), (0, -1), (1.0, 4), (0, 4.0), (None, 4)])
def test_read_range_rejects_bad_arguments(small_file, offset, nbytes):
    with pytest.raises(InvalidArgumentError):
        read_range(small_file, offset, nbytes)


def test_read_range_of_a_missing_file(tmp_path):
    with pytest.raises(Exception) as info:
        read_range(tmp_path / "nope.pt", 0, 1)
    assert "nope.pt" in str(info.value)
