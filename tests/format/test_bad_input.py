"""Bad input: truncated and mutated archives raise ckptlab errors, never anything else.

Every prefix of a small torch.save archive, and a few thousand seeded random mutations of it
(1-4 overwritten bytes, little-endian "interesting" values written over length and offset
fields, inserted and deleted bytes; weighted towards data.pkl, the local headers and the
central directory / trailer), go through ``inspect`` and ``storage_offsets``. Each call must
either return a sane result (segments tile the file, offsets inside it, both functions agree)
or raise an :class:`~ckptlab.errors.ArchiveError`: a ``struct.error``, ``IndexError``,
``KeyError``, ``UnicodeError``, ``zlib.error``, ``RecursionError``, ``MemoryError``... fails.

Each call is also watched, by measures that give the same number on every run: more than
``file size / 4 + 20,000`` Python calls (counted by :mod:`ckptlab.testing.work`, which stops
the call there) is work sized from a corrupt field rather than from the file, as is a
``tracemalloc`` peak above ``16 x file size + 4 MiB``. A loop that calls nothing is left to the
tests' ``timeout`` marks (a hang guard, not a measure of speed).
"""

from __future__ import annotations

import functools
import io
import os
import random
import struct
import tracemalloc
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptlab
from ckptlab.errors import (
    ArchiveError,
    CorruptArchiveError,
    TruncatedArchiveError,
    UnsupportedFormatError,
)
from ckptlab.format import SegmentKind
from ckptlab.format._pickle import scan_pickle
from ckptlab.testing.archives import rewrite_archive
from ckptlab.testing.work import WorkLimitExceeded, counting

MiB = 1 << 20


def storage_offsets_scanned(source: Any) -> ckptlab.format.StorageOffsets:
    """``storage_offsets`` in torch's pickle order (parses data.pkl with the scanner)."""
    return ckptlab.storage_offsets(source, scan=True)


FUNCTIONS: tuple[Callable[[Any], Any], ...] = (ckptlab.inspect, ckptlab.storage_offsets,
                                               storage_offsets_scanned)


def memory_limit(file_nbytes: int) -> int:
    return 16 * file_nbytes + 4 * MiB


def work_limit(file_nbytes: int) -> int:
    """Python calls one call may make (``ckptlab.testing.work``): the most seen is ~2,000 on
    the ~3 KiB archive and ~19,000 on the 1.4 MB sample (its 10 KB data.pkl); a loop run as
    many times as a corrupt count or length says passes this long before it could hang."""
    return file_nbytes // 4 + 20_000


# --------------------------------------------------------------------------------------------
# the archive under test
# --------------------------------------------------------------------------------------------
def build_state(protocol: int = 2) -> dict[str, Any]:
    """A few small tensors: a shared storage with views, bf16, fp16, int64, bool, nesting."""
    base = torch.arange(24, dtype=torch.float32)
    return {
        "weight": base.view(4, 6),
        "view": base[6:18].view(3, 4),  # same storage, element offset 6
        "column": base.view(4, 6)[:, 1],  # same storage, stride 6
        "bf16": torch.linspace(-1, 1, 5).to(torch.bfloat16),
        "nested": OrderedDict(
            ids=torch.arange(4),
            mask=torch.tensor([True, False, True]),
            stack=[torch.full((2, 2), 0.5, dtype=torch.float16), (base,)],
        ),
        "step": 7,
        "name": "tiny",
    }


@functools.cache
def small_archive(protocol: int = 2) -> bytes:
    buf = io.BytesIO()
    torch.save(build_state(), buf, pickle_protocol=protocol)
    return buf.getvalue()


