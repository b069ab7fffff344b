"""ByteSource.read_into: the bytes, counts and errors of ByteSource.read, into a given view."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from ckptlab.errors import TruncatedArchiveError
from ckptlab.format._source import ByteSource

DATA = bytes(range(256)) * 64  # 16 KiB


def _sources(tmp_path: Path) -> list[ByteSource]:
    path = tmp_path / "f.bin"
    path.write_bytes(DATA)
    return [ByteSource(str(path)), ByteSource(DATA), ByteSource(io.BytesIO(DATA)),
            ByteSource(str(path), cache=True)]


@pytest.mark.parametrize("offset, nbytes", [(0, 1), (100, 4000), (16383, 1), (0, len(DATA)),
                                            (5, 0)])
def test_read_into_gives_what_read_gives(tmp_path: Path, offset: int, nbytes: int) -> None:
    for src in _sources(tmp_path):
        with src:
            out = bytearray(nbytes)
            src.read_into(offset, memoryview(out), what="headers")
            assert bytes(out) == src.read(offset, nbytes) == DATA[offset:offset + nbytes]


def test_read_into_counts_like_read(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(DATA)
    with ByteSource(str(path)) as a, ByteSource(str(path)) as b:
        a.read(10, 500)
        b.read_into(10, memoryview(bytearray(500)))
        assert (a.reads, a.bytes_read) == (b.reads, b.bytes_read) == (1, 500)


def test_read_into_past_the_end_is_the_same_error(tmp_path: Path) -> None:
    for src in _sources(tmp_path):
        with src:
            with pytest.raises(TruncatedArchiveError) as into:
                src.read_into(len(DATA) - 10, memoryview(bytearray(20)), what="headers")
            with pytest.raises(TruncatedArchiveError) as read:
                src.read(len(DATA) - 10, 20, what="headers")
            assert str(into.value) == str(read.value) and into.value.offset == len(DATA) - 10


def test_a_file_cut_after_it_was_opened_is_a_short_read(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(DATA)
    with ByteSource(str(path)) as src:
        os.truncate(path, 1000)  # another process rewrites the checkpoint meanwhile
        with pytest.raises(TruncatedArchiveError, match="short read of the headers") as err:
            src.read_into(500, memoryview(bytearray(2000)), what="headers", record="r")
        assert err.value.offset == 500 and err.value.record == "r"
        assert "500 bytes" in str(err.value) and "2000 bytes" in str(err.value)
