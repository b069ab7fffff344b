"""ByteSource.read_into: the bytes, counts and errors of ByteSource.read, into a given view."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from ckptlab.errors import TruncatedArchiveError
from ckptlab.source._bytes import ByteSource

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


def _spans(total: int, count: int, seed: int) -> tuple[list[int], list[int]]:
    """``count`` sorted, non-overlapping spans inside ``total`` bytes, gaps of every size."""
    import random

    rng = random.Random(seed)
    starts, lengths, at = [], [], 0
    for _ in range(count):
        at += rng.choice([0, 1, 7, 300, 5000])
        length = rng.choice([0, 1, 30, 200])
        if at + length > total:
            break
        starts.append(at)
        lengths.append(length)
        at += length
    return starts, lengths


@pytest.mark.parametrize("seed", range(4))
def test_gather_into_gives_the_spans_back_to_back(tmp_path: Path, seed: int) -> None:
    big = bytes(range(251)) * 12_000  # 3 MB: gaps past GATHER_GAP, more spans than IOV_MAX
    path = tmp_path / "g.bin"
    path.write_bytes(big)
    starts, lengths = _spans(len(big) - 200_000, 1500, seed)
    starts += [len(big) - 150_000, len(big) - 10]  # one gap larger than GATHER_GAP
    lengths += [100, 10]
    expected = b"".join(big[s:s + n] for s, n in zip(starts, lengths))
    for src in (ByteSource(str(path)), ByteSource(big), ByteSource(io.BytesIO(big)),
                ByteSource(str(path), cache=True)):
        with src:
            out = bytearray(len(expected))
            src.gather_into(starts, lengths, memoryview(out), what="local headers")
            assert bytes(out) == expected
            assert src.bytes_read >= len(expected)


def test_gather_into_a_file_takes_few_calls_and_requests_skip_long_gaps(tmp_path: Path) -> None:
    from ckptlab.source._bytes import _IOV_MAX, GATHER_GAP, READ_GAP

    data = bytes(4_000_000)
    path = tmp_path / "g.bin"
    path.write_bytes(data)
    starts = list(range(0, 2_000_000, 4000))  # 500 spans 4000 bytes apart
    lengths = [100] * len(starts)
    with ByteSource(str(path)) as src:
        src.gather_into(starts, lengths, memoryview(bytearray(100 * len(starts))))
        assert src.reads == -(-len(starts) // (_IOV_MAX // 2))  # one call per IOV_MAX/2 spans
    far = [0, GATHER_GAP + 1000, 2 * GATHER_GAP + 2000]  # gaps too long to read through
    with ByteSource(str(path)) as src:
        src.gather_into(far, [10, 10, 10], memoryview(bytearray(30)))
        assert src.reads == 3 and src.bytes_read == 30
    with ByteSource(io.BytesIO(data)) as src:  # a request per cluster: READ_GAP apart or less
        src.gather_into([0, 100 + READ_GAP, 300 + 3 * READ_GAP], [100, 100, 100],
                        memoryview(bytearray(300)))
        assert src.reads == 2


def test_gather_into_past_the_end_or_from_a_cut_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(DATA)
    for src in _sources(tmp_path):
        with src:
            with pytest.raises(TruncatedArchiveError) as err:
                src.gather_into([10, len(DATA) - 5], [5, 10], memoryview(bytearray(15)),
                                what="local headers")
            assert err.value.offset == len(DATA) - 5 and "local headers" in str(err.value)
    with ByteSource(str(path)) as src:
        os.truncate(path, 1000)  # rewritten by another process after the open
        with pytest.raises(TruncatedArchiveError, match="short read of the local headers"):
            src.gather_into([10, 2000], [5, 10], memoryview(bytearray(15)),
                            what="local headers")