@functools.cache
def regions(protocol: int = 2) -> dict[str, tuple[tuple[int, int], ...]]:
    """Byte ranges of the clean archive, by what they hold (from its own layout)."""
    data = small_archive(protocol)
    layout = ckptlab.inspect(data)
    pkl = layout.record("data.pkl")
    headers = tuple(
        (s.offset, s.end_offset) for s in layout.segments
        if s.kind in (SegmentKind.LOCAL_HEADER, SegmentKind.NAME, SegmentKind.PADDING,
                      SegmentKind.ZIP64_EXTRA, SegmentKind.DESCRIPTOR)
    )
    small = tuple((r.data_offset, r.data_offset + r.data_nbytes) for r in layout.records
                  if r.short_name in (".format_version", ".storage_alignment", "byteorder"))
    return {
        "data.pkl": ((pkl.data_offset, pkl.data_offset + pkl.data_nbytes),),
        "local headers": headers,
        "small records": small,
        "central directory": ((layout.central_directory_offset,
                               layout.central_directory_offset
                               + layout.central_directory_nbytes),),
        "trailer": ((layout.central_directory_offset + layout.central_directory_nbytes,
                     len(data)),),
        "anywhere": ((0, len(data)),),
    }


REGION_WEIGHTS = {"data.pkl": 40, "local headers": 15, "small records": 5,
                  "central directory": 20, "trailer": 10, "anywhere": 10}


def interesting_values(file_nbytes: int) -> list[int]:
    return [0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 0x7FFFFFFF,
            0x80000000, 0xFFFFFFFE, 0xFFFFFFFF, 0x100000000, 2**63 - 1, 2**64 - 1,
            file_nbytes - 1, file_nbytes, file_nbytes + 1, file_nbytes // 2]


def mutate(data: bytes, rng: random.Random, region_ranges: dict[str, tuple[tuple[int, int], ...]]
           ) -> tuple[bytes, str]:
    """One random mutation of ``data`` and a description of it."""
    name = rng.choices(list(REGION_WEIGHTS), weights=list(REGION_WEIGHTS.values()))[0]
    lo, hi = rng.choice(region_ranges[name])
    out = bytearray(data)
    kind = rng.choices(["overwrite", "value", "insert", "delete"], weights=[50, 20, 15, 15])[0]
    pos = rng.randrange(lo, max(lo + 1, hi))
    if kind == "overwrite":
        changes = []
        for _ in range(rng.randint(1, 4)):
            p = rng.randrange(lo, max(lo + 1, hi))
            out[p] = rng.randrange(256)
            changes.append((p, out[p]))
        return bytes(out), f"{name}: overwrite {changes}"
    if kind == "value":
        width = rng.choice([1, 2, 4, 8])
        value = rng.choice(interesting_values(len(data))) & ((1 << (8 * width)) - 1)
        out[pos:pos + width] = value.to_bytes(width, "little")
        del out[len(data):]  # keep the length when the value ran off the end
        return bytes(out), f"{name}: write u{8 * width} {value:#x} at {pos}"
    if kind == "insert":
        blob = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        out[pos:pos] = blob
        return bytes(out), f"{name}: insert {blob.hex()} at {pos}"
    n = rng.randint(1, 8)
    del out[pos:pos + n]
    return bytes(out), f"{name}: delete {n} bytes at {pos}"


@pytest.fixture(scope="module")
def sample_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded 1.4 MB sample checkpoint (own fixture: no dependency on conftest)."""
    return Path(ckptlab.samples.write_sample(tmp_path_factory.mktemp("bad_input") / "sample.pt"))


# --------------------------------------------------------------------------------------------
# the watched call
# --------------------------------------------------------------------------------------------
@pytest.fixture
def traced() -> Iterator[None]:
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        yield
    finally:
        if started:
            tracemalloc.stop()


def watched(fn: Callable[[Any], Any], source: Any, file_nbytes: int, what: str
            ) -> tuple[Any, ArchiveError | None]:
    """Call ``fn(source)``: (result, None) or (None, ArchiveError); anything else fails.

    The call's work (Python calls, :mod:`ckptlab.testing.work`) is bounded by
    :func:`work_limit` of the file size and stopped there; its ``tracemalloc`` peak by
    :func:`memory_limit`, where tracing is on (the ``traced`` fixture).
    """
    tracing = tracemalloc.is_tracing()
    if tracing:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
    limit = work_limit(file_nbytes)
    try:
        with counting(limit=limit) as work:
            try:
                result, error = fn(source), None
            except ArchiveError as exc:
                result, error = None, exc
    except WorkLimitExceeded:
        raise AssertionError(f"{fn.__name__} made more than {limit:,} calls on a "
                             f"{file_nbytes}-byte file ({what})") from None
    except Exception as exc:
        raise AssertionError(f"{fn.__name__} raised {type(exc).__name__}: {exc!s:.300} "
                             f"instead of an ArchiveError ({what})") from exc
    assert not work.exceeded, (
        f"{fn.__name__} made more than {limit:,} calls on a {file_nbytes}-byte file ({what}) "
        f"and caught the stop")
    if tracing:
        _, peak = tracemalloc.get_traced_memory()
        assert peak - before <= memory_limit(file_nbytes), (
            f"{fn.__name__} peaked at {peak - before} traced bytes on a {file_nbytes}-byte "
            f"file ({what})")
    return result, error


def test_watched_stops_a_call_that_runs_away() -> None:
    """The work bound itself: a loop run as many times as a corrupt u32 says is stopped (not
    waited for), even where the code turns every Exception into an ArchiveError."""
    def runaway(source: bytes) -> None:
        try:
            for _ in range(int.from_bytes(source[:4], "little")):
                len(source)
        except Exception as exc:
            raise CorruptArchiveError("bad") from exc

    data = b"\xff\xff\xff\xff" + bytes(3000)
    with pytest.raises(AssertionError, match="made more than 20,751 calls on a 3004-byte"):
        watched(runaway, data, len(data), "runaway")
    assert watched(runaway, bytes(3004), 3004, "no loop") == (None, None)


def check_layout(layout: ckptlab.format.ArchiveLayout, file_nbytes: int, what: str) -> None:
    """A returned layout must describe the file it came from."""
    assert layout.file_nbytes == file_nbytes, what
    cursor = 0
    for seg in layout.segments:
        assert seg.offset == cursor and seg.nbytes >= 0, f"segments do not tile ({what}): {seg}"
        cursor = seg.end_offset
    assert cursor == file_nbytes, f"segments end at {cursor} of {file_nbytes} ({what})"
    keys = {s.key for s in layout.storages}
    for s in layout.storages:
        assert 0 <= s.data_offset <= s.data_offset + s.nbytes <= file_nbytes, (what, s)
    for r in layout.records:
        assert 0 <= r.header_offset < r.data_offset <= r.end_offset <= file_nbytes, (what, r)
    for t in layout.tensors:
        assert t.storage_key in keys or t.storage_key == "", (what, t)


def check_offsets(offsets: ckptlab.format.StorageOffsets, file_nbytes: int, what: str) -> None:
    assert offsets.method in ("cursor", "central_directory"), what
    for key, off in offsets.offsets.items():
        assert isinstance(off, int) and 0 <= off <= file_nbytes, (what, key, off)


def check_all(data: bytes, what: str) -> tuple[Any, Any]:
    """All three calls on ``data``: each returns a sane result or raises ArchiveError."""
    layout, _ = watched(ckptlab.inspect, data, len(data), what)
    if layout is not None:
        check_layout(layout, len(data), what)
    inspected = None if layout is None else {s.key: s.data_offset for s in layout.storages}
    results = []
    for fn in (ckptlab.storage_offsets, storage_offsets_scanned):
        offsets, _ = watched(fn, data, len(data), what)
        results.append(offsets)
        if offsets is None:
            continue
        check_offsets(offsets, len(data), what)
        if inspected is not None:
            # inspect reads every local header; the verified arithmetic must agree with it
            common = inspected.keys() & offsets.offsets.keys()
            assert {k: inspected[k] for k in common} == {k: offsets.offsets[k] for k in common}, (
                f"{fn.__name__} disagrees with inspect ({what}): {offsets.offsets} vs {inspected}")
            if fn is storage_offsets_scanned:
                assert offsets.offsets.keys() == inspected.keys(), what
    return layout, results[1]


# --------------------------------------------------------------------------------------------
# the clean archive
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [2, 5])
def test_clean_archive_is_inspected(protocol: int) -> None:
    data = small_archive(protocol)
    layout, offsets = check_all(data, "clean")
    assert layout is not None and offsets is not None
    assert len(layout.storages) == 5 and offsets.method == "cursor"
    assert offsets.offsets == {s.key: s.data_offset for s in layout.storages}
    loaded = torch.load(io.BytesIO(data), weights_only=False)
    assert loaded["weight"].untyped_storage().data_ptr() == loaded["view"].untyped_storage().data_ptr()
    by_path = {t.path: t for t in layout.tensors}
    assert by_path[("view",)].storage_offset == 6
    assert by_path[("column",)].stride == (6,)
    assert by_path[("bf16",)].dtype == "bfloat16"
    assert by_path[("nested", "stack", 1, 0)].storage_key == by_path[("weight",)].storage_key


# --------------------------------------------------------------------------------------------
# truncation
# --------------------------------------------------------------------------------------------
def cut_points(data: bytes, rng: random.Random, extra: int) -> list[int]:
    """Every segment boundary of the clean file (+-2) and ``extra`` random cut points."""
    layout = ckptlab.inspect(data)
    cuts = {0, 1, 2, 3, 4, len(data) - 1}
    for seg in layout.segments:
        for d in (-2, -1, 0, 1, 2):
            cuts.add(seg.offset + d)
    cuts.update(rng.randrange(len(data)) for _ in range(extra))
    return sorted(c for c in cuts if 0 <= c < len(data))


def check_truncation_error(error: ArchiveError, cut: int, path: str | None, what: str) -> None:
    if path is not None:
        assert error.path == path and path in str(error), f"{what}: {error}"
    if isinstance(error, (TruncatedArchiveError, CorruptArchiveError)):
        assert isinstance(error.offset, int) and 0 <= error.offset <= cut, f"{what}: {error}"
    elif error.offset is not None:
        assert 0 <= error.offset <= cut, f"{what}: {error}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", [2, 4])
def test_every_prefix_raises_archive_error(protocol: int, traced: None) -> None:
    data = small_archive(protocol)
    for cut in range(len(data)):
        what = f"protocol {protocol}, first {cut} of {len(data)} bytes"
        for fn in FUNCTIONS:
            result, error = watched(fn, data[:cut], cut, what)
            assert result is None and error is not None, f"{fn.__name__} accepted {what}"
            check_truncation_error(error, cut, None, what)
    check_all(data, "full file")  # and the whole file works


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,seed,extra", [("path", 1, 100), ("file object", 2, 40)])
def test_truncated_files_name_path_and_offset(kind: str, seed: int, extra: int,
                                              tmp_path: Path) -> None:
    """Path and binary file object inputs: the error names the file (the file object by its
    name) and an offset inside what is left of it."""
    data = small_archive()
    path = tmp_path / "truncated.pt"
    for cut in cut_points(data, random.Random(seed), extra=extra):
        path.write_bytes(data[:cut])
        for fn in FUNCTIONS:
            what = f"{fn.__name__}, {kind} cut at {cut}"
            if kind == "path":
                _result, error = watched(fn, path, cut, what)
            else:
                with open(path, "rb") as fh:
                    _result, error = watched(fn, fh, cut, what)
            assert error is not None, f"{fn.__name__} accepted the {kind} cut at {cut}"
            check_truncation_error(error, cut, str(path), what)
    path.write_bytes(data)
    with open(path, "rb") as fh:
        check_layout(ckptlab.inspect(fh), len(data), f"full {kind}")


@pytest.mark.timeout(120)
def test_truncated_sample_checkpoint(sample_file: Path, tmp_path: Path) -> None:
    """The 1.4 MB sample, cut at its boundaries (data.pkl, storages, directory, trailer)."""
    data = sample_file.read_bytes()
    cuts = cut_points(data, random.Random(3), extra=20)
    rng = random.Random(4)
    cuts = sorted(set(rng.sample(cuts, min(len(cuts), 150))) | {0, len(data) - 1})
    path = tmp_path / "sample_cut.pt"
    path.write_bytes(data)
    for cut in reversed(cuts):  # shrink one file in place
        os.truncate(path, cut)
        for fn in FUNCTIONS:
            _result, error = watched(fn, path, cut, f"sample cut at {cut}")
            assert error is not None, f"{fn.__name__} accepted the sample cut at {cut}"
            check_truncation_error(error, cut, str(path), f"{fn.__name__}, sample cut at {cut}")


# --------------------------------------------------------------------------------------------
# random mutations
# --------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol,seed,count", [
    pytest.param(2, 0, 1500, marks=pytest.mark.slow),  # 11 s (24 s loaded)
    pytest.param(2, 1, 1000, marks=pytest.mark.slow),  # 6 s (16 s loaded)
    (5, 2, 700),  # the one in the fast set
])
def test_random_mutations(protocol: int, seed: int, count: int, traced: None) -> None:
    data = small_archive(protocol)
    ranges = regions(protocol)
    rng = random.Random(seed)
    accepted = rejected = 0
    for i in range(count):
        mutated, how = mutate(data, rng, ranges)
        layout, _offsets = check_all(mutated, f"protocol {protocol} seed {seed} #{i}: {how}")
        accepted += layout is not None
        rejected += layout is None
    # the mix must exercise both outcomes (mutations of tensor bytes are harmless)
    assert accepted > count // 20 and rejected > count // 4, (accepted, rejected)


@pytest.mark.slow  # 11 s (20 s loaded)
@pytest.mark.timeout(120)
def test_random_mutations_of_data_pkl_only(traced: None) -> None:
    """Overwrites inside data.pkl only: the scanner sees every kind of opcode damage."""
    data = small_archive(4)  # protocol 4: FRAME, STACK_GLOBAL, MEMOIZE, SHORT_BINUNICODE
    (lo, hi), = regions(4)["data.pkl"]
    rng = random.Random(7)
    for i in range(800):
        out = bytearray(data)
        changes = []
        for _ in range(rng.randint(1, 4)):
            p = rng.randrange(lo, hi)
            out[p] = rng.randrange(256)
            changes.append((p, out[p]))
        check_all(bytes(out), f"data.pkl #{i}: {changes}")


@pytest.mark.timeout(120)
def test_random_mutations_via_path(tmp_path: Path) -> None:
    """A sample of mutations through path inputs: errors name the file."""
    data = small_archive()
    ranges = regions()
    rng = random.Random(11)
    path = tmp_path / "mutated.pt"
    for i in range(200):
        mutated, how = mutate(data, rng, ranges)
        path.write_bytes(mutated)
        for fn in FUNCTIONS:
            _, error = watched(fn, path, len(mutated), f"#{i}: {how}")
            if error is not None:
                assert error.path == str(path) and str(path) in str(error), (how, str(error))


@pytest.mark.slow  # 7 s (14 s loaded), 1.4 MB file
@pytest.mark.timeout(120)
def test_random_mutations_of_sample(sample_file: Path, traced: None) -> None:
    """The 1.4 MB sample (a 10 KB data.pkl, 100+ storages): memory bound is 16 x 1.4 MB."""
    data = sample_file.read_bytes()
    layout = ckptlab.inspect(data)
    pkl = layout.record("data.pkl")
    sample_ranges = {
        "data.pkl": ((pkl.data_offset, pkl.data_offset + pkl.data_nbytes),),
        "local headers": tuple((s.offset, s.end_offset) for s in layout.segments
                               if s.kind in (SegmentKind.LOCAL_HEADER, SegmentKind.PADDING,
                                             SegmentKind.DESCRIPTOR)),
        "small records": tuple((r.header_offset, r.end_offset) for r in layout.records
                               if r.short_name in (".format_version", ".storage_alignment",
                                                   "byteorder")),
        "central directory": ((layout.central_directory_offset,
                               layout.central_directory_offset
                               + layout.central_directory_nbytes),),
        "trailer": ((layout.central_directory_offset + layout.central_directory_nbytes,
                     len(data)),),
        "anywhere": ((0, len(data)),),
    }
    rng = random.Random(13)
    for i in range(120):
        mutated, how = mutate(data, rng, sample_ranges)
        check_all(mutated, f"sample #{i}: {how}")


@st.composite
def mutated_archives(draw: st.DrawFn) -> bytes:
    data = small_archive()
    ranges = regions()
    name = draw(st.sampled_from(sorted(REGION_WEIGHTS)))
    lo, hi = draw(st.sampled_from(ranges[name]))
    kind = draw(st.sampled_from(["overwrite", "value", "insert", "delete"]))
    pos = draw(st.integers(lo, max(lo, hi - 1)))
    out = bytearray(data)
    if kind == "overwrite":
        for p, b in draw(st.lists(st.tuples(st.integers(lo, max(lo, hi - 1)),
                                            st.integers(0, 255)), min_size=1, max_size=4)):
            out[p] = b
    elif kind == "value":
        width = draw(st.sampled_from([1, 2, 4, 8]))
        value = draw(st.sampled_from(interesting_values(len(data)))) & ((1 << (8 * width)) - 1)
        out[pos:pos + width] = value.to_bytes(width, "little")
        del out[len(data):]
    elif kind == "insert":
        out[pos:pos] = draw(st.binary(min_size=1, max_size=8))
    else:
        del out[pos:pos + draw(st.integers(1, 8))]
    return bytes(out)


@pytest.mark.timeout(120)
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.function_scoped_fixture])
@given(mutated=mutated_archives())
def test_hypothesis_mutations(mutated: bytes) -> None:
    # example count from the active profile ('ci' in tests/conftest.py)
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        check_all(mutated, "hypothesis example")
    finally:
        if started:
            tracemalloc.stop()


# --------------------------------------------------------------------------------------------
# a valid zip around a broken pickle
# --------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", [2, 5])
def test_truncated_pickle_in_intact_zip(protocol: int, traced: None) -> None:
    """Every prefix of data.pkl: directly, and as the data.pkl of a well-formed archive."""
    data = small_archive(protocol)
    pkl = zipfile.ZipFile(io.BytesIO(data)).read("archive/data.pkl")
    scan_pickle(pkl)
    for cut in range(len(pkl)):
        _, error = watched(scan_pickle, pkl[:cut], len(pkl), f"scan_pickle of {cut} bytes")
        assert isinstance(error, CorruptArchiveError), f"scan_pickle accepted {cut} bytes"
        assert error.offset is not None and 0 <= error.offset <= cut, str(error)
    rng = random.Random(protocol)
    for cut in sorted(rng.sample(range(len(pkl)), 60)):
        broken = rewrite_archive(data, {"data.pkl": pkl[:cut]})
        for fn in (ckptlab.inspect, storage_offsets_scanned):
            _, error = watched(fn, broken, len(broken), f"data.pkl cut at {cut}")
            assert isinstance(error, CorruptArchiveError), f"{fn.__name__}: data.pkl cut at {cut}"
            assert error.record is not None and error.record.endswith("data.pkl"), str(error)
        # without scan=True the pickle is not read: the offsets must still be right
        offsets, _ = watched(ckptlab.storage_offsets, broken, len(broken), f"cut at {cut}")
        if offsets is not None:
            zf = zipfile.ZipFile(io.BytesIO(broken))
            for key, off in offsets.offsets.items():
                info = zf.getinfo(f"archive/data/{key}")
                n_name, n_extra = struct.unpack_from("<HH", broken, info.header_offset + 26)
                assert off == info.header_offset + 30 + n_name + n_extra


# --------------------------------------------------------------------------------------------
# errors name the offset: targeted corruptions
# --------------------------------------------------------------------------------------------
def _pkl_storage_key_renamed(data: bytes) -> bytes:
    """data.pkl's first persistent key '0' -> '9' (same length, so the zip stays valid)."""
    layout = ckptlab.inspect(data)
    pkl = layout.record("data.pkl")
    body = data[pkl.data_offset:pkl.data_offset + pkl.data_nbytes]
    at = body.index(b"storage")
    key = body.index(b"X\x01\x00\x00\x000", at) + 5
    pos = pkl.data_offset + key
    return data[:pos] + b"9" + data[pos + 1:]


def _storage_alignment_garbled(data: bytes) -> bytes:
    rec = ckptlab.inspect(data).record(".storage_alignment")
    return data[:rec.data_offset] + b"6x" + data[rec.data_offset + 2:]


def _zip64_cd_offset_huge(data: bytes) -> bytes:
    layout = ckptlab.inspect(data)
    assert layout.zip64_eocd_offset is not None
    pos = layout.zip64_eocd_offset + 48  # zip64 EOCD: offset of the central directory
    return data[:pos] + struct.pack("<Q", 0x1234_5678_9ABC) + data[pos + 8:]


def _cd_header_offset_huge(data: bytes) -> bytes:
    layout = ckptlab.inspect(data)
    pos = layout.central_directory_offset + 42  # first entry: local header offset (u32)
    return data[:pos] + struct.pack("<I", 0x7FFF_0000) + data[pos + 4:]


OFFSET_BUG = ("ckptlab bug: the error's offset is None or not a position in the file "
              "(it reports a value read from a corrupt field)")


@pytest.mark.parametrize("corrupt,fn", [
    pytest.param(_pkl_storage_key_renamed, ckptlab.inspect, id="missing-storage-record-inspect"),
    pytest.param(_pkl_storage_key_renamed, storage_offsets_scanned,
                 id="missing-storage-record-offsets"),
    pytest.param(_storage_alignment_garbled, ckptlab.inspect, id="bad-alignment-inspect"),
    pytest.param(_storage_alignment_garbled, ckptlab.storage_offsets, id="bad-alignment-offsets"),
    pytest.param(_zip64_cd_offset_huge, ckptlab.inspect, id="cd-offset-huge-inspect"),
    pytest.param(_zip64_cd_offset_huge, ckptlab.storage_offsets, id="cd-offset-huge-offsets"),
    pytest.param(_cd_header_offset_huge, ckptlab.inspect, id="header-offset-huge-inspect"),
    pytest.param(_cd_header_offset_huge, ckptlab.storage_offsets,
                 id="header-offset-huge-offsets"),
])
def test_corruption_error_names_file_and_offset(corrupt: Callable[[bytes], bytes],
                                                fn: Callable[[Any], Any],
                                                tmp_path: Path) -> None:
    data = corrupt(small_archive())
    path = tmp_path / "corrupt.pt"
    path.write_bytes(data)
    with pytest.raises((TruncatedArchiveError, CorruptArchiveError)) as info:
        fn(path)
    error = info.value
    assert error.path == str(path) and str(path) in str(error)
    assert isinstance(error.offset, int) and 0 <= error.offset <= len(data), str(error)


def test_errors_are_value_errors() -> None:
    for cls in (ArchiveError, TruncatedArchiveError, CorruptArchiveError, UnsupportedFormatError):
        assert issubclass(cls, ValueError) and issubclass(cls, ckptlab.CkptlabError)
